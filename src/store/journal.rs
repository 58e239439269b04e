//! The journal's tables: audit events (`audit_v1`, seq → event; appended
//! only through `Chain::append`) and pending intents (`pending_v1`).

use super::StoreError;
use super::event::Event;
use super::typed::{ReadOps, WriteOps};

/// How many events a scan reads at a time: memory stays flat however long
/// the journal.
const SCAN: usize = 1024;

/// The event with sequence number `seq`.
pub fn event(txn: &impl ReadOps, seq: u64) -> Result<Option<Event>, StoreError> {
    txn.event(seq)
}

/// Visit the events with `seq >= since` in order, with the key each is
/// stored under; stops at the first error.
pub fn for_each_event(
    txn: &impl ReadOps,
    since: u64,
    mut f: impl FnMut(u64, Event) -> Result<(), StoreError>,
) -> Result<(), StoreError> {
    let mut from = since;
    loop {
        let batch = txn.events(from, SCAN)?;
        let Some(&(last, _)) = batch.last() else {
            return Ok(());
        };
        let full = batch.len() == SCAN;
        for (seq, ev) in batch {
            f(seq, ev)?;
        }
        if !full || last == u64::MAX {
            return Ok(());
        }
        from = last + 1;
    }
}

/// Record an intent as pending (operation id → its event's seq).
pub fn put_pending(txn: &impl WriteOps, op: &str, seq: u64) -> Result<(), StoreError> {
    txn.put_pending(op, seq)
}

/// An intent is no longer pending (absent is fine).
pub fn remove_pending(txn: &impl WriteOps, op: &str) -> Result<(), StoreError> {
    txn.remove_pending(op)
}

/// Every pending intent: (operation id, seq of its event), by id.
pub fn pending(txn: &impl ReadOps) -> Result<Vec<(String, u64)>, StoreError> {
    txn.pending()
}
