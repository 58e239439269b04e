//! The store's transactions, whichever engine holds the data: [`Rx`] (a
//! read) and [`Wx`] (a write, inside one group commit). Every record module
//! and caller goes through their operations ([`ReadOps`], [`WriteOps`]),
//! never through an engine's own tables, so redb (the default) and
//! PostgreSQL (`[store] kind = "postgres"`) serve the same code.
//!
//! The operations mirror the tables of `tables`: keyed records (JSON through
//! `codec`), links (a key to a key), indexes (keys only), the audit journal
//! and its search indexes, pending intents, the sinks' cursors and `meta`.
//! Writes take the write transaction; reads take either kind.

use std::collections::BTreeMap;

use redb::{ReadTransaction, ReadableTable, WriteTransaction};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::event::Event;
use super::pg::PgTx;
use super::{StoreError, codec, tables};

/// A `&str → JSON` table.
pub type Records = redb::TableDefinition<'static, &'static str, &'static [u8]>;
/// A `&str → &str` table (an index to a key).
pub type Links = redb::TableDefinition<'static, &'static str, &'static str>;
/// A `owner \0 item → ()` index table.
pub type Index = redb::TableDefinition<'static, &'static str, ()>;

/// Reads that both transaction kinds answer.
pub trait ReadOps {
    /// The record under `key`, decoded.
    fn record<T: DeserializeOwned>(
        &self,
        table: Records,
        key: &str,
    ) -> Result<Option<T>, StoreError>;
    /// Whether `key` is present.
    fn has(&self, table: Records, key: &str) -> Result<bool, StoreError>;
    /// Every record of the table, in key order.
    fn records<T: DeserializeOwned>(&self, table: Records) -> Result<Vec<T>, StoreError>;
    /// Every record of the table with its key, undecoded, in key order.
    fn raw_records(&self, table: Records) -> Result<Vec<(String, Vec<u8>)>, StoreError>;
    /// The value of a link table under `key`.
    fn link(&self, table: Links, key: &str) -> Result<Option<String>, StoreError>;
    /// The keys of an index table in `[from, to)`.
    fn index_keys(&self, table: Index, from: &str, to: &str) -> Result<Vec<String>, StoreError>;
    /// A `meta` value.
    fn meta(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError>;
    /// The audit event stored under `seq`.
    fn event(&self, seq: u64) -> Result<Option<Event>, StoreError>;
    /// Up to `limit` audit events with `seq >= from`, in order, each with
    /// the `seq` it is stored under.
    fn events(&self, from: u64, limit: usize) -> Result<Vec<(u64, Event)>, StoreError>;
    /// The `seq` of the last audit event (0: none).
    fn last_seq(&self) -> Result<u64, StoreError>;
    /// Every pending intent: (operation id, seq of its event), by id.
    fn pending(&self) -> Result<Vec<(String, u64)>, StoreError>;
    /// The highest `seq <= at` indexed under `key` (`audit_index`).
    fn by_at_or_below(&self, key: &str, at: u64) -> Result<Option<u64>, StoreError>;
    /// The lowest `seq >= at` indexed under `key`.
    fn by_at_or_above(&self, key: &str, at: u64) -> Result<Option<u64>, StoreError>;
    /// How many events are indexed under `key`.
    fn by_count(&self, key: &str) -> Result<u64, StoreError>;
    /// The (lowest, highest) `seq` stamped in one Unix minute.
    fn minute(&self, minute: u64) -> Result<Option<(u64, u64)>, StoreError>;
    /// The `seq` span of the minutes `from..=to` (`None`: no event then).
    fn minutes_span(&self, from: u64, to: u64) -> Result<Option<(u64, u64)>, StoreError>;
    /// The audit sinks' cursors.
    fn cursors(&self) -> Result<BTreeMap<String, u64>, StoreError>;
}

/// Writes, in the write transaction.
pub trait WriteOps: ReadOps {
    /// Insert (or replace) an encoded record.
    fn put_raw(&self, table: Records, key: &str, value: &[u8]) -> Result<(), StoreError>;
    /// Remove a record (absent is fine): whether it was there.
    fn remove(&self, table: Records, key: &str) -> Result<bool, StoreError>;
    fn put_link(&self, table: Links, key: &str, value: &str) -> Result<(), StoreError>;
    fn remove_link(&self, table: Links, key: &str) -> Result<(), StoreError>;
    fn put_index(&self, table: Index, key: &str) -> Result<(), StoreError>;
    fn remove_index(&self, table: Index, key: &str) -> Result<(), StoreError>;
    fn put_meta(&self, key: &str, value: &[u8]) -> Result<(), StoreError>;
    /// Store an encoded audit event (only `Chain::append` and copies call
    /// this).
    fn insert_event(&self, seq: u64, value: &[u8]) -> Result<(), StoreError>;
    /// Append an event with its index entries (`audit_index`): its keys,
    /// and the minute it is stamped in. `Chain::append` calls this; an
    /// engine may do it in one statement.
    fn append_event(
        &self,
        seq: u64,
        value: &[u8],
        keys: &[String],
        minute: Option<u64>,
    ) -> Result<(), StoreError> {
        self.insert_event(seq, value)?;
        for k in keys {
            self.put_by(k, seq)?;
        }
        if let Some(m) = minute {
            let span = match self.minute(m)? {
                Some((lo, hi)) => (lo.min(seq), hi.max(seq)),
                None => (seq, seq),
            };
            self.put_minute(m, span)?;
        }
        Ok(())
    }
    fn put_pending(&self, op: &str, seq: u64) -> Result<(), StoreError>;
    fn remove_pending(&self, op: &str) -> Result<(), StoreError>;
    /// Index event `seq` under `key` (`audit_index`).
    fn put_by(&self, key: &str, seq: u64) -> Result<(), StoreError>;
    fn put_minute(&self, minute: u64, span: (u64, u64)) -> Result<(), StoreError>;
    fn put_cursor(&self, name: &str, seq: u64) -> Result<(), StoreError>;
}

/// A table that may not exist yet (a store opened read-only, a backup):
/// absent reads as empty.
fn missing(e: &redb::TableError) -> bool {
    matches!(e, redb::TableError::TableDoesNotExist(_))
}

/// Open a table for reading, or return `$empty` when a copy from before it
/// does not have it.
macro_rules! open_or {
    ($txn:expr, $table:expr, $empty:expr) => {
        match $txn.open_table($table) {
            Ok(t) => t,
            Err(e) if missing(&e) => return Ok($empty),
            Err(e) => return Err(e.into()),
        }
    };
}

macro_rules! redb_reads {
    ($t:ty) => {
        impl ReadOps for $t {
            fn record<T: DeserializeOwned>(
                &self,
                table: Records,
                key: &str,
            ) -> Result<Option<T>, StoreError> {
                let t = self.open_table(table)?;
                match t.get(key)? {
                    Some(v) => Ok(Some(codec::decode(v.value())?)),
                    None => Ok(None),
                }
            }

            fn has(&self, table: Records, key: &str) -> Result<bool, StoreError> {
                Ok(self.open_table(table)?.get(key)?.is_some())
            }

            fn records<T: DeserializeOwned>(&self, table: Records) -> Result<Vec<T>, StoreError> {
                let t = open_or!(self, table, vec![]);
                let mut out = vec![];
                for r in t.iter()? {
                    let (_, v) = r?;
                    out.push(codec::decode(v.value())?);
                }
                Ok(out)
            }

            fn raw_records(&self, table: Records) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
                let t = open_or!(self, table, vec![]);
                let mut out = vec![];
                for r in t.iter()? {
                    let (k, v) = r?;
                    out.push((k.value().to_string(), v.value().to_vec()));
                }
                Ok(out)
            }

            fn link(&self, table: Links, key: &str) -> Result<Option<String>, StoreError> {
                Ok(self
                    .open_table(table)?
                    .get(key)?
                    .map(|v| v.value().to_string()))
            }

            fn index_keys(
                &self,
                table: Index,
                from: &str,
                to: &str,
            ) -> Result<Vec<String>, StoreError> {
                let t = self.open_table(table)?;
                let mut keys = vec![];
                for r in t.range(from..to)? {
                    keys.push(r?.0.value().to_string());
                }
                Ok(keys)
            }

            fn meta(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
                let t = open_or!(self, tables::META, None);
                Ok(t.get(key)?.map(|v| v.value().to_vec()))
            }

            fn event(&self, seq: u64) -> Result<Option<Event>, StoreError> {
                let t = self.open_table(tables::AUDIT)?;
                match t.get(seq)? {
                    Some(v) => Ok(Some(codec::decode(v.value())?)),
                    None => Ok(None),
                }
            }

            fn events(&self, from: u64, limit: usize) -> Result<Vec<(u64, Event)>, StoreError> {
                let t = self.open_table(tables::AUDIT)?;
                let mut v = Vec::with_capacity(limit.min(1024));
                for item in t.range(from..)?.take(limit) {
                    let (k, bytes) = item?;
                    v.push((k.value(), codec::decode::<Event>(bytes.value())?));
                }
                Ok(v)
            }

            fn last_seq(&self) -> Result<u64, StoreError> {
                let t = open_or!(self, tables::AUDIT, 0);
                Ok(t.last()?.map(|(k, _)| k.value()).unwrap_or(0))
            }

            fn pending(&self) -> Result<Vec<(String, u64)>, StoreError> {
                let t = open_or!(self, tables::PENDING, vec![]);
                let mut v = vec![];
                for item in t.iter()? {
                    let (k, s) = item?;
                    v.push((k.value().to_string(), s.value()));
                }
                Ok(v)
            }

            fn by_at_or_below(&self, key: &str, at: u64) -> Result<Option<u64>, StoreError> {
                let t = self.open_table(tables::AUDIT_BY)?;
                let r = t.range((key, 0)..=(key, at))?.next_back();
                match r {
                    Some(item) => Ok(Some(item?.0.value().1)),
                    None => Ok(None),
                }
            }

            fn by_at_or_above(&self, key: &str, at: u64) -> Result<Option<u64>, StoreError> {
                let t = self.open_table(tables::AUDIT_BY)?;
                let r = t.range((key, at)..=(key, u64::MAX))?.next();
                match r {
                    Some(item) => Ok(Some(item?.0.value().1)),
                    None => Ok(None),
                }
            }

            fn by_count(&self, key: &str) -> Result<u64, StoreError> {
                let t = open_or!(self, tables::AUDIT_BY, 0);
                let mut n = 0;
                for item in t.range((key, 0)..=(key, u64::MAX))? {
                    item?;
                    n += 1;
                }
                Ok(n)
            }

            fn minute(&self, minute: u64) -> Result<Option<(u64, u64)>, StoreError> {
                let t = self.open_table(tables::AUDIT_MINUTES)?;
                Ok(t.get(minute)?.map(|v| v.value()))
            }

            fn minutes_span(&self, from: u64, to: u64) -> Result<Option<(u64, u64)>, StoreError> {
                let t = self.open_table(tables::AUDIT_MINUTES)?;
                minutes_span(&t, from, to)
            }

            fn cursors(&self) -> Result<BTreeMap<String, u64>, StoreError> {
                let t = open_or!(self, tables::SINK_CURSORS, BTreeMap::new());
                let mut m = BTreeMap::new();
                for item in t.iter()? {
                    let (k, v) = item?;
                    m.insert(k.value().to_string(), v.value());
                }
                Ok(m)
            }
        }
    };
}
redb_reads!(ReadTransaction);
redb_reads!(WriteTransaction);

/// The span of `from..=to` in a minutes table.
pub(crate) fn minutes_span(
    t: &impl ReadableTable<u64, (u64, u64)>,
    from: u64,
    to: u64,
) -> Result<Option<(u64, u64)>, StoreError> {
    if from > to {
        return Ok(None);
    }
    let mut span: Option<(u64, u64)> = None;
    for item in t.range(from..=to)? {
        let (_, v) = item?;
        let (lo, hi) = v.value();
        span = Some(match span {
            Some((a, b)) => (a.min(lo), b.max(hi)),
            None => (lo, hi),
        });
    }
    Ok(span)
}

impl WriteOps for WriteTransaction {
    fn put_raw(&self, table: Records, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.open_table(table)?.insert(key, value)?;
        Ok(())
    }

    fn remove(&self, table: Records, key: &str) -> Result<bool, StoreError> {
        Ok(self.open_table(table)?.remove(key)?.is_some())
    }

    fn put_link(&self, table: Links, key: &str, value: &str) -> Result<(), StoreError> {
        self.open_table(table)?.insert(key, value)?;
        Ok(())
    }

    fn remove_link(&self, table: Links, key: &str) -> Result<(), StoreError> {
        self.open_table(table)?.remove(key)?;
        Ok(())
    }

    fn put_index(&self, table: Index, key: &str) -> Result<(), StoreError> {
        self.open_table(table)?.insert(key, ())?;
        Ok(())
    }

    fn remove_index(&self, table: Index, key: &str) -> Result<(), StoreError> {
        self.open_table(table)?.remove(key)?;
        Ok(())
    }

    fn put_meta(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.open_table(tables::META)?.insert(key, value)?;
        Ok(())
    }

    fn insert_event(&self, seq: u64, value: &[u8]) -> Result<(), StoreError> {
        self.open_table(tables::AUDIT)?.insert(seq, value)?;
        Ok(())
    }

    fn put_pending(&self, op: &str, seq: u64) -> Result<(), StoreError> {
        self.open_table(tables::PENDING)?.insert(op, seq)?;
        Ok(())
    }

    fn remove_pending(&self, op: &str) -> Result<(), StoreError> {
        self.open_table(tables::PENDING)?.remove(op)?;
        Ok(())
    }

    fn put_by(&self, key: &str, seq: u64) -> Result<(), StoreError> {
        self.open_table(tables::AUDIT_BY)?.insert((key, seq), ())?;
        Ok(())
    }

    fn put_minute(&self, minute: u64, span: (u64, u64)) -> Result<(), StoreError> {
        self.open_table(tables::AUDIT_MINUTES)?
            .insert(minute, span)?;
        Ok(())
    }

    fn put_cursor(&self, name: &str, seq: u64) -> Result<(), StoreError> {
        self.open_table(tables::SINK_CURSORS)?.insert(name, seq)?;
        Ok(())
    }

    /// Each table opened once for the event (the hot path of every write).
    fn append_event(
        &self,
        seq: u64,
        value: &[u8],
        keys: &[String],
        minute: Option<u64>,
    ) -> Result<(), StoreError> {
        self.open_table(tables::AUDIT)?.insert(seq, value)?;
        {
            let mut by = self.open_table(tables::AUDIT_BY)?;
            for k in keys {
                by.insert((k.as_str(), seq), ())?;
            }
        }
        if let Some(m) = minute {
            let mut mins = self.open_table(tables::AUDIT_MINUTES)?;
            let span = match mins.get(m)? {
                Some(v) => {
                    let (lo, hi) = v.value();
                    (lo.min(seq), hi.max(seq))
                }
                None => (seq, seq),
            };
            mins.insert(m, span)?;
        }
        Ok(())
    }
}

/// A read transaction.
pub enum Rx {
    Redb(ReadTransaction),
    Pg(PgTx),
}

/// A write transaction: the group commit it belongs to commits it. One
/// per group commit, on the writer's stack: the variants' sizes do not
/// matter.
#[allow(clippy::large_enum_variant)]
pub enum Wx {
    Redb(WriteTransaction),
    Pg(PgTx),
}

impl Rx {
    /// The redb transaction, for what only a redb file has (backups, the
    /// summary of a stopped store).
    pub fn redb(&self) -> Option<&ReadTransaction> {
        match self {
            Rx::Redb(t) => Some(t),
            Rx::Pg(_) => None,
        }
    }
}

impl Wx {
    /// The redb transaction (the schema steps of a redb file).
    pub fn redb(&self) -> Option<&WriteTransaction> {
        match self {
            Wx::Redb(t) => Some(t),
            Wx::Pg(_) => None,
        }
    }
}

/// Both kinds delegate every operation to their engine's transaction.
macro_rules! delegate_reads {
    ($t:ident) => {
        impl ReadOps for $t {
            fn record<T: DeserializeOwned>(
                &self,
                table: Records,
                key: &str,
            ) -> Result<Option<T>, StoreError> {
                match self {
                    $t::Redb(t) => t.record(table, key),
                    $t::Pg(t) => t.record(table, key),
                }
            }
            fn has(&self, table: Records, key: &str) -> Result<bool, StoreError> {
                match self {
                    $t::Redb(t) => t.has(table, key),
                    $t::Pg(t) => t.has(table, key),
                }
            }
            fn records<T: DeserializeOwned>(&self, table: Records) -> Result<Vec<T>, StoreError> {
                match self {
                    $t::Redb(t) => t.records(table),
                    $t::Pg(t) => t.records(table),
                }
            }
            fn raw_records(&self, table: Records) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
                match self {
                    $t::Redb(t) => t.raw_records(table),
                    $t::Pg(t) => t.raw_records(table),
                }
            }
            fn link(&self, table: Links, key: &str) -> Result<Option<String>, StoreError> {
                match self {
                    $t::Redb(t) => t.link(table, key),
                    $t::Pg(t) => t.link(table, key),
                }
            }
            fn index_keys(
                &self,
                table: Index,
                from: &str,
                to: &str,
            ) -> Result<Vec<String>, StoreError> {
                match self {
                    $t::Redb(t) => t.index_keys(table, from, to),
                    $t::Pg(t) => t.index_keys(table, from, to),
                }
            }
            fn meta(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
                match self {
                    $t::Redb(t) => t.meta(key),
                    $t::Pg(t) => t.meta(key),
                }
            }
            fn event(&self, seq: u64) -> Result<Option<Event>, StoreError> {
                match self {
                    $t::Redb(t) => t.event(seq),
                    $t::Pg(t) => t.event(seq),
                }
            }
            fn events(&self, from: u64, limit: usize) -> Result<Vec<(u64, Event)>, StoreError> {
                match self {
                    $t::Redb(t) => t.events(from, limit),
                    $t::Pg(t) => t.events(from, limit),
                }
            }
            fn last_seq(&self) -> Result<u64, StoreError> {
                match self {
                    $t::Redb(t) => t.last_seq(),
                    $t::Pg(t) => t.last_seq(),
                }
            }
            fn pending(&self) -> Result<Vec<(String, u64)>, StoreError> {
                match self {
                    $t::Redb(t) => t.pending(),
                    $t::Pg(t) => t.pending(),
                }
            }
            fn by_at_or_below(&self, key: &str, at: u64) -> Result<Option<u64>, StoreError> {
                match self {
                    $t::Redb(t) => t.by_at_or_below(key, at),
                    $t::Pg(t) => t.by_at_or_below(key, at),
                }
            }
            fn by_at_or_above(&self, key: &str, at: u64) -> Result<Option<u64>, StoreError> {
                match self {
                    $t::Redb(t) => t.by_at_or_above(key, at),
                    $t::Pg(t) => t.by_at_or_above(key, at),
                }
            }
            fn by_count(&self, key: &str) -> Result<u64, StoreError> {
                match self {
                    $t::Redb(t) => t.by_count(key),
                    $t::Pg(t) => t.by_count(key),
                }
            }
            fn minute(&self, minute: u64) -> Result<Option<(u64, u64)>, StoreError> {
                match self {
                    $t::Redb(t) => t.minute(minute),
                    $t::Pg(t) => t.minute(minute),
                }
            }
            fn minutes_span(&self, from: u64, to: u64) -> Result<Option<(u64, u64)>, StoreError> {
                match self {
                    $t::Redb(t) => t.minutes_span(from, to),
                    $t::Pg(t) => t.minutes_span(from, to),
                }
            }
            fn cursors(&self) -> Result<BTreeMap<String, u64>, StoreError> {
                match self {
                    $t::Redb(t) => t.cursors(),
                    $t::Pg(t) => t.cursors(),
                }
            }
        }
    };
}
delegate_reads!(Rx);
delegate_reads!(Wx);

impl WriteOps for Wx {
    fn put_raw(&self, table: Records, key: &str, value: &[u8]) -> Result<(), StoreError> {
        match self {
            Wx::Redb(t) => t.put_raw(table, key, value),
            Wx::Pg(t) => t.put_raw(table, key, value),
        }
    }
    fn remove(&self, table: Records, key: &str) -> Result<bool, StoreError> {
        match self {
            Wx::Redb(t) => WriteOps::remove(t, table, key),
            Wx::Pg(t) => WriteOps::remove(t, table, key),
        }
    }
    fn put_link(&self, table: Links, key: &str, value: &str) -> Result<(), StoreError> {
        match self {
            Wx::Redb(t) => t.put_link(table, key, value),
            Wx::Pg(t) => t.put_link(table, key, value),
        }
    }
    fn remove_link(&self, table: Links, key: &str) -> Result<(), StoreError> {
        match self {
            Wx::Redb(t) => t.remove_link(table, key),
            Wx::Pg(t) => t.remove_link(table, key),
        }
    }
    fn put_index(&self, table: Index, key: &str) -> Result<(), StoreError> {
        match self {
            Wx::Redb(t) => t.put_index(table, key),
            Wx::Pg(t) => t.put_index(table, key),
        }
    }
    fn remove_index(&self, table: Index, key: &str) -> Result<(), StoreError> {
        match self {
            Wx::Redb(t) => t.remove_index(table, key),
            Wx::Pg(t) => t.remove_index(table, key),
        }
    }
    fn put_meta(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        match self {
            Wx::Redb(t) => t.put_meta(key, value),
            Wx::Pg(t) => t.put_meta(key, value),
        }
    }
    fn insert_event(&self, seq: u64, value: &[u8]) -> Result<(), StoreError> {
        match self {
            Wx::Redb(t) => t.insert_event(seq, value),
            Wx::Pg(t) => t.insert_event(seq, value),
        }
    }
    fn put_pending(&self, op: &str, seq: u64) -> Result<(), StoreError> {
        match self {
            Wx::Redb(t) => t.put_pending(op, seq),
            Wx::Pg(t) => t.put_pending(op, seq),
        }
    }
    fn remove_pending(&self, op: &str) -> Result<(), StoreError> {
        match self {
            Wx::Redb(t) => t.remove_pending(op),
            Wx::Pg(t) => t.remove_pending(op),
        }
    }
    fn put_by(&self, key: &str, seq: u64) -> Result<(), StoreError> {
        match self {
            Wx::Redb(t) => t.put_by(key, seq),
            Wx::Pg(t) => t.put_by(key, seq),
        }
    }
    fn put_minute(&self, minute: u64, span: (u64, u64)) -> Result<(), StoreError> {
        match self {
            Wx::Redb(t) => t.put_minute(minute, span),
            Wx::Pg(t) => t.put_minute(minute, span),
        }
    }
    fn put_cursor(&self, name: &str, seq: u64) -> Result<(), StoreError> {
        match self {
            Wx::Redb(t) => t.put_cursor(name, seq),
            Wx::Pg(t) => t.put_cursor(name, seq),
        }
    }
    fn append_event(
        &self,
        seq: u64,
        value: &[u8],
        keys: &[String],
        minute: Option<u64>,
    ) -> Result<(), StoreError> {
        match self {
            Wx::Redb(t) => t.append_event(seq, value, keys, minute),
            Wx::Pg(t) => t.append_event(seq, value, keys, minute),
        }
    }
}

/// Insert (or replace) a record.
pub fn put<T: Serialize>(
    txn: &impl WriteOps,
    table: Records,
    key: &str,
    value: &T,
) -> Result<(), StoreError> {
    txn.put_raw(table, key, &codec::encode(value)?)
}

/// Remove a record (absent is fine): whether it was there.
pub fn remove(txn: &impl WriteOps, table: Records, key: &str) -> Result<bool, StoreError> {
    WriteOps::remove(txn, table, key)
}

/// Set a link.
pub fn put_link(
    txn: &impl WriteOps,
    table: Links,
    key: &str,
    value: &str,
) -> Result<(), StoreError> {
    txn.put_link(table, key, value)
}

/// Remove a link (absent is fine).
pub fn remove_link(txn: &impl WriteOps, table: Links, key: &str) -> Result<(), StoreError> {
    txn.remove_link(table, key)
}

/// Add an index entry.
pub fn put_index(txn: &impl WriteOps, table: Index, key: &str) -> Result<(), StoreError> {
    txn.put_index(table, key)
}

/// Remove an index entry (absent is fine).
pub fn remove_index(txn: &impl WriteOps, table: Index, key: &str) -> Result<(), StoreError> {
    txn.remove_index(table, key)
}
