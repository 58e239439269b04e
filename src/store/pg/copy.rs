//! `cube-adapter store migrate --to postgres`: a redb store's every table,
//! copied as it is (the same keys, the same value bytes) into an empty
//! database, in one transaction. The chain checks on both sides are the
//! caller's (`ops::migrate_to_postgres`).

use redb::{ReadTransaction, ReadableTable};

use super::PgTx;
use crate::store::typed::{Index, Links, Records, WriteOps};
use crate::store::{Chain, StoreError, tables};

/// What was copied, table by table.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct Copied {
    pub events: u64,
    pub records: u64,
    pub index_entries: u64,
    pub pending: u64,
}

/// The keyed record tables.
const RECORDS: &[Records] = &[
    tables::TOKENS,
    tables::LEASES,
    tables::JOBS,
    tables::CHECKPOINTS,
    tables::PTYS,
    tables::PLANS,
    tables::TASKS,
    tables::USERS,
    tables::CONSOLE_SESSIONS,
    tables::RECORDINGS,
];
const LINKS: &[Links] = &[tables::SESSIONS];
const INDEXES: &[Index] = &[
    tables::LEASE_JOBS,
    tables::LEASE_CHECKPOINTS,
    tables::LEASE_PTYS,
    tables::LEASE_RECORDINGS,
];

/// Whether the database holds a store already (its chain or any record).
pub fn is_empty(tx: &PgTx) -> Result<bool, StoreError> {
    let rows = tx.query(
        "SELECT (SELECT next_seq FROM cube_chain WHERE id = 1) = 1
            AND NOT EXISTS (SELECT 1 FROM cube_records)
            AND NOT EXISTS (SELECT 1 FROM cube_meta)",
        &[],
    )?;
    match rows.first() {
        Some(r) => r.try_get(0).map_err(super::corrupt),
        None => Ok(false),
    }
}

/// Copy everything of `from` into `to` (a write transaction that has
/// locked the chain head), and set the head to `chain`.
pub fn copy(from: &ReadTransaction, to: &PgTx, chain: &Chain) -> Result<Copied, StoreError> {
    let mut n = Copied::default();
    for item in from.open_table(tables::META)?.iter()? {
        let (k, v) = item?;
        to.put_meta(k.value(), v.value())?;
    }
    for t in RECORDS {
        for item in from.open_table(*t)?.iter()? {
            let (k, v) = item?;
            to.put_raw(*t, k.value(), v.value())?;
            n.records += 1;
        }
    }
    for t in LINKS {
        for item in from.open_table(*t)?.iter()? {
            let (k, v) = item?;
            to.put_link(*t, k.value(), v.value())?;
            n.records += 1;
        }
    }
    for t in INDEXES {
        for item in from.open_table(*t)?.iter()? {
            let (k, _) = item?;
            to.put_index(*t, k.value())?;
            n.index_entries += 1;
        }
    }
    for item in from.open_table(tables::AUDIT)?.iter()? {
        let (k, v) = item?;
        to.insert_event(k.value(), v.value())?;
        n.events += 1;
    }
    // Intents left pending by the redb store's process: of no replica, so
    // the first replica to start resolves them.
    for item in from.open_table(tables::PENDING)?.iter()? {
        let (k, v) = item?;
        to.put_pending(k.value(), v.value())?;
        n.pending += 1;
    }
    for item in from.open_table(tables::AUDIT_BY)?.iter()? {
        let (k, _) = item?;
        let (key, seq) = k.value();
        to.put_by(key, seq)?;
        n.index_entries += 1;
    }
    for item in from.open_table(tables::AUDIT_MINUTES)?.iter()? {
        let (k, v) = item?;
        to.put_minute(k.value(), v.value())?;
        n.index_entries += 1;
    }
    for item in from.open_table(tables::SINK_CURSORS)?.iter()? {
        let (k, v) = item?;
        to.put_cursor(k.value(), v.value())?;
    }
    to.store_chain(chain)?;
    Ok(n)
}
