//! The journal's tables: audit events (`audit_v1`, seq → event; appended
//! only through `Chain::append`) and pending intents (`pending_v1`).

use redb::{ReadTransaction, ReadableTable, WriteTransaction};

use super::event::Event;
use super::{StoreError, codec, tables};

/// The event with sequence number `seq`.
pub fn event(txn: &ReadTransaction, seq: u64) -> Result<Option<Event>, StoreError> {
    let t = txn.open_table(tables::AUDIT)?;
    match t.get(seq)? {
        Some(v) => Ok(Some(codec::decode(v.value())?)),
        None => Ok(None),
    }
}

/// Visit the events with `seq >= since` in order, with the key each is
/// stored under; stops at the first error.
pub fn for_each_event(
    txn: &ReadTransaction,
    since: u64,
    mut f: impl FnMut(u64, Event) -> Result<(), StoreError>,
) -> Result<(), StoreError> {
    let t = txn.open_table(tables::AUDIT)?;
    for item in t.range(since..)? {
        let (k, v) = item?;
        f(k.value(), codec::decode(v.value())?)?;
    }
    Ok(())
}

/// Record an intent as pending (operation id → its event's seq).
pub fn put_pending(txn: &WriteTransaction, op: &str, seq: u64) -> Result<(), StoreError> {
    txn.open_table(tables::PENDING)?.insert(op, seq)?;
    Ok(())
}

/// An intent is no longer pending (absent is fine).
pub fn remove_pending(txn: &WriteTransaction, op: &str) -> Result<(), StoreError> {
    txn.open_table(tables::PENDING)?.remove(op)?;
    Ok(())
}

/// Every pending intent: (operation id, seq of its event), by id.
pub fn pending(txn: &ReadTransaction) -> Result<Vec<(String, u64)>, StoreError> {
    let t = txn.open_table(tables::PENDING)?;
    let mut v = vec![];
    for item in t.iter()? {
        let (k, s) = item?;
        v.push((k.value().to_string(), s.value()));
    }
    Ok(v)
}
