//! The audit journal's search indexes (schema 6), kept by `Chain::append`
//! in the same write transaction as the event they index: an index never
//! disagrees with the journal.
//!
//! - `audit_by_v1`: `(field \0 value, seq)` → () for every indexed field an
//!   event has (tenant and identity digests, runtime, action, outcome,
//!   sandbox_ref, request_id, plan_ref, task_ref). The events with one
//!   value are a range scan, in `seq` order.
//! - `audit_minutes_v1`: Unix minute → (lowest, highest) `seq` of the
//!   events stamped in that minute. A time range becomes a `seq` range
//!   (every event of the range lies in it; each candidate's own `ts` is
//!   checked, so a late-stamped event is neither lost nor misplaced).

use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use super::StoreError;
use super::event::Event;
use super::typed::{ReadOps, Rx, WriteOps};

/// An indexed field of an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    Tenant,
    Identity,
    Runtime,
    Action,
    Outcome,
    SandboxRef,
    RequestId,
    PlanRef,
    TaskRef,
}

impl Field {
    pub const ALL: [Field; 9] = [
        Field::Tenant,
        Field::Identity,
        Field::Runtime,
        Field::Action,
        Field::Outcome,
        Field::SandboxRef,
        Field::RequestId,
        Field::PlanRef,
        Field::TaskRef,
    ];

    /// The key prefix (short: it is in every key).
    fn tag(self) -> &'static str {
        match self {
            Field::Tenant => "t",
            Field::Identity => "i",
            Field::Runtime => "r",
            Field::Action => "a",
            Field::Outcome => "o",
            Field::SandboxRef => "s",
            Field::RequestId => "q",
            Field::PlanRef => "p",
            Field::TaskRef => "k",
        }
    }

    /// The event's value of this field.
    pub fn of(self, ev: &Event) -> Option<&str> {
        match self {
            Field::Tenant => ev.tenant_digest.as_deref(),
            Field::Identity => ev.identity_digest.as_deref(),
            Field::Runtime => ev.runtime.as_deref(),
            Field::Action => Some(ev.action.as_str()),
            Field::Outcome => Some(ev.outcome.as_str()),
            Field::SandboxRef => ev.sandbox_ref.as_deref(),
            Field::RequestId => ev.request_id.as_deref(),
            Field::PlanRef => ev.plan_ref.as_deref(),
            Field::TaskRef => ev.task_ref.as_deref(),
        }
        .filter(|v| !v.is_empty())
    }
}

/// The index key of a field's value.
pub fn key(field: Field, value: &str) -> String {
    format!("{}\0{value}", field.tag())
}

/// The Unix minute of an RFC 3339 timestamp (`None`: not one).
pub fn minute_of(ts: &str) -> Option<u64> {
    let t = OffsetDateTime::parse(ts, &Rfc3339).ok()?;
    u64::try_from(t.unix_timestamp().div_euclid(60)).ok()
}

/// The index keys of an event (`Chain::append` hands them to the engine
/// with the event).
pub fn keys_of(ev: &Event) -> Vec<String> {
    Field::ALL
        .iter()
        .filter_map(|f| f.of(ev).map(|v| key(*f, v)))
        .collect()
}

/// Index one event (the schema 6 step, for the events written before it;
/// `Chain::append` indexes through `WriteOps::append_event`).
pub fn add(txn: &impl WriteOps, ev: &Event) -> Result<(), StoreError> {
    for f in Field::ALL {
        if let Some(v) = f.of(ev) {
            txn.put_by(&key(f, v), ev.seq)?;
        }
    }
    if let Some(m) = minute_of(&ev.ts) {
        let span = match txn.minute(m)? {
            Some((lo, hi)) => (lo.min(ev.seq), hi.max(ev.seq)),
            None => (ev.seq, ev.seq),
        };
        txn.put_minute(m, span)?;
    }
    Ok(())
}

/// How much more start-up time each batch of the upgrade asks systemd for
/// (`EXTEND_TIMEOUT_USEC`): far more than one batch takes.
const UPGRADE_EXTEND_USEC: u64 = 60_000_000;

/// Build the indexes for every event of the journal (schema 5 → 6). Returns
/// the number of events indexed. Under systemd, each batch extends the
/// start-up timeout (`EXTEND_TIMEOUT_USEC`), so that a large journal's
/// upgrade is not killed by `TimeoutStartSec`; so does the end, for the
/// commit that follows.
pub fn rebuild(txn: &impl WriteOps) -> Result<u64, StoreError> {
    let extend = |n: u64| {
        crate::systemd::notify(&format!(
            "EXTEND_TIMEOUT_USEC={UPGRADE_EXTEND_USEC}\nSTATUS=upgrading the store: {n} audit events indexed"
        ))
    };
    let mut n = 0;
    let mut batch = Vec::with_capacity(1024);
    let mut from = 0u64;
    loop {
        batch.clear();
        batch.extend(txn.events(from, 1024)?);
        extend(n);
        let Some(&(last, _)) = batch.last() else {
            break;
        };
        for (seq, ev) in &mut batch {
            // The key is the truth (verify checks they agree).
            ev.seq = *seq;
            add(txn, ev)?;
            n += 1;
        }
        from = last + 1;
    }
    Ok(n)
}

/// Reads of the indexes in one read transaction (a search asks many
/// times: a redb transaction's tables are opened once, here). One per
/// search, on the stack: its size does not matter.
#[allow(clippy::large_enum_variant)]
pub enum Reader<'a> {
    Redb {
        by: redb::ReadOnlyTable<(&'static str, u64), ()>,
        minutes: redb::ReadOnlyTable<u64, (u64, u64)>,
        audit: redb::ReadOnlyTable<u64, &'static [u8]>,
    },
    /// Another engine: each read is the transaction's own.
    Other(&'a Rx),
}

impl<'a> Reader<'a> {
    pub fn open(txn: &'a Rx) -> Result<Self, StoreError> {
        Ok(match txn.redb() {
            Some(t) => Self::Redb {
                by: t.open_table(super::tables::AUDIT_BY)?,
                minutes: t.open_table(super::tables::AUDIT_MINUTES)?,
                audit: t.open_table(super::tables::AUDIT)?,
            },
            None => Self::Other(txn),
        })
    }

    /// The highest `seq <= at` of an event whose field `key` (see [`key`])
    /// has this value.
    pub fn at_or_below(&self, key: &str, at: u64) -> Result<Option<u64>, StoreError> {
        match self {
            Self::Redb { by, .. } => match by.range((key, 0)..=(key, at))?.next_back() {
                Some(item) => Ok(Some(item?.0.value().1)),
                None => Ok(None),
            },
            Self::Other(t) => t.by_at_or_below(key, at),
        }
    }

    /// How many events have this value of a field (a range scan of the
    /// index: for values that are rare, such as `outcome` `uncertain`).
    pub fn count(&self, field: Field, value: &str) -> Result<u64, StoreError> {
        let k = key(field, value);
        match self {
            Self::Redb { by, .. } => {
                let mut n = 0;
                for item in by.range((k.as_str(), 0)..=(k.as_str(), u64::MAX))? {
                    item?;
                    n += 1;
                }
                Ok(n)
            }
            Self::Other(t) => t.by_count(&k),
        }
    }

    /// The lowest `seq >= at` of an event whose field `key` has this value.
    pub fn at_or_above(&self, key: &str, at: u64) -> Result<Option<u64>, StoreError> {
        match self {
            Self::Redb { by, .. } => match by.range((key, at)..=(key, u64::MAX))?.next() {
                Some(item) => Ok(Some(item?.0.value().1)),
                None => Ok(None),
            },
            Self::Other(t) => t.by_at_or_above(key, at),
        }
    }

    /// The `seq` range holding every event stamped in the minutes
    /// `from..=to` (`None`: no event then).
    pub fn seq_span(&self, from: u64, to: u64) -> Result<Option<(u64, u64)>, StoreError> {
        match self {
            Self::Redb { minutes, .. } => super::typed::minutes_span(minutes, from, to),
            Self::Other(t) => t.minutes_span(from, to),
        }
    }

    /// The event stored under `seq`.
    pub fn event(&self, seq: u64) -> Result<Option<Event>, StoreError> {
        match self {
            Self::Redb { audit, .. } => match redb::ReadableTable::get(audit, seq)? {
                Some(v) => Ok(Some(super::codec::decode(v.value())?)),
                None => Ok(None),
            },
            Self::Other(t) => t.event(seq),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::event::{Action, Outcome};
    use crate::store::{Store, codec, tables};
    use redb::{ReadableDatabase, ReadableTable};

    /// The index keys, and the minute spans.
    type Dump = (Vec<(String, u64)>, Vec<(u64, (u64, u64))>);

    fn ev(i: u64) -> Event {
        Event {
            // `exec` for even `i`, `read` for odd.
            action: if i.is_multiple_of(2) {
                Action::Exec
            } else {
                Action::Read
            },
            outcome: Outcome::Ok,
            tenant_digest: Some(format!("tenant{}", i % 3)),
            request_id: Some(format!("req{i}")),
            ts: format!("2026-01-01T00:{:02}:00Z", i % 60),
            ..Default::default()
        }
    }

    async fn fill(store: &Store, n: u64) {
        for i in 0..n {
            let e = ev(i);
            store
                .write(move |txn, chain| chain.append(txn, e).map(|_| ()))
                .await
                .unwrap();
        }
    }

    /// Every (key, seq) the indexes hold, and the minute spans.
    fn dump(store: &Store) -> Dump {
        store
            .read_now(|txn| {
                let txn = txn.redb().unwrap();
                let by = txn.open_table(tables::AUDIT_BY)?;
                let mut a = vec![];
                for r in by.iter()? {
                    let (k, _) = r?;
                    let (s, q) = k.value();
                    a.push((s.to_string(), q));
                }
                let m = txn.open_table(tables::AUDIT_MINUTES)?;
                let mut b = vec![];
                for r in m.iter()? {
                    let (k, v) = r?;
                    b.push((k.value(), v.value()));
                }
                Ok((a, b))
            })
            .unwrap()
    }

    /// Appends index every field they carry, in the same transaction.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn append_indexes_each_field() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        fill(&store, 10).await;
        let (by, mins) = dump(&store);
        // action, outcome, tenant, request id: four keys an event.
        assert_eq!(by.len(), 40);
        let odd: Vec<u64> = by
            .iter()
            .filter(|(k, _)| k == &key(Field::Action, "read"))
            .map(|(_, s)| *s)
            .collect();
        assert_eq!(odd, vec![2, 4, 6, 8, 10]);
        assert_eq!(mins.len(), 10);
        store
            .read_now(|txn| {
                let r = Reader::open(txn)?;
                let k = key(Field::Tenant, "tenant1");
                assert_eq!(r.at_or_below(&k, 10)?, Some(8));
                assert_eq!(r.at_or_below(&k, 1)?, None);
                assert_eq!(r.at_or_above(&k, 3)?, Some(5));
                assert_eq!(r.at_or_above(&k, 9)?, None);
                let base = minute_of("2026-01-01T00:00:00Z").unwrap();
                assert_eq!(r.seq_span(base + 2, base + 4)?, Some((3, 5)));
                assert_eq!(r.seq_span(base + 30, base + 40)?, None);
                Ok(())
            })
            .unwrap();
    }

    /// A schema-5 store (its journal and no indexes) opened by this binary
    /// gets the indexes built, the same as if they had been kept all along,
    /// and schema 6.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn schema_5_store_is_migrated() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        fill(&store, 25).await;
        let want = dump(&store);
        store.close().await;
        drop(store);
        // Make it a schema-5 store: no index tables, version 5.
        {
            let db = redb::Database::create(dir.path().join("state.redb")).unwrap();
            let txn = db.begin_write().unwrap();
            txn.delete_table(tables::AUDIT_BY).unwrap();
            txn.delete_table(tables::AUDIT_MINUTES).unwrap();
            txn.open_table(tables::META)
                .unwrap()
                .insert("schema_version", codec::encode(&5u64).unwrap().as_slice())
                .unwrap();
            txn.commit().unwrap();
            let r = db.begin_read().unwrap();
            assert!(r.open_table(tables::AUDIT_BY).is_err());
        }
        let store = Store::open(dir.path()).unwrap();
        assert_eq!(dump(&store), want);
        let v: u64 = store
            .read_now(|txn| codec::decode(&txn.meta("schema_version")?.unwrap()))
            .unwrap();
        assert_eq!(v, tables::SCHEMA_VERSION);
        // And appends go on indexing after the step.
        fill(&store, 1).await;
        assert_eq!(dump(&store).0.len(), want.0.len() + 4);
    }

    /// Each indexed field of an event has its own key.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_field_is_indexed() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let e = Event {
            action: Action::Status,
            outcome: Outcome::Ok,
            runtime: Some("rt".into()),
            tenant_digest: Some("td".into()),
            identity_digest: Some("id".into()),
            sandbox_ref: Some("sb".into()),
            request_id: Some("rq".into()),
            plan_ref: Some("pl".into()),
            task_ref: Some("tk".into()),
            ts: "2026-01-01T00:00:00Z".into(),
            ..Default::default()
        };
        let seq = store
            .write(move |txn, chain| chain.append(txn, e))
            .await
            .unwrap()
            .seq;
        let (by, _) = dump(&store);
        let mut want: Vec<(String, u64)> = [
            (Field::Tenant, "td"),
            (Field::Identity, "id"),
            (Field::Runtime, "rt"),
            (Field::Action, "status"),
            (Field::Outcome, "ok"),
            (Field::SandboxRef, "sb"),
            (Field::RequestId, "rq"),
            (Field::PlanRef, "pl"),
            (Field::TaskRef, "tk"),
        ]
        .iter()
        .map(|(f, v)| (key(*f, v), seq))
        .collect();
        want.sort();
        assert_eq!(by, want);
    }
}
