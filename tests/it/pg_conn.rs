//! `conn`: the store's PostgreSQL connections against real servers, from
//! every calling context, with TLS, pool limits, advisory locks, and the
//! server dying and coming back.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use cube_adapter::store::StoreError;
use cube_adapter::store::pg::conn::{Conn, Pg, Settings, lock_key};

use crate::kit::Postgres;
use crate::kit::pg::free_port;

fn settings(db: &Postgres) -> Settings {
    Settings {
        url: format!("{}?sslmode=disable", db.url()),
        password_file: Some(db.password_file()),
        ..Settings::default()
    }
}

fn connect(db: &Postgres) -> Pg {
    Pg::connect(&settings(db)).unwrap()
}

/// The first column of the first row, int4 or int8.
fn int(conn: &mut Conn, sql: &str) -> i64 {
    let row = &conn.query(sql, &[]).unwrap()[0];
    row.try_get::<_, i64>(0)
        .or_else(|_| row.try_get::<_, i32>(0).map(i64::from))
        .unwrap()
}

fn backend_pid(conn: &mut Conn) -> i32 {
    conn.query("SELECT pg_backend_pid()", &[]).unwrap()[0].get(0)
}

/// Client sessions the cluster has on database `cube`.
fn sessions(db: &Postgres) -> i64 {
    db.psql("SELECT count(*) FROM pg_stat_activity WHERE datname = 'cube'")
        .parse()
        .unwrap()
}

fn eventually(what: &str, mut ok: impl FnMut() -> bool) {
    // Generous: the machine may be busy building.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        thread::sleep(Duration::from_millis(20));
    }
}

fn unavailable(e: &StoreError) -> bool {
    matches!(e, StoreError::Unavailable(_))
}

/// What every context runs: a few queries through the sync API.
fn sync_queries(pg: &Pg) {
    let mut c = pg.conn().unwrap();
    assert_eq!(int(&mut c, "SELECT 41 + 1"), 42);
    let rows = c
        .query("SELECT x FROM generate_series(1, $1::int) x", &[&3i32])
        .unwrap();
    assert_eq!(rows.len(), 3);
    let who: String = c
        .query_opt("SELECT current_user::text", &[])
        .unwrap()
        .unwrap()
        .get(0);
    assert_eq!(who, "cube");
    assert_eq!(c.execute("SELECT 1 WHERE false", &[]).unwrap(), 0);
    c.batch("SET search_path TO public").unwrap();
}

#[test]
fn plain_connection_with_password_file() {
    let db = Postgres::start();
    let pg = connect(&db);
    sync_queries(&pg);
    let mut c = pg.conn().unwrap();
    let ssl: bool = c
        .query(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .unwrap()[0]
        .get(0);
    assert!(!ssl);
    let app: String = c
        .query("SELECT current_setting('application_name')", &[])
        .unwrap()[0]
        .get(0);
    assert_eq!(app, "cube-adapter");
    // Prepared once per connection: repeating a statement adds nothing.
    let count = "SELECT count(*) FROM pg_prepared_statements";
    let before = int(&mut c, count);
    for _ in 0..3 {
        int(&mut c, "SELECT 7");
    }
    assert_eq!(int(&mut c, count), before + 1);
}

#[test]
fn settings_errors_are_clear_and_never_show_the_password() {
    let db = Postgres::start();
    let password = db.password().to_owned();

    // A password in the URL and a password file.
    let mut s = settings(&db);
    s.url = format!(
        "postgres://cube:{password}@127.0.0.1:{}/cube?sslmode=disable",
        db.port
    );
    let e = Pg::connect(&s).unwrap_err().to_string();
    assert!(
        e.contains("contains a password and password_file is set"),
        "{e}"
    );
    assert!(!e.contains(&password), "{e}");
    // ...which alone is fine.
    s.password_file = None;
    sync_queries(&Pg::connect(&s).unwrap());

    // A wrong password: the server's SQLSTATE.
    let dir = tempfile::tempdir().unwrap();
    let wrong = dir.path().join("wrong");
    std::fs::write(&wrong, "not-the-password\n").unwrap();
    let mut s = settings(&db);
    s.password_file = Some(wrong);
    let e = Pg::connect(&s).unwrap_err();
    assert!(matches!(e, StoreError::Io(_)), "{e:?}");
    let e = e.to_string();
    assert!(
        e.contains("SQLSTATE 28P01") && e.contains("password authentication failed"),
        "{e}"
    );
    assert!(!e.contains("not-the-password"), "{e}");

    // A bad password with a bad option in the URL.
    let mut s = settings(&db);
    s.password_file = None;
    s.url = format!(
        "postgres://cube:{password}@127.0.0.1:{}/cube?sslmode=sometimes",
        db.port
    );
    let e = Pg::connect(&s).unwrap_err().to_string();
    assert!(
        e.contains("invalid database URL") && e.contains("sslmode"),
        "{e}"
    );
    assert!(!e.contains(&password), "{e}");

    // No password file.
    let mut s = settings(&db);
    s.password_file = Some(PathBuf::from("/nonexistent/pw"));
    let e = Pg::connect(&s).unwrap_err().to_string();
    assert!(
        e.contains("cannot read the password file /nonexistent/pw"),
        "{e}"
    );

    // Nothing listening: refused at once.
    let mut s = settings(&db);
    s.url = format!(
        "postgres://cube@127.0.0.1:{}/cube?sslmode=disable",
        free_port()
    );
    let started = Instant::now();
    let e = Pg::connect(&s).unwrap_err();
    assert!(unavailable(&e), "{e:?}");
    assert!(e.to_string().contains("Connection refused"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(2));

    // TLS asked of a server without it.
    let mut s = settings(&db);
    s.url = format!("{}?sslmode=require", db.url());
    s.ca_file = Some(PathBuf::from("/etc/ssl/certs/ca-certificates.crt"));
    let e = Pg::connect(&s).unwrap_err().to_string();
    assert!(e.contains("server does not support TLS"), "{e}");
}

#[test]
fn connect_times_out_on_a_silent_server() {
    // Accepts and never answers: the startup message waits forever.
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let port = listener.local_addr().unwrap().port();
    thread::spawn(move || {
        let held: Vec<TcpStream> = listener.incoming().filter_map(Result::ok).collect();
        drop(held);
    });
    let s = Settings {
        url: format!("postgres://cube@127.0.0.1:{port}/cube?sslmode=disable"),
        connect_timeout: Duration::from_millis(500),
        ..Settings::default()
    };
    let started = Instant::now();
    let e = Pg::connect(&s).unwrap_err();
    let took = started.elapsed();
    assert!(
        unavailable(&e) && e.to_string().contains("no connection within 500 ms"),
        "{e}"
    );
    assert!(
        took >= Duration::from_millis(500) && took < Duration::from_secs(3),
        "{took:?}"
    );
}

/// A CA, and a certificate it signs for `names` (IP addresses or DNS).
fn ca_and_cert(ca_name: &str, names: &[&str]) -> (String, String, String) {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    };
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, ca_name);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_pem = ca.self_signed(&ca_key).unwrap().pem();
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate().unwrap();
    let mut params =
        CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap();
    params
        .distinguished_name
        .push(DnType::CommonName, "postgres");
    let cert = params.signed_by(&key, &issuer).unwrap();
    (ca_pem, cert.pem(), key.serialize_pem())
}

#[test]
fn tls_verifies_the_server() {
    let db = Postgres::start();
    let (ca, cert, key) = ca_and_cert("test CA", &["127.0.0.1"]);
    db.enable_tls(&cert, &key);
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, &ca).unwrap();
    let with = |mode: &str, ca: Option<PathBuf>| Settings {
        url: format!("{}{mode}", db.url()),
        ca_file: ca,
        ..settings(&db)
    };
    let on_tls = |pg: &Pg| -> bool {
        let mut c = pg.conn().unwrap();
        c.query(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .unwrap()[0]
            .get(0)
    };

    for mode in [
        "?sslmode=require",
        "?sslmode=verify-full",
        "?sslmode=verify-ca",
        "",
        "?sslmode=prefer",
    ] {
        let pg = Pg::connect(&with(mode, Some(ca_file.clone())))
            .unwrap_or_else(|e| panic!("{mode}: {e}"));
        assert!(on_tls(&pg), "{mode}");
        sync_queries(&pg);
    }
    let pg = Pg::connect(&with("?sslmode=disable", Some(ca_file.clone()))).unwrap();
    assert!(!on_tls(&pg));

    // Another CA: refused, saying why.
    let (other_ca, _, _) = ca_and_cert("another CA", &["127.0.0.1"]);
    let other = dir.path().join("other.pem");
    std::fs::write(&other, &other_ca).unwrap();
    let e = Pg::connect(&with("?sslmode=require", Some(other))).unwrap_err();
    assert!(unavailable(&e), "{e:?}");
    let e = e.to_string();
    assert!(
        e.contains("TLS handshake") && e.contains("UnknownIssuer"),
        "{e}"
    );
    // No ca_file: the system's CAs, which do not know ours.
    let e = Pg::connect(&with("?sslmode=require", None))
        .unwrap_err()
        .to_string();
    assert!(e.contains("UnknownIssuer"), "{e}");
    // A CA file that is not PEM.
    let junk = dir.path().join("junk.pem");
    std::fs::write(&junk, "not a certificate").unwrap();
    let e = Pg::connect(&with("?sslmode=require", Some(junk)))
        .unwrap_err()
        .to_string();
    assert!(e.contains("junk.pem") && e.contains("0 usable"), "{e}");

    // A certificate for another name: verify-full (and require) refuse,
    // verify-ca accepts (the chain is still checked).
    let (ca2, cert2, key2) = ca_and_cert("third CA", &["db.example"]);
    db.enable_tls(&cert2, &key2);
    let ca2_file = dir.path().join("ca2.pem");
    std::fs::write(&ca2_file, &ca2).unwrap();
    for mode in ["?sslmode=verify-full", "?sslmode=require"] {
        let e = Pg::connect(&with(mode, Some(ca2_file.clone())))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not valid for name"), "{mode}: {e}");
    }
    let pg = Pg::connect(&with("?sslmode=verify-ca", Some(ca2_file.clone()))).unwrap();
    assert!(on_tls(&pg));
    let e = Pg::connect(&with("?sslmode=verify-ca", Some(ca_file.clone())))
        .unwrap_err()
        .to_string();
    assert!(e.contains("UnknownIssuer"), "{e}");
}

#[test]
fn from_a_plain_thread_and_a_foreign_executor() {
    let db = Postgres::start();
    let pg = connect(&db);
    let p = pg.clone();
    thread::spawn(move || sync_queries(&p)).join().unwrap();
    // No tokio at all: the async API under futures' own executor.
    futures_executor::block_on(async {
        let mut c = pg.conn_async().await.unwrap();
        let rows = c.query_async("SELECT 5", &[]).await.unwrap();
        assert_eq!(rows[0].get::<_, i32>(0), 5);
        let _lock = pg.lock(lock_key("foreign")).await.unwrap();
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_a_multi_thread_worker() {
    let db = Postgres::start();
    // Sync calls straight from async code on a worker thread.
    let pg = connect(&db);
    sync_queries(&pg);
    // More blocking callers than workers, each holding its connection
    // while waiting on a gate: all of them must be waiting at once (a
    // blocked worker would let only two run).
    let gate_key = lock_key("gate");
    let gate = pg.lock(gate_key).await.unwrap();
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let pg = pg.clone();
            tokio::spawn(async move {
                let mut c = pg.conn().unwrap();
                c.query("SELECT pg_advisory_xact_lock_shared($1)", &[&gate_key])
                    .unwrap();
            })
        })
        .collect();
    let waiting = || -> i64 {
        db.psql("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'")
            .parse()
            .unwrap()
    };
    eventually("8 callers wait at once", || waiting() == 8);
    drop(gate);
    for t in tasks {
        t.await.unwrap();
    }
    // The async API too.
    let mut c = pg.conn_async().await.unwrap();
    assert_eq!(
        c.query_async("SELECT 3", &[]).await.unwrap()[0].get::<_, i32>(0),
        3
    );
    drop(c);
    drop(pg); // the last Pg dropped in async context: no panic
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_spawn_blocking() {
    let db = Postgres::start();
    let pg = tokio::task::spawn_blocking({
        let s = settings(&db);
        move || Pg::connect(&s).unwrap()
    })
    .await
    .unwrap();
    let p = pg.clone();
    tokio::task::spawn_blocking(move || sync_queries(&p))
        .await
        .unwrap();
}

#[tokio::test(flavor = "current_thread")]
async fn from_a_current_thread_runtime() {
    let db = Postgres::start();
    let pg = connect(&db);
    // Blocking calls block this runtime's only thread, but cannot
    // deadlock: the connections are driven elsewhere.
    sync_queries(&pg);
    let mut c = pg.conn_async().await.unwrap();
    assert_eq!(c.execute_async("SELECT 1", &[]).await.unwrap(), 1);
    c.batch_async("SELECT 1").await.unwrap();
    drop(c);
    let p = pg.clone();
    tokio::task::spawn_blocking(move || sync_queries(&p))
        .await
        .unwrap();
    // A lock wait does not hold this thread: a timer keeps ticking.
    let key = lock_key("current-thread");
    let held = pg.lock(key).await.unwrap();
    let other = connect(&db);
    let waiter = tokio::spawn(async move { other.lock(key).await.map(|l| (l, other)) });
    let mut ticks = 0;
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        ticks += 1;
    }
    assert_eq!(ticks, 5);
    assert!(!waiter.is_finished());
    drop(held);
    let (lock, _other) = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(!lock.is_lost());
    drop(pg); // dropping the last Pg on a current-thread runtime: no panic
}

#[test]
fn pool_cap_waits_then_times_out() {
    let db = Postgres::start();
    let s = Settings {
        pool_size: 2,
        connect_timeout: Duration::from_millis(1000),
        ..settings(&db)
    };
    let pg = Pg::connect(&s).unwrap();
    let mut a = pg.conn().unwrap();
    let mut b = pg.conn().unwrap();
    backend_pid(&mut b);
    assert_eq!(sessions(&db), 2);

    let started = Instant::now();
    let e = pg.conn().err().unwrap();
    let took = started.elapsed();
    assert!(
        unavailable(&e) && e.to_string().contains("all 2 connections are busy"),
        "{e}"
    );
    assert!(
        took >= Duration::from_millis(1000) && took < Duration::from_secs(3),
        "{took:?}"
    );

    // A waiter gets the first connection given back, and no new one opens.
    let p = pg.clone();
    let waiter = thread::spawn(move || {
        let started = Instant::now();
        let mut c = p.conn().unwrap();
        (started.elapsed(), backend_pid(&mut c))
    });
    thread::sleep(Duration::from_millis(200));
    let a_pid = backend_pid(&mut a);
    drop(a);
    let (waited, pid) = waiter.join().unwrap();
    assert!(
        waited >= Duration::from_millis(150) && waited < Duration::from_millis(1000),
        "{waited:?}"
    );
    assert_eq!(pid, a_pid);
    assert_eq!(sessions(&db), 2);

    // Locks have a pool of their own: available with every query
    // connection taken, and their holders can still query.
    let mut c = pg.conn().unwrap();
    let lock = pg.try_lock_blocking(lock_key("pool")).unwrap().unwrap();
    assert_eq!(sessions(&db), 3);
    drop(b);
    sync_queries(&pg);
    drop(lock);
    int(&mut c, "SELECT 1");
}

#[test]
fn connections_are_reused_unless_unsafe() {
    let db = Postgres::start();
    let s = Settings {
        pool_size: 1,
        ..settings(&db)
    };
    let pg = Pg::connect(&s).unwrap();
    let pid = |pg: &Pg| backend_pid(&mut pg.conn().unwrap());
    let first = pid(&pg);
    assert_eq!(pid(&pg), first, "an idle connection is reused");

    // A database error leaves the connection usable and pooled.
    {
        let mut c = pg.conn().unwrap();
        let e = c.query("SELEC 1", &[]).unwrap_err();
        assert!(
            matches!(&e, StoreError::Io(m) if m.contains("SQLSTATE 42601")),
            "{e:?}"
        );
        let e = c
            .query(
                "DO $$ BEGIN RAISE EXCEPTION 'retry me' USING ERRCODE = '40001'; END $$",
                &[],
            )
            .unwrap_err();
        assert!(
            matches!(&e, StoreError::Conflict(m) if m.contains("40001") && m.contains("retry me")),
            "{e:?}"
        );
        let e = c
            .execute(
                "DO $$ BEGIN RAISE EXCEPTION 'dl' USING ERRCODE = '40P01'; END $$",
                &[],
            )
            .unwrap_err();
        assert!(matches!(e, StoreError::Conflict(_)), "{e:?}");
        // Caller errors (parameter types, row counts) are not availability.
        let e = c.query("SELECT $1::int", &[&"text"]).unwrap_err();
        assert!(
            matches!(&e, StoreError::Io(m) if m.contains("error serializing parameter 0")),
            "{e:?}"
        );
        let e = c
            .query_opt("SELECT generate_series(1, 2)", &[])
            .unwrap_err();
        assert!(
            matches!(&e, StoreError::Io(m) if m.contains("at most one row")),
            "{e:?}"
        );
        assert!(c.query_opt("SELECT 1 WHERE false", &[]).unwrap().is_none());
    }
    assert_eq!(pid(&pg), first);

    // Dropped inside a transaction: discarded, the server rolls back.
    {
        let mut c = pg.conn().unwrap();
        c.batch("CREATE TABLE t (x int)").unwrap();
        c.batch("BEGIN").unwrap();
        c.set_in_txn(true);
        c.execute("INSERT INTO t VALUES (1)", &[]).unwrap();
    }
    let second = pid(&pg);
    assert_ne!(second, first);
    assert_eq!(int(&mut pg.conn().unwrap(), "SELECT count(*) FROM t"), 0);
    eventually("the discarded session is gone", || sessions(&db) == 1);

    // Ended transactions and explicit `set_in_txn(false)` are reused.
    {
        let mut c = pg.conn().unwrap();
        c.batch("BEGIN").unwrap();
        c.set_in_txn(true);
        c.batch("COMMIT").unwrap();
        c.set_in_txn(false);
    }
    assert_eq!(pid(&pg), second);

    // Marked broken: discarded.
    pg.conn().unwrap().mark_broken();
    let third = pid(&pg);
    assert_ne!(third, second);

    // Ended by the server (an admin, a failover): the call fails
    // Unavailable and the connection is not reused.
    {
        let mut c = pg.conn().unwrap();
        db.psql(&format!("SELECT pg_terminate_backend({third})"));
        let e = c.query("SELECT 1", &[]).unwrap_err();
        assert!(unavailable(&e), "{e:?}");
    }
    let fourth = pid(&pg);
    assert_ne!(fourth, third);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_query_discards_its_connection() {
    let db = Postgres::start();
    let s = Settings {
        pool_size: 1,
        ..settings(&db)
    };
    let pg = Pg::connect(&s).unwrap();
    let mut c = pg.conn_async().await.unwrap();
    let before = c.query_async("SELECT pg_backend_pid()", &[]).await.unwrap()[0].get::<_, i32>(0);
    let slow = tokio::time::timeout(
        Duration::from_millis(100),
        c.query_async("SELECT pg_sleep(2)", &[]),
    )
    .await;
    assert!(slow.is_err());
    drop(c);
    let mut c = pg.conn_async().await.unwrap();
    let after = c.query_async("SELECT pg_backend_pid()", &[]).await.unwrap()[0].get::<_, i32>(0);
    assert_ne!(
        before, after,
        "a connection with a response pending is not reused"
    );
}

#[test]
fn statements_are_prepared_again_after_a_schema_change() {
    let db = Postgres::start();
    let pg = connect(&db);
    let mut c = pg.conn().unwrap();
    c.batch("CREATE TABLE s (a int); INSERT INTO s VALUES (1)")
        .unwrap();
    assert_eq!(c.query("SELECT * FROM s", &[]).unwrap()[0].len(), 1);
    c.batch("ALTER TABLE s ADD COLUMN b int").unwrap();
    let e = c.query("SELECT * FROM s", &[]).unwrap_err();
    assert!(
        matches!(&e, StoreError::Io(m) if m.contains("0A000")),
        "{e:?}"
    );
    assert_eq!(c.query("SELECT * FROM s", &[]).unwrap()[0].len(), 2);
}

/// Forwards a local port to `target`, holding each server-to-client chunk
/// back by `delay`: a slow network, to count round trips.
fn slow_link(target: SocketAddr, delay: Duration) -> u16 {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let port = listener.local_addr().unwrap().port();
    thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { continue };
            let server = TcpStream::connect(target).unwrap();
            client.set_nodelay(true).unwrap();
            server.set_nodelay(true).unwrap();
            let (mut from_client, mut to_server) =
                (client.try_clone().unwrap(), server.try_clone().unwrap());
            thread::spawn(move || {
                let _ = std::io::copy(&mut from_client, &mut to_server);
                let _ = to_server.shutdown(std::net::Shutdown::Write);
            });
            let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
            let mut from_server = server;
            thread::spawn(move || {
                let mut buf = [0u8; 65536];
                while let Ok(n @ 1..) = from_server.read(&mut buf) {
                    if tx
                        .send((Instant::now() + delay, buf[..n].to_vec()))
                        .is_err()
                    {
                        break;
                    }
                }
            });
            let mut to_client = client;
            thread::spawn(move || {
                for (due, bytes) in rx {
                    thread::sleep(due.saturating_duration_since(Instant::now()));
                    if to_client.write_all(&bytes).is_err() {
                        break;
                    }
                }
                let _ = to_client.shutdown(std::net::Shutdown::Both);
            });
        }
    });
    port
}

#[test]
fn begin_then_query_is_one_round_trip_inside_the_transaction() {
    let db = Postgres::start();
    let rtt = Duration::from_millis(300);
    let port = slow_link(db.addr(), rtt);
    let s = Settings {
        url: format!("postgres://cube@127.0.0.1:{port}/cube?sslmode=disable"),
        ..settings(&db)
    };
    let pg = Pg::connect(&s).unwrap();
    let mut c = pg.conn().unwrap();
    c.batch("CREATE TABLE t (x int)").unwrap();
    let insert = "INSERT INTO t VALUES ($1) RETURNING x, current_setting('transaction_isolation')";

    // First use: BEGIN and Parse go together, then Bind/Execute.
    let rows = c
        .begin_then_query("BEGIN ISOLATION LEVEL REPEATABLE READ", insert, &[&5i32])
        .unwrap();
    assert_eq!(rows[0].get::<_, i32>(0), 5);
    assert_eq!(rows[0].get::<_, String>(1), "repeatable read");
    assert!(c.in_txn());
    c.batch("ROLLBACK").unwrap();
    c.set_in_txn(false);
    assert_eq!(
        int(&mut c, "SELECT count(*) FROM t"),
        0,
        "the statement ran inside the transaction"
    );

    // Prepared: BEGIN and the statement in one round trip.
    let started = Instant::now();
    c.begin_then_query("BEGIN", insert, &[&6i32]).unwrap();
    let pipelined = started.elapsed();
    c.batch("COMMIT").unwrap();
    c.set_in_txn(false);
    let started = Instant::now();
    c.batch("BEGIN").unwrap();
    c.query(insert, &[&7i32]).unwrap();
    let sequential = started.elapsed();
    c.batch("COMMIT").unwrap();
    assert!(pipelined < rtt * 3 / 2, "pipelined took {pipelined:?}");
    assert!(sequential >= rtt * 2, "sequential took {sequential:?}");
    assert_eq!(int(&mut c, "SELECT count(*) FROM t"), 2);

    // A BEGIN that fails: an error, and the connection is discarded.
    let pid = backend_pid(&mut c);
    let e = c
        .begin_then_query("BEGIN NONSENSE", "SELECT 1", &[])
        .unwrap_err();
    assert!(matches!(e, StoreError::Io(_)), "{e:?}");
    drop(c);
    assert_ne!(backend_pid(&mut pg.conn().unwrap()), pid);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_lock_excludes_another_replica_until_dropped() {
    let db = Postgres::start();
    let (a, b) = (connect(&db), connect(&db));
    let key = lock_key("background");
    let held = a.lock(key).await.unwrap();
    assert!(!held.is_lost());
    assert_eq!(held.key(), key);
    assert!(b.try_lock_blocking(key).unwrap().is_none());
    assert!(b.try_lock(key).await.unwrap().is_none());
    // Within one Pg too: each lock is its own session.
    assert!(a.try_lock_blocking(key).unwrap().is_none());

    let waiter = tokio::spawn(async move {
        let started = Instant::now();
        let lock = b.lock(key).await.unwrap();
        (started.elapsed(), lock, b)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished());
    drop(held); // unlocks in the background
    let (waited, lock_b, b) = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .unwrap()
        .unwrap();
    // Measured from the task's first poll, a little after the spawn.
    assert!(waited >= Duration::from_millis(250), "{waited:?}");
    assert!(a.try_lock_blocking(key).unwrap().is_none());
    drop(lock_b);
    eventually("the lock is free again", || {
        a.try_lock_blocking(key).unwrap().is_some()
    });

    // A waiter that gives up does not leave the lock taken behind it.
    let held = a.lock(key).await.unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(200), b.lock(key))
            .await
            .is_err()
    );
    drop(held);
    eventually("the abandoned wait released the lock", || {
        // The abandoned wait is granted, then released at once.
        a.try_lock_blocking(key).unwrap().is_some()
    });
    drop(b);

    // A lock whose session ends is lost, and free for others.
    let held = a.lock(key).await.unwrap();
    let other = connect(&db);
    db.psql(
        "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' AND granted",
    );
    eventually("the lock is lost", || held.is_lost());
    assert!(other.try_lock_blocking(key).unwrap().is_some());
    drop(held);
}

#[test]
fn a_lock_outliving_its_pg_is_released() {
    let db = Postgres::start();
    let a = connect(&db);
    let key = lock_key("outlive");
    let lock = a.try_lock_blocking(key).unwrap().unwrap();
    drop(a);
    let b = connect(&db);
    assert!(
        b.try_lock_blocking(key).unwrap().is_none(),
        "the lock keeps its runtime alive"
    );
    drop(lock);
    eventually("released", || b.try_lock_blocking(key).unwrap().is_some());
}

#[test]
fn close_fails_later_calls() {
    let db = Postgres::start();
    let pg = connect(&db);
    let mut held = pg.conn().unwrap();
    int(&mut held, "SELECT 1");
    pg.close();
    let closed =
        |e: StoreError| matches!(&e, StoreError::Unavailable(m) if m == "the store is closed");
    assert!(closed(pg.conn().err().unwrap()));
    assert!(closed(
        futures_executor::block_on(pg.conn_async()).err().unwrap()
    ));
    assert!(closed(pg.try_lock_blocking(1).err().unwrap()));
    assert!(closed(
        futures_executor::block_on(pg.lock(1)).err().unwrap()
    ));
    // A connection still held works until dropped, then closes.
    int(&mut held, "SELECT 1");
    drop(held);
    eventually("no session left", || sessions(&db) == 0);
}

#[test]
fn a_dead_server_fails_calls_fast_and_a_restarted_one_serves_again() {
    let db = Postgres::start();
    let s = Settings {
        connect_timeout: Duration::from_secs(2),
        ..settings(&db)
    };
    let pg = Pg::connect(&s).unwrap();
    let mut held = pg.conn().unwrap();
    int(&mut held, "SELECT 1");
    drop(pg.conn().unwrap()); // one idle too
    let lock = pg.try_lock_blocking(lock_key("dead")).unwrap().unwrap();
    let p = pg.clone();
    let in_flight = thread::spawn(move || {
        let mut c = p.conn().unwrap();
        let started = Instant::now();
        let result = c.query("SELECT pg_sleep(30)", &[]);
        (started.elapsed(), result.err())
    });
    thread::sleep(Duration::from_millis(300));

    let killed = Instant::now();
    db.kill();
    let (took, e) = in_flight.join().unwrap();
    let e = e.unwrap();
    assert!(unavailable(&e), "{e:?}");
    eprintln!(
        "in-flight query failed {:?} after the kill: {e}",
        killed.elapsed()
    );
    assert!(
        killed.elapsed() < Duration::from_secs(2),
        "in flight: {took:?}, {e}"
    );
    let started = Instant::now();
    let e = held.query("SELECT 1", &[]).unwrap_err();
    assert!(unavailable(&e), "{e:?}");
    let e = pg
        .conn()
        .and_then(|mut c| c.query("SELECT 1", &[]))
        .unwrap_err();
    assert!(
        unavailable(&e) && e.to_string().contains("Connection refused"),
        "{e}"
    );
    eprintln!(
        "held and new connections failed within {:?}: {e}",
        started.elapsed()
    );
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    eventually("the lock is lost", || lock.is_lost());
    drop(held);

    db.restart();
    sync_queries(&pg);
    let mut c = pg.conn().unwrap();
    int(&mut c, "SELECT 1");
    drop(c);
    drop(lock);
    assert!(pg.try_lock_blocking(lock_key("dead")).unwrap().is_some());

    // A clean stop (pg_ctl stop -m fast) ends sessions with 57P01.
    let mut held = pg.conn().unwrap();
    int(&mut held, "SELECT 1");
    db.stop();
    let e = held.query("SELECT 1", &[]).unwrap_err();
    assert!(unavailable(&e), "{e:?}");
    drop(held);
    db.restart();
    sync_queries(&pg);
}

#[test]
fn through_haproxy_with_tls_and_a_failover() {
    let db = Postgres::start();
    let (ca, cert, key) = ca_and_cert("test CA", &["127.0.0.1"]);
    db.enable_tls(&cert, &key);
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, &ca).unwrap();
    let proxy = crate::kit::Haproxy::start_tcp(&[db.addr()]);
    let s = Settings {
        url: format!(
            "postgres://cube@127.0.0.1:{}/cube?sslmode=verify-full",
            proxy.port
        ),
        ca_file: Some(ca_file),
        connect_timeout: Duration::from_secs(2),
        ..settings(&db)
    };
    let pg = Pg::connect(&s).unwrap();
    sync_queries(&pg);
    db.kill();
    let e = pg
        .conn()
        .and_then(|mut c| c.query("SELECT 1", &[]))
        .unwrap_err();
    assert!(unavailable(&e), "{e:?}");
    db.restart();
    eventually("haproxy sees the server again", || {
        pg.conn().and_then(|mut c| c.query("SELECT 1", &[])).is_ok()
    });
}

#[test]
fn many_quick_queries() {
    let db = Postgres::start();
    let pg = connect(&db);
    let started = Instant::now();
    for i in 0..2000i64 {
        let mut c = pg.conn().unwrap();
        let rows = c.query("SELECT $1::bigint", &[&i]).unwrap();
        assert_eq!(rows[0].get::<_, i64>(0), i);
    }
    eprintln!("2000 pooled queries: {:?} each", started.elapsed() / 2000);
}

#[test]
fn handles_are_send_and_their_futures_too() {
    fn send<T: Send>(_: &T) {}
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Pg>();
    send_sync::<cube_adapter::store::pg::AdvisoryLock>();
    send_sync::<Conn>();
    fn check(pg: &Pg, c: &mut Conn) {
        send(&pg.conn_async());
        send(&pg.lock(1));
        send(&pg.try_lock(1));
        send(&c.query_async("", &[]));
        send(&c.begin_then_query_async("", "", &[]));
    }
    let _ = check;
}
