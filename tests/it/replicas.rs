//! Several replicas on one PostgreSQL store (issue #22): Debian's real
//! PostgreSQL on 127.0.0.1, two `serve` processes on it with one shared
//! CubeSandbox backend (the embedded backend, faithful, in this process),
//! and a real haproxy in front of them.

use std::path::{Path, PathBuf};

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::kit::{BIN, Haproxy, Postgres, Proc};

/// Two replicas of one appliance: their state directories (each with the
/// first one's keys and CA), their processes, and haproxy in front.
struct Replicas {
    dir: tempfile::TempDir,
    states: Vec<PathBuf>,
    config: PathBuf,
    procs: Vec<Option<Proc>>,
    http: reqwest::Client,
    admin: String,
    backend: cube_adapter::embedded::Backend,
    stop: tokio_util::sync::CancellationToken,
}

/// What a second replica needs from the first: the key secrets are sealed
/// under, the digest and receipt keys, and the CA (docs/operations.md,
/// "Several replicas").
const SHARED: &[&str] = &[
    "secret.key",
    "hmac.key",
    "receipt-ed25519.key",
    "receipt-ed25519.pub",
    "tls",
];

fn copy_tree(from: &Path, to: &Path) {
    if from.is_dir() {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap() {
            let e = e.unwrap();
            copy_tree(&e.path(), &to.join(e.file_name()));
        }
    } else if from.exists() {
        std::fs::copy(from, to).unwrap();
    }
}

/// The embedded backend (faithful) on plain HTTP in this process, for both
/// replicas, and the `[backend]` section that names it.
async fn shared_backend(
    dir: &Path,
) -> (
    cube_adapter::embedded::Backend,
    tokio_util::sync::CancellationToken,
    String,
) {
    let mut s = crate::kit::backend::settings(dir);
    s.faithful = Some(cube_adapter::embedded::sandbox::Faithful::default());
    let backend = cube_adapter::embedded::Backend::open(s, None).unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    backend.spawn_reaper(stop.clone());
    let bl = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = bl.local_addr().unwrap().port();
    let app = backend.router();
    // The appliance's own server (TCP_NODELAY: no delayed-ACK stalls
    // between the replicas and the backend).
    tokio::spawn(cube_adapter::server::serve(
        bl,
        app,
        None,
        std::future::pending(),
    ));
    // CubeAPI and CubeProxy on one port: two names for it (the appliance
    // refuses one URL for both).
    let section = format!(
        "[backend]\napi_url = \"http://127.0.0.1:{port}\"\nproxy_url = \"http://localhost:{port}\"\n\
         domain = \"cube.test\"\ninsecure_plain_http = true\n\n"
    );
    (backend, stop, section)
}

/// `[store]` on `pg`.
fn store_section(pg: &Postgres) -> String {
    format!(
        "[store]\nkind = \"postgres\"\nurl = \"{}?sslmode=disable\"\npassword_file = \"{}\"\n",
        pg.url(),
        pg.password_file().display()
    )
}

impl Replicas {
    async fn start(pg: &Postgres, extra: &str) -> Self {
        Self::start_n(Some(pg), 2, extra).await
    }

    /// `n` replicas on `pg`, or (`None`) one process on a redb store.
    async fn start_n(pg: Option<&Postgres>, n: usize, extra: &str) -> Self {
        cube_adapter::tls::install_default_provider();
        let dir = tempfile::tempdir().unwrap();
        let (backend, stop, section) = shared_backend(dir.path()).await;
        let config = dir.path().join("config.toml");
        let store = pg.map(store_section).unwrap_or_default();
        std::fs::write(&config, format!("{section}{store}{extra}")).unwrap();
        let states: Vec<PathBuf> = (0..n).map(|i| dir.path().join(format!("r{i}"))).collect();
        let mut procs = vec![Some(Proc::start(&states[0], &config, &[]).unwrap())];
        for s in states.iter().skip(1) {
            std::fs::create_dir_all(s).unwrap();
            for f in SHARED {
                copy_tree(&states[0].join(f), &s.join(f));
            }
            procs.push(Some(Proc::start(s, &config, &[]).unwrap()));
        }
        let ca = std::fs::read(states[0].join("tls/ca.pem")).unwrap();
        let http = reqwest::Client::builder()
            .tls_backend_preconfigured(cube_adapter::tls::client_config(Some(&ca), None).unwrap())
            .build()
            .unwrap();
        let admin = std::fs::read_to_string(states[0].join("admin.token"))
            .unwrap()
            .trim()
            .to_string();
        Self {
            dir,
            states,
            config,
            procs,
            http,
            admin,
            backend,
            stop,
        }
    }

    fn url(&self, i: usize) -> String {
        self.procs[i].as_ref().unwrap().url.clone()
    }

    fn addrs(&self) -> Vec<std::net::SocketAddr> {
        (0..self.procs.len())
            .map(|i| self.url(i).trim_start_matches("https://").parse().unwrap())
            .collect()
    }

    /// The sandboxes the backend has.
    fn sandboxes(&self) -> usize {
        self.backend.manager.list(&[], None, 10_000).len()
    }

    async fn post(&self, url: String, body: Value) -> (StatusCode, Value) {
        let r = self
            .http
            .post(url)
            .bearer_auth(&self.admin)
            .json(&body)
            .send()
            .await
            .unwrap();
        let st = r.status();
        (st, r.json().await.unwrap_or(Value::Null))
    }

    /// `cube-adapter ARGS --state-dir` of replica `i` (through its admin
    /// socket).
    fn cli(&self, i: usize, args: &[&str]) -> std::process::Output {
        std::process::Command::new(BIN)
            .args(args)
            .arg("--state-dir")
            .arg(&self.states[i])
            .arg("--config")
            .arg(&self.config)
            .output()
            .unwrap()
    }
}

impl Drop for Replicas {
    fn drop(&mut self) {
        for p in self.procs.iter_mut().filter_map(Option::take) {
            p.stop();
        }
        self.stop.cancel();
        crate::kit::end_sandboxes(&self.dir.path().join("embedded/sandboxes"));
    }
}

/// Concurrent acquires of one session, half through each replica (haproxy
/// alternates), give one lease and one sandbox; the tenant's quota holds
/// with the requests spread over both; the journal both wrote is one chain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_sessions_quotas_and_one_chain() {
    let pg = Postgres::start();
    let r = Replicas::start(&pg, "").await;
    let lb = Haproxy::start_tcp(&r.addrs());
    let front = format!("https://127.0.0.1:{}", lb.port);

    let mut tasks = vec![];
    for _ in 0..12 {
        let (http, admin, url) = (r.http.clone(), r.admin.clone(), front.clone());
        tasks.push(tokio::spawn(async move {
            let resp = http
                .post(format!("{url}/v1/leases/acquire"))
                .bearer_auth(admin)
                .json(&json!({"runtime": "mcp", "session_key": "one-session"}))
                .send()
                .await
                .unwrap();
            let st = resp.status();
            let v: Value = resp.json().await.unwrap();
            assert_eq!(st, StatusCode::OK, "{v}");
            v["lease_ref"].as_str().unwrap().to_string()
        }));
    }
    let mut refs = vec![];
    for t in tasks {
        refs.push(t.await.unwrap());
    }
    refs.sort();
    refs.dedup();
    assert_eq!(
        refs.len(),
        1,
        "one session, several leases: {refs:?}\nhaproxy: {}",
        lb.log()
    );
    assert_eq!(r.sandboxes(), 1, "one session, several sandboxes");

    // The lease is the same through either replica.
    for i in 0..2 {
        let (st, v) = r
            .post(
                format!("{}/v1/leases/acquire", r.url(i)),
                json!({"runtime": "mcp", "session_key": "one-session"}),
            )
            .await;
        assert_eq!(st, StatusCode::OK, "{v}");
        assert_eq!(v["lease_ref"], refs[0].as_str(), "replica {i}");
    }

    // The quota (8 active leases a tenant, the shipped profiles') holds
    // with the sessions spread over both replicas: 16 sessions at once,
    // 7 more leases at most.
    let mut tasks = vec![];
    for n in 0..16 {
        let (http, admin, url) = (r.http.clone(), r.admin.clone(), r.url(n % 2));
        tasks.push(tokio::spawn(async move {
            let resp = http
                .post(format!("{url}/v1/leases/acquire"))
                .bearer_auth(admin)
                .json(&json!({"runtime": "mcp", "session_key": format!("quota-{n}")}))
                .send()
                .await
                .unwrap();
            let st = resp.status();
            let v: Value = resp.json().await.unwrap();
            (st, v)
        }));
    }
    let mut ok = 0;
    for t in tasks {
        let (st, v) = t.await.unwrap();
        match st {
            StatusCode::OK => ok += 1,
            _ => assert_eq!(crate::kit::code(&v), "lease_quota_exceeded", "{st} {v}"),
        }
    }
    assert_eq!(ok, 7, "the quota let {ok} more leases through");
    assert_eq!(r.sandboxes(), 8);

    // One chain, whichever replica wrote each event; either replica
    // verifies it.
    for i in 0..2 {
        let out = r.cli(i, &["audit", "verify"]);
        assert!(
            out.status.success(),
            "replica {i}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Replicas {
    /// Acquire a lease for `session` through replica `i`: its ref.
    async fn acquire(&self, i: usize, session: &str) -> String {
        let (st, v) = self
            .post(
                format!("{}/v1/leases/acquire", self.url(i)),
                json!({"runtime": "mcp", "session_key": session}),
            )
            .await;
        assert_eq!(st, StatusCode::OK, "{v}");
        v["lease_ref"].as_str().unwrap().to_string()
    }

    /// The journal, through replica `i`'s admin socket.
    fn journal(&self, i: usize) -> Vec<Value> {
        let out = self.cli(i, &["audit", "export"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// SIGKILL replica `i`.
    fn kill(&mut self, i: usize) {
        let mut p = self.procs[i].take().unwrap();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(p.child.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        p.child.wait().unwrap();
    }

    /// Start replica `i` again on its state directory.
    fn restart(&mut self, i: usize) {
        assert!(self.procs[i].is_none());
        self.procs[i] = Some(Proc::start(&self.states[i], &self.config, &[]).unwrap());
    }

    /// Every intent has exactly one outcome, and the chain verifies
    /// (through replica `i`): the journal.
    fn assert_settled(&self, i: usize) -> Vec<Value> {
        let events = self.journal(i);
        let mut outcomes: std::collections::BTreeMap<&str, usize> = Default::default();
        for e in events.iter().filter(|e| e["phase"] == "outcome") {
            if let Some(op) = e["operation_id"].as_str() {
                *outcomes.entry(op).or_default() += 1;
            }
        }
        for e in events.iter().filter(|e| e["phase"] == "intent") {
            let op = e["operation_id"].as_str().unwrap();
            let n = outcomes.get(op).copied().unwrap_or(0);
            assert_eq!(n, 1, "intent {op} ({}) has {n} outcomes", e["action"]);
        }
        let out = self.cli(i, &["audit", "verify"]);
        assert!(
            out.status.success(),
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        events
    }

    /// `GET /readyz` of replica `i`.
    async fn ready(&self, i: usize) -> (StatusCode, Value) {
        let resp = self
            .http
            .get(format!("{}/readyz", self.url(i)))
            .send()
            .await
            .unwrap();
        let st = resp.status();
        (st, resp.json().await.unwrap())
    }

    /// `exec` on a lease through replica `i`.
    async fn exec(&self, i: usize, lease: &str, command: &str) -> (StatusCode, Value) {
        self.post(
            format!("{}/v1/leases/{lease}/exec", self.url(i)),
            json!({ "command": command }),
        )
        .await
    }
}

/// SIGKILL of one replica under load: the other keeps serving; when the
/// killed one starts again it resolves its own intents; no audit event is
/// lost, nothing ran twice or without its intent, and the chain verifies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_under_load_loses_nothing_and_the_other_serves() {
    use std::collections::BTreeSet;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    let pg = Postgres::start();
    let mut r = Replicas::start(&pg, "").await;
    let mut leases = vec![];
    for i in 0..4 {
        leases.push(r.acquire(i % 2, &format!("load-{i}")).await);
    }
    let next = Arc::new(AtomicU64::new(0));
    // (replica, request id) of every exec answered 200.
    let answered = Arc::new(std::sync::Mutex::new(Vec::<(usize, String)>::new()));
    let stop = tokio_util::sync::CancellationToken::new();
    let mut clients = vec![];
    for c in 0..12 {
        let replica = c % 2;
        let (http, admin, url) = (r.http.clone(), r.admin.clone(), r.url(replica));
        let (next, answered, stop) = (next.clone(), answered.clone(), stop.clone());
        let lease = leases[c % leases.len()].clone();
        clients.push(tokio::spawn(async move {
            while !stop.is_cancelled() {
                let id = format!("x{}", next.fetch_add(1, Ordering::SeqCst));
                let resp = http
                    .post(format!("{url}/v1/leases/{lease}/exec"))
                    .bearer_auth(&admin)
                    .json(&json!({
                        "command": format!("echo {id} >> /workspace/ran"),
                        "request_id": id,
                    }))
                    .send()
                    .await;
                match resp {
                    Ok(resp) if resp.status() == StatusCode::OK => {
                        answered.lock().unwrap().push((replica, id));
                    }
                    Ok(_) => {}
                    // The replica died under this request.
                    Err(_) => break,
                }
            }
        }));
    }
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    r.kill(0);
    let at_kill = answered.lock().unwrap().iter().filter(|a| a.0 == 1).count();
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let after = answered.lock().unwrap().iter().filter(|a| a.0 == 1).count();
    assert!(
        after > at_kill,
        "the other replica stopped serving when one was killed ({at_kill} then {after})"
    );
    stop.cancel();
    for c in clients {
        let _ = c.await;
    }
    // The killed replica starts again and resolves what it left.
    r.restart(0);
    let mut ran: Vec<String> = vec![];
    for lease in &leases {
        let (st, v) = r.exec(1, lease, "cat /workspace/ran").await;
        assert_eq!(st, StatusCode::OK, "{v}");
        ran.extend(v["stdout"].as_str().unwrap().lines().map(str::to_string));
    }
    let events = r.assert_settled(1);
    let unique: BTreeSet<&String> = ran.iter().collect();
    assert_eq!(unique.len(), ran.len(), "an exec ran twice");
    let intents: BTreeSet<&str> = events
        .iter()
        .filter(|e| e["action"] == "exec" && e["phase"] == "intent")
        .filter_map(|e| e["request_id"].as_str())
        .collect();
    for id in &ran {
        assert!(intents.contains(id.as_str()), "{id} ran without an intent");
    }
    let answered = answered.lock().unwrap();
    for (_, id) in answered.iter() {
        assert!(unique.contains(id), "{id} was answered 200 but did not run");
    }
    let status = r.cli(0, &["status", "--json"]);
    let v: Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(v["store"]["pending_intents"], 0, "{v}");
    eprintln!(
        "a replica SIGKILLed under load: {} execs answered, {} ran, {} intents resolved at its restart",
        answered.len(),
        ran.len(),
        events
            .iter()
            .filter(|e| e["action"] == "audit_recover")
            .count()
    );
}

/// PostgreSQL going away makes the replicas answer 503 (`audit_unavailable`,
/// nothing done); once it is back they serve again by themselves, with
/// nothing lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_restart_gives_503_then_recovers() {
    let pg = Postgres::start();
    let r = Replicas::start(&pg, "").await;
    let lease = r.acquire(0, "db-restart").await;
    let (st, v) = r.exec(1, &lease, "echo before >> /workspace/ran").await;
    assert_eq!(st, StatusCode::OK, "{v}");
    pg.stop();
    for i in 0..2 {
        let (st, v) = r.exec(i, &lease, "echo during >> /workspace/ran").await;
        assert_eq!(st, StatusCode::SERVICE_UNAVAILABLE, "replica {i}: {v}");
        assert_eq!(crate::kit::code(&v), "audit_unavailable", "{v}");
    }
    pg.restart();
    for i in 0..2 {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let (st, v) = r
                .exec(i, &lease, &format!("echo after{i} >> /workspace/ran"))
                .await;
            if st == StatusCode::OK {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "replica {i} still answers {st} {v} 20 s after the database came back"
            );
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    }
    let (st, v) = r.exec(0, &lease, "cat /workspace/ran").await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(
        v["stdout"].as_str().unwrap(),
        "before\nafter0\nafter1\n",
        "what ran while the database was away"
    );
    r.assert_settled(0);
}

/// `store migrate --to postgres`: a stopped appliance's redb store is
/// copied into an empty database (the chain verified on both sides), the
/// appliance then serves from the database with the same leases, tokens
/// and journal; a second migration into the same database is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redb_store_moves_to_postgres_and_serves_from_it() {
    cube_adapter::tls::install_default_provider();
    let pg = Postgres::start();
    let dir = tempfile::tempdir().unwrap();
    let (_backend, stop, section) = shared_backend(dir.path()).await;
    let state = dir.path().join("state");
    let config = dir.path().join("config.toml");
    std::fs::write(&config, &section).unwrap();
    let cli = |args: &[&str]| {
        std::process::Command::new(BIN)
            .args(args)
            .arg("--state-dir")
            .arg(&state)
            .arg("--config")
            .arg(&config)
            .output()
            .unwrap()
    };
    let p = Proc::start(&state, &config, &[]).unwrap();
    let ca = std::fs::read(state.join("tls/ca.pem")).unwrap();
    let http = reqwest::Client::builder()
        .tls_backend_preconfigured(cube_adapter::tls::client_config(Some(&ca), None).unwrap())
        .build()
        .unwrap();
    let admin = std::fs::read_to_string(state.join("admin.token"))
        .unwrap()
        .trim()
        .to_string();
    let post = |url: String, body: Value| {
        let (http, admin) = (http.clone(), admin.clone());
        async move {
            let r = http
                .post(url)
                .bearer_auth(admin)
                .json(&body)
                .send()
                .await
                .unwrap();
            let st = r.status();
            (st, r.json::<Value>().await.unwrap())
        }
    };
    let acquire = json!({"runtime": "mcp", "session_key": "moved"});
    let (st, v) = post(format!("{}/v1/leases/acquire", p.url), acquire.clone()).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let lease = v["lease_ref"].as_str().unwrap().to_string();
    let (st, v) = post(
        format!("{}/v1/leases/{lease}/exec", p.url),
        json!({"command": "echo one >> /workspace/ran"}),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    p.stop();

    // [store] is still the redb file: refused.
    let out = cli(&["store", "migrate", "--to", "postgres"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let before = cli(&["audit", "export"]);
    assert!(before.status.success(), "{before:?}");
    let before = String::from_utf8(before.stdout).unwrap();

    std::fs::write(&config, format!("{section}{}", store_section(&pg))).unwrap();
    let out = cli(&["store", "migrate", "--to", "postgres"]);
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let events = before.lines().count();
    assert!(
        said.contains(&format!("copied {events} audit events")),
        "{said}"
    );
    // The database holds a store now: a second copy is refused, and
    // changes nothing.
    let out = cli(&["store", "migrate", "--to", "postgres"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("already holds a store"),
        "{out:?}"
    );

    // Served from the database: the same lease, its sandbox, the journal.
    let p = Proc::start(&state, &config, &[]).unwrap();
    let (st, v) = post(format!("{}/v1/leases/acquire", p.url), acquire).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["lease_ref"], lease.as_str(), "{v}");
    let (st, v) = post(
        format!("{}/v1/leases/{lease}/exec", p.url),
        json!({"command": "cat /workspace/ran"}),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["stdout"], "one\n");
    let after = cli(&["audit", "export"]);
    assert!(after.status.success(), "{after:?}");
    let after = String::from_utf8(after.stdout).unwrap();
    assert!(
        after.starts_with(&before),
        "the journal in the database does not begin with the redb store's"
    );
    assert!(after.lines().count() > events);
    let out = cli(&["audit", "verify"]);
    assert!(out.status.success(), "{out:?}");
    p.stop();
    stop.cancel();
    crate::kit::end_sandboxes(&dir.path().join("embedded/sandboxes"));
}

/// Whether replica `i` says it runs the background work (`status`).
fn runs_background(r: &Replicas, i: usize) -> Option<bool> {
    let out = r.cli(i, &["status", "--json"]);
    let v: Value = serde_json::from_slice(&out.stdout).ok()?;
    v.pointer("/replica/background").and_then(Value::as_bool)
}

/// The `seq`s of the events a file sink wrote, in the file's order.
fn seqs_in(file: &Path) -> Vec<u64> {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v["seq"].as_u64())
        .collect()
}

/// Background work (here: audit delivery to a file sink both replicas
/// have) runs on one replica at a time; when that one dies, the other takes
/// it over and delivers on from the shared cursor: every event arrives, in
/// journal order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_work_runs_on_one_replica_and_moves_when_it_dies() {
    let pg = Postgres::start();
    let sinks = tempfile::tempdir().unwrap();
    let file = sinks.path().join("audit.jsonl");
    let mut r = Replicas::start(
        &pg,
        &format!(
            "\n[[audit.sinks]]\nkind = \"file\"\nname = \"shared\"\npath = \"{}\"\nbatch = 4\n",
            file.display()
        ),
    )
    .await;
    let until = |what: &str, secs: u64, mut ok: Box<dyn FnMut() -> bool + '_>| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
        while !ok() {
            assert!(
                std::time::Instant::now() < deadline,
                "{what} within {secs} s"
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    };
    until(
        "one replica takes the background work",
        15,
        Box::new(|| (0..2).any(|i| runs_background(&r, i) == Some(true))),
    );
    let holder = (0..2)
        .find(|i| runs_background(&r, *i) == Some(true))
        .unwrap();
    let other = 1 - holder;
    assert_eq!(runs_background(&r, other), Some(false), "both run it");
    let leases = [r.acquire(0, "bg-0").await, r.acquire(1, "bg-1").await];
    for n in 0..6 {
        let (st, v) = r.exec(n % 2, &leases[n % 2], "true").await;
        assert_eq!(st, StatusCode::OK, "{v}");
    }
    let journal = |r: &Replicas, i: usize| -> Vec<u64> {
        r.journal(i)
            .iter()
            .filter_map(|e| e["seq"].as_u64())
            .collect()
    };
    let want = journal(&r, 0);
    until(
        "the holder delivers the journal",
        15,
        Box::new(|| seqs_in(&file).len() >= want.len()),
    );
    let got = seqs_in(&file);
    assert_eq!(
        &got[..want.len()],
        &want[..],
        "one replica delivering: each event once, in order"
    );

    r.kill(holder);
    until(
        "the other replica takes the background work over",
        15,
        Box::new(|| runs_background(&r, other) == Some(true)),
    );
    for _ in 0..5 {
        let (st, v) = r.exec(other, &leases[other], "true").await;
        assert_eq!(st, StatusCode::OK, "{v}");
    }
    let want = journal(&r, other);
    let covered = |got: &[u64]| {
        let have: std::collections::BTreeSet<&u64> = got.iter().collect();
        want.iter().all(|s| have.contains(s))
    };
    until(
        "the journal reaches the sink after the handover",
        15,
        Box::new(|| covered(&seqs_in(&file))),
    );
    // At least once, in order: the new holder starts again from the last
    // cursor the old one stored (at most a second old), so a run may come
    // twice; nothing is missing, and within each run the order is the
    // journal's.
    let got = seqs_in(&file);
    assert!(covered(&got));
    for w in got.windows(2) {
        assert!(
            w[1] == w[0] + 1 || w[1] <= w[0],
            "a gap or a jump in the delivery: {w:?} in {got:?}"
        );
    }
}

/// An empty database again (the service makes its tables at start).
const FRESH: &str =
    "DROP SCHEMA public CASCADE; CREATE SCHEMA public; GRANT ALL ON SCHEMA public TO cube";

/// p50 and p99 of some durations, in ms.
fn p50_p99(mut v: Vec<std::time::Duration>) -> (f64, f64) {
    v.sort();
    let at = |q: f64| {
        let i = ((v.len() as f64 - 1.0) * q).round() as usize;
        v.get(i).map(|d| d.as_secs_f64() * 1e3).unwrap_or(0.0)
    };
    (at(0.5), at(0.99))
}

/// Benchmark, not a test (ignored: a minute or two, numbers rather than
/// assertions): the PostgreSQL store next to redb. Group commit in this
/// process; the audited exec's latency through one process; exec
/// throughput of 16 agents through haproxy with redb, one replica and two.
/// `cargo test --release --test it replicas::bench -- --ignored --nocapture`
/// (docs/benchmarks.md, "PostgreSQL and replicas").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: minutes, and numbers rather than assertions"]
async fn bench_postgres_next_to_redb() {
    use std::time::{Duration, Instant};
    let pg = Postgres::start();
    // Group commit: 64 writers, 50 events each, as `bench audit`.
    let settings = cube_adapter::store::pg::Settings {
        url: format!("{}?sslmode=disable", pg.url()),
        password_file: Some(pg.password_file()),
        ..Default::default()
    };
    for (engine, batch) in [
        ("redb", 512),
        ("redb", 1),
        ("postgres", 512),
        ("postgres", 1),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let store = match engine {
            "redb" => cube_adapter::store::Store::open_with(dir.path(), batch).unwrap(),
            _ => {
                pg.psql_in("cube", FRESH);
                cube_adapter::store::Store::open_postgres_with(dir.path(), &settings, batch)
                    .unwrap()
            }
        };
        let t = Instant::now();
        let mut tasks = vec![];
        for w in 0..64 {
            let s = store.clone();
            tasks.push(tokio::spawn(async move {
                let mut took = vec![];
                for e in 0..50 {
                    let ev = cube_adapter::audit::event::Event {
                        request_id: Some(format!("w{w}e{e}")),
                        ..Default::default()
                    };
                    let t = Instant::now();
                    s.write(move |txn, chain| chain.append(txn, ev).map(|_| ()))
                        .await
                        .unwrap();
                    took.push(t.elapsed());
                }
                took
            }));
        }
        let mut all = vec![];
        for t in tasks {
            all.extend(t.await.unwrap());
        }
        let secs = t.elapsed().as_secs_f64();
        let cs = store.commit_stats();
        let (p50, p99) = p50_p99(all.clone());
        eprintln!(
            "BENCH group commit {engine} batch {batch}: {:.0} events/s, {:.1} events/commit, \
             write p50 {p50:.2} ms p99 {p99:.2} ms",
            all.len() as f64 / secs,
            cs.writes as f64 / cs.commits.max(1) as f64
        );
        store.close().await;
    }

    // Through serve processes: redb; one replica; two replicas.
    for (name, with_pg, n) in [
        ("redb, one process", false, 1),
        ("postgres, one replica", true, 1),
        ("postgres, two replicas", true, 2),
    ] {
        if with_pg {
            pg.psql_in("cube", FRESH);
        }
        let r = Replicas::start_n(with_pg.then_some(&pg), n, "").await;
        let lb = Haproxy::start_tcp(&r.addrs());
        let front = format!("https://127.0.0.1:{}", lb.port);
        let mut leases = vec![];
        for i in 0..8 {
            leases.push(r.acquire(i % n, &format!("bench-{i}")).await);
        }
        // The audited exec, one agent, one process.
        for _ in 0..20 {
            r.exec(0, &leases[0], "true").await;
        }
        let mut took = vec![];
        for _ in 0..300 {
            let t = Instant::now();
            let (st, _) = r.exec(0, &leases[0], "true").await;
            assert_eq!(st, StatusCode::OK);
            took.push(t.elapsed());
        }
        let (p50, p99) = p50_p99(took);
        // Throughput: 16 agents on 8 leases for 8 s, through haproxy.
        let stop_at = Instant::now() + Duration::from_secs(8);
        let mut tasks = vec![];
        for c in 0..16 {
            let (http, admin, url) = (r.http.clone(), r.admin.clone(), front.clone());
            let lease = leases[c % leases.len()].clone();
            tasks.push(tokio::spawn(async move {
                let mut n = 0u64;
                while Instant::now() < stop_at {
                    let ok = http
                        .post(format!("{url}/v1/leases/{lease}/exec"))
                        .bearer_auth(&admin)
                        .json(&json!({"command": "true"}))
                        .send()
                        .await
                        .map(|r| r.status() == StatusCode::OK)
                        .unwrap_or(false);
                    n += u64::from(ok);
                }
                n
            }));
        }
        let mut done = 0;
        for t in tasks {
            done += t.await.unwrap();
        }
        eprintln!(
            "BENCH {name}: exec p50 {p50:.2} ms p99 {p99:.2} ms (one agent); \
             {:.0} execs/s (16 agents through haproxy)",
            done as f64 / 8.0
        );
        drop(lb);
        drop(r);
    }
}

/// With `on_crash = "block"`, a replica that crashed between an intent and
/// its outcome blocks when it starts again (readiness 503, no sandbox
/// effect) while the other serves on; `audit reconcile` (offline, as on
/// one host: that replica stopped, the other still serving) settles the
/// intent in the shared journal, and it serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_replica_blocks_until_reconciled_while_the_other_serves() {
    let pg = Postgres::start();
    let mut r = Replicas::start(&pg, "\n[audit]\non_crash = \"block\"\n").await;
    let lease = r.acquire(1, "blocked").await;
    // Replica 0 again, dying right after it commits an exec intent.
    r.procs[0].take().unwrap().stop();
    r.procs[0] = Some(
        Proc::start(
            &r.states[0],
            &r.config,
            &[("CUBE_ADAPTER_FAILPOINT", "after_intent")],
        )
        .unwrap(),
    );
    let died = r
        .http
        .post(format!("{}/v1/leases/{lease}/exec", r.url(0)))
        .bearer_auth(&r.admin)
        .json(&json!({"command": "echo never-runs > /workspace/proof"}))
        .send()
        .await;
    assert!(died.is_err(), "replica 0 should have died mid-request");
    r.procs[0].take().unwrap().child.wait().unwrap();
    let (st, v) = r.exec(1, &lease, "true").await;
    assert_eq!(st, StatusCode::OK, "the other replica: {v}");

    r.restart(0);
    let (st, v) = r.ready(0).await;
    assert_eq!(st, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert_eq!(v["checks"]["audit"], "reconciliation_required", "{v}");
    let (st, v) = r.exec(0, &lease, "true").await;
    assert_eq!(st, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    let (st, v) = r.ready(1).await;
    assert_eq!(st, StatusCode::OK, "the other replica is not blocked: {v}");
    let (st, v) = r.exec(1, &lease, "true").await;
    assert_eq!(st, StatusCode::OK, "{v}");

    // Reconcile works offline, as on one host: replica 0 stopped (the
    // other serving), its intents settled in the shared journal.
    let note = ["audit", "reconcile", "--note", "checked: it never ran"];
    let out = r.cli(0, &note);
    assert_eq!(out.status.code(), Some(3), "refused while it runs: {out:?}");
    r.procs[0].take().unwrap().stop();
    let out = r.cli(0, &note);
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    r.restart(0);
    let (st, v) = r.ready(0).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let (st, v) = r
        .exec(0, &lease, "cat /workspace/proof 2>/dev/null || echo absent")
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["stdout"], "absent\n");
    let events = r.assert_settled(1);
    assert!(
        events
            .iter()
            .any(|e| e["phase"] == "outcome" && e["outcome"] == "reconciled"),
        "no reconciled outcome in the shared journal"
    );
}

/// Queue a store write without waiting for it: its job is in the writer's
/// queue when this returns (the future is polled once), and the handle
/// gives its answer later.
async fn queue<T: Send + 'static>(
    store: &cube_adapter::store::Store,
    f: impl FnOnce(
        &cube_adapter::store::Wx,
        &mut cube_adapter::store::Chain,
    ) -> Result<T, cube_adapter::store::StoreError>
    + Send
    + 'static,
) -> tokio::task::JoinHandle<Result<T, cube_adapter::store::StoreError>> {
    let s = store.clone();
    let mut write = Box::pin(async move { s.write(f).await });
    std::future::poll_fn(|cx| {
        assert!(
            write.as_mut().poll(cx).is_pending(),
            "the write answered before its group commit"
        );
        std::task::Poll::Ready(())
    })
    .await;
    tokio::spawn(write)
}

/// One write whose statement PostgreSQL refuses fails alone (#34, H2):
/// the writes it shares a group commit with commit, and what the failing
/// write did to the chain (an event appended before the statement that
/// failed) is undone with it, so the journal stays one verified chain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_statement_fails_only_its_own_write() {
    use cube_adapter::audit::event::Event;
    use cube_adapter::store::{Store, StoreError, WriteOps, tables};
    let pg = Postgres::start();
    let settings = cube_adapter::store::pg::Settings {
        url: format!("{}?sslmode=disable", pg.url()),
        password_file: Some(pg.password_file()),
        ..Default::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open_postgres(dir.path(), &settings).unwrap();
    // Each event named by its request id.
    let ev = |name: &str| Event {
        request_id: Some(name.into()),
        ..Default::default()
    };
    let first = ev("first");
    store
        .write(move |txn, chain| chain.append(txn, first).map(|_| ()))
        .await
        .unwrap();

    // Hold the writer in a job of its own while the batch is queued, so
    // the batch is one group commit.
    let (entered_tx, entered_rx) = tokio::sync::oneshot::channel::<()>();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let held = queue(&store, move |_, _| {
        let _ = entered_tx.send(());
        let _ = release_rx.recv();
        Ok(())
    })
    .await;
    entered_rx.await.unwrap();
    let before = store.commit_stats();

    let mut good = vec![];
    let mut bad = vec![];
    for i in 0..3 {
        let e = ev(&format!("good-{i}"));
        good.push(queue(&store, move |txn, chain| chain.append(txn, e).map(|_| ())).await);
    }
    // An event appended, then a statement the database refuses (event 1
    // exists): the append must be undone with it.
    let e = ev("bad-duplicate");
    bad.push(
        queue(&store, move |txn, chain| {
            chain.append(txn, e)?;
            txn.insert_event(1, b"{}")
        })
        .await,
    );
    for i in 3..6 {
        let e = ev(&format!("good-{i}"));
        good.push(queue(&store, move |txn, chain| chain.append(txn, e).map(|_| ())).await);
    }
    // A key over the btree index's row limit (random hex does not
    // compress below it), after an append.
    let big = {
        let mut s = String::new();
        while s.len() < 12_000 {
            s.push_str(&format!("{:016x}", rand::random::<u64>()));
        }
        s
    };
    let e = ev("bad-oversized-key");
    bad.push(
        queue(&store, move |txn, chain| {
            chain.append(txn, e)?;
            txn.put_index(tables::LEASE_JOBS, &big)
        })
        .await,
    );
    let e = ev("good-last");
    good.push(queue(&store, move |txn, chain| chain.append(txn, e).map(|_| ())).await);
    let key = "lease\0job";
    good.push(queue(&store, move |txn, _| txn.put_index(tables::LEASE_JOBS, key)).await);

    release_tx.send(()).unwrap();
    held.await.unwrap().unwrap();
    for (i, w) in good.into_iter().enumerate() {
        w.await
            .unwrap()
            .unwrap_or_else(|e| panic!("good write {i} failed with the bad ones: {e}"));
    }
    for w in bad {
        let e = w.await.unwrap().unwrap_err();
        assert!(
            !matches!(e, StoreError::Unavailable(_)),
            "a refused statement is its write's own error, not the store's: {e}"
        );
    }
    let after = store.commit_stats();
    assert_eq!(
        after.commits - before.commits,
        2,
        "the held job and the batch: {before:?} {after:?}"
    );
    assert!(!store.failed());

    // The chain: 1 + 7 good events, the refused writes' appends undone.
    let v = cube_adapter::audit::verify(&store).unwrap();
    assert_eq!((v.events, v.last_seq), (8, 8), "{v:?}");
    let names: Vec<String> = store
        .read_now(|txn| {
            use cube_adapter::store::ReadOps;
            txn.events(1, 100)
        })
        .unwrap()
        .into_iter()
        .filter_map(|(_, e)| e.request_id)
        .collect();
    assert_eq!(names.len(), 8, "{names:?}");
    assert!(names.iter().all(|a| !a.starts_with("bad")), "{names:?}");
    let has = store
        .read_now(|txn| {
            use cube_adapter::store::ReadOps;
            txn.index_keys(tables::LEASE_JOBS, "lease\0", "lease\u{1}")
        })
        .unwrap();
    assert_eq!(has, vec!["lease\0job".to_string()]);
    // The head the writer keeps matches the database's: the next append
    // links on.
    let e = ev("next");
    store
        .write(move |txn, chain| chain.append(txn, e).map(|_| ()))
        .await
        .unwrap();
    let v = cube_adapter::audit::verify(&store).unwrap();
    assert_eq!((v.events, v.last_seq), (9, 9), "{v:?}");
    store.close().await;
}

/// A replica whose lock connection broke a moment ago is still running: a
/// replica starting then must not resolve its intents (#34, L10). One
/// silent for the grace period (`GRACE_SECONDS`), its lock free, is
/// stopped, and its intents are the others' to resolve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_lost_its_lock_a_moment_ago_keeps_its_intents() {
    use cube_adapter::audit::event::Event;
    use cube_adapter::store::pg::{GRACE_SECONDS, replica_lock};
    use cube_adapter::store::{Store, journal};
    use std::time::{Duration, Instant};
    let pg = Postgres::start();
    let up = Instant::now();
    let settings = cube_adapter::store::pg::Settings {
        url: format!("{}?sslmode=disable", pg.url()),
        password_file: Some(pg.password_file()),
        ..Default::default()
    };
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = Store::open_postgres(da.path(), &settings).unwrap();
    let a_id = a.replica().unwrap().to_string();
    let ev = Event {
        action: cube_adapter::audit::event::Action::Exec,
        phase: cube_adapter::audit::event::Phase::Intent,
        ..Default::default()
    };
    a.write(move |txn, chain| {
        let ev = chain.append(txn, ev)?;
        journal::put_pending(txn, "op-of-a", ev.seq)
    })
    .await
    .unwrap();
    // B has A's secret.key, as every replica has the first one's.
    std::fs::copy(da.path().join("secret.key"), db.path().join("secret.key")).unwrap();
    let b = Store::open_postgres(db.path(), &settings).unwrap();
    let of_a = |b: &Store| {
        b.pending_to_resolve()
            .unwrap()
            .iter()
            .any(|(op, _)| op == "op-of-a")
    };
    assert!(!of_a(&b));
    assert!(b.replica_running(&a_id).unwrap());

    // The database has been up longer than the grace, so that what keeps
    // A running below is its heartbeat alone, not the database's youth.
    let grace = Duration::from_secs(GRACE_SECONDS as u64 + 1);
    tokio::time::sleep(grace.saturating_sub(up.elapsed())).await;
    // A's lock connection is cut: for a moment no session holds its lock.
    let (_, hi, lo) = replica_lock(&a_id);
    let cut = pg.psql_in(
        "cube",
        &format!(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_locks WHERE locktype = 'advisory' \
             AND classid::bigint = {hi} AND objid::bigint = {lo} AND objsubid = 1"
        ),
    );
    assert_eq!(cut, "1");
    let until = Instant::now() + Duration::from_millis(1500);
    while Instant::now() < until {
        assert!(b.replica_running(&a_id).unwrap(), "A taken for stopped");
        assert!(!of_a(&b), "B would resolve A's intents while A runs");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // A stops for good, and has been silent for longer than the grace:
    // its intents are B's.
    a.close().await;
    drop(a);
    pg.psql_in(
        "cube",
        &format!(
            "UPDATE cube_replicas SET seen_at = now() - interval '1 hour' WHERE id = '{a_id}'"
        ),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while b.replica_running(&a_id).unwrap() {
        assert!(Instant::now() < deadline, "A's lock is still held");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(of_a(&b));
    b.close().await;
}

/// Issue #34's H2, as it was reproduced: eight clients of another tenant,
/// with an auditor's token, send acquires whose `runtime` is 3,000
/// characters (more than a PostgreSQL btree row takes, were it an index key
/// as it was) while the admin's tenant acquires and runs commands through
/// the same replica: every one of the victim's calls answers 200, the
/// replica keeps serving, and every intent has its one outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_tenants_oversized_names_do_not_fail_this_ones_calls() {
    let pg = Postgres::start();
    let r = Replicas::start_n(Some(&pg), 1, "").await;
    let out = r.cli(
        0,
        &[
            "token",
            "create",
            "--tenant",
            "evil",
            "--subject",
            "flood",
            "--role",
            "auditor",
        ],
    );
    assert!(out.status.success(), "{out:?}");
    let flood = String::from_utf8(out.stdout).unwrap().trim().to_string();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut floods = vec![];
    for _ in 0..8 {
        let (http, url, flood, stop) = (r.http.clone(), r.url(0), flood.clone(), stop.clone());
        floods.push(tokio::spawn(async move {
            let mut n = 0u32;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let st = http
                    .post(format!("{url}/v1/leases/acquire"))
                    .bearer_auth(&flood)
                    .json(&json!({"runtime": "r".repeat(3000), "session_key": "s", "profile": "p".repeat(3000)}))
                    .send()
                    .await
                    .unwrap()
                    .status();
                assert_eq!(st, StatusCode::FORBIDDEN);
                n += 1;
            }
            n
        }));
    }
    let mut failed = vec![];
    for i in 0..20 {
        let (st, v) = r
            .post(
                format!("{}/v1/leases/acquire", r.url(0)),
                json!({"runtime": "mcp", "session_key": format!("victim-{}", i % 4)}),
            )
            .await;
        if st != StatusCode::OK {
            failed.push(format!("acquire {st} {v}"));
            continue;
        }
        let lease = v["lease_ref"].as_str().unwrap().to_string();
        let (st, v) = r.exec(0, &lease, "echo ok").await;
        if st != StatusCode::OK {
            failed.push(format!("exec {st} {v}"));
        }
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut sent = 0;
    for f in floods {
        sent += f.await.unwrap();
    }
    assert!(sent >= 8, "the flood ran ({sent} requests)");
    assert!(failed.is_empty(), "the victim's calls failed: {failed:?}");
    let lease = r.acquire(0, "after").await;
    let (st, v) = r.exec(0, &lease, "echo still").await;
    assert_eq!(st, StatusCode::OK, "the replica still serves: {v}");
    let events = r.assert_settled(0);
    assert!(
        events
            .iter()
            .filter(|e| e["outcome"] == "rejected")
            .all(|e| e["runtime"].as_str().is_none_or(|v| v.len() <= 128)),
        "a refused name was kept verbatim"
    );
}
