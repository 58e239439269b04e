//! PostgreSQL connections for the store: a capped pool of query connections,
//! a separate pool for advisory locks, and a dedicated runtime driving both.
//!
//! The store's callers are synchronous closures that run anywhere (a worker
//! of the application's runtime, `spawn_blocking`, a plain thread, a
//! current-thread runtime), so nothing here relies on the caller's runtime.
//! Every `tokio_postgres::Connection` runs on our own two `store-pg`
//! threads; a `Client` future only talks to it through channels, so a
//! blocking call runs that future on the caller's thread with
//! `futures_executor::block_on` (inside `block_in_place` on a multi-thread
//! worker). Opening a connection needs a reactor, so it runs on our runtime
//! and the caller waits for its `JoinHandle`.
//!
//! Errors: closed, unreachable, failing or timed-out connections are
//! `Unavailable`; database errors are `Io` with their SQLSTATE, except
//! 40001/40P01 (`Conflict`: retry the transaction). The password is never
//! in an error or a log line.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::{
    CertificateError, DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme,
};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName, UnixTime};
use sha2::{Digest, Sha256};
use tokio::runtime::{Handle, Runtime, RuntimeFlavor};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, TryAcquireError};
use tokio_postgres::config::{Host, SslMode};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Config, NoTls, Row, SimpleQueryMessage, Statement};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::store::StoreError;

/// Query parameters, as `tokio_postgres` takes them.
pub type Params<'a> = &'a [&'a (dyn ToSql + Sync)];

/// Prepared statements kept per connection. The store's SQL is a fixed set
/// of strings; the cap only guards against a caller that formats values
/// into its SQL (the cache is then cleared, not grown without bound).
const STATEMENT_CACHE_MAX: usize = 256;

/// Where the system's CA bundle lives (Debian/Ubuntu, RHEL/Fedora, others),
/// used when TLS is on and no `ca_file` is given.
const SYSTEM_CA_BUNDLES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/cert.pem",
];

/// How to reach the database.
#[derive(Clone)]
pub struct Settings {
    /// A libpq-style URL or key=value string, e.g.
    /// `postgres://cube@127.0.0.1:5432/cube?sslmode=require`. `sslmode` may
    /// be `verify-full` (the default), `verify-ca`, `require`, and, when
    /// every host is this machine (loopback, `localhost`, a unix socket),
    /// `prefer` or `disable`. Whenever TLS is used the server's certificate
    /// is verified against the CA (`ca_file` or the system bundle), and so
    /// is its host name except under `verify-ca`: there is no unverified
    /// TLS.
    pub url: String,
    /// A file holding the password (one trailing newline is ignored), read
    /// each time a connection is opened, so a rotated password is picked up
    /// without a restart. The URL must then carry no password.
    pub password_file: Option<PathBuf>,
    /// A PEM CA bundle to verify the server with. Without it, TLS uses the
    /// system's bundle, and fails clearly when there is none.
    pub ca_file: Option<PathBuf>,
    /// The most query connections open at once (lock connections are not
    /// counted). At least 1.
    pub pool_size: usize,
    /// How long opening a connection (TCP, TLS, authentication) may take,
    /// and how long `conn` waits for a busy pool.
    pub connect_timeout: Duration,
    /// Shown in `pg_stat_activity`; empty keeps what the URL says.
    pub application_name: String,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            url: String::new(),
            password_file: None,
            ca_file: None,
            pool_size: 16,
            connect_timeout: Duration::from_secs(5),
            application_name: "cube-adapter".to_owned(),
        }
    }
}

/// A handle on the database: cheap to clone, shared by every caller.
#[derive(Clone)]
pub struct Pg {
    inner: Arc<Inner>,
}

/// Owns the runtime; what runs on it holds only `Shared`, so the runtime is
/// never dropped from one of its own tasks.
struct Inner {
    shared: Arc<Shared>,
    runtime: Option<Runtime>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // `shutdown_background` neither blocks nor panics, so the last `Pg`
        // may be dropped anywhere, an async context included (a plain drop
        // of a runtime there panics). Connections still open are cut; the
        // server ends their sessions, releasing their locks.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

struct Shared {
    /// The parsed URL, without the password when it comes from a file.
    config: Config,
    password_file: Option<PathBuf>,
    tls: Tls,
    pool_size: usize,
    connect_timeout: Duration,
    /// Our runtime, where connections are opened and driven.
    handle: Handle,
    /// One permit per query connection in use: the pool's cap.
    permits: Arc<Semaphore>,
    idle: Mutex<Vec<Session>>,
    lock_idle: Mutex<Vec<Session>>,
    closed: AtomicBool,
}

#[derive(Clone)]
enum Tls {
    Off,
    Rustls(MakeRustlsConnect),
}

/// One server session: its client and the statements prepared on it.
struct Session {
    client: Client,
    statements: HashMap<String, Statement>,
}

impl Pg {
    /// Starts the runtime and opens one connection, so that wrong settings
    /// (URL, password, TLS) fail here with a clear error rather than at the
    /// first query. Blocking; callable from any context.
    pub fn connect(s: &Settings) -> Result<Pg, StoreError> {
        let (mut config, verify) = parse_url(&s.url)?;
        if s.password_file.is_some() && config.get_password().is_some() {
            return Err(StoreError::Unavailable(
                "postgres: the database URL contains a password and password_file is set: \
                 remove the password from the URL"
                    .to_owned(),
            ));
        }
        if !s.application_name.is_empty() {
            config.application_name(&s.application_name);
        }
        detect_dead_peers(&mut config);
        let tls = tls_for(config.get_ssl_mode(), verify, s.ca_file.as_deref())?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("store-pg")
            .enable_all()
            .build()
            .map_err(|e| {
                StoreError::Unavailable(format!("postgres: cannot start the store's runtime: {e}"))
            })?;
        let pool_size = s.pool_size.max(1);
        let shared = Arc::new(Shared {
            config,
            password_file: s.password_file.clone(),
            tls,
            pool_size,
            connect_timeout: s.connect_timeout,
            handle: runtime.handle().clone(),
            permits: Arc::new(Semaphore::new(pool_size)),
            idle: Mutex::new(Vec::new()),
            lock_idle: Mutex::new(Vec::new()),
            closed: AtomicBool::new(false),
        });
        let pg = Pg {
            inner: Arc::new(Inner {
                shared: Arc::clone(&shared),
                runtime: Some(runtime),
            }),
        };
        let first = block(pg.on_runtime(open(Arc::clone(&shared))))?;
        lock(&shared.idle).push(first);
        tracing::info!(pool_size, "postgres store connected");
        Ok(pg)
    }

    /// A query connection: an idle one, a new one while fewer than
    /// `pool_size` are open, or else the first one given back within
    /// `connect_timeout`. Blocking; callable from any context.
    pub fn conn(&self) -> Result<Conn, StoreError> {
        let shared = &self.inner.shared;
        shared.check_open()?;
        let lease = match shared.try_idle() {
            Some(lease) => lease,
            None => block(self.on_runtime(acquire(Arc::clone(shared))))?,
        };
        Ok(Conn {
            lease,
            _pg: self.clone(),
        })
    }

    /// `conn` for async callers.
    pub async fn conn_async(&self) -> Result<Conn, StoreError> {
        let shared = &self.inner.shared;
        shared.check_open()?;
        let lease = match shared.try_idle() {
            Some(lease) => lease,
            None => self.on_runtime(acquire(Arc::clone(shared))).await?,
        };
        Ok(Conn {
            lease,
            _pg: self.clone(),
        })
    }

    /// Waits for the session-level advisory lock `key` (see `lock_key`), on
    /// a connection of the lock pool, which `pool_size` does not cap: a lock
    /// holder runs its queries through `conn`, so one shared cap could leave
    /// every connection held by a lock waiter. The wait runs on our runtime,
    /// never blocking the caller's thread; if the caller gives up (drops
    /// this future), a lock granted later is released at once.
    pub async fn lock(&self, key: i64) -> Result<AdvisoryLock, StoreError> {
        let shared = Arc::clone(&self.inner.shared);
        shared.check_open()?;
        let lease = self
            .on_runtime(async move {
                let session = match shared.pop_idle(&shared.lock_idle) {
                    Some(session) => session,
                    None => open(Arc::clone(&shared)).await?,
                };
                let mut lease = LockLease::new(shared, session, key);
                lease
                    .send(&format!("SELECT pg_advisory_lock({key})"))
                    .await?;
                lease.held = true;
                Ok(lease)
            })
            .await?;
        Ok(AdvisoryLock {
            lease,
            _pg: self.clone(),
        })
    }

    /// Takes the advisory lock `key` if it is free, for "one replica runs
    /// the background work" leases. Blocking; callable from any context.
    pub fn try_lock_blocking(&self, key: i64) -> Result<Option<AdvisoryLock>, StoreError> {
        let shared = &self.inner.shared;
        shared.check_open()?;
        let session = match shared.pop_idle(&shared.lock_idle) {
            Some(session) => session,
            None => block(self.on_runtime(open(Arc::clone(shared))))?,
        };
        let mut lease = LockLease::new(Arc::clone(shared), session, key);
        let got = block(lease.ask(&format!("SELECT pg_try_advisory_lock({key})")))?;
        Ok(self.granted(lease, got))
    }

    /// `try_lock_blocking` for async callers.
    pub async fn try_lock(&self, key: i64) -> Result<Option<AdvisoryLock>, StoreError> {
        let shared = &self.inner.shared;
        shared.check_open()?;
        let session = match shared.pop_idle(&shared.lock_idle) {
            Some(session) => session,
            None => self.on_runtime(open(Arc::clone(shared))).await?,
        };
        let mut lease = LockLease::new(Arc::clone(shared), session, key);
        let got = lease
            .ask(&format!("SELECT pg_try_advisory_lock({key})"))
            .await?;
        Ok(self.granted(lease, got))
    }

    fn granted(&self, mut lease: LockLease, got: bool) -> Option<AdvisoryLock> {
        // Not granted: the lease goes back to the lock pool on drop.
        lease.held = got;
        got.then(|| AdvisoryLock {
            lease,
            _pg: self.clone(),
        })
    }

    /// Closes the idle connections; every later call fails with
    /// `Unavailable("the store is closed")`. Connections and locks still
    /// held are closed when dropped.
    pub fn close(&self) {
        let shared = &self.inner.shared;
        shared.closed.store(true, Ordering::SeqCst);
        shared.permits.close();
        let idle = std::mem::take(&mut *lock(&shared.idle));
        let lock_idle = std::mem::take(&mut *lock(&shared.lock_idle));
        drop((idle, lock_idle));
    }

    /// Runs `work` on our runtime and returns a future of its result, which
    /// any executor can await (a `JoinHandle` needs no tokio context).
    fn on_runtime<T, W>(&self, work: W) -> impl Future<Output = Result<T, StoreError>> + use<T, W>
    where
        T: Send + 'static,
        W: Future<Output = Result<T, StoreError>> + Send + 'static,
    {
        let task = self.inner.shared.handle.spawn(work);
        async move {
            match task.await {
                Ok(result) => result,
                Err(e) if e.is_cancelled() => {
                    Err(StoreError::Unavailable("the store is closed".to_owned()))
                }
                Err(_) => Err(StoreError::Unavailable(
                    "postgres: a connection task panicked".to_owned(),
                )),
            }
        }
    }
}

impl fmt::Debug for Pg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shared = &self.inner.shared;
        f.debug_struct("Pg")
            .field("pool_size", &shared.pool_size)
            .field("idle", &lock(&shared.idle).len())
            .field("closed", &shared.closed.load(Ordering::SeqCst))
            .finish_non_exhaustive()
    }
}

impl Shared {
    fn check_open(&self) -> Result<(), StoreError> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(StoreError::Unavailable("the store is closed".to_owned()));
        }
        Ok(())
    }

    /// The fast path: a free permit and an idle connection, without a hop
    /// to our runtime.
    fn try_idle(self: &Arc<Self>) -> Option<Lease> {
        let permit = Arc::clone(&self.permits).try_acquire_owned().ok()?;
        let session = self.pop_idle(&self.idle)?;
        Some(Lease::new(Arc::clone(self), session, permit))
    }

    /// An idle connection that is still open; closed ones (the server went
    /// away or ended the session) are dropped on the way.
    fn pop_idle(&self, pool: &Mutex<Vec<Session>>) -> Option<Session> {
        let mut idle = lock(pool);
        while let Some(session) = idle.pop() {
            if !session.client.is_closed() {
                return Some(session);
            }
        }
        None
    }

    fn give_back(&self, pool: &Mutex<Vec<Session>>, session: Session) {
        if !self.closed.load(Ordering::SeqCst) && !session.client.is_closed() {
            lock(pool).push(session);
        }
    }
}

/// A permit, then an idle connection or a new one. Runs on our runtime.
async fn acquire(shared: Arc<Shared>) -> Result<Lease, StoreError> {
    let closed = || StoreError::Unavailable("the store is closed".to_owned());
    let permit = match Arc::clone(&shared.permits).try_acquire_owned() {
        Ok(permit) => permit,
        Err(TryAcquireError::Closed) => return Err(closed()),
        Err(TryAcquireError::NoPermits) => {
            let wait = Arc::clone(&shared.permits).acquire_owned();
            match tokio::time::timeout(shared.connect_timeout, wait).await {
                Ok(Ok(permit)) => permit,
                Ok(Err(_)) => return Err(closed()),
                Err(_) => {
                    return Err(StoreError::Unavailable(format!(
                        "postgres: all {} connections are busy",
                        shared.pool_size
                    )));
                }
            }
        }
    };
    shared.check_open()?;
    let session = match shared.pop_idle(&shared.idle) {
        Some(session) => session,
        None => open(Arc::clone(&shared)).await?,
    };
    Ok(Lease::new(shared, session, permit))
}

/// Opens a connection and spawns its driver. Runs on our runtime.
async fn open(shared: Arc<Shared>) -> Result<Session, StoreError> {
    let mut config = shared.config.clone();
    if let Some(path) = &shared.password_file {
        config.password(read_password(path)?);
    }
    let attempt = async {
        match &shared.tls {
            Tls::Off => {
                let (client, connection) = config.connect(NoTls).await?;
                drive(connection);
                Ok(client)
            }
            Tls::Rustls(tls) => {
                let (client, connection) = config.connect(tls.clone()).await?;
                drive(connection);
                Ok(client)
            }
        }
    };
    let timeout = shared.connect_timeout;
    match tokio::time::timeout(timeout, attempt).await {
        Ok(Ok(client)) => {
            tracing::debug!("postgres: opened a connection");
            Ok(Session {
                client,
                statements: HashMap::new(),
            })
        }
        Ok(Err(e)) => Err(map_err(&e)),
        Err(_) => Err(StoreError::Unavailable(format!(
            "postgres: no connection within {} ms (connect_timeout)",
            timeout.as_millis()
        ))),
    }
}

/// Runs a connection's I/O until the session ends, on our runtime.
fn drive(connection: impl Future<Output = Result<(), tokio_postgres::Error>> + Send + 'static) {
    drop(tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::warn!(error = %chain(&e), "postgres: connection lost");
        }
    }));
}

/// A peer that vanishes without closing (a partition, a crashed host) would
/// leave a query waiting for an answer forever: TCP's defaults notice after
/// hours. Unless the URL says otherwise, keepalive probes start after 30 s
/// idle (every 10 s, 3 tries) and unacknowledged data gives up after 60 s,
/// so a dead peer fails calls within about a minute. A slow query is not
/// affected: the server's kernel keeps acknowledging.
fn detect_dead_peers(config: &mut Config) {
    // tokio-postgres's default idle time; the URL's `keepalives_idle`
    // otherwise.
    if config.get_keepalives_idle() == Duration::from_secs(2 * 60 * 60) {
        config.keepalives_idle(Duration::from_secs(30));
    }
    if config.get_keepalives_interval().is_none() {
        config.keepalives_interval(Duration::from_secs(10));
    }
    if config.get_keepalives_retries().is_none() {
        config.keepalives_retries(3);
    }
    if config.get_tcp_user_timeout().is_none() {
        config.tcp_user_timeout(Duration::from_secs(60));
    }
}

fn read_password(path: &Path) -> Result<String, StoreError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        StoreError::Unavailable(format!(
            "postgres: cannot read the password file {}: {e}",
            path.display()
        ))
    })?;
    let password = text
        .strip_suffix('\n')
        .map(|p| p.strip_suffix('\r').unwrap_or(p))
        .unwrap_or(&text);
    if password.is_empty() {
        return Err(StoreError::Unavailable(format!(
            "postgres: the password file {} is empty",
            path.display()
        )));
    }
    Ok(password.to_owned())
}

/// A query connection, back to the pool when dropped.
pub struct Conn {
    lease: Lease,
    /// Keeps the runtime (and so this connection's driver) alive.
    _pg: Pg,
}

/// What goes back to the pool: kept apart from `Conn` so the runtime's own
/// tasks can hold one without holding the runtime.
struct Lease {
    shared: Arc<Shared>,
    session: Option<Session>,
    in_txn: bool,
    broken: bool,
    /// A request is in flight: set while one is awaited, so a cancelled
    /// async call (its response still to come) discards the connection.
    busy: bool,
    /// Released after `Drop::drop` has given the session back, so a waiter
    /// woken by the permit finds it idle.
    _permit: OwnedSemaphorePermit,
}

impl Lease {
    fn new(shared: Arc<Shared>, session: Session, permit: OwnedSemaphorePermit) -> Self {
        Self {
            shared,
            session: Some(session),
            in_txn: false,
            broken: false,
            busy: false,
            _permit: permit,
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(session) = self.session.take() {
            // Never hand on a session mid-transaction or with a response
            // pending: dropping it ends the session, and the server rolls
            // back whatever was open.
            if !(self.broken || self.in_txn || self.busy) {
                self.shared.give_back(&self.shared.idle, session);
            }
        }
    }
}

/// Marks the lease busy while `work` is awaited, maps its error, and marks
/// the connection broken when the error says it is unusable.
async fn guarded<T>(
    busy: &mut bool,
    broken: &mut bool,
    work: impl Future<Output = Result<T, tokio_postgres::Error>>,
) -> Result<T, StoreError> {
    *busy = true;
    let result = work.await;
    *busy = false;
    result.map_err(|e| {
        let mapped = map_err(&e);
        if matches!(mapped, StoreError::Unavailable(_)) {
            *broken = true;
        }
        mapped
    })
}

fn discarded() -> StoreError {
    StoreError::Unavailable("postgres: the connection was discarded".to_owned())
}

impl Conn {
    /// Runs a statement and returns its rows. Blocking.
    pub fn query(&mut self, sql: &str, params: Params<'_>) -> Result<Vec<Row>, StoreError> {
        block(self.query_async(sql, params))
    }

    /// Runs a statement expected to return at most one row (more is an
    /// error). Blocking.
    pub fn query_opt(&mut self, sql: &str, params: Params<'_>) -> Result<Option<Row>, StoreError> {
        block(self.query_opt_async(sql, params))
    }

    /// Runs a statement and returns how many rows it affected. Blocking.
    pub fn execute(&mut self, sql: &str, params: Params<'_>) -> Result<u64, StoreError> {
        block(self.execute_async(sql, params))
    }

    /// Runs one or more statements without parameters, through the simple
    /// protocol (`BEGIN`, `COMMIT`, DDL). Blocking.
    pub fn batch(&mut self, sql: &str) -> Result<(), StoreError> {
        block(self.batch_async(sql))
    }

    /// Sends `begin_sql` (a `BEGIN ...`) and the first statement of the
    /// transaction together, in one round trip, and marks the connection as
    /// inside a transaction. Blocking.
    pub fn begin_then_query(
        &mut self,
        begin_sql: &str,
        sql: &str,
        params: Params<'_>,
    ) -> Result<Vec<Row>, StoreError> {
        block(self.begin_then_query_async(begin_sql, sql, params))
    }

    pub async fn query_async(
        &mut self,
        sql: &str,
        params: Params<'_>,
    ) -> Result<Vec<Row>, StoreError> {
        let Lease {
            session,
            busy,
            broken,
            ..
        } = &mut self.lease;
        let session = session.as_mut().ok_or_else(discarded)?;
        guarded(busy, broken, session.query(sql, params)).await
    }

    pub async fn query_opt_async(
        &mut self,
        sql: &str,
        params: Params<'_>,
    ) -> Result<Option<Row>, StoreError> {
        let mut rows = self.query_async(sql, params).await?.into_iter();
        let first = rows.next();
        match rows.next() {
            None => Ok(first),
            Some(_) => Err(StoreError::Io(format!(
                "postgres: expected at most one row, got {}",
                rows.len() + 2
            ))),
        }
    }

    pub async fn execute_async(
        &mut self,
        sql: &str,
        params: Params<'_>,
    ) -> Result<u64, StoreError> {
        let Lease {
            session,
            busy,
            broken,
            ..
        } = &mut self.lease;
        let session = session.as_mut().ok_or_else(discarded)?;
        guarded(busy, broken, session.execute(sql, params)).await
    }

    pub async fn batch_async(&mut self, sql: &str) -> Result<(), StoreError> {
        let Lease {
            session,
            busy,
            broken,
            ..
        } = &mut self.lease;
        let session = session.as_mut().ok_or_else(discarded)?;
        guarded(busy, broken, session.client.batch_execute(sql)).await
    }

    /// `begin_then_query` for async callers. tokio-postgres writes requests
    /// in the order they are first polled and pipelines them, and `join`
    /// polls `BEGIN` first, so the statement (and its `Parse` when it is not
    /// prepared yet) follows it on the wire without waiting for its answer.
    /// If `BEGIN` fails the statement may have run outside any transaction,
    /// so the connection is discarded and the error returned.
    pub async fn begin_then_query_async(
        &mut self,
        begin_sql: &str,
        sql: &str,
        params: Params<'_>,
    ) -> Result<Vec<Row>, StoreError> {
        let Lease {
            session,
            busy,
            broken,
            in_txn,
            ..
        } = &mut self.lease;
        let session = session.as_mut().ok_or_else(discarded)?;
        let (begun, rows) = guarded(busy, broken, async {
            Ok::<_, tokio_postgres::Error>(session.begin_then_query(begin_sql, sql, params).await)
        })
        .await?;
        if let Err(e) = begun {
            *broken = true;
            return Err(map_err(&e));
        }
        *in_txn = true;
        rows.map_err(|e| {
            let mapped = map_err(&e);
            if matches!(mapped, StoreError::Unavailable(_)) {
                *broken = true;
            }
            mapped
        })
    }

    /// Never give this connection back to the pool (its state is unknown).
    pub fn mark_broken(&mut self) {
        self.lease.broken = true;
    }

    /// Tells the connection whether a transaction is open on it (the caller
    /// tracks its `BEGIN` and `COMMIT`/`ROLLBACK`): one dropped while open is
    /// discarded, never handed to the next caller.
    pub fn set_in_txn(&mut self, yes: bool) {
        self.lease.in_txn = yes;
    }

    pub fn in_txn(&self) -> bool {
        self.lease.in_txn
    }

    /// The session ended (the server went away or closed it).
    pub fn is_closed(&self) -> bool {
        self.lease
            .session
            .as_ref()
            .is_none_or(|s| s.client.is_closed())
    }
}

impl Session {
    /// The statement for `sql`, prepared once per connection.
    async fn prepared(&mut self, sql: &str) -> Result<Statement, tokio_postgres::Error> {
        if let Some(statement) = self.statements.get(sql) {
            return Ok(statement.clone());
        }
        let statement = self.client.prepare(sql).await?;
        remember(&mut self.statements, sql, &statement);
        Ok(statement)
    }

    async fn query(
        &mut self,
        sql: &str,
        params: Params<'_>,
    ) -> Result<Vec<Row>, tokio_postgres::Error> {
        let statement = self.prepared(sql).await?;
        let result = self.client.query(&statement, params).await;
        self.forget_if_stale(sql, &result);
        result
    }

    async fn execute(
        &mut self,
        sql: &str,
        params: Params<'_>,
    ) -> Result<u64, tokio_postgres::Error> {
        let statement = self.prepared(sql).await?;
        let result = self.client.execute(&statement, params).await;
        self.forget_if_stale(sql, &result);
        result
    }

    async fn begin_then_query(
        &mut self,
        begin_sql: &str,
        sql: &str,
        params: Params<'_>,
    ) -> (
        Result<(), tokio_postgres::Error>,
        Result<Vec<Row>, tokio_postgres::Error>,
    ) {
        let Session { client, statements } = self;
        let client = &*client;
        let cached = statements.get(sql).cloned();
        let begin = client.batch_execute(begin_sql);
        let query = async {
            let statement = match cached {
                Some(statement) => statement,
                None => {
                    let statement = client.prepare(sql).await?;
                    remember(statements, sql, &statement);
                    statement
                }
            };
            client.query(&statement, params).await
        };
        let (begun, rows) = futures_util::future::join(begin, query).await;
        self.forget_if_stale(sql, &rows);
        (begun, rows)
    }

    /// A statement prepared before a schema change can fail with "cached
    /// plan must not change result type" (0A000), or vanish (26000): forget
    /// it so the next call prepares it again.
    fn forget_if_stale<T>(&mut self, sql: &str, result: &Result<T, tokio_postgres::Error>) {
        if let Err(e) = result
            && let Some(code) = e.code()
            && (*code == SqlState::FEATURE_NOT_SUPPORTED
                || *code == SqlState::INVALID_SQL_STATEMENT_NAME)
        {
            self.statements.remove(sql);
        }
    }
}

fn remember(statements: &mut HashMap<String, Statement>, sql: &str, statement: &Statement) {
    if statements.len() >= STATEMENT_CACHE_MAX {
        statements.clear();
    }
    statements.insert(sql.to_owned(), statement.clone());
}

/// A session-level advisory lock, held as long as this value and its
/// connection live. Dropping it unlocks in the background and gives the
/// connection back to the lock pool; if the connection broke instead, the
/// server already released the lock when the session ended.
pub struct AdvisoryLock {
    lease: LockLease,
    /// Keeps the runtime (and so the lock's connection) alive.
    _pg: Pg,
}

impl AdvisoryLock {
    /// The lock's connection closed: the server released the lock, and
    /// another replica may hold it now. Whoever relies on the lock stops.
    pub fn is_lost(&self) -> bool {
        self.lease
            .session
            .as_ref()
            .is_none_or(|s| s.client.is_closed())
    }

    pub fn key(&self) -> i64 {
        self.lease.key
    }
}

impl fmt::Debug for AdvisoryLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdvisoryLock")
            .field("key", &self.lease.key)
            .field("lost", &self.is_lost())
            .finish()
    }
}

struct LockLease {
    shared: Arc<Shared>,
    session: Option<Session>,
    key: i64,
    held: bool,
    /// As in `Lease`: a lock request in flight (its grant may still come).
    busy: bool,
}

impl LockLease {
    fn new(shared: Arc<Shared>, session: Session, key: i64) -> Self {
        Self {
            shared,
            session: Some(session),
            key,
            held: false,
            busy: false,
        }
    }

    /// Runs a query through the simple protocol (one round trip, nothing
    /// prepared), marked busy while it waits.
    async fn send(&mut self, sql: &str) -> Result<Vec<SimpleQueryMessage>, StoreError> {
        let session = self.session.as_ref().ok_or_else(discarded)?;
        self.busy = true;
        let result = session.client.simple_query(sql).await;
        self.busy = false;
        result.map_err(|e| map_err(&e))
    }

    /// `send` for a query returning one boolean.
    async fn ask(&mut self, sql: &str) -> Result<bool, StoreError> {
        first_bool(&self.send(sql).await?)
    }
}

fn first_bool(messages: &[SimpleQueryMessage]) -> Result<bool, StoreError> {
    for message in messages {
        if let SimpleQueryMessage::Row(row) = message {
            return match row.try_get(0) {
                Ok(Some("t")) => Ok(true),
                Ok(Some("f") | None) => Ok(false),
                Ok(Some(other)) => Err(StoreError::Io(format!(
                    "postgres: unexpected boolean {other:?}"
                ))),
                Err(e) => Err(map_err(&e)),
            };
        }
    }
    Err(StoreError::Io(
        "postgres: the query returned no row".to_owned(),
    ))
}

impl Drop for LockLease {
    fn drop(&mut self) {
        let Some(session) = self.session.take() else {
            return;
        };
        if self.busy || session.client.is_closed() || self.shared.closed.load(Ordering::SeqCst) {
            // Dropping the session ends it, releasing anything it held.
            return;
        }
        if !self.held {
            self.shared.give_back(&self.shared.lock_idle, session);
            return;
        }
        // Unlock without blocking the dropping thread. If our runtime is
        // already shut down the task never runs, the session is cut, and
        // the server releases the lock all the same.
        let shared = Arc::clone(&self.shared);
        let key = self.key;
        drop(self.shared.handle.spawn(async move {
            let sql = format!("SELECT pg_advisory_unlock({key})");
            match session
                .client
                .simple_query(&sql)
                .await
                .map_err(|e| map_err(&e))
            {
                Ok(messages) if first_bool(&messages).unwrap_or(false) => {
                    shared.give_back(&shared.lock_idle, session);
                }
                Ok(_) => tracing::warn!(key, "postgres: advisory lock was not held at unlock"),
                Err(e) => tracing::debug!(key, error = %e, "postgres: advisory unlock failed"),
            }
        }));
    }
}

/// A stable advisory-lock key for `name`: the first 8 bytes of
/// SHA-256("cube-adapter:" + name), big-endian, so every replica and every
/// version agree on it.
pub fn lock_key(name: &str) -> i64 {
    let digest = Sha256::new()
        .chain_update(b"cube-adapter:")
        .chain_update(name.as_bytes())
        .finalize();
    let mut bytes = [0u8; 8];
    for (to, from) in bytes.iter_mut().zip(digest.iter()) {
        *to = *from;
    }
    i64::from_be_bytes(bytes)
}

/// Runs `work` to completion on the calling thread. A `Client` future needs
/// no tokio context (its connection is driven on our runtime), so a plain
/// executor does; on a multi-thread worker the wait goes through
/// `block_in_place` so the worker's other tasks move to another thread. A
/// current-thread runtime cannot do that (`block_in_place` panics there),
/// so its thread just blocks, which cannot deadlock: nothing we wait for
/// runs on it.
pub(crate) fn block<F: Future>(work: F) -> F::Output {
    match Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(|| futures_executor::block_on(work))
        }
        _ => futures_executor::block_on(work),
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // The pools stay consistent even if a holder panicked: a Vec push/pop.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn map_err(e: &tokio_postgres::Error) -> StoreError {
    if let Some(db) = e.as_db_error() {
        let code = db.code().code();
        let text = format!("postgres: SQLSTATE {code}: {}", db.message());
        return match code {
            "40001" | "40P01" => StoreError::Conflict(text),
            // The server is shutting down, starting up or full, or the
            // connection failed: transient, like a refused connection.
            "57P01" | "57P02" | "57P03" | "53300" => StoreError::Unavailable(text),
            c if c.starts_with("08") => StoreError::Unavailable(text),
            _ => StoreError::Io(text),
        };
    }
    let text = format!("postgres: {}", chain(e));
    if is_caller_error(e) {
        StoreError::Io(text)
    } else {
        StoreError::Unavailable(text)
    }
}

/// Errors of the request itself (parameters, row shapes), not of the
/// connection: tokio-postgres exposes its error kinds only through their
/// messages, which are fixed strings.
fn is_caller_error(e: &tokio_postgres::Error) -> bool {
    let text = e.to_string();
    [
        "error serializing parameter",
        "error deserializing column",
        "invalid column",
        "query returned an unexpected number",
        "expected ",
        "error encoding message",
        "invalid connection string",
        "invalid configuration",
    ]
    .iter()
    .any(|prefix| text.starts_with(prefix))
}

/// An error and its causes: tokio-postgres's own message is only its kind
/// ("error connecting to server"), the useful part is in the sources.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// What `sslmode` asked to verify beyond what tokio-postgres parses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verify {
    /// `verify-full`: the chain and the host name.
    Full,
    /// `verify-ca`: the chain only.
    Chain,
}

/// Parse the database URL with the TLS it asks for, and hold it to the
/// rules: no `sslmode` means `verify-full`; `disable` and `prefer` (which
/// falls back to plain text when the server, or a machine on the way, says
/// it has no TLS) only when every host is this machine (`loopback_only`).
fn parse_url(url: &str) -> Result<(Config, Option<Verify>), StoreError> {
    let (url, mut verify, given) = rewrite_sslmode(url);
    let mut config = Config::from_str(&url).map_err(|e| {
        StoreError::Unavailable(format!("postgres: invalid database URL: {}", chain(&e)))
    })?;
    if !given {
        config.ssl_mode(SslMode::Require);
        verify = Some(Verify::Full);
    }
    let unverified = match config.get_ssl_mode() {
        SslMode::Disable => Some("disable"),
        SslMode::Prefer => Some("prefer"),
        _ => None,
    };
    if let Some(mode) = unverified
        && !loopback_only(&config)
    {
        return Err(StoreError::Unavailable(format!(
            "postgres: sslmode={mode} is refused for a database on another host: the password \
             and every record could go in clear, to whoever answers; use sslmode=verify-full \
             (the default; with ca_file), verify-ca or require (both verify the certificate); \
             disable and prefer are for 127.0.0.0/8, ::1, localhost and unix sockets"
        )));
    }
    Ok((config, verify))
}

/// Check a database URL as `Pg::connect` would before connecting (`[store]
/// url`, at config load): it parses, and its `sslmode` is allowed for its
/// hosts.
pub fn check_url(url: &str) -> Result<(), StoreError> {
    parse_url(url).map(|_| ())
}

/// Whether every address the URL dials is this machine: a unix socket, a
/// loopback address (127.0.0.0/8, ::1, IPv4-mapped included) or
/// `localhost`. As tokio-postgres dials: the `i`th `hostaddr` when there
/// is one, else the `i`th host. No host at all fails to connect anyway.
fn loopback_only(config: &Config) -> bool {
    let loopback_ip = |ip: std::net::IpAddr| ip.to_canonical().is_loopback();
    let (hosts, addrs) = (config.get_hosts(), config.get_hostaddrs());
    (0..hosts.len().max(addrs.len())).all(|i| match (addrs.get(i), hosts.get(i)) {
        (Some(ip), _) => loopback_ip(*ip),
        (None, Some(Host::Tcp(name))) => {
            let name = name.trim_start_matches('[').trim_end_matches(']');
            name.eq_ignore_ascii_case("localhost")
                || name.parse::<std::net::IpAddr>().is_ok_and(loopback_ip)
        }
        (None, Some(Host::Unix(_))) => true,
        (None, None) => true,
    })
}

/// tokio-postgres knows `disable`, `prefer` and `require`; libpq's
/// `verify-ca` and `verify-full` become `require` (TLS or nothing) and the
/// verification they ask for is returned, with whether the URL sets
/// `sslmode` at all.
fn rewrite_sslmode(url: &str) -> (String, Option<Verify>, bool) {
    let mut out = String::with_capacity(url.len());
    let mut verify = None;
    let mut given = false;
    let mut rest = url;
    'scan: while let Some(at) = rest.find("sslmode") {
        let (before, from) = rest.split_at(at);
        out.push_str(before);
        let Some(after_key) = from.strip_prefix("sslmode") else {
            break;
        };
        let at_boundary = out
            .chars()
            .last()
            .is_none_or(|c| c == '?' || c == '&' || c.is_whitespace());
        if at_boundary && let Some(value) = after_key.trim_start().strip_prefix('=') {
            given = true;
            let value = value.trim_start();
            let quoted = value.starts_with('\'');
            let bare = value.strip_prefix('\'').unwrap_or(value);
            for (name, mode) in [("verify-full", Verify::Full), ("verify-ca", Verify::Chain)] {
                if let Some(tail) = bare.strip_prefix(name)
                    && (tail.is_empty()
                        || tail.starts_with(['&', '\'', '#'])
                        || tail.starts_with(char::is_whitespace))
                {
                    out.push_str(if quoted {
                        "sslmode='require"
                    } else {
                        "sslmode=require"
                    });
                    verify = Some(mode);
                    rest = tail;
                    continue 'scan;
                }
            }
        }
        out.push_str("sslmode");
        rest = after_key;
    }
    out.push_str(rest);
    (out, verify, given)
}

fn tls_for(
    mode: SslMode,
    verify: Option<Verify>,
    ca_file: Option<&Path>,
) -> Result<Tls, StoreError> {
    if mode == SslMode::Disable {
        return Ok(Tls::Off);
    }
    let tls_error = |e: rustls::Error| StoreError::Unavailable(format!("postgres: TLS setup: {e}"));
    let roots = Arc::new(roots(ca_file)?);
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(tls_error)?;
    let config = match verify {
        None | Some(Verify::Full) => builder.with_root_certificates(roots).with_no_client_auth(),
        Some(Verify::Chain) => {
            let inner = WebPkiServerVerifier::builder_with_provider(roots, provider)
                .build()
                .map_err(|e| StoreError::Unavailable(format!("postgres: TLS setup: {e}")))?;
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(ChainOnly(inner)))
                .with_no_client_auth()
        }
    };
    Ok(Tls::Rustls(MakeRustlsConnect::new(config)))
}

/// The CAs to trust: `ca_file` (every block must parse) or the system
/// bundle (unparsable entries skipped, as other TLS clients do).
fn roots(ca_file: Option<&Path>) -> Result<RootCertStore, StoreError> {
    let (path, strict) = match ca_file {
        Some(path) => (path, true),
        None => match SYSTEM_CA_BUNDLES
            .iter()
            .map(Path::new)
            .find(|p| p.is_file())
        {
            Some(path) => (path, false),
            None => {
                return Err(StoreError::Unavailable(format!(
                    "postgres: TLS needs a CA to verify the server: set ca_file, or add \
                     sslmode=disable to the URL (no system CA bundle at {})",
                    SYSTEM_CA_BUNDLES.join(", ")
                )));
            }
        },
    };
    let unreadable = |e: rustls_pki_types::pem::Error| {
        StoreError::Unavailable(format!(
            "postgres: cannot read the CA file {}: {e}",
            path.display()
        ))
    };
    let mut certs = Vec::new();
    for cert in CertificateDer::pem_file_iter(path).map_err(unreadable)? {
        match cert {
            Ok(cert) => certs.push(cert),
            Err(e) if strict => return Err(unreadable(e)),
            Err(_) => {}
        }
    }
    let mut store = RootCertStore::empty();
    let (added, rejected) = store.add_parsable_certificates(certs);
    if added == 0 || (strict && rejected > 0) {
        return Err(StoreError::Unavailable(format!(
            "postgres: the CA file {} holds {added} usable certificate(s) and {rejected} unusable",
            path.display()
        )));
    }
    Ok(store)
}

/// `verify-ca`: the usual verification, except that a certificate for
/// another host name is accepted (the chain to a trusted CA is still
/// required; rustls checks the chain before the name).
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }

    fn root_hint_subjects(&self) -> Option<&[DistinguishedName]> {
        self.0.root_hint_subjects()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rewrites_verify_modes() {
        let (url, v, given) = rewrite_sslmode("postgres://a@h/db?sslmode=verify-full");
        assert_eq!(url, "postgres://a@h/db?sslmode=require");
        assert_eq!(v, Some(Verify::Full));
        assert!(given);
        let (url, v, _) = rewrite_sslmode("host=h sslmode = 'verify-ca' user=a");
        assert_eq!(url, "host=h sslmode='require' user=a");
        assert_eq!(v, Some(Verify::Chain));
        let (url, v, given) =
            rewrite_sslmode("postgres://h/db?application_name=xsslmode&sslmode=require");
        assert_eq!(
            url,
            "postgres://h/db?application_name=xsslmode&sslmode=require"
        );
        assert_eq!(v, None);
        assert!(given);
        let (url, v, _) = rewrite_sslmode("postgres://h/db?sslmode=verify-fullish");
        assert_eq!(url, "postgres://h/db?sslmode=verify-fullish");
        assert_eq!(v, None);
        let (_, v, given) = rewrite_sslmode("postgres://h/db?application_name=xsslmode");
        assert_eq!((v, given), (None, false));
    }

    /// No `sslmode`: `verify-full`, whatever the host (#34, L5).
    #[test]
    fn sslmode_defaults_to_verify_full() {
        for url in [
            "postgres://cube@db.example:5432/cube",
            "postgres://cube@127.0.0.1/cube",
            "host=db.example user=cube",
        ] {
            let (config, verify) = parse_url(url).unwrap();
            assert_eq!(config.get_ssl_mode(), SslMode::Require, "{url}");
            assert_eq!(verify, Some(Verify::Full), "{url}");
        }
    }

    /// `disable` and `prefer` only on this machine; every verifying mode
    /// anywhere (#34, L5).
    #[test]
    fn unverified_sslmode_only_on_loopback() {
        let local = [
            "postgres://cube@127.0.0.1:5432/cube",
            "postgres://cube@127.8.9.10/cube",
            "postgres://cube@localhost/cube",
            "postgres://cube@LocalHost/cube",
            "postgres://cube@[::1]:5432/cube",
            "postgres://cube@%2Frun%2Fpostgresql/cube",
            "host=/run/postgresql user=cube",
            "host=::ffff:127.0.0.1 user=cube",
            "host=127.0.0.1,localhost user=cube",
            "host=db.example hostaddr=127.0.0.1 user=cube",
        ];
        let remote = [
            "postgres://cube@db.example:5432/cube",
            "postgres://cube@10.0.0.5/cube",
            "postgres://cube@[2001:db8::1]/cube",
            "postgres://cube@128.0.0.1/cube",
            "postgres://cube@localhost.example/cube",
            "host=127.0.0.1,db.example user=cube",
            "host=localhost hostaddr=10.0.0.5 user=cube",
        ];
        let with = |url: &str, mode: &str| {
            let sep = if url.starts_with("postgres://") {
                "?"
            } else {
                " "
            };
            format!("{url}{sep}sslmode={mode}")
        };
        for url in local {
            for mode in ["disable", "prefer", "require", "verify-ca", "verify-full"] {
                parse_url(&with(url, mode)).unwrap_or_else(|e| panic!("{url} {mode}: {e}"));
            }
        }
        for url in remote {
            for mode in ["disable", "prefer"] {
                let e = parse_url(&with(url, mode)).unwrap_err().to_string();
                assert!(
                    e.contains(&format!("sslmode={mode} is refused")),
                    "{url} {mode}: {e}"
                );
            }
            for mode in ["require", "verify-ca", "verify-full"] {
                parse_url(&with(url, mode)).unwrap_or_else(|e| panic!("{url} {mode}: {e}"));
            }
            check_url(url).unwrap();
        }
    }

    #[test]
    fn lock_keys_are_stable() {
        // First 8 bytes of sha256("cube-adapter:leases"), from sha256sum.
        assert_eq!(
            lock_key("leases"),
            i64::from_be_bytes(0xd63d_79f9_0fbc_a58e_u64.to_be_bytes())
        );
        assert_eq!(lock_key("leases"), -3_009_114_865_395_784_306);
        assert_ne!(lock_key("leases"), lock_key("jobs"));
    }

    #[test]
    fn password_file_trimming() {
        let dir = std::env::temp_dir().join(format!("pgscratch-pw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("pw");
        std::fs::write(&file, "s3cret\r\n").unwrap();
        assert_eq!(read_password(&file).unwrap(), "s3cret");
        std::fs::write(&file, "s3cret\n\n").unwrap();
        assert_eq!(read_password(&file).unwrap(), "s3cret\n");
        std::fs::write(&file, "\n").unwrap();
        assert!(read_password(&file).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
