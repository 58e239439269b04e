//! The audit journal: intent before effect, outcome after, hash-chained.
//!
//! In `required` mode (the default) an intent is committed durably before
//! any backend effect; if it cannot be, the request fails with 503
//! `audit_unavailable` and nothing happens. A crash between intent and
//! outcome leaves the intent pending: at the next start every sandbox effect
//! (and `/readyz`) answers 503 until `cube-adapter audit reconcile` records
//! a resolution. A backend error or timeout is recorded as the outcome
//! (`error` / `uncertain`), so it never blocks the journal.

/// The event record (kept by the store, which chains it).
pub mod event {
    pub use crate::store::event::*;
}
#[cfg(test)]
mod journal_words;
pub(crate) mod search;
pub(crate) mod sinks;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};

use self::event::{Action, Event, GENESIS, Outcome, Phase};
use crate::store::{Store, StoreError, journal};

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum AuditMode {
    #[default]
    Required,
    BestEffort,
}

impl AuditMode {
    /// The mode's name in config and answers.
    pub const fn as_str(self) -> &'static str {
        match self {
            AuditMode::Required => "required",
            AuditMode::BestEffort => "best_effort",
        }
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum AuditError {
    #[error("the audit journal cannot record this action: {0}")]
    Unavailable(String),
    #[error(
        "the audit journal has unreconciled intents; run `cube-adapter audit reconcile` with the service stopped"
    )]
    Blocked,
}

fn new_id() -> String {
    crate::ids::random_hex(16)
}

/// Cheap to clone.
#[derive(Clone)]
pub struct Journal {
    store: Store,
    mode: AuditMode,
    blocked: Arc<AtomicBool>,
    key: Arc<[u8]>,
    /// Events' timestamps (the system clock unless `with_clock`).
    clock: crate::clock::Clock,
    /// Where copies of the journal go (`[[audit.sinks]]`; none until
    /// started).
    sinks: Arc<sinks::Sinks>,
    /// Operations and effect latency, for `/metrics`.
    metrics: Arc<crate::metrics::Audit>,
}

/// A committed intent, waiting for its outcome.
pub struct Intent {
    pub operation_id: String,
    base: Event,
    started: Instant,
    /// False when best-effort mode could not write the intent.
    recorded: bool,
}

impl Intent {
    /// The action the intent is for.
    pub fn action(&self) -> &Action {
        &self.base.action
    }
}

impl Journal {
    /// `key` keys the digests (HMAC-SHA256). The journal is blocked when
    /// intents are pending from an earlier run.
    pub fn open(store: Store, mode: AuditMode, key: Vec<u8>) -> Result<Self, StoreError> {
        let pending = unheld_pending(&store)?;
        if !pending.is_empty() {
            tracing::error!(
                count = pending.len(),
                "pending audit intents from an earlier run: sandbox effects wait until they are resolved (at start, unless [audit] on_crash = \"block\": then by `cube-adapter audit reconcile`)"
            );
        }
        Ok(Self {
            store: store.clone(),
            mode,
            blocked: Arc::new(AtomicBool::new(!pending.is_empty())),
            key: key.into(),
            clock: crate::clock::Clock::System,
            sinks: Arc::new(sinks::Sinks::new(store, crate::clock::Clock::System)),
            metrics: Arc::default(),
        })
    }

    /// The same journal, its events stamped by `clock`.
    pub fn with_clock(mut self, clock: crate::clock::Clock) -> Self {
        self.sinks = Arc::new(sinks::Sinks::new(self.store.clone(), clock.clone()));
        self.clock = clock;
        self
    }

    /// The audit sinks delivering this journal.
    pub fn sinks(&self) -> &Arc<sinks::Sinks> {
        &self.sinks
    }

    /// The clock that stamps this journal's events.
    pub fn clock(&self) -> &crate::clock::Clock {
        &self.clock
    }

    /// The journal's instruments (and the audit sinks' metrics hook,
    /// `set_sink_source`).
    pub fn metrics(&self) -> &Arc<crate::metrics::Audit> {
        &self.metrics
    }

    /// Count an operation's event (and time an effect's, from its intent).
    fn observe(&self, ev: &Event, took: Option<std::time::Duration>) {
        /// A label's value: a value recorded as its digest (a caller's
        /// name that was not valid) is one label, not one per value.
        fn opt(v: &Option<String>) -> &str {
            match v.as_deref() {
                None => "",
                Some(s) if s.starts_with(event::UNSHAPED_PREFIX) || !event::fits(s) => "(invalid)",
                Some(s) => s,
            }
        }
        self.metrics.operations.inc([
            ev.action.as_str(),
            ev.outcome.as_str(),
            opt(&ev.runtime),
            opt(&ev.profile),
        ]);
        if let Some(took) = took
            && let Some(h) = self.metrics.effects.get([
                ev.action.as_str(),
                ev.outcome.as_str(),
                opt(&ev.backend),
            ])
        {
            h.observe_duration(took);
        }
    }

    pub fn mode(&self) -> AuditMode {
        self.mode
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Why the journal cannot take a sandbox effect now, if it cannot.
    pub fn check(&self) -> Result<(), AuditError> {
        if self.mode == AuditMode::BestEffort {
            return Ok(());
        }
        if self.blocked.load(Ordering::SeqCst) {
            return Err(AuditError::Blocked);
        }
        if self.store.failed() {
            return Err(AuditError::Unavailable("a store commit failed".into()));
        }
        Ok(())
    }

    pub fn is_ready(&self) -> bool {
        self.check().is_ok()
    }

    /// Keyed digest of a value, labelled by kind (`command`, `path`, …).
    pub fn digest(&self, kind: &str, value: &[u8]) -> String {
        let mut m = match <Hmac<sha2::Sha256> as Mac>::new_from_slice(&self.key) {
            Ok(m) => m,
            Err(_) => return String::new(),
        };
        m.update(kind.as_bytes());
        m.update(b"\0");
        m.update(value);
        hex::encode(m.finalize().into_bytes())
            .chars()
            .take(32)
            .collect()
    }

    /// A new event with id and timestamp.
    pub fn event(&self, action: Action) -> Event {
        Event {
            event_id: new_id(),
            ts: self.clock.text(),
            action,
            ..Default::default()
        }
    }

    /// Commit an intent (and its pending marker) before an effect.
    pub async fn intent(&self, mut base: Event) -> Result<Intent, AuditError> {
        self.check()?;
        let op = new_id();
        base.operation_id = Some(op.clone());
        let mut ev = base.clone();
        ev.phase = Phase::Intent;
        ev.outcome = Outcome::Pending;
        let op2 = op.clone();
        let r = self
            .store
            .write(move |txn, chain| {
                let ev = chain.append(txn, ev)?;
                journal::put_pending(txn, &op2, ev.seq)
            })
            .await;
        let recorded = match (r, self.mode) {
            (Ok(()), _) => true,
            (Err(e), AuditMode::Required) => return Err(AuditError::Unavailable(e.to_string())),
            (Err(e), AuditMode::BestEffort) => {
                tracing::warn!(error = %e, "best-effort audit: intent not recorded");
                false
            }
        };
        Ok(Intent {
            operation_id: op,
            base,
            started: Instant::now(),
            recorded,
        })
    }

    /// Record the outcome of an intent, together with `state` changes in the
    /// same transaction.
    pub async fn outcome<T: Send + 'static>(
        &self,
        intent: Intent,
        outcome: Outcome,
        fill: impl FnOnce(&mut Event),
        state: impl FnOnce(&crate::store::Wx) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, AuditError> {
        let mut ev = intent.base.clone();
        ev.event_id = new_id();
        ev.ts = self.clock.text();
        ev.phase = Phase::Outcome;
        ev.outcome = outcome.clone();
        let took = intent.started.elapsed();
        ev.duration_ms = Some(u64::try_from(took.as_millis()).unwrap_or(u64::MAX));
        fill(&mut ev);
        self.observe(&ev, Some(took));
        let op = intent.operation_id.clone();
        let recorded = intent.recorded;
        let r = self
            .store
            .write(move |txn, chain| {
                let t = state(txn)?;
                chain.append(txn, ev)?;
                if recorded {
                    journal::remove_pending(txn, &op)?;
                }
                Ok(t)
            })
            .await;
        let e = match r {
            Ok(t) => return Ok(t),
            Err(e) => e,
        };
        // The effect happened and its outcome is not recorded. When the
        // database refused this write alone and undid all of it
        // (`Refused`: its savepoint; the store committed the others), the
        // intent gets an `uncertain` outcome made only of what the intent
        // already recorded, and the journal goes on: one caller's data
        // cannot stop the journal. Anything else — the store failed (a
        // commit, the connection), or a write that may have left part of
        // its state change behind — stops everything, as does a fallback
        // that cannot be written.
        let settled = recorded
            && matches!(e, StoreError::Refused(_))
            && self.settle_unrecorded(&intent, &outcome).await.is_ok();
        if !settled && self.mode == AuditMode::Required {
            self.blocked.store(true, Ordering::SeqCst);
        }
        tracing::error!(
            operation = %intent.operation_id,
            action = %intent.base.action,
            error = %e,
            blocked = !settled && self.mode == AuditMode::Required,
            "an effect's outcome could not be recorded"
        );
        Err(AuditError::Unavailable(e.to_string()))
    }

    /// The outcome of an intent whose own outcome could not be written:
    /// `uncertain`, with `error_code` `unrecorded:<outcome meant>`, and
    /// nothing but the intent's own fields (which the store took once). An
    /// intent no longer pending (its outcome committed after all) is left
    /// alone.
    async fn settle_unrecorded(&self, intent: &Intent, meant: &Outcome) -> Result<(), StoreError> {
        let mut ev = intent.base.clone();
        ev.event_id = new_id();
        ev.ts = self.clock.text();
        ev.phase = Phase::Outcome;
        ev.outcome = Outcome::Uncertain;
        ev.error_code = Some(format!("unrecorded:{meant}"));
        let took = intent.started.elapsed();
        ev.duration_ms = Some(u64::try_from(took.as_millis()).unwrap_or(u64::MAX));
        let op = intent.operation_id.clone();
        self.store
            .write(move |txn, chain| {
                if !journal::pending(txn)?.iter().any(|(o, _)| *o == op) {
                    return Ok(());
                }
                chain.append(txn, ev)?;
                journal::remove_pending(txn, &op)
            })
            .await
    }

    /// A single-step event (a rejection, a read-only action).
    pub async fn record(&self, mut ev: Event) -> Result<(), AuditError> {
        if ev.phase == Phase::Blank {
            ev.phase = Phase::Event;
        }
        self.observe(&ev, None);
        let r = self
            .store
            .write(move |txn, chain| chain.append(txn, ev).map(|_| ()))
            .await;
        match (r, self.mode) {
            (Ok(()), _) => Ok(()),
            (Err(e), AuditMode::Required) => Err(AuditError::Unavailable(e.to_string())),
            (Err(e), AuditMode::BestEffort) => {
                tracing::warn!(error = %e, "best-effort audit: event not recorded");
                Ok(())
            }
        }
    }
}

/// Operation ids with an intent and no outcome that this process answers
/// for: every one, with redb; with replicas on a shared database, its own
/// and those of replicas that are not running (`Store::pending_to_resolve`).
pub fn pending(store: &Store) -> Result<Vec<(String, u64)>, StoreError> {
    store.pending_to_resolve()
}

/// The operations a lease is held by (`Lease::held_by`): sent, with no
/// answer (an MCP call past its timeout). Their intents stay pending on
/// purpose, blocking only their lease, until an operator reconciles them;
/// a restart leaves them so.
pub fn held(store: &Store) -> Result<Vec<String>, StoreError> {
    store.read_now(crate::store::leases::held)
}

/// [`pending`] but for the held operations: the intents a crash left.
pub fn unheld_pending(store: &Store) -> Result<Vec<(String, u64)>, StoreError> {
    let held = held(store)?;
    Ok(pending(store)?
        .into_iter()
        .filter(|(op, _)| !held.contains(op))
        .collect())
}

/// Result of `audit verify`.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Verified {
    pub events: u64,
    pub last_seq: u64,
    pub head: String,
    pub pending: usize,
}

/// Check every event's hash and the links between them (a broken link
/// is `StoreError::Corrupt`, saying where).
pub fn verify(store: &Store) -> Result<Verified, StoreError> {
    let (events, last_seq, head) = store.read_now(verify_chain)?;
    let pending = pending(store)?.len();
    Ok(Verified {
        events,
        last_seq,
        head,
        pending,
    })
}

/// The chain check of `verify` in one read transaction (a backup's copy is
/// checked with it too): the number of events, the last sequence number
/// and the head hash.
pub fn verify_chain(txn: &impl crate::store::ReadOps) -> Result<(u64, u64, String), StoreError> {
    let mut prev = GENESIS.to_string();
    let mut expect = 1u64;
    let mut n = 0u64;
    journal::for_each_event(txn, 0, |seq, ev| {
        if seq != expect || ev.seq != seq {
            return Err(StoreError::Corrupt(format!(
                "sequence gap or mismatch at {seq} (expected {expect})"
            )));
        }
        if ev.prev_hash != prev {
            return Err(StoreError::Corrupt(format!(
                "event {seq}: prev_hash does not match event {}",
                seq - 1
            )));
        }
        if ev.compute_hash() != ev.hash {
            return Err(StoreError::Corrupt(format!(
                "event {seq}: hash does not match its content"
            )));
        }
        prev = ev.hash;
        expect += 1;
        n += 1;
        Ok(())
    })?;
    Ok((n, expect - 1, prev))
}

/// Events with `seq >= since`, in order, in one read transaction (the
/// CLI on a stopped store; the running service reads in batches,
/// [`search::forward`] with an empty query). Each event is handed to `out` as it is read: memory
/// stays flat however long the journal. A failure of `out` is
/// `StoreError::Io`.
pub fn export(
    store: &Store,
    since: u64,
    mut out: impl FnMut(&Event) -> std::io::Result<()>,
) -> Result<u64, StoreError> {
    store.read_now(|txn| {
        let mut n = 0;
        journal::for_each_event(txn, since, |_, ev| {
            out(&ev).map_err(|e| StoreError::Io(e.to_string()))?;
            n += 1;
            Ok(())
        })?;
        Ok(n)
    })
}

/// One exported event as `audit export` prints it: one JSON object, keys
/// sorted (through a `Value`, as the export has always printed them), no
/// newline. Both paths (through the service, on the store) print this.
pub fn export_line(ev: &Event) -> String {
    serde_json::to_value(ev)
        .map(|v| v.to_string())
        .unwrap_or_default()
}

/// The sequence number of the last event (0: none yet).
pub fn last_seq(txn: &impl crate::store::ReadOps) -> Result<u64, StoreError> {
    txn.last_seq()
}

/// Every pending intent, with its event (oldest first).
pub fn pending_intents(store: &Store) -> Result<Vec<(String, Event)>, StoreError> {
    let mine = store.pending_to_resolve()?;
    store.read_now(|txn| {
        let mut v = vec![];
        for (op, seq) in mine {
            if let Some(ev) = journal::event(txn, seq)? {
                v.push((op, ev));
            }
        }
        v.sort_by_key(|(_, e)| e.seq);
        Ok(v)
    })
}

impl Journal {
    /// Resolve one pending intent with `ev` (its outcome, by the system):
    /// appended, and the intent leaves the pending set, in one transaction
    /// with `persist`'s state change.
    pub async fn resolve(
        &self,
        operation_id: &str,
        mut ev: Event,
        persist: impl FnOnce(&crate::store::Wx) -> Result<(), StoreError> + Send + 'static,
    ) -> Result<(), AuditError> {
        ev.phase = Phase::Outcome;
        ev.operation_id = Some(operation_id.to_string());
        let op = operation_id.to_string();
        self.store
            .write(move |txn, chain| {
                persist(txn)?;
                chain.append(txn, ev)?;
                journal::remove_pending(txn, &op)
            })
            .await
            .map_err(|e| AuditError::Unavailable(e.to_string()))
    }

    /// Serve sandbox effects again once no intent is pending.
    pub fn unblock_if_clear(&self) -> bool {
        let clear = unheld_pending(&self.store)
            .map(|p| p.is_empty())
            .unwrap_or(false);
        if clear {
            self.blocked.store(false, Ordering::SeqCst);
        }
        clear
    }
}

/// Why `audit reconcile` stopped.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ReconcileError {
    /// The operation id given has no pending intent.
    #[error("no pending intent with operation id {operation_id}")]
    NotPending { operation_id: String },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Resolve pending intents (offline): each gets a `reconciled` outcome
/// carrying a digest of the operator's note, and leaves the pending set.
pub async fn reconcile(
    journal: &Journal,
    only: Option<&str>,
    note: &str,
) -> Result<Vec<String>, ReconcileError> {
    let all = pending(&journal.store)?;
    let chosen: Vec<(String, u64)> = all
        .into_iter()
        .filter(|(op, _)| only.is_none_or(|o| o == op))
        .collect();
    if let Some(o) = only
        && chosen.is_empty()
    {
        return Err(ReconcileError::NotPending {
            operation_id: o.to_string(),
        });
    }
    let note_digest = journal.digest("note", note.as_bytes());
    let mut done = vec![];
    for (op, seq) in chosen {
        let intent: Event = journal
            .store
            .read_now(|txn| journal::event(txn, seq)?.ok_or(StoreError::NotFound))?;
        let mut ev = journal.event(Action::AuditReconcile);
        ev.phase = Phase::Outcome;
        ev.outcome = Outcome::Reconciled;
        ev.operation_id = Some(op.clone());
        ev.runtime = Some("admin".into());
        ev.lease_ref = intent.lease_ref.clone();
        ev.sandbox_ref = intent.sandbox_ref.clone();
        ev.note_digest = Some(note_digest.clone());
        ev.error_code = Some(format!("reconciled:{}", intent.action));
        let op2 = op.clone();
        let lease_ref = intent.lease_ref.clone();
        journal
            .store
            .write(move |txn, chain| {
                chain.append(txn, ev)?;
                journal::remove_pending(txn, &op2)?;
                // A held lease serves again.
                if let Some(l) = &lease_ref {
                    crate::store::leases::unhold(txn, l, &op2)?;
                }
                Ok(())
            })
            .await?;
        done.push(op);
    }
    if unheld_pending(&journal.store)
        .map(|p| p.is_empty())
        .unwrap_or(false)
    {
        journal.blocked.store(false, Ordering::SeqCst);
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::ReadOps;

    /// An outcome that only its own write failed to record (its state
    /// change refused; the store is fine) gets an `uncertain` outcome and
    /// leaves the journal serving; one the store could not take blocks it
    /// (#34, H2).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_refused_outcome_is_settled_and_a_lost_one_blocks() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let j = Journal::open(store.clone(), AuditMode::Required, vec![7; 32]).unwrap();

        let intent = j.intent(j.event(Action::Exec)).await.unwrap();
        let op = intent.operation_id.clone();
        // A write the store refused and undid alone (what the PostgreSQL
        // store answers for a statement it refuses: its savepoint).
        let r = j
            .outcome(
                intent,
                Outcome::Ok,
                |_| {},
                |_| Err::<(), _>(StoreError::Refused("refused".into())),
            )
            .await;
        assert!(r.is_err());
        j.check()
            .expect("one refused write does not block the journal");
        assert!(pending(&store).unwrap().is_empty());
        let last = store
            .read_now(|t| {
                let n = t.last_seq()?;
                journal::event(t, n)
            })
            .unwrap()
            .unwrap();
        assert_eq!(last.operation_id.as_deref(), Some(op.as_str()));
        assert_eq!(
            (last.phase, last.outcome),
            (Phase::Outcome, Outcome::Uncertain)
        );
        assert_eq!(last.error_code.as_deref(), Some("unrecorded:ok"));
        assert_eq!(verify(&store).unwrap().events, 2);

        // The next effect goes through as usual.
        let intent = j.intent(j.event(Action::Exec)).await.unwrap();
        j.outcome(intent, Outcome::Ok, |_| {}, |_| Ok(()))
            .await
            .unwrap();

        // A state change that failed part way (redb has no per-write undo:
        // what it wrote may stay): not settled, it blocks.
        let intent = j.intent(j.event(Action::Exec)).await.unwrap();
        let r = j
            .outcome(
                intent,
                Outcome::Ok,
                |_| {},
                |_| Err::<(), _>(StoreError::Conflict("half done".into())),
            )
            .await;
        assert!(r.is_err());
        assert!(matches!(j.check(), Err(AuditError::Blocked)));
        j.blocked.store(false, Ordering::SeqCst);

        // The store itself fails: the outcome is lost, and that blocks.
        let intent = j.intent(j.event(Action::Exec)).await.unwrap();
        store.close().await;
        let r = j.outcome(intent, Outcome::Ok, |_| {}, |_| Ok(())).await;
        assert!(r.is_err());
        assert!(matches!(j.check(), Err(AuditError::Blocked)));
    }
}
