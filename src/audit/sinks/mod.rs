//! Audit delivery (`[[audit.sinks]]`, docs/operations.md "Audit delivery").
//!
//! The journal in the store is the authority; a sink is a reader of it. Each
//! sink runs as its own task: it waits for the journal's head to pass its
//! cursor, reads the next batch (in `seq` order), delivers it, and moves its
//! cursor (`sink_cursors_v1`) only after the delivery was acknowledged. So
//! delivery is at-least-once, in journal order, and resumes after a restart;
//! a receiver dedupes by `event_id`. Nothing on the request path waits for a
//! sink: a slow or dead one only falls behind (its lag and failures are in
//! `status`, the console overview and the metrics).
//!
//! Cursors are written at most once a second per sink (and when the sink
//! stops), not once per delivery: a crash redelivers at most that second's
//! events, and a busy journal does not pay a commit per sink per batch. A
//! shutdown lets the sinks catch up with the journal before it stops them
//! (`Sinks::stop`), and closes the store only after they wrote their
//! cursors (`app::Running::shutdown`).

pub mod def;
mod outputs;

pub use outputs::OutputError;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::store::{ReadOps, WriteOps};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use self::outputs::{Failure, Output};
use crate::audit::event::Event;
use crate::audit::sinks::def::{From, SinkDef};
use crate::store::{Store, StoreError};

/// How often a sink's cursor is written at most.
const PERSIST_EVERY: Duration = Duration::from_secs(1);

/// How long a sink waits for a partial batch to fill before delivering it.
const LINGER: Duration = Duration::from_millis(50);

/// The first wait after a failure; it doubles up to the sink's maximum.
const FIRST_BACKOFF: Duration = Duration::from_millis(500);

/// The longest wait for the file and stdout sinks (a full disk).
const LOCAL_MAX_BACKOFF: Duration = Duration::from_secs(5);

/// What a sink has done, for `status`, the console and the metrics.
#[derive(Debug, Default)]
struct Progress {
    /// The `seq` of the last event delivered.
    cursor: AtomicU64,
    delivered: AtomicU64,
    failures: AtomicU64,
    /// Failures since the last delivery.
    consecutive: AtomicU64,
    last_error: std::sync::Mutex<Option<String>>,
    last_delivery: std::sync::Mutex<Option<String>>,
    /// Events the receiver refused even alone, skipped.
    quarantined: AtomicU64,
    last_quarantined: std::sync::Mutex<Option<String>>,
}

/// One sink's state, as reported.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct SinkStatus {
    pub name: String,
    pub kind: &'static str,
    /// `seq` of the last event delivered (0: none).
    pub cursor: u64,
    /// Events in the journal the sink has not delivered yet.
    pub lag: u64,
    /// Events delivered since the service started.
    pub delivered: u64,
    /// Failed deliveries since the service started.
    pub failures: u64,
    /// Failed deliveries since the last one that succeeded.
    pub consecutive_failures: u64,
    pub last_error: Option<String>,
    pub last_delivery_at: Option<String>,
    /// Events the receiver refused even when sent alone (a datagram too
    /// long for the socket, HTTP 413), skipped so that the sink goes on;
    /// since the service started. `audit export --since` gives them.
    pub quarantined: u64,
    /// The last one: its `seq` and why.
    pub last_quarantined: Option<String>,
    /// `ok`, `behind` (lagging, no failure), or `failing`.
    pub state: &'static str,
}

struct Worker {
    def: SinkDef,
    progress: Arc<Progress>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

/// The running sinks. Cheap to share (`Arc`); empty until `start`.
pub struct Sinks {
    store: Store,
    clock: crate::clock::Clock,
    running: std::sync::Mutex<Running>,
}

#[derive(Default)]
struct Running {
    /// Set by `start`: the service's stop, parent of every worker's.
    stop: Option<CancellationToken>,
    rt: Option<tokio::runtime::Handle>,
    workers: BTreeMap<String, Worker>,
}

/// Why sinks could not be prepared: a start or a reload refuses them.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// The definitions do not hold together (`def::validate`).
    #[error(transparent)]
    Invalid(#[from] def::SinkError),
    /// One sink's files or client.
    #[error("audit sink '{name}': {source}")]
    Sink {
        name: String,
        #[source]
        source: OutputError,
    },
}

/// Sinks checked and built, ready to replace the running ones
/// (`Sinks::prepare`, then `Sinks::apply`: a refused reload changes
/// nothing).
pub struct Prepared {
    start: Vec<(SinkDef, Output)>,
    keep: Vec<String>,
}

impl Sinks {
    pub fn new(store: Store, clock: crate::clock::Clock) -> Self {
        Self {
            store,
            clock,
            running: std::sync::Mutex::new(Running::default()),
        }
    }

    fn running(&self) -> std::sync::MutexGuard<'_, Running> {
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Check and build `defs` (files read, clients made); the sinks whose
    /// definition is unchanged keep running as they are.
    pub fn prepare(&self, defs: &[SinkDef]) -> Result<Prepared, SinkError> {
        crate::audit::sinks::def::validate(defs)?;
        let r = self.running();
        let mut start = vec![];
        let mut keep = vec![];
        for d in defs {
            match r.workers.get(d.name()) {
                Some(w) if &w.def == d => keep.push(d.name().to_string()),
                _ => start.push((d.clone(), Output::prepare(d)?)),
            }
        }
        Ok(Prepared { start, keep })
    }

    /// Start delivering (at service start), under `stop`.
    pub fn start(&self, prepared: Prepared, stop: CancellationToken) -> Vec<String> {
        {
            let mut r = self.running();
            r.stop = Some(stop);
            r.rt = tokio::runtime::Handle::try_current().ok();
        }
        self.apply(prepared)
    }

    /// Replace the running sinks with `prepared`'s: a removed sink stops
    /// (its cursor stays in the store: added again under its name, it
    /// resumes), a changed one restarts from its cursor once the old one
    /// has stopped. Returns what changed, for the reload's report.
    pub fn apply(&self, prepared: Prepared) -> Vec<String> {
        let mut r = self.running();
        let (Some(stop), Some(rt)) = (r.stop.clone(), r.rt.clone()) else {
            return vec![];
        };
        let mut changed = vec![];
        let names: Vec<String> = r.workers.keys().cloned().collect();
        let mut old: BTreeMap<String, tokio::task::JoinHandle<()>> = BTreeMap::new();
        for n in names {
            if prepared.keep.contains(&n) {
                continue;
            }
            if let Some(w) = r.workers.remove(&n) {
                w.stop.cancel();
                if !prepared.start.iter().any(|(d, _)| d.name() == n) {
                    tracing::info!(sink = %n, "audit sink removed (its cursor is kept)");
                    changed.push(format!("audit sink '{n}' removed"));
                }
                old.insert(n, w.task);
            }
        }
        for (def, out) in prepared.start {
            let name = def.name().to_string();
            let progress = Arc::new(Progress::default());
            let wstop = stop.child_token();
            let before = old.remove(&name);
            changed.push(format!(
                "audit sink '{name}' {}",
                if before.is_some() {
                    "replaced"
                } else {
                    "started"
                }
            ));
            let run = Run {
                def: def.clone(),
                out,
                progress: progress.clone(),
                store: self.store.clone(),
                clock: self.clock.clone(),
                stop: wstop.clone(),
            };
            let task = rt.spawn(async move {
                if let Some(h) = before {
                    let _ = h.await;
                }
                run.run().await;
            });
            r.workers.insert(
                name,
                Worker {
                    def,
                    progress,
                    stop: wstop,
                    task,
                },
            );
        }
        changed
    }

    /// Stop every sink: first let them deliver what the journal holds (for
    /// up to half of `grace`; a sink that is failing, or a replica's that
    /// does not hold the background turn, is not waited for: the next
    /// start delivers from its cursor), then stop them and wait (for the
    /// rest of `grace`) for each to write its cursor.
    pub async fn stop(&self, grace: Duration) {
        let until = Instant::now() + grace / 2;
        let turn = self.store.turn();
        while *turn.borrow()
            && Instant::now() < until
            && self
                .status()
                .iter()
                .any(|s| s.lag > 0 && s.consecutive_failures == 0)
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let grace = until
            .saturating_duration_since(Instant::now())
            .saturating_add(grace / 2);
        let tasks: Vec<_> = {
            let mut r = self.running();
            std::mem::take(&mut r.workers)
                .into_values()
                .map(|w| {
                    w.stop.cancel();
                    w.task
                })
                .collect()
        };
        let _ = tokio::time::timeout(grace, futures_util::future::join_all(tasks)).await;
    }

    /// Each running sink's state, by name.
    pub fn status(&self) -> Vec<SinkStatus> {
        let head = *self.store.last_seq().borrow();
        let r = self.running();
        r.workers.values().map(|w| w.status(head)).collect()
    }
}

impl Worker {
    fn status(&self, head: u64) -> SinkStatus {
        let p = &self.progress;
        let cursor = p.cursor.load(Ordering::Relaxed);
        let lag = head.saturating_sub(cursor);
        let consecutive = p.consecutive.load(Ordering::Relaxed);
        SinkStatus {
            name: self.def.name().to_string(),
            kind: self.def.kind(),
            cursor,
            lag,
            delivered: p.delivered.load(Ordering::Relaxed),
            failures: p.failures.load(Ordering::Relaxed),
            consecutive_failures: consecutive,
            last_error: p
                .last_error
                .lock()
                .unwrap_or_else(|x| x.into_inner())
                .clone(),
            last_delivery_at: p
                .last_delivery
                .lock()
                .unwrap_or_else(|x| x.into_inner())
                .clone(),
            quarantined: p.quarantined.load(Ordering::Relaxed),
            last_quarantined: p
                .last_quarantined
                .lock()
                .unwrap_or_else(|x| x.into_inner())
                .clone(),
            state: if consecutive > 0 {
                "failing"
            } else if lag > 0 {
                "behind"
            } else {
                "ok"
            },
        }
    }
}

/// The cursors kept in the store (the stopped service's `status`).
pub fn stored_cursors(txn: &impl ReadOps) -> Result<BTreeMap<String, u64>, StoreError> {
    txn.cursors()
}

/// Move a cursor forward (never back: a replaced sink's last write may
/// come after its successor's).
fn put_cursor(txn: &impl WriteOps, name: &str, seq: u64) -> Result<(), StoreError> {
    let cur = txn.cursors()?.get(name).copied().unwrap_or(0);
    if seq > cur {
        txn.put_cursor(name, seq)?;
    }
    Ok(())
}

/// Up to `n` events after `cursor`, in order.
fn read_batch(txn: &impl ReadOps, cursor: u64, n: usize) -> Result<Vec<Event>, StoreError> {
    Ok(txn
        .events(cursor.saturating_add(1), n)?
        .into_iter()
        .map(|(_, ev)| ev)
        .collect())
}

/// One sink's task.
struct Run {
    def: SinkDef,
    out: Output,
    progress: Arc<Progress>,
    store: Store,
    clock: crate::clock::Clock,
    stop: CancellationToken,
}

/// Deliver a batch, then the recordings its `recording_sealed` events
/// seal (the sinks that carry files): the cursor moves past the batch
/// only once both are delivered, so a recording is delivered at least
/// once and resumes after a restart. A recording whose file is not on
/// this disk (retention removed it, or another replica holds it) is
/// skipped, and said so.
async fn deliver(
    out: &mut Output,
    store: &Store,
    name: &str,
    batch: &[Event],
) -> Result<(), Failure> {
    out.deliver(batch).await?;
    let dir = store
        .path()
        .parent()
        .map(|d| d.join(crate::store::recordings::DIR));
    for ev in batch {
        if ev.action != crate::audit::event::Action::RecordingSealed {
            continue;
        }
        let (Some(r), Some(dir)) = (ev.recording_ref.as_deref(), dir.as_ref()) else {
            continue;
        };
        let path = dir.join(format!("{r}.cast"));
        if !path.exists() {
            tracing::warn!(
                sink = name,
                recording = r,
                "audit sink: a sealed recording's file is not on this disk; not delivered"
            );
            continue;
        }
        let sha = ev.content_sha256.as_deref().unwrap_or_default();
        out.deliver_recording(r, &path, sha).await?;
    }
    Ok(())
}

impl Run {
    async fn run(mut self) {
        let name = self.def.name().to_string();
        let mut head_rx = self.store.last_seq();
        let cursor = match self.first_cursor(&name).await {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(sink = %name, error = %e, "audit sink cannot read its cursor; not delivering");
                self.failed(&format!("cursor: {e}"));
                return;
            }
        };
        self.progress.cursor.store(cursor, Ordering::Relaxed);
        let mut persisted = cursor;
        let mut last_persist = Instant::now();
        let mut backoff = FIRST_BACKOFF;
        let mut lingered = false;
        // After a batch the receiver refused as a whole, its events go one
        // at a time up to this `seq`, so that one it cannot take is found
        // and quarantined and the others are delivered.
        let mut alone_until = 0u64;
        let max_backoff = match &self.def {
            SinkDef::Http(h) => Duration::from_secs(h.max_backoff_seconds),
            SinkDef::Syslog(s) => Duration::from_secs(s.max_backoff_seconds),
            _ => LOCAL_MAX_BACKOFF,
        };
        tracing::info!(sink = %name, kind = self.def.kind(), cursor, "audit sink delivering");
        // With replicas on a shared database, the one holding the
        // background turn delivers; the others wait for it, and start again
        // from the stored cursor (the one that delivered moved it).
        let mut turn = self.store.turn();
        loop {
            if !*turn.borrow_and_update() {
                let c = self.progress.cursor.load(Ordering::Relaxed);
                if c > persisted && self.persist(&name, c).await {
                    persisted = c;
                }
                let got = tokio::select! {
                    () = self.stop.cancelled() => break,
                    r = turn.wait_for(|t| *t) => r.is_ok(),
                };
                if !got {
                    break;
                }
                match self.first_cursor(&name).await {
                    Ok(c) => {
                        self.progress.cursor.store(c, Ordering::Relaxed);
                        persisted = c;
                    }
                    Err(e) => {
                        self.failed(&format!("cursor: {e}"));
                        if self.pause(&mut backoff, max_backoff).await {
                            break;
                        }
                    }
                }
                continue;
            }
            let cursor = self.progress.cursor.load(Ordering::Relaxed);
            if cursor > persisted && last_persist.elapsed() >= PERSIST_EVERY {
                if self.persist(&name, cursor).await {
                    persisted = cursor;
                }
                last_persist = Instant::now();
            }
            let head = *head_rx.borrow_and_update();
            if head <= cursor {
                // Caught up: wait for the journal (or the next cursor write).
                let wait = if cursor > persisted {
                    PERSIST_EVERY.saturating_sub(last_persist.elapsed())
                } else {
                    Duration::from_secs(3600)
                };
                tokio::select! {
                    () = self.stop.cancelled() => break,
                    r = head_rx.changed() => if r.is_err() { break },
                    r = turn.changed() => if r.is_err() { break },
                    () = tokio::time::sleep(wait) => {}
                }
                continue;
            }
            // Less than a batch waiting: give the journal a moment to add
            // to it, so that a busy journal costs a sink one delivery (one
            // fsync, one POST) per batch rather than one per event.
            if !lingered && cursor >= alone_until && head - cursor < self.def.batch() as u64 {
                lingered = true;
                tokio::select! {
                    () = self.stop.cancelled() => break,
                    () = tokio::time::sleep(LINGER) => {}
                }
                continue;
            }
            lingered = false;
            let batch = {
                let n = if cursor < alone_until {
                    1
                } else {
                    self.def.batch()
                };
                match self.store.read(move |txn| read_batch(txn, cursor, n)).await {
                    Ok(b) => b,
                    Err(e) => {
                        self.failed(&format!("read the journal: {e}"));
                        if self.pause(&mut backoff, max_backoff).await {
                            break;
                        }
                        continue;
                    }
                }
            };
            let Some(last) = batch.last().map(|e| e.seq) else {
                continue;
            };
            let delivered = tokio::select! {
                () = self.stop.cancelled() => break,
                r = deliver(&mut self.out, &self.store, &name, &batch) => r,
            };
            match delivered {
                Ok(()) => {
                    let p = &self.progress;
                    p.cursor.store(last, Ordering::Relaxed);
                    p.delivered.fetch_add(batch.len() as u64, Ordering::Relaxed);
                    p.consecutive.store(0, Ordering::Relaxed);
                    *p.last_delivery.lock().unwrap_or_else(|x| x.into_inner()) =
                        Some(self.clock.text());
                    backoff = FIRST_BACKOFF;
                }
                Err(Failure::Refused(e)) if batch.len() > 1 => {
                    tracing::warn!(sink = %name, error = %e, first = cursor + 1, last, "audit sink: the receiver refused a batch; sending its events one at a time");
                    alone_until = last;
                }
                Err(Failure::Refused(e)) => {
                    // Alone and still refused: no retry can deliver it.
                    // Skip it, say so, and go on with the rest.
                    tracing::error!(sink = %name, seq = last, error = %e, "audit sink: the receiver refuses this event; it is quarantined (skipped; `cube-adapter audit export --since` has it)");
                    let p = &self.progress;
                    p.cursor.store(last, Ordering::Relaxed);
                    p.quarantined.fetch_add(1, Ordering::Relaxed);
                    p.consecutive.store(0, Ordering::Relaxed);
                    *p.last_quarantined.lock().unwrap_or_else(|x| x.into_inner()) =
                        Some(format!("event {last}: {e}"));
                    backoff = FIRST_BACKOFF;
                }
                Err(Failure::Retry(e)) => {
                    if self.progress.consecutive.load(Ordering::Relaxed) == 0 {
                        tracing::warn!(sink = %name, error = %e, "audit sink delivery failed; retrying with backoff");
                    }
                    self.failed(&e.to_string());
                    if self.pause(&mut backoff, max_backoff).await {
                        break;
                    }
                }
            }
        }
        let cursor = self.progress.cursor.load(Ordering::Relaxed);
        if cursor > persisted {
            self.persist(&name, cursor).await;
        }
    }

    /// The stored cursor; a new sink starts at 0 or (`from = "now"`) at
    /// the head, written at once.
    async fn first_cursor(&self, name: &str) -> Result<u64, StoreError> {
        let n = name.to_string();
        let stored = self
            .store
            .read(move |txn| Ok(stored_cursors(txn)?.get(&n).copied()))
            .await?;
        if let Some(c) = stored {
            return Ok(c);
        }
        match self.def.from() {
            From::Start => Ok(0),
            From::Now => {
                let head = *self.store.last_seq().borrow();
                let n = name.to_string();
                self.store
                    .write(move |txn, _| put_cursor(txn, &n, head))
                    .await?;
                Ok(head)
            }
        }
    }

    async fn persist(&self, name: &str, cursor: u64) -> bool {
        let n = name.to_string();
        match self
            .store
            .write(move |txn, _| put_cursor(txn, &n, cursor))
            .await
        {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(sink = %name, error = %e, "audit sink cursor not written (delivery goes on; a restart redelivers)");
                false
            }
        }
    }

    fn failed(&self, e: &str) {
        let p = &self.progress;
        p.failures.fetch_add(1, Ordering::Relaxed);
        p.consecutive.fetch_add(1, Ordering::Relaxed);
        *p.last_error.lock().unwrap_or_else(|x| x.into_inner()) = Some(e.to_string());
    }

    /// Wait out a backoff with jitter (between half of it and all of it);
    /// true when the sink is stopping.
    async fn pause(&self, backoff: &mut Duration, max: Duration) -> bool {
        let ms = u64::try_from(backoff.as_millis())
            .unwrap_or(u64::MAX)
            .max(2);
        let wait = Duration::from_millis(rand::random_range(ms / 2..=ms));
        *backoff = (*backoff * 2).min(max);
        tokio::select! {
            () = self.stop.cancelled() => true,
            () = tokio::time::sleep(wait) => false,
        }
    }
}
