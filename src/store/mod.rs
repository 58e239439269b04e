//! The store: one redb file, `STATE/state.redb`, opened by one process.
//!
//! All mutations go through one writer thread that batches whatever is
//! queued into a single durable commit (group commit): throughput is bounded
//! by commits per fsync, not requests per fsync. A failed commit stops the
//! writer for good and every later write fails (`Unavailable`): redb blocks
//! writes after a failed commit, and retrying blindly could record an effect
//! twice. Point lookups run inline (`read_now`: a few microseconds from the
//! page cache); scans run on the blocking pool (`read`).

pub(crate) mod audit_index;
pub(crate) mod checkpoints;
pub(crate) mod codec;
pub(crate) mod console;
pub(crate) mod event;
pub(crate) mod jobs;
pub mod journal;
pub(crate) mod leases;
pub mod pg;
pub(crate) mod plans;
pub(crate) mod ptys;
pub(crate) mod recordings;
pub mod tables;
pub(crate) mod tasks;
pub mod typed;
pub(crate) mod vocab;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use redb::{Database, ReadableDatabase, ReadableTable, WriteTransaction};
use tokio::sync::{mpsc, oneshot, watch};

use self::event::Event;
pub use self::typed::{ReadOps, Rx, WriteOps, Wx};
pub use crate::secrets::Sealer;

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("{0}")]
    Locked(String),
    #[error("store I/O: {0}")]
    Io(String),
    #[error("store data is corrupt: {0}")]
    Corrupt(String),
    #[error("store unavailable: {0}")]
    Unavailable(String),
    #[error(
        "store schema {found} is newer than this binary supports ({supported}); upgrade cube-adapter"
    )]
    Newer { found: u64, supported: u64 },
    #[error("{0}")]
    Conflict(String),
    #[error("not found")]
    NotFound,
    /// The database refused one of this write's statements, and the write
    /// was undone alone (its savepoint, and what it did to the chain head);
    /// the other writes of its group commit went on. Only the PostgreSQL
    /// store answers this: redb has no per-write undo.
    #[error("the store refused this write (undone): {0}")]
    Refused(String),
}

impl From<crate::secrets::SecretsError> for StoreError {
    fn from(e: crate::secrets::SecretsError) -> Self {
        match e {
            crate::secrets::SecretsError::Io(m) => StoreError::Io(m),
            crate::secrets::SecretsError::Corrupt(m) => StoreError::Corrupt(m),
        }
    }
}

impl From<redb::Error> for StoreError {
    fn from(e: redb::Error) -> Self {
        match e {
            redb::Error::DatabaseAlreadyOpen => {
                StoreError::Locked("the store is already open".into())
            }
            redb::Error::Corrupted(m) => StoreError::Corrupt(m),
            redb::Error::Io(e) => StoreError::Io(e.to_string()),
            other => StoreError::Io(other.to_string()),
        }
    }
}

macro_rules! from_redb {
    ($($t:ty),*) => {$(
        impl From<$t> for StoreError {
            fn from(e: $t) -> Self {
                StoreError::from(redb::Error::from(e))
            }
        }
    )*};
}
from_redb!(
    redb::DatabaseError,
    redb::TransactionError,
    redb::TableError,
    redb::StorageError,
    redb::CommitError
);

impl From<redb::SetDurabilityError> for StoreError {
    fn from(e: redb::SetDurabilityError) -> Self {
        StoreError::Io(e.to_string())
    }
}

/// The head of the audit hash chain, owned by the writer.
#[derive(Debug, Clone)]
pub struct Chain {
    pub next_seq: u64,
    pub last_hash: String,
}

impl Chain {
    /// Append an event: assign its sequence number and chain hash, insert it.
    /// Every field is bounded first (`Event::bound`): the event, its index
    /// keys and what the sinks send stay small whatever a caller sent.
    pub fn append(&mut self, txn: &Wx, mut ev: Event) -> Result<Event, StoreError> {
        ev.bound();
        ev.seq = self.next_seq;
        ev.prev_hash = self.last_hash.clone();
        ev.hash = ev.compute_hash();
        let bytes = codec::encode(&ev)?;
        txn.append_event(
            ev.seq,
            &bytes,
            &audit_index::keys_of(&ev),
            audit_index::minute_of(&ev.ts),
        )?;
        self.next_seq += 1;
        self.last_hash = ev.hash.clone();
        Ok(ev)
    }
}

type Finish = Box<dyn FnOnce(Result<(), StoreError>) + Send>;
type Job = Box<dyn FnOnce(&Wx, &mut Chain) -> Finish + Send>;

/// Where the data is.
enum Engine {
    /// `STATE/state.redb`. `None` once closed: reads and writes then fail
    /// `Unavailable`, and the file (and its lock) is released.
    Redb(std::sync::RwLock<Option<Arc<Database>>>),
    /// A PostgreSQL database that several replicas may share.
    Pg(pg::Pg),
}

struct Inner {
    engine: Engine,
    jobs: mpsc::Sender<Job>,
    writer: std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
    failed: AtomicBool,
    closed: AtomicBool,
    path: PathBuf,
    stats: Arc<Stats>,
    /// The token key, unsealed once at open (`None` if that failed: then
    /// each `token_key` call tries again and reports why).
    token_key: Option<[u8; 32]>,
    /// The sequence number of the last committed audit event (0: none):
    /// the audit sinks wait on it instead of polling.
    last_seq: watch::Receiver<u64>,
    /// Why the last group commit failed (for the writes whose replies it
    /// dropped).
    last_error: std::sync::Mutex<Option<String>>,
    /// This process's id among the replicas of a shared database (`None`:
    /// a redb store, which one process holds).
    replica: Option<Arc<str>>,
    /// Whether this process runs the background work (GC, keepalive,
    /// audit delivery): always, with redb; with a shared database, the
    /// replica holding its `background` lock does.
    turn: watch::Receiver<bool>,
    _turn_tx: watch::Sender<bool>,
}

/// Counters kept by the writer.
#[derive(Default)]
struct Stats {
    commits: AtomicU64,
    writes: AtomicU64,
    /// The last `RECENT` commit durations (oldest first).
    recent: std::sync::Mutex<std::collections::VecDeque<Duration>>,
    /// Commit latency and audit events per commit, for `/metrics`.
    metrics: crate::metrics::Store,
}

/// How long the writer waits for writers woken by the previous commit.
const GATHER: Duration = Duration::from_micros(100);

/// How many commit durations `recent_commits` keeps.
const RECENT: usize = 4096;

/// What the writer has done since the store was opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommitStats {
    /// Durable commits (each one fsync).
    pub commits: u64,
    /// Writes carried by them (group commit puts several in one).
    pub writes: u64,
}

/// Cheap to clone.
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
    pub sealer: Sealer,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("path", &self.inner.path)
            .finish()
    }
}

/// `meta` key of the sealed token key.
const TOKEN_KEY: &str = "token_key";

/// Largest number of queued writes committed together.
const MAX_BATCH: usize = 512;

impl Store {
    /// Open (or create) `STATE/state.redb` with an exclusive lock, apply
    /// migrations, and start the writer.
    pub fn open(state_dir: &Path) -> Result<Self, StoreError> {
        Self::open_with(state_dir, MAX_BATCH)
    }

    /// As `open`, committing at most `max_batch` queued writes together
    /// (1 = one fsync per write; benchmarks compare the two).
    pub fn open_with(state_dir: &Path, max_batch: usize) -> Result<Self, StoreError> {
        let max_batch = max_batch.max(1);
        std::fs::create_dir_all(state_dir)
            .map_err(|e| StoreError::Io(format!("create {}: {e}", state_dir.display())))?;
        let path = state_dir.join("state.redb");
        // A bounded page cache: the working set (leases, the chain head) is small.
        let db = match Database::builder()
            .set_cache_size(32 * 1024 * 1024)
            .create(&path)
        {
            Ok(db) => db,
            Err(redb::DatabaseError::DatabaseAlreadyOpen) => {
                return Err(StoreError::Locked(format!(
                    "{} is in use by another cube-adapter process (is the service running? \
                     operator commands reach a running service through STATE/admin.sock)",
                    path.display()
                )));
            }
            Err(e) => return Err(e.into()),
        };
        set_mode(&path, 0o600);
        let sealer = Sealer::load_or_create(&state_dir.join("secret.key"))?;
        let chain = migrate(&db, &sealer)?;
        let token_key = db
            .begin_read()
            .map_err(StoreError::from)
            .and_then(|t| read_token_key(&t, &sealer))
            .ok();
        let db = Arc::new(db);
        let (tx, rx) = mpsc::channel::<Job>(4096);
        let stats = Arc::new(Stats::default());
        let (seq_tx, seq_rx) = watch::channel(chain.next_seq - 1);
        let (turn_tx, turn_rx) = watch::channel(true);
        let inner = Arc::new(Inner {
            engine: Engine::Redb(std::sync::RwLock::new(Some(db.clone()))),
            jobs: tx,
            writer: std::sync::Mutex::new(None),
            failed: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            path,
            stats: stats.clone(),
            token_key,
            last_seq: seq_rx,
            last_error: std::sync::Mutex::new(None),
            replica: None,
            turn: turn_rx,
            _turn_tx: turn_tx,
        });
        let weak = Arc::downgrade(&inner);
        let handle = std::thread::Builder::new()
            .name("store-writer".into())
            .spawn(move || writer(Writing::Redb(db), rx, chain, weak, stats, max_batch, seq_tx))
            .map_err(|e| StoreError::Io(format!("start writer: {e}")))?;
        if let Ok(mut w) = inner.writer.lock() {
            *w = Some(handle);
        }
        Ok(Self { inner, sealer })
    }

    /// Open the store in a PostgreSQL database (`[store] kind =
    /// "postgres"`): apply its schema steps (under an advisory lock: the
    /// replicas take turns), make `meta` once, and start the writer. The
    /// key secrets are sealed under is `STATE/secret.key`, as for a redb
    /// store; every replica must have the same one (docs/operations.md,
    /// "Several replicas").
    pub fn open_postgres(state_dir: &Path, settings: &pg::Settings) -> Result<Self, StoreError> {
        Self::open_postgres_with(state_dir, settings, MAX_BATCH)
    }

    /// As `open_postgres`, committing at most `max_batch` queued writes
    /// together (benchmarks compare 1 with the default).
    pub fn open_postgres_with(
        state_dir: &Path,
        settings: &pg::Settings,
        max_batch: usize,
    ) -> Result<Self, StoreError> {
        let max_batch = max_batch.max(1);
        std::fs::create_dir_all(state_dir)
            .map_err(|e| StoreError::Io(format!("create {}: {e}", state_dir.display())))?;
        let sealer = Sealer::load_or_create(&state_dir.join("secret.key"))?;
        let db = pg::Pg::connect(settings)?;
        pg::migrate(&db)?;
        let chain = init_postgres_meta(&db, &sealer)?;
        // This replica's id, and its lock for as long as it runs: the
        // other replicas see from the lock whether its intents are in
        // flight or left by a crash.
        let replica: Arc<str> = replica_id(state_dir)?.into();
        let lock = db
            .try_lock_blocking(pg::replica_lock(&replica).0)?
            .ok_or_else(|| {
                StoreError::Locked(format!(
                    "replica {replica} is already running on this database: is {} a copy of \
                     another replica's? each replica needs its own replica.id",
                    state_dir.join("replica.id").display()
                ))
            })?;
        let host = nix::unistd::gethostname()
            .map(|h| h.to_string_lossy().into_owned())
            .unwrap_or_default();
        pg::register(&mut db.conn()?, &replica, &host)?;
        let token_key = {
            let tx = pg::PgTx::read(db.conn()?);
            let k = read_token_key(&tx, &sealer);
            let _ = tx.finish(false);
            match k {
                Ok(k) => k,
                Err(StoreError::Corrupt(m)) => {
                    return Err(StoreError::Corrupt(format!(
                        "{m}: the database's secrets were sealed under another key than \
                         {}; every replica needs the first one's secret.key",
                        state_dir.join("secret.key").display()
                    )));
                }
                Err(e) => return Err(e),
            }
        };
        let (tx, rx) = mpsc::channel::<Job>(4096);
        let stats = Arc::new(Stats::default());
        let (seq_tx, seq_rx) = watch::channel(chain.next_seq - 1);
        let (turn_tx, turn_rx) = watch::channel(false);
        let inner = Arc::new(Inner {
            engine: Engine::Pg(db.clone()),
            jobs: tx,
            writer: std::sync::Mutex::new(None),
            failed: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            path: state_dir.join("postgres"),
            stats: stats.clone(),
            token_key: Some(token_key),
            last_seq: seq_rx,
            last_error: std::sync::Mutex::new(None),
            replica: Some(replica.clone()),
            turn: turn_rx,
            _turn_tx: turn_tx.clone(),
        });
        let weak = Arc::downgrade(&inner);
        let engine = Writing::Pg {
            pg: db.clone(),
            conn: None,
            replica: replica.clone(),
        };
        let seq_watch = seq_tx.clone();
        let handle = std::thread::Builder::new()
            .name("store-writer".into())
            .spawn(move || writer(engine, rx, chain, weak, stats, max_batch, seq_tx))
            .map_err(|e| StoreError::Io(format!("start writer: {e}")))?;
        if let Ok(mut w) = inner.writer.lock() {
            *w = Some(handle);
        }
        // Other replicas append too: follow the head (the sinks wait on
        // it); keep this replica's lock, and take the background turn when
        // it is free.
        let weak = Arc::downgrade(&inner);
        let tending = Tending {
            db,
            inner: weak,
            last_seq: seq_watch,
            turn: turn_tx,
            replica,
            lock: Some(lock),
            background: None,
        };
        std::thread::Builder::new()
            .name("store-tend".into())
            .spawn(move || tending.run())
            .map_err(|e| StoreError::Io(format!("start the store's tending: {e}")))?;
        Ok(Self { inner, sealer })
    }

    fn db(&self) -> Result<Arc<Database>, StoreError> {
        match &self.inner.engine {
            Engine::Redb(db) => db
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .clone()
                .ok_or_else(|| StoreError::Unavailable("the store is closed".into())),
            Engine::Pg(_) => Err(StoreError::Unavailable(
                "the store is in PostgreSQL, not a redb file".into(),
            )),
        }
    }

    /// This process's id among the replicas of a shared database.
    pub fn replica(&self) -> Option<&str> {
        self.inner.replica.as_deref()
    }

    /// Whether this process runs the background work now (changes as
    /// replicas come and go; always true with redb).
    pub fn turn(&self) -> watch::Receiver<bool> {
        self.inner.turn.clone()
    }

    /// The pending intents this process answers for (after a crash, at
    /// start; `audit reconcile`): every one in a redb store; in a shared
    /// database its own, and those of replicas that are not running.
    pub fn pending_to_resolve(&self) -> Result<Vec<(String, u64)>, StoreError> {
        match &self.inner.replica {
            Some(me) => {
                let me = me.clone();
                self.read_here(move |txn| match txn {
                    Rx::Pg(t) => t.pending_for(&me),
                    Rx::Redb(t) => t.pending(),
                })
            }
            None => self.read_here(|txn| txn.pending()),
        }
    }

    /// Whether replica `id` is running (true for this one, and for every
    /// id with redb: one process).
    pub fn replica_running(&self, id: &str) -> Result<bool, StoreError> {
        match &self.inner.replica {
            Some(me) if &**me != id => self.read_here(|txn| match txn {
                Rx::Pg(t) => t.replica_running(id),
                Rx::Redb(_) => Ok(true),
            }),
            _ => Ok(true),
        }
    }

    /// The PostgreSQL database, when the store is in one.
    pub fn postgres(&self) -> Option<&pg::Pg> {
        match &self.inner.engine {
            Engine::Pg(p) => Some(p),
            Engine::Redb(_) => None,
        }
    }

    /// Run `f` in a read transaction of whichever engine, on this thread.
    fn read_here<T>(&self, f: impl FnOnce(&Rx) -> Result<T, StoreError>) -> Result<T, StoreError> {
        match &self.inner.engine {
            Engine::Redb(_) => {
                let txn = Rx::Redb(self.db()?.begin_read()?);
                f(&txn)
            }
            Engine::Pg(p) => {
                if self.inner.closed.load(Ordering::SeqCst) {
                    return Err(StoreError::Unavailable("the store is closed".into()));
                }
                let txn = Rx::Pg(pg::PgTx::read(p.conn()?));
                let r = f(&txn);
                let Rx::Pg(t) = txn else {
                    return r;
                };
                // A read's end cannot change what it read; a failure to end
                // it only costs the connection.
                let _ = t.finish(false);
                r
            }
        }
    }

    /// Commit what is queued, stop the writer and wait for it, and release
    /// the file (and its lock) once reads in progress end: later reads and
    /// writes, through any clone, fail `Unavailable`.
    pub async fn close(&self) {
        self.inner.closed.store(true, Ordering::SeqCst);
        // Wake the writer: it commits what is queued up to this no-op, then
        // sees `closed` and stops.
        let wake: Job = Box::new(|_txn, _chain| Box::new(|_| {}));
        let _ = self.inner.jobs.send(wake).await;
        let handle = self
            .inner
            .writer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(h) = handle {
            let _ = tokio::task::spawn_blocking(move || h.join()).await;
        }
        match &self.inner.engine {
            Engine::Redb(db) => {
                db.write().unwrap_or_else(|p| p.into_inner()).take();
            }
            Engine::Pg(p) => p.close(),
        }
    }

    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// The writer's instruments (commit latency, audit events per commit).
    pub fn metrics(&self) -> &crate::metrics::Store {
        &self.inner.stats.metrics
    }

    /// Commits and writes since the store opened (the durations of recent
    /// commits: `recent_commits`).
    pub fn commit_stats(&self) -> CommitStats {
        let s = &self.inner.stats;
        CommitStats {
            commits: s.commits.load(Ordering::Relaxed),
            writes: s.writes.load(Ordering::Relaxed),
        }
    }

    /// The durations of the last (up to 4096) commits, oldest first.
    pub fn recent_commits(&self) -> Vec<Duration> {
        let r = self
            .inner
            .stats
            .recent
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        r.iter().copied().collect()
    }

    /// The sequence number of the last committed audit event, updated after
    /// each commit (0 while the journal is empty).
    pub fn last_seq(&self) -> watch::Receiver<u64> {
        self.inner.last_seq.clone()
    }

    /// Whether a commit has failed (the writer is stopped).
    pub fn failed(&self) -> bool {
        self.inner.failed.load(Ordering::SeqCst)
    }

    /// Run `f` in the next group commit. `f` must not write anything when it
    /// returns an error (validate first, then write).
    pub async fn write<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Wx, &mut Chain) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        if self.failed() {
            return Err(StoreError::Unavailable(
                "an earlier commit failed; restart required".into(),
            ));
        }
        if self.inner.closed.load(Ordering::SeqCst) {
            return Err(StoreError::Unavailable("the store is closed".into()));
        }
        let (tx, rx) = oneshot::channel();
        let job: Job = Box::new(move |txn, chain| {
            let r = f(txn, chain);
            Box::new(move |commit: Result<(), StoreError>| {
                let _ = tx.send(commit.and(r));
            })
        });
        self.inner
            .jobs
            .send(job)
            .await
            .map_err(|_| StoreError::Unavailable("the writer has stopped".into()))?;
        rx.await.map_err(|_| {
            let why = self
                .inner
                .last_error
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            StoreError::Unavailable(why.unwrap_or_else(|| "the writer has stopped".into()))
        })?
    }

    /// Run a read on the blocking pool.
    pub async fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Rx) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || me.read_here(f))
            .await
            .map_err(|e| StoreError::Io(e.to_string()))?
    }

    /// Synchronous read: point lookups from async code (microseconds from
    /// the page cache), the CLI and startup. Scans use `read`.
    pub fn read_now<T>(
        &self,
        f: impl FnOnce(&Rx) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        self.read_here(f)
    }

    /// The key bearer tokens are verified under (HMAC-SHA-256): made with
    /// the store (schema 4), kept in `meta` sealed under the store key, and
    /// unsealed once, when the store is opened.
    pub fn token_key(&self) -> Result<[u8; 32], StoreError> {
        match self.inner.token_key {
            Some(k) => Ok(k),
            None => self.read_here(|txn| read_token_key(txn, &self.sealer)),
        }
    }
}

/// Read and unseal the token key from `meta`.
fn read_token_key(txn: &impl ReadOps, sealer: &Sealer) -> Result<[u8; 32], StoreError> {
    let sealed: String = codec::decode(
        &txn.meta(TOKEN_KEY)?
            .ok_or_else(|| StoreError::Corrupt("meta has no token key".into()))?,
    )?;
    let raw = sealer.open(&sealed)?;
    raw.as_slice()
        .try_into()
        .map_err(|_| StoreError::Corrupt("the token key is not 32 bytes".into()))
}

fn set_mode(p: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode));
}

/// One durable write transaction (fsync on commit).
fn begin(db: &Database) -> Result<WriteTransaction, StoreError> {
    let mut txn = db.begin_write()?;
    txn.set_durability(redb::Durability::Immediate)?;
    Ok(txn)
}

/// Create tables, check and record the schema version, make the token key
/// (schema 4), load the chain head.
fn migrate(db: &Database, sealer: &Sealer) -> Result<Chain, StoreError> {
    let txn = begin(db)?;
    let found = {
        let meta = txn.open_table(tables::META)?;
        match meta.get("schema_version")? {
            Some(v) => Some(codec::decode::<u64>(v.value())?),
            None => None,
        }
    };
    match found {
        Some(v) if v > tables::SCHEMA_VERSION => {
            return Err(StoreError::Newer {
                found: v,
                supported: tables::SCHEMA_VERSION,
            });
        }
        Some(v) if v < tables::SCHEMA_VERSION => {
            // Every step so far only adds tables (created below) and, for
            // 4, the token key (below); token records are rekeyed one by
            // one as they are used (see `auth`). 5 adds console sessions.
            // 6 adds the audit search indexes, built here for the events
            // written before them (in this same transaction). 7 adds the audit
            // sinks' cursors. 8 adds session recordings.
            tracing::info!(
                from = v,
                to = tables::SCHEMA_VERSION,
                "upgrading the store schema"
            );
            if v < 6 {
                let n = audit_index::rebuild(&txn)?;
                tracing::info!(events = n, "audit search indexes built (schema 6)");
            }
            txn.open_table(tables::META)?.insert(
                "schema_version",
                codec::encode(&tables::SCHEMA_VERSION)?.as_slice(),
            )?;
        }
        Some(_) => {}
        None => {
            let mut meta = txn.open_table(tables::META)?;
            meta.insert(
                "schema_version",
                codec::encode(&tables::SCHEMA_VERSION)?.as_slice(),
            )?;
            let instance = crate::ids::random_hex(16);
            meta.insert("instance_id", codec::encode(&instance)?.as_slice())?;
        }
    }
    // Schema 4: the key bearer tokens are verified under (HMAC-SHA-256),
    // sealed under the store key like every other secret at rest.
    {
        let mut meta = txn.open_table(tables::META)?;
        if meta.get(TOKEN_KEY)?.is_none() {
            let sealed = sealer.seal(&crate::ids::random_bytes(32))?;
            meta.insert(TOKEN_KEY, codec::encode(&sealed)?.as_slice())?;
        }
    }
    // Versions 1 to 3, 5, 7 and 8 only create tables: opening them is the whole
    // step.
    txn.open_table(tables::CONSOLE_SESSIONS)?;
    txn.open_table(tables::SINK_CURSORS)?;
    txn.open_table(tables::RECORDINGS)?;
    txn.open_table(tables::LEASE_RECORDINGS)?;
    txn.open_table(tables::AUDIT_BY)?;
    txn.open_table(tables::AUDIT_MINUTES)?;
    txn.open_table(tables::PLANS)?;
    txn.open_table(tables::USERS)?;
    txn.open_table(tables::TASKS)?;
    txn.open_table(tables::JOBS)?;
    txn.open_table(tables::LEASE_JOBS)?;
    txn.open_table(tables::CHECKPOINTS)?;
    txn.open_table(tables::LEASE_CHECKPOINTS)?;
    txn.open_table(tables::PTYS)?;
    txn.open_table(tables::LEASE_PTYS)?;
    txn.open_table(tables::TOKENS)?;
    txn.open_table(tables::LEASES)?;
    txn.open_table(tables::SESSIONS)?;
    txn.open_table(tables::PENDING)?;
    let chain = {
        let audit = txn.open_table(tables::AUDIT)?;
        match audit.last()? {
            Some((k, v)) => {
                let ev: Event = codec::decode(v.value())?;
                Chain {
                    next_seq: k.value() + 1,
                    last_hash: ev.hash,
                }
            }
            None => Chain {
                next_seq: 1,
                last_hash: event::GENESIS.into(),
            },
        }
    };
    txn.commit()?;
    Ok(chain)
}

/// How often a replica looks at the chain head other replicas move.
const FOLLOW: Duration = Duration::from_millis(200);

/// How many `FOLLOW`s between looks at the locks (and the heartbeat).
const LOCKS_EVERY: u32 = 5;

/// The name of the lock the replica running the background work holds.
const BACKGROUND_LOCK: &str = "background";

/// A replica's own upkeep of a shared database, on a thread of its own.
struct Tending {
    db: pg::Pg,
    inner: std::sync::Weak<Inner>,
    last_seq: watch::Sender<u64>,
    turn: watch::Sender<bool>,
    replica: Arc<str>,
    /// This replica's lock (taken again if the database restarted).
    lock: Option<pg::AdvisoryLock>,
    /// The background work's lock, while this replica has the turn.
    background: Option<pg::AdvisoryLock>,
}

impl Tending {
    fn run(mut self) {
        let mut n: u32 = 0;
        loop {
            std::thread::sleep(FOLLOW);
            match self.inner.upgrade() {
                Some(i) if !i.closed.load(Ordering::SeqCst) => {}
                _ => return,
            }
            self.follow();
            n = n.wrapping_add(1);
            if n.is_multiple_of(LOCKS_EVERY) {
                self.locks();
            }
        }
    }

    /// Move `last_seq` to the database's head.
    fn follow(&self) {
        let head = self.db.conn().and_then(|mut c| {
            let rows = c.query("SELECT next_seq FROM cube_chain WHERE id = 1", &[])?;
            let n: i64 = match rows.first() {
                Some(r) => r.try_get(0).unwrap_or(1),
                None => 1,
            };
            Ok(u64::try_from(n).unwrap_or(1).saturating_sub(1))
        });
        if let Ok(h) = head {
            self.last_seq.send_if_modified(|v| {
                let grew = h > *v;
                if grew {
                    *v = h;
                }
                grew
            });
        }
    }

    /// Keep this replica's lock, say it is alive, and take or give up the
    /// background turn.
    fn locks(&mut self) {
        if self.lock.as_ref().is_none_or(|l| l.is_lost()) {
            self.lock = None;
            match self.db.try_lock_blocking(pg::replica_lock(&self.replica).0) {
                Ok(Some(l)) => self.lock = Some(l),
                Ok(None) => {
                    tracing::error!(replica = %self.replica, "another process holds this replica's lock")
                }
                Err(_) => {}
            }
        }
        if let Ok(mut c) = self.db.conn() {
            let _ = c.execute(
                "UPDATE cube_replicas SET seen_at = now() WHERE id = $1",
                &[&&*self.replica],
            );
        }
        if self.background.as_ref().is_some_and(|l| l.is_lost()) {
            self.background = None;
            tracing::warn!("the background turn is lost (the database connection ended)");
        }
        if self.background.is_none()
            && let Ok(Some(l)) = self.db.try_lock_blocking(pg::lock_key(BACKGROUND_LOCK))
        {
            tracing::info!(replica = %self.replica, "this replica runs the background work (GC, keepalive, audit delivery)");
            self.background = Some(l);
        }
        let mine = self.background.is_some();
        self.turn.send_if_modified(|t| {
            let changed = *t != mine;
            *t = mine;
            changed
        });
    }
}

/// This replica's id: `STATE/replica.id`, made at its first start.
fn replica_id(state_dir: &Path) -> Result<String, StoreError> {
    let p = state_dir.join("replica.id");
    match std::fs::read_to_string(&p) {
        Ok(s) if !s.trim().is_empty() => return Ok(s.trim().to_string()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(StoreError::Io(format!("read {}: {e}", p.display()))),
    }
    let id = crate::ids::random_hex(8);
    std::fs::write(&p, format!("{id}\n"))
        .map_err(|e| StoreError::Io(format!("write {}: {e}", p.display())))?;
    Ok(id)
}

/// Make a new database's `meta` (once: the first replica to get the chain
/// head's lock does it) and read the chain head.
fn init_postgres_meta(db: &pg::Pg, sealer: &Sealer) -> Result<Chain, StoreError> {
    let tx = pg::PgTx::write(db.conn()?);
    let r = (|| {
        let chain = tx.lock_chain()?;
        if tx.meta("schema_version")?.is_none() {
            tx.put_meta("schema_version", &codec::encode(&tables::SCHEMA_VERSION)?)?;
            let instance = crate::ids::random_hex(16);
            tx.put_meta("instance_id", &codec::encode(&instance)?)?;
        }
        if tx.meta(TOKEN_KEY)?.is_none() {
            let sealed = sealer.seal(&crate::ids::random_bytes(32))?;
            tx.put_meta(TOKEN_KEY, &codec::encode(&sealed)?)?;
        }
        Ok(chain)
    })();
    match r {
        Ok(chain) => {
            tx.finish(true)?;
            Ok(chain)
        }
        Err(e) => {
            let _ = tx.finish(false);
            Err(e)
        }
    }
}

/// How the writer reaches its engine (one, for the writer's life).
#[allow(clippy::large_enum_variant)]
enum Writing {
    Redb(Arc<Database>),
    /// The connection is kept from one group commit to the next (its
    /// prepared statements with it), and replaced when it breaks.
    Pg {
        pg: pg::Pg,
        conn: Option<pg::Conn>,
        /// Whose intents this writer records.
        replica: Arc<str>,
    },
}

impl Writing {
    /// Begin one group commit: its transaction, and the chain head when
    /// the database holds it (locked for the transaction: other replicas
    /// append too).
    fn begin(&mut self) -> Result<(Wx, Option<Chain>), StoreError> {
        match self {
            Writing::Redb(db) => Ok((Wx::Redb(begin(db)?), None)),
            Writing::Pg { pg, conn, replica } => {
                let c = match conn.take() {
                    Some(c) if !c.is_closed() => c,
                    _ => pg.conn()?,
                };
                let tx = pg::PgTx::write(c).for_replica(replica.clone());
                match tx.lock_chain() {
                    Ok(chain) => Ok((Wx::Pg(tx), Some(chain))),
                    Err(e) => {
                        let _ = tx.finish(false);
                        Err(e)
                    }
                }
            }
        }
    }

    /// Commit it (with the chain head it moved, in a database).
    fn commit(&mut self, txn: Wx, chain: &Chain, moved: bool) -> Result<(), StoreError> {
        match (self, txn) {
            (Writing::Redb(_), Wx::Redb(t)) => Ok(t.commit()?),
            (Writing::Pg { conn, .. }, Wx::Pg(t)) => {
                if moved {
                    t.store_chain(chain)?;
                }
                *conn = Some(t.finish(true)?);
                Ok(())
            }
            _ => Err(StoreError::Io(
                "a transaction of another engine reached the writer".into(),
            )),
        }
    }

    /// Whether a failed commit stops the writer for good: redb refuses
    /// writes after one, and the in-memory chain head may be wrong; a
    /// database rolls the transaction back, and the next one reads the
    /// head again.
    fn stops_on_failure(&self) -> bool {
        matches!(self, Writing::Redb(_))
    }
}

fn writer(
    mut engine: Writing,
    mut rx: mpsc::Receiver<Job>,
    mut chain: Chain,
    inner: std::sync::Weak<Inner>,
    stats: Arc<Stats>,
    max_batch: usize,
    last_seq: watch::Sender<u64>,
) {
    let drain = |rx: &mut mpsc::Receiver<Job>, jobs: &mut Vec<Job>| {
        while jobs.len() < max_batch {
            match rx.try_recv() {
                Ok(j) => jobs.push(j),
                Err(_) => break,
            }
        }
    };
    // The size of the previous batch: the writers it woke are coming back.
    let mut expect = 1;
    while let Some(first) = rx.blocking_recv() {
        let mut jobs = vec![first];
        drain(&mut rx, &mut jobs);
        // When the last commit carried more writes than are queued now, the
        // writers it answered are still on their way back (on two cores,
        // about half of them): wait a moment for them instead of paying a
        // whole commit for half a batch. A lone writer never waits.
        if jobs.len() < expect {
            std::thread::sleep(GATHER);
            drain(&mut rx, &mut jobs);
        }
        expect = jobs.len();
        let txn = match engine.begin() {
            Ok((t, head)) => {
                if let Some(h) = head {
                    chain = h;
                }
                t
            }
            Err(e) => {
                // Nothing may run without a transaction: each job's caller
                // sees its reply dropped, and the reason (`last_error`).
                note_failure(&inner, &e, engine.stops_on_failure());
                drop(jobs);
                if engine.stops_on_failure() {
                    break;
                }
                continue;
            }
        };
        let before = chain.clone();
        let n = jobs.len() as u64;
        // Each job runs on its own: in a database, a job whose statement
        // fails is undone alone (its savepoint) and so is what it did to
        // the chain head, and the others commit; with redb, a job's
        // failure writes nothing the others depend on (`write`'s rule).
        let mut finishes: Vec<(Finish, Option<StoreError>)> = Vec::with_capacity(jobs.len());
        for j in jobs {
            let saved = chain.clone();
            txn.job_begins();
            let finish = j(&txn, &mut chain);
            match txn.job_ends() {
                Ok(()) => finishes.push((finish, None)),
                Err(e) => {
                    chain = saved;
                    finishes.push((finish, Some(e)));
                }
            }
        }
        let t = Instant::now();
        let moved = chain.next_seq != before.next_seq;
        let committed = engine.commit(txn, &chain, moved);
        let took = t.elapsed();
        {
            let mut r = stats.recent.lock().unwrap_or_else(|p| p.into_inner());
            if r.len() == RECENT {
                r.pop_front();
            }
            r.push_back(took);
        }
        match committed {
            Ok(()) => {
                stats.commits.fetch_add(1, Ordering::Relaxed);
                stats.writes.fetch_add(n, Ordering::Relaxed);
                stats.metrics.commit.observe_duration(took);
                stats
                    .metrics
                    .events_per_commit
                    .observe_count(chain.next_seq.saturating_sub(before.next_seq));
                if moved {
                    last_seq.send_if_modified(|v| {
                        let new = chain.next_seq - 1;
                        let grew = new > *v;
                        if grew {
                            *v = new;
                        }
                        grew
                    });
                }
                for (f, undone) in finishes {
                    f(undone.map_or(Ok(()), Err));
                }
                if inner
                    .upgrade()
                    .is_some_and(|i| i.closed.load(Ordering::SeqCst))
                {
                    break;
                }
            }
            Err(e) => {
                note_failure(&inner, &e, engine.stops_on_failure());
                chain = before;
                for (f, _) in finishes {
                    f(Err(StoreError::Unavailable(format!("commit failed: {e}"))));
                }
                if engine.stops_on_failure() {
                    break;
                }
            }
        }
    }
    // Stopped: everything still queued fails (its sender sees a dropped reply).
    rx.close();
}

impl Wx {
    /// One job of a group commit begins (see `PgTx::job_begins`).
    fn job_begins(&self) {
        if let Wx::Pg(t) = self {
            t.job_begins();
        }
    }

    /// One job of a group commit ended: `Err` when its work was undone (a
    /// statement of it failed in the database), with the reason, for that
    /// job alone.
    fn job_ends(&self) -> Result<(), StoreError> {
        match self {
            Wx::Pg(t) => t.job_ends(),
            Wx::Redb(_) => Ok(()),
        }
    }
}

/// A group commit failed: logged, and kept for the callers whose replies
/// were dropped; `stop`: the store takes no more writes until restart.
fn note_failure(inner: &std::sync::Weak<Inner>, e: &StoreError, stop: bool) {
    if stop {
        tracing::error!(error = %e, "store commit failed; the store is now read-only until restart");
    } else {
        tracing::warn!(error = %e, "store commit failed; the next one tries again");
    }
    if let Some(i) = inner.upgrade() {
        if stop {
            i.failed.store(true, Ordering::SeqCst);
        }
        *i.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
    }
}

/// An index key: `owner \0 item` (a lease's jobs, PTYs, checkpoints).
pub fn index_key(owner: &str, item: &str) -> String {
    format!("{owner}\0{item}")
}

fn owner_range(owner: &str) -> (String, String) {
    (format!("{owner}\0"), format!("{owner}\u{1}"))
}

/// The records an owner has, through an index table (`owner \0 item` →
/// ()) into their own table (item → JSON).
pub fn owned_items<T: serde::de::DeserializeOwned>(
    txn: &impl ReadOps,
    index: typed::Index,
    items: typed::Records,
    owner: &str,
) -> Result<Vec<T>, StoreError> {
    let (from, to) = owner_range(owner);
    let mut out = vec![];
    for k in txn.index_keys(index, &from, &to)? {
        if let Some((_, item)) = k.split_once('\0')
            && let Some(v) = txn.record::<T>(items, item)?
        {
            out.push(v);
        }
    }
    Ok(out)
}

/// Remove everything an owner has from an index table and its items.
pub fn delete_owned(
    txn: &impl WriteOps,
    index: typed::Index,
    items: typed::Records,
    owner: &str,
) -> Result<(), StoreError> {
    let (from, to) = owner_range(owner);
    for k in txn.index_keys(index, &from, &to)? {
        txn.remove_index(index, &k)?;
        if let Some((_, item)) = k.split_once('\0') {
            txn.remove(items, item)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Concurrent writes all land, in one chain, and the counters add up:
    /// every write is carried by exactly one commit.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn group_commit_counts_every_write() {
        let dir = std::env::temp_dir().join(format!("cube-store-{:016x}", rand::random::<u64>()));
        let store = Store::open(&dir).unwrap();
        let mut tasks = vec![];
        for i in 0..32 {
            let s = store.clone();
            tasks.push(tokio::spawn(async move {
                for j in 0..8 {
                    let ev = Event {
                        request_id: Some(format!("w{i}e{j}")),
                        ..Default::default()
                    };
                    s.write(move |txn, chain| chain.append(txn, ev).map(|_| ()))
                        .await
                        .unwrap();
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let st = store.commit_stats();
        assert_eq!(st.writes, 256);
        assert!(st.commits >= 1 && st.commits <= 256, "{st:?}");
        assert_eq!(store.recent_commits().len() as u64, st.commits);
        let n = store.read_now(|txn| txn.last_seq()).unwrap();
        assert_eq!(n, 256);
        drop(store);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// `close` commits what was queued, stops the writer and releases the
    /// file at once, however many clones are left: the same process can
    /// open it again, and the clones fail cleanly.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn close_releases_the_file_for_every_clone() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let clone = store.clone();
        let queued = {
            let s = store.clone();
            tokio::spawn(async move {
                let ev = Event {
                    request_id: Some("queued".into()),
                    ..Default::default()
                };
                s.write(move |txn, chain| chain.append(txn, ev).map(|_| ()))
                    .await
            })
        };
        queued.await.unwrap().unwrap();
        store.close().await;
        assert!(matches!(
            clone.write(|_, _| Ok(())).await,
            Err(StoreError::Unavailable(_))
        ));
        assert!(clone.read_now(|_| Ok(())).is_err());
        let again = Store::open(dir.path()).expect("the file is still locked after close");
        let n = again.read_now(|txn| txn.last_seq()).unwrap();
        assert_eq!(n, 1, "the write queued before close was lost");
        drop(clone);
    }
}
