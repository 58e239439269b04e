//! The PostgreSQL engine (`[store] kind = "postgres"`): the same records,
//! journal and indexes as the redb file, in tables of one database that
//! several replicas share (`migrations/pg/`).
//!
//! - Every write transaction starts by locking the chain head
//!   (`cube_chain`, `FOR UPDATE`): writes of all replicas are serialised
//!   as redb's one writer serialises them, so a check-then-write inside a
//!   transaction (a quota, "one session, one lease") holds across
//!   replicas, and the chain link of each event is computed from the head
//!   read in the transaction that appends it.
//! - Reads are `REPEATABLE READ, READ ONLY` transactions: a snapshot, as
//!   redb's read transactions are.
//! - Each write of a group commit runs after a savepoint of its own (sent
//!   with its first statement, no extra round trip): a statement that
//!   fails undoes that write alone (`ROLLBACK TO SAVEPOINT`), which gets
//!   the statement's error, and the others commit. One caller's write that
//!   the database refuses (a key over the index's row limit, a constraint)
//!   cannot fail the writes of the others it was queued with.
//! - A failed commit (or a savepoint that cannot be rolled back to: the
//!   connection went away) fails that group commit only (every write in it
//!   gets `Unavailable`): the next one reconnects. Unlike the redb file, a
//!   database that went away comes back.
//!
//! Keys are `bytea` (record keys hold `\0`, which `text` cannot); values
//! are the same JSON bytes redb holds.

pub mod conn;
pub mod copy;

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;

use tokio_postgres::types::ToSql;

use super::event::Event;
use super::typed::{Index, Links, ReadOps, Records, WriteOps};
use super::{Chain, StoreError, codec};

pub use conn::{AdvisoryLock, Conn, Pg, Settings, lock_key};

/// The schema steps, in order: (version, SQL). Applied at start under an
/// advisory lock, each in its own transaction with its row in
/// `cube_schema`.
pub const MIGRATIONS: &[(i32, &str)] =
    &[(1, include_str!("../../../migrations/pg/0001_initial.sql"))];

/// The advisory lock the schema steps run under.
const MIGRATE_LOCK: &str = "migrate";

/// How long a replica must have been silent before another may take it
/// for stopped (and resolve its intents, mark its PTYs lost): its lock is
/// not enough, as a replica whose lock connection broke takes the lock
/// again a second later. A running replica notes `seen_at` every second.
pub const GRACE_SECONDS: i32 = 30;

/// SQL: replica `r` (a `cube_replicas` row) is not running. Its advisory
/// lock is free, it has not noted `seen_at` for `GRACE_SECONDS` ($2), and
/// the database has been up that long (after a database restart every
/// replica's lock is gone and its `seen_at` old until it reconnects).
const NOT_RUNNING: &str = "NOT EXISTS (
        SELECT 1 FROM pg_locks l
         WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
           AND l.classid::bigint = r.lock_hi AND l.objid::bigint = r.lock_lo
           AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()))
    AND r.seen_at < now() - $2::int * interval '1 second'
    AND pg_postmaster_start_time() < now() - $2::int * interval '1 second'";

type P<'a> = &'a (dyn ToSql + Sync);

/// A transaction on one connection. Statements run blocking: the store's
/// closures are synchronous, as redb's are.
pub struct PgTx {
    conn: RefCell<Conn>,
    /// The replica whose intents this transaction records (`cube_pending`).
    replica: Option<std::sync::Arc<str>>,
    /// `BEGIN` is sent with the first statement (one round trip).
    begin: &'static str,
    begun: Cell<bool>,
    /// A statement failed: the transaction is aborted and must not commit
    /// (unless it is rolled back to the failing write's savepoint).
    failed: Cell<bool>,
    /// Why the last statement failed.
    why: RefCell<Option<StoreError>>,
    /// A write of the group commit has begun and sent no statement yet:
    /// its savepoint goes with its first one.
    job_pending: Cell<bool>,
    /// The savepoint `job` is open (made for the current or the previous
    /// write; the next write releases it and makes its own).
    job_open: Cell<bool>,
}

/// The savepoint each write of a group commit runs after.
const SAVEPOINT: &str = "SAVEPOINT job";
/// The previous write's savepoint is released (its work stays in the
/// transaction) and the next one made: one savepoint open at a time.
const NEXT_SAVEPOINT: &str = "RELEASE SAVEPOINT job; SAVEPOINT job";
/// Undo the current write (the savepoint stays, as PostgreSQL keeps it).
const UNDO_JOB: &str = "ROLLBACK TO SAVEPOINT job";

/// Read transactions see one snapshot.
const BEGIN_READ: &str = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY";
/// Write transactions are serialised by the chain head's row lock.
const BEGIN_WRITE: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";

fn seq_of(v: i64) -> Result<u64, StoreError> {
    u64::try_from(v).map_err(|_| StoreError::Corrupt(format!("negative sequence number {v}")))
}

fn int(v: u64) -> Result<i64, StoreError> {
    i64::try_from(v).map_err(|_| StoreError::Corrupt(format!("sequence number {v} is too large")))
}

fn text(b: Vec<u8>) -> Result<String, StoreError> {
    String::from_utf8(b).map_err(|_| StoreError::Corrupt("a key is not UTF-8".into()))
}

impl PgTx {
    pub fn read(conn: Conn) -> Self {
        Self::new(conn, BEGIN_READ)
    }

    pub fn write(conn: Conn) -> Self {
        Self::new(conn, BEGIN_WRITE)
    }

    /// Record intents as this replica's.
    pub fn for_replica(mut self, replica: std::sync::Arc<str>) -> Self {
        self.replica = Some(replica);
        self
    }

    /// The pending intents a replica answers for: its own, those of no
    /// replica (a store copied from redb), and those of replicas that are
    /// not running (`NOT_RUNNING`).
    pub fn pending_for(&self, replica: &str) -> Result<Vec<(String, u64)>, StoreError> {
        let sql = format!(
            "SELECT p.op, p.seq FROM cube_pending p
             WHERE p.replica IS NULL OR p.replica = $1 OR NOT EXISTS (
                 SELECT 1 FROM cube_replicas r WHERE r.id = p.replica AND NOT ({NOT_RUNNING}))
             ORDER BY p.op"
        );
        let rows = self.query(&sql, &[&replica, &GRACE_SECONDS])?;
        rows.into_iter()
            .map(|r| {
                Ok((
                    r.try_get(0).map_err(corrupt)?,
                    seq_of(r.try_get(1).map_err(corrupt)?)?,
                ))
            })
            .collect()
    }

    /// Whether a replica may be running (see `NOT_RUNNING`).
    pub fn replica_running(&self, replica: &str) -> Result<bool, StoreError> {
        let sql = format!("SELECT NOT ({NOT_RUNNING}) FROM cube_replicas r WHERE r.id = $1");
        let rows = self.query(&sql, &[&replica, &GRACE_SECONDS])?;
        match rows.first() {
            Some(r) => r.try_get(0).map_err(corrupt),
            None => Ok(false),
        }
    }

    fn new(conn: Conn, begin: &'static str) -> Self {
        Self {
            conn: RefCell::new(conn),
            replica: None,
            begin,
            begun: Cell::new(false),
            failed: Cell::new(false),
            why: RefCell::new(None),
            job_pending: Cell::new(false),
            job_open: Cell::new(false),
        }
    }

    /// A write of the group commit begins: whatever it does until
    /// `job_ends` can be undone alone. Costs nothing until it sends a
    /// statement (its savepoint goes with that statement).
    pub(crate) fn job_begins(&self) {
        self.job_pending.set(true);
    }

    /// A write of the group commit ended. If one of its statements failed,
    /// its work is undone (to its savepoint) and the transaction goes on
    /// for the other writes: the statement's error is returned, for that
    /// write alone. If it cannot be undone (the connection went away), the
    /// transaction stays failed and the whole group commit fails.
    pub(crate) fn job_ends(&self) -> Result<(), StoreError> {
        // Still pending: the write sent nothing (or nothing could be sent:
        // the transaction had failed before it), so it has nothing to undo.
        let sent = !self.job_pending.replace(false);
        if !sent || !self.failed.get() {
            return Ok(());
        }
        let why =
            self.why.borrow_mut().take().unwrap_or_else(|| {
                StoreError::Unavailable("a statement of this write failed".into())
            });
        let mut c = self.conn.borrow_mut();
        if c.batch(UNDO_JOB).is_ok() {
            self.failed.set(false);
            // Undone: this write alone failed, and left nothing behind.
            return Err(StoreError::Refused(why.to_string()));
        }
        Err(why)
    }

    /// Run a statement in the transaction (beginning it with the first).
    pub(crate) fn query(
        &self,
        sql: &str,
        params: &[P<'_>],
    ) -> Result<Vec<tokio_postgres::Row>, StoreError> {
        if self.failed.get() {
            return Err(StoreError::Unavailable(
                "an earlier statement of this transaction failed".into(),
            ));
        }
        let mut c = self.conn.borrow_mut();
        let savepoint = self.job_pending.replace(false).then(|| {
            if self.job_open.replace(true) {
                NEXT_SAVEPOINT
            } else {
                SAVEPOINT
            }
        });
        let r = match (self.begun.get(), savepoint) {
            (true, None) => c.query(sql, params),
            (true, Some(sp)) => c.begin_then_query(sp, sql, params),
            (false, sp) => {
                c.set_in_txn(true);
                self.begun.set(true);
                match sp {
                    None => c.begin_then_query(self.begin, sql, params),
                    Some(sp) => c.begin_then_query(&format!("{}; {sp}", self.begin), sql, params),
                }
            }
        };
        if let Err(e) = &r {
            self.failed.set(true);
            *self.why.borrow_mut() = Some(e.clone());
        }
        r
    }

    fn exec(&self, sql: &str, params: &[P<'_>]) -> Result<(), StoreError> {
        self.query(sql, params).map(|_| ())
    }

    /// End the transaction: `COMMIT` (a write), or end a read. A failed
    /// transaction rolls back and reports why.
    pub fn finish(self, commit: bool) -> Result<Conn, StoreError> {
        let mut c = self.conn.into_inner();
        if !self.begun.get() {
            return Ok(c);
        }
        if self.failed.get() || !commit {
            let r = c.batch("ROLLBACK");
            c.set_in_txn(false);
            r?;
            if self.failed.get() {
                let why = self.why.borrow().as_ref().map(|e| e.to_string());
                return Err(StoreError::Unavailable(format!(
                    "a statement failed ({}); the transaction was rolled back",
                    why.as_deref().unwrap_or("unknown")
                )));
            }
            return Ok(c);
        }
        // `COMMIT` of an aborted transaction answers ROLLBACK without an
        // error: `failed` above catches that case first.
        let r = c.batch("COMMIT");
        match r {
            Ok(()) => {
                c.set_in_txn(false);
                Ok(c)
            }
            Err(e) => {
                c.mark_broken();
                Err(e)
            }
        }
    }

    /// Lock the chain head for this transaction (the first statement of
    /// every write) and read it.
    pub fn lock_chain(&self) -> Result<Chain, StoreError> {
        let rows = self.query(
            "SELECT next_seq, last_hash FROM cube_chain WHERE id = 1 FOR UPDATE",
            &[],
        )?;
        let row = rows
            .first()
            .ok_or_else(|| StoreError::Corrupt("cube_chain has no head".into()))?;
        Ok(Chain {
            next_seq: seq_of(row.try_get(0).map_err(corrupt)?)?,
            last_hash: row.try_get(1).map_err(corrupt)?,
        })
    }

    /// Write the chain head back (when the transaction appended).
    pub fn store_chain(&self, c: &Chain) -> Result<(), StoreError> {
        self.exec(
            "UPDATE cube_chain SET next_seq = $1, last_hash = $2 WHERE id = 1",
            &[&int(c.next_seq)?, &c.last_hash],
        )
    }

    fn bytes_col(rows: Vec<tokio_postgres::Row>, i: usize) -> Result<Option<Vec<u8>>, StoreError> {
        match rows.first() {
            Some(r) => Ok(Some(r.try_get(i).map_err(corrupt)?)),
            None => Ok(None),
        }
    }

    fn get_raw(&self, table: &str, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let rows = self.query(
            "SELECT v FROM cube_records WHERE tbl = $1 AND k = $2",
            &[&table, &key.as_bytes()],
        )?;
        Self::bytes_col(rows, 0)
    }

    fn scan(&self, table: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let rows = self.query(
            "SELECT k, v FROM cube_records WHERE tbl = $1 ORDER BY k",
            &[&table],
        )?;
        rows.into_iter()
            .map(|r| {
                let k: Vec<u8> = r.try_get(0).map_err(corrupt)?;
                Ok((text(k)?, r.try_get(1).map_err(corrupt)?))
            })
            .collect()
    }

    fn put_bytes(&self, table: &str, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.exec(
            "INSERT INTO cube_records (tbl, k, v) VALUES ($1, $2, $3) \
             ON CONFLICT (tbl, k) DO UPDATE SET v = EXCLUDED.v",
            &[&table, &key.as_bytes(), &value],
        )
    }

    fn delete(&self, table: &str, key: &str) -> Result<bool, StoreError> {
        let rows = self.query(
            "DELETE FROM cube_records WHERE tbl = $1 AND k = $2 RETURNING 1",
            &[&table, &key.as_bytes()],
        )?;
        Ok(!rows.is_empty())
    }
}

pub(crate) fn corrupt(e: tokio_postgres::Error) -> StoreError {
    StoreError::Corrupt(format!("postgres: a column has an unexpected type: {e}"))
}

fn name<'a, K: redb::Key + 'static, V: redb::Value + 'static>(
    t: &'a redb::TableDefinition<'static, K, V>,
) -> &'a str {
    use redb::TableHandle;
    t.name()
}

impl ReadOps for PgTx {
    fn record<T: serde::de::DeserializeOwned>(
        &self,
        table: Records,
        key: &str,
    ) -> Result<Option<T>, StoreError> {
        match self.get_raw(name(&table), key)? {
            Some(b) => Ok(Some(codec::decode(&b)?)),
            None => Ok(None),
        }
    }

    fn has(&self, table: Records, key: &str) -> Result<bool, StoreError> {
        let rows = self.query(
            "SELECT 1 FROM cube_records WHERE tbl = $1 AND k = $2",
            &[&name(&table), &key.as_bytes()],
        )?;
        Ok(!rows.is_empty())
    }

    fn records<T: serde::de::DeserializeOwned>(
        &self,
        table: Records,
    ) -> Result<Vec<T>, StoreError> {
        self.scan(name(&table))?
            .into_iter()
            .map(|(_, v)| codec::decode(&v))
            .collect()
    }

    fn raw_records(&self, table: Records) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        self.scan(name(&table))
    }

    fn link(&self, table: Links, key: &str) -> Result<Option<String>, StoreError> {
        match self.get_raw(name(&table), key)? {
            Some(b) => Ok(Some(text(b)?)),
            None => Ok(None),
        }
    }

    fn index_keys(&self, table: Index, from: &str, to: &str) -> Result<Vec<String>, StoreError> {
        let rows = self.query(
            "SELECT k FROM cube_records WHERE tbl = $1 AND k >= $2 AND k < $3 ORDER BY k",
            &[&name(&table), &from.as_bytes(), &to.as_bytes()],
        )?;
        rows.into_iter()
            .map(|r| text(r.try_get(0).map_err(corrupt)?))
            .collect()
    }

    fn meta(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let rows = self.query("SELECT v FROM cube_meta WHERE k = $1", &[&key])?;
        Self::bytes_col(rows, 0)
    }

    fn event(&self, seq: u64) -> Result<Option<Event>, StoreError> {
        let rows = self.query("SELECT event FROM cube_audit WHERE seq = $1", &[&int(seq)?])?;
        match Self::bytes_col(rows, 0)? {
            Some(b) => Ok(Some(codec::decode(&b)?)),
            None => Ok(None),
        }
    }

    fn events(&self, from: u64, limit: usize) -> Result<Vec<(u64, Event)>, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = self.query(
            "SELECT seq, event FROM cube_audit WHERE seq >= $1 ORDER BY seq LIMIT $2",
            &[&int(from)?, &limit],
        )?;
        rows.into_iter()
            .map(|r| {
                let seq = seq_of(r.try_get(0).map_err(corrupt)?)?;
                let b: Vec<u8> = r.try_get(1).map_err(corrupt)?;
                Ok((seq, codec::decode(&b)?))
            })
            .collect()
    }

    fn last_seq(&self) -> Result<u64, StoreError> {
        let rows = self.query("SELECT next_seq FROM cube_chain WHERE id = 1", &[])?;
        match rows.first() {
            Some(r) => Ok(seq_of(r.try_get(0).map_err(corrupt)?)?.saturating_sub(1)),
            None => Ok(0),
        }
    }

    fn pending(&self) -> Result<Vec<(String, u64)>, StoreError> {
        let rows = self.query("SELECT op, seq FROM cube_pending ORDER BY op", &[])?;
        rows.into_iter()
            .map(|r| {
                Ok((
                    r.try_get(0).map_err(corrupt)?,
                    seq_of(r.try_get(1).map_err(corrupt)?)?,
                ))
            })
            .collect()
    }

    fn by_at_or_below(&self, key: &str, at: u64) -> Result<Option<u64>, StoreError> {
        let rows = self.query(
            "SELECT seq FROM cube_audit_by WHERE k = $1 AND seq <= $2 ORDER BY seq DESC LIMIT 1",
            &[&key.as_bytes(), &int(at)?],
        )?;
        rows.first()
            .map(|r| seq_of(r.try_get(0).map_err(corrupt)?))
            .transpose()
    }

    fn by_at_or_above(&self, key: &str, at: u64) -> Result<Option<u64>, StoreError> {
        let rows = self.query(
            "SELECT seq FROM cube_audit_by WHERE k = $1 AND seq >= $2 ORDER BY seq LIMIT 1",
            &[&key.as_bytes(), &int(at.min(i64::MAX as u64))?],
        )?;
        rows.first()
            .map(|r| seq_of(r.try_get(0).map_err(corrupt)?))
            .transpose()
    }

    fn by_count(&self, key: &str) -> Result<u64, StoreError> {
        let rows = self.query(
            "SELECT count(*) FROM cube_audit_by WHERE k = $1",
            &[&key.as_bytes()],
        )?;
        match rows.first() {
            Some(r) => seq_of(r.try_get(0).map_err(corrupt)?),
            None => Ok(0),
        }
    }

    fn minute(&self, minute: u64) -> Result<Option<(u64, u64)>, StoreError> {
        let rows = self.query(
            "SELECT lo, hi FROM cube_audit_minutes WHERE minute = $1",
            &[&int(minute)?],
        )?;
        match rows.first() {
            Some(r) => Ok(Some((
                seq_of(r.try_get(0).map_err(corrupt)?)?,
                seq_of(r.try_get(1).map_err(corrupt)?)?,
            ))),
            None => Ok(None),
        }
    }

    fn minutes_span(&self, from: u64, to: u64) -> Result<Option<(u64, u64)>, StoreError> {
        if from > to {
            return Ok(None);
        }
        let rows = self.query(
            "SELECT min(lo), max(hi) FROM cube_audit_minutes WHERE minute BETWEEN $1 AND $2",
            &[
                &int(from.min(i64::MAX as u64))?,
                &int(to.min(i64::MAX as u64))?,
            ],
        )?;
        let Some(r) = rows.first() else {
            return Ok(None);
        };
        let lo: Option<i64> = r.try_get(0).map_err(corrupt)?;
        let hi: Option<i64> = r.try_get(1).map_err(corrupt)?;
        match (lo, hi) {
            (Some(lo), Some(hi)) => Ok(Some((seq_of(lo)?, seq_of(hi)?))),
            _ => Ok(None),
        }
    }

    fn cursors(&self) -> Result<BTreeMap<String, u64>, StoreError> {
        let rows = self.query("SELECT name, seq FROM cube_sink_cursors", &[])?;
        rows.into_iter()
            .map(|r| {
                Ok((
                    r.try_get(0).map_err(corrupt)?,
                    seq_of(r.try_get(1).map_err(corrupt)?)?,
                ))
            })
            .collect()
    }
}

impl WriteOps for PgTx {
    fn put_raw(&self, table: Records, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.put_bytes(name(&table), key, value)
    }

    fn remove(&self, table: Records, key: &str) -> Result<bool, StoreError> {
        self.delete(name(&table), key)
    }

    fn put_link(&self, table: Links, key: &str, value: &str) -> Result<(), StoreError> {
        self.put_bytes(name(&table), key, value.as_bytes())
    }

    fn remove_link(&self, table: Links, key: &str) -> Result<(), StoreError> {
        self.delete(name(&table), key).map(|_| ())
    }

    fn put_index(&self, table: Index, key: &str) -> Result<(), StoreError> {
        self.put_bytes(name(&table), key, b"")
    }

    fn remove_index(&self, table: Index, key: &str) -> Result<(), StoreError> {
        self.delete(name(&table), key).map(|_| ())
    }

    fn put_meta(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.exec(
            "INSERT INTO cube_meta (k, v) VALUES ($1, $2) \
             ON CONFLICT (k) DO UPDATE SET v = EXCLUDED.v",
            &[&key, &value],
        )
    }

    fn insert_event(&self, seq: u64, value: &[u8]) -> Result<(), StoreError> {
        self.exec(
            "INSERT INTO cube_audit (seq, event) VALUES ($1, $2)",
            &[&int(seq)?, &value],
        )
    }

    /// One statement, one round trip: the event, its index keys, its
    /// minute's span.
    fn append_event(
        &self,
        seq: u64,
        value: &[u8],
        keys: &[String],
        minute: Option<u64>,
    ) -> Result<(), StoreError> {
        let keys: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        let minute = minute.map(int).transpose()?;
        self.exec(
            "WITH e AS (INSERT INTO cube_audit (seq, event) VALUES ($1, $2)),
                  b AS (INSERT INTO cube_audit_by (k, seq)
                        SELECT k, $1 FROM unnest($3::bytea[]) AS k ON CONFLICT DO NOTHING)
             INSERT INTO cube_audit_minutes (minute, lo, hi)
             SELECT $4, $1, $1 WHERE $4::bigint IS NOT NULL
             ON CONFLICT (minute) DO UPDATE
               SET lo = least(cube_audit_minutes.lo, EXCLUDED.lo),
                   hi = greatest(cube_audit_minutes.hi, EXCLUDED.hi)",
            &[&int(seq)?, &value, &keys, &minute],
        )
    }

    fn put_pending(&self, op: &str, seq: u64) -> Result<(), StoreError> {
        let replica = self.replica.as_deref();
        self.exec(
            "INSERT INTO cube_pending (op, seq, replica) VALUES ($1, $2, $3) \
             ON CONFLICT (op) DO UPDATE SET seq = EXCLUDED.seq, replica = EXCLUDED.replica",
            &[&op, &int(seq)?, &replica],
        )
    }

    fn remove_pending(&self, op: &str) -> Result<(), StoreError> {
        self.exec("DELETE FROM cube_pending WHERE op = $1", &[&op])
    }

    fn put_by(&self, key: &str, seq: u64) -> Result<(), StoreError> {
        self.exec(
            "INSERT INTO cube_audit_by (k, seq) VALUES ($1, $2) ON CONFLICT DO NOTHING",
            &[&key.as_bytes(), &int(seq)?],
        )
    }

    fn put_minute(&self, minute: u64, span: (u64, u64)) -> Result<(), StoreError> {
        self.exec(
            "INSERT INTO cube_audit_minutes (minute, lo, hi) VALUES ($1, $2, $3) \
             ON CONFLICT (minute) DO UPDATE SET lo = EXCLUDED.lo, hi = EXCLUDED.hi",
            &[&int(minute)?, &int(span.0)?, &int(span.1)?],
        )
    }

    fn put_cursor(&self, name: &str, seq: u64) -> Result<(), StoreError> {
        self.exec(
            "INSERT INTO cube_sink_cursors (name, seq) VALUES ($1, $2) \
             ON CONFLICT (name) DO UPDATE SET seq = EXCLUDED.seq",
            &[&name, &int(seq)?],
        )
    }
}

/// Apply the schema steps not applied yet, under an advisory lock (two
/// replicas starting together take turns). A database whose schema is
/// newer than this binary's is refused.
pub fn migrate(pg: &Pg) -> Result<(), StoreError> {
    let _lock = conn::block(pg.lock(lock_key(MIGRATE_LOCK)))?;
    let mut c = pg.conn()?;
    c.batch(
        "CREATE TABLE IF NOT EXISTS cube_schema (
            version integer PRIMARY KEY,
            applied_at timestamptz NOT NULL DEFAULT now()
        )",
    )?;
    let rows = c.query("SELECT coalesce(max(version), 0) FROM cube_schema", &[])?;
    let found: i32 = match rows.first() {
        Some(r) => r.try_get(0).map_err(corrupt)?,
        None => 0,
    };
    let supported = MIGRATIONS.last().map(|(v, _)| *v).unwrap_or(0);
    if found > supported {
        return Err(StoreError::Newer {
            found: u64::try_from(found).unwrap_or(0),
            supported: u64::try_from(supported).unwrap_or(0),
        });
    }
    for (v, sql) in MIGRATIONS {
        if *v <= found {
            continue;
        }
        tracing::info!(version = v, "applying a PostgreSQL schema step");
        c.set_in_txn(true);
        let step =
            format!("BEGIN;\n{sql}\nINSERT INTO cube_schema (version) VALUES ({v});\nCOMMIT;");
        if let Err(e) = c.batch(&step) {
            c.mark_broken();
            return Err(e);
        }
        c.set_in_txn(false);
    }
    Ok(())
}

/// The advisory lock key of a replica, split as `pg_locks` shows it
/// (`classid`, `objid`).
pub fn replica_lock(id: &str) -> (i64, i64, i64) {
    let key = lock_key(&format!("replica:{id}"));
    let bits = key as u64;
    (key, (bits >> 32) as i64, (bits & 0xffff_ffff) as i64)
}

/// Register a replica (at start, holding its lock) and note that it is
/// alive (every few seconds).
pub fn register(c: &mut Conn, id: &str, host: &str) -> Result<(), StoreError> {
    let (_, hi, lo) = replica_lock(id);
    c.execute(
        "INSERT INTO cube_replicas (id, lock_hi, lock_lo, host, started_at, seen_at)
         VALUES ($1, $2, $3, $4, now(), now())
         ON CONFLICT (id) DO UPDATE SET host = EXCLUDED.host, started_at = now(), seen_at = now()",
        &[&id, &hi, &lo, &host],
    )
    .map(|_| ())
}
