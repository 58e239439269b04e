//! Interactive terminals (reference rows 24–29).
//!
//! The appliance holds each PTY's output stream and keeps the last
//! `RETAIN` bytes in memory with absolute offsets, so any number of viewers
//! can watch one PTY and a viewer that reconnects resumes from its cursor
//! without loss (within what is retained; an older cursor is told exactly
//! which bytes it missed). The shell lives in the sandbox: after an
//! appliance restart the appliance re-attaches to a PTY that was running
//! (its viewers start again from offset 0, and its recording goes on, with
//! a marker for the time it was down); one it cannot re-attach to is
//! `lost` (nothing re-runs). Every PTY is recorded (`recordings`).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use super::dto::{self, PtyAnswer};
use super::leases::{Done, Lease, Visible, new_ref, valid_ref};
use super::recordings::{Recorder, Stream};
use super::{Broker, Code, Ctx, Error, Result, error::backend};
use crate::audit::event::{Action, Outcome};
use crate::auth::Principal;
use crate::cube::envd::decode_data;
use crate::cube::wire::{ProcessEvent, PtySize};
use crate::cube::{ErrorKind, StartOptions};
use crate::store::{self, StoreError};

/// Output kept per PTY for viewers that connect or reconnect later.
pub const RETAIN: usize = 1024 * 1024;
/// Largest input in one call (reference: 256 KiB).
pub const MAX_INPUT: usize = 256 * 1024;

pub use crate::store::ptys::{Pty, PtyState};

pub(crate) use crate::store::ptys::put as put_pty;

/// Save a change to a PTY against the record as it is now: an ended PTY
/// never goes back to `running` (a resize racing the end keeps the end).
fn save_pty(txn: &crate::store::Wx, seen: &Pty) -> std::result::Result<(), StoreError> {
    let Some(current) = store::ptys::get(txn, &seen.pty_ref)? else {
        return Ok(());
    };
    let mut p = seen.clone();
    // A state recorded first stands, but for a kill: its own signal may end
    // the process and the pump record `exited` before the kill is saved;
    // the PTY was still killed (`cancelled`, as the kill answered).
    let killed_first = seen.state == PtyState::Cancelled && current.state == PtyState::Exited;
    if !current.is_running() && !killed_first {
        p.state = current.state;
        p.exit_code = current.exit_code;
    }
    put_pty(txn, &p)
}

/// A lease's PTYs.
pub(crate) fn lease_ptys(
    txn: &crate::store::Rx,
    lease_ref: &str,
) -> std::result::Result<Vec<Pty>, StoreError> {
    store::ptys::of_lease(txn, lease_ref)
}

/// Remove a lease's PTY records.
pub(crate) fn delete_lease_ptys(
    txn: &crate::store::Wx,
    lease_ref: &str,
) -> std::result::Result<(), StoreError> {
    store::ptys::remove_lease(txn, lease_ref)
}

/// The PTYs recorded as running that this process answers for: with redb,
/// all; with replicas on a shared database, its own and those of replicas
/// that are not running.
fn ours_running(store: &crate::store::Store) -> std::result::Result<Vec<Pty>, StoreError> {
    let running: Vec<Pty> = store.read_now(|txn| {
        let mut all = crate::store::ptys::all(txn)?;
        all.retain(Pty::is_running);
        Ok(all)
    })?;
    let mut keep = Vec::with_capacity(running.len());
    for p in running {
        let ours = match &p.replica {
            Some(r) => !store.replica_running(r)? || store.replica() == Some(r.as_str()),
            None => true,
        };
        if ours {
            keep.push(p);
        }
    }
    Ok(keep)
}

/// Record PTYs `lost` (their terminal could not be re-attached).
async fn mark_lost(
    store: &crate::store::Store,
    clock: &crate::clock::Clock,
    lost: Vec<Pty>,
) -> std::result::Result<(), StoreError> {
    if lost.is_empty() {
        return Ok(());
    }
    let ts = clock.text();
    store
        .write(move |txn, _| {
            for mut p in lost {
                // Only one still recorded as running (a kill may have won).
                if store::ptys::get(txn, &p.pty_ref)?.is_some_and(|c| c.is_running()) {
                    p.state = PtyState::Lost;
                    p.updated_at = ts.clone();
                    put_pty(txn, &p)?;
                }
            }
            Ok(())
        })
        .await
}

/// How long a start keeps trying to re-attach a PTY (its backend may still
/// be coming up).
const REATTACH_FOR: std::time::Duration = std::time::Duration::from_secs(15);

/// The output of one PTY, shared by its reader task and its viewers.
pub struct Hub {
    inner: Mutex<Buf>,
    /// The total bytes produced so far (and the end), for waiting viewers.
    pub tick: tokio::sync::watch::Sender<u64>,
}

struct Buf {
    /// Absolute offset of `data[0]`.
    start: u64,
    data: VecDeque<u8>,
    ended: bool,
}

/// What a viewer gets from `Hub::read`.
pub struct Chunk {
    /// Bytes before `from` that were no longer retained (`(from, to)`).
    pub missed: Option<(u64, u64)>,
    pub from: u64,
    pub bytes: Vec<u8>,
    pub ended: bool,
}

impl Hub {
    fn new() -> Arc<Self> {
        let (tick, _) = tokio::sync::watch::channel(0);
        Arc::new(Self {
            inner: Mutex::new(Buf {
                start: 0,
                data: VecDeque::new(),
                ended: false,
            }),
            tick,
        })
    }

    fn push(&self, b: &[u8]) {
        let total = {
            let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            g.data.extend(b);
            while g.data.len() > RETAIN {
                let drop = g.data.len() - RETAIN;
                g.data.drain(..drop);
                g.start += drop as u64;
            }
            g.start + g.data.len() as u64
        };
        self.tick.send_replace(total);
    }

    fn end(&self) {
        let total = {
            let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            g.ended = true;
            g.start + g.data.len() as u64
        };
        // A change of value wakes viewers even with no new bytes.
        self.tick.send_replace(total.wrapping_add(1u64 << 63));
    }

    /// Up to `max` bytes from `from`.
    pub fn read(&self, from: u64, max: usize) -> Chunk {
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let end = g.start + g.data.len() as u64;
        let (missed, from) = if from < g.start {
            (Some((from, g.start)), g.start)
        } else {
            (None, from.min(end))
        };
        let skip = usize::try_from(from - g.start).unwrap_or(usize::MAX);
        let bytes: Vec<u8> = g.data.iter().skip(skip).take(max).copied().collect();
        let ended = g.ended && from + bytes.len() as u64 >= end;
        Chunk {
            missed,
            from,
            bytes,
            ended,
        }
    }
}

/// The hubs of the PTYs this process runs.
#[derive(Default)]
pub struct Hubs(Mutex<HashMap<String, Arc<Hub>>>);

impl Hubs {
    pub fn get(&self, pty_ref: &str) -> Option<Arc<Hub>> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(pty_ref)
            .cloned()
    }

    fn insert(&self, pty_ref: &str, h: Arc<Hub>) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(pty_ref.to_string(), h);
    }

    fn remove(&self, pty_ref: &str) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(pty_ref);
    }
}

fn check_size(rows: u32, cols: u32) -> Result<()> {
    if (1..=1000).contains(&rows) && (1..=1000).contains(&cols) {
        Ok(())
    } else {
        Err(Error::new(
            Code::InvalidPtySize,
            "rows and cols must be integers in 1..=1000",
        ))
    }
}

impl Broker {
    /// The PTY as recorded (event streams read it for the final status).
    pub(crate) fn get_pty(&self, pty_ref: &str) -> Result<Option<Pty>> {
        Ok(self
            .inner
            .store
            .read_now(|txn| store::ptys::get(txn, pty_ref))?)
    }

    /// The PTY and its lease, if the principal may see them; otherwise
    /// exactly what a missing PTY answers.
    /// Its lease's profile and runtime must be the identity's too
    /// ([`Broker::usable`]; a refusal is recorded with `ev`).
    async fn owned_pty(
        &self,
        p: &Principal,
        pty_ref: &str,
        ev: &crate::audit::event::Event,
    ) -> Result<(Pty, Lease)> {
        let missing = || Error::new(Code::PtyNotFound, "no such PTY");
        if !valid_ref(pty_ref, "pty") {
            return Err(missing());
        }
        // Whose it is follows the lease it runs on.
        let pty = self.get_pty(pty_ref)?.ok_or_else(missing)?;
        let lease = self
            .get_lease(&pty.lease_ref)
            .await?
            .filter(|l| l.visible_to(p))
            .ok_or_else(missing)?;
        self.usable(p, &lease, ev).await?;
        Ok((pty, lease))
    }

    /// Running PTYs of a lease (they count against `max_jobs_per_lease`).
    pub(crate) fn running_ptys(&self, lease_ref: &str) -> Result<u32> {
        let ptys = self
            .inner
            .store
            .read_now(|txn| lease_ptys(txn, lease_ref))?;
        Ok(ptys.iter().filter(|p| p.is_running()).count() as u32)
    }

    /// At start: re-attach to the PTYs an earlier run of the appliance
    /// left running (their shells live in the sandbox), so that their
    /// viewers and recordings go on; output they made while the appliance
    /// was down is not seen (their recording says so). A PTY whose sandbox
    /// or process is gone, or that cannot be re-attached within
    /// `REATTACH_FOR`, is `lost`. Returns (re-attached, lost).
    pub async fn resume_ptys(&self) -> std::result::Result<(usize, usize), StoreError> {
        let running = ours_running(&self.inner.store)?;
        let mut lost = vec![];
        let mut back = 0;
        for pty in running {
            match self.reattach(&pty).await {
                Ok(()) => back += 1,
                Err(e) => {
                    tracing::warn!(pty = %pty.pty_ref, error = %e.message, "a PTY of the previous run cannot be re-attached: lost");
                    lost.push(pty);
                }
            }
        }
        let n = lost.len();
        mark_lost(&self.inner.store, &self.inner.clock, lost).await?;
        Ok((back, n))
    }

    async fn reattach(&self, pty: &Pty) -> Result<()> {
        let l = self
            .get_lease(&pty.lease_ref)
            .await?
            .ok_or_else(|| Error::new(Code::LeaseNotFound, "its lease is gone"))?;
        let until = std::time::Instant::now() + REATTACH_FOR;
        let stream = loop {
            let tried = match self.addr(&l) {
                Ok(addr) => addr
                    .cube
                    .connect_process(&addr, pty.pid)
                    .await
                    .map_err(|e| backend(&e)),
                Err(e) => Err(e),
            };
            match tried {
                Ok(s) => break s,
                Err(e) if std::time::Instant::now() >= until => return Err(e),
                Err(_) => tokio::time::sleep(std::time::Duration::from_secs(1)).await,
            }
        };
        let rec = if self.records(&l.profile) {
            Some(self.reattach_recording(pty, &l).await?)
        } else {
            None
        };
        let hub = Hub::new();
        self.inner.ptys.insert(&pty.pty_ref, hub.clone());
        self.pump(pty.pty_ref.clone(), stream, hub, rec);
        Ok(())
    }

    /// The recording a re-attached PTY goes on with.
    async fn reattach_recording(&self, pty: &Pty, l: &Lease) -> Result<Recorder> {
        let rec = match self.recording_of(&pty.lease_ref, &pty.pty_ref) {
            Some(r) if r.state == super::recordings::RecordingState::Open => {
                match self.reopen_recording(r, Some(l)).await {
                    Ok(rec) => rec,
                    Err(e) => {
                        return Err(Error::new(
                            Code::AuditUnavailable,
                            format!("its recording cannot be reopened: {e}"),
                        ));
                    }
                }
            }
            // Started before recordings, or sealed: a new one.
            _ => {
                let (rec, record) = self
                    .begin_recording(
                        super::recordings::RecordingKind::Pty,
                        l,
                        &pty.pty_ref,
                        (pty.cols, pty.rows),
                    )
                    .map_err(|e| Error::new(Code::AuditUnavailable, e.to_string()))?;
                self.inner
                    .store
                    .write(move |txn, _| crate::store::recordings::put(txn, &record))
                    .await?;
                rec
            }
        };
        rec.marker(
            "the appliance restarted; output from while it was down is not in this recording",
        )
        .await;
        Ok(rec)
    }

    /// `POST /v1/leases/{ref}/ptys` (201).
    pub async fn create_pty(
        &self,
        p: &Principal,
        ctx: &Ctx,
        lease_ref: &str,
        rows: u32,
        cols: u32,
        cwd: Option<&str>,
    ) -> Result<PtyAnswer> {
        check_size(rows, cols)?;
        let cwd = match cwd {
            Some(c) => self.checked_path(p, ctx, &Action::PtyCreate, c).await?,
            None => "/workspace".to_string(),
        };
        let ev = self.event(p, Action::PtyCreate, ctx);
        self.authorize(p, "pty:create", &ev).await?;
        let l = self.owned_lease(p, lease_ref, &ev).await?;
        if !self.profile(&l.profile).is_some_and(|pr| pr.ptys_enabled) {
            return Err(self
                .reject(
                    self.lease_event(p, Action::PtyCreate, ctx, &l),
                    Error::new(
                        Code::ActionDenied,
                        format!("PTYs are not enabled for profile {}", l.profile),
                    ),
                )
                .await);
        }
        let (l, lock) = self.relock(p, l).await?;
        let prof = self.profile(&l.profile).unwrap_or_default();
        let tenant = l.tenant.clone();
        let pty_ref = new_ref("pty");
        let (l, pty) = self
            .effect_on(
                p,
                ctx,
                l,
                Action::PtyCreate,
                |_| {},
                Some(lock),
                move |b: Broker, l: Lease, addr| async move {
                    let busy =
                        b.running_jobs(&addr, &l.lease_ref).await? + b.running_ptys(&l.lease_ref)?;
                    if busy >= prof.max_jobs_per_lease {
                        return Err(Error::new(
                            Code::JobQuotaExceeded,
                            format!(
                                "this lease already runs {busy} jobs or PTYs (the profile allows {})",
                                prof.max_jobs_per_lease
                            ),
                        ));
                    }
                    let mut o = StartOptions {
                        cmd: "/bin/bash".into(),
                        args: vec!["-i".into(), "-l".into()],
                        cwd: Some(cwd),
                        pty: Some(PtySize { rows, cols }),
                        ..Default::default()
                    };
                    o.envs = b.egress_env(&l);
                    o.envs.insert("TERM".into(), "xterm-256color".into());
                    let stream = addr.cube.start(&addr, &o).await.map_err(|e| backend(&e))?;
                    let (ts, _) = b.now();
                    let pty = Pty {
                        pty_ref,
                        lease_ref: l.lease_ref.clone(),
                        tenant,
                        pid: stream.pid,
                        state: PtyState::Running,
                        exit_code: None,
                        rows,
                        cols,
                        created_at: ts.clone(),
                        updated_at: ts,
                        replica: b.inner.store.replica().map(str::to_string),
                    };
                    let recorded = if b.records(&l.profile) {
                        match b.begin_recording(
                            super::recordings::RecordingKind::Pty,
                            &l,
                            &pty.pty_ref,
                            (cols, rows),
                        ) {
                            Ok(r) => Some(r),
                            Err(e) => {
                                // No recording, no terminal.
                                let _ = addr.cube.signal(&addr, pty.pid, true).await;
                                return Err(Error::new(
                                    Code::AuditUnavailable,
                                    format!("the PTY's recording cannot be written: {e}"),
                                ));
                            }
                        }
                    } else {
                        None
                    };
                    let (rec, record) = recorded.unzip();
                    let hub = Hub::new();
                    b.inner.ptys.insert(&pty.pty_ref, hub.clone());
                    b.pump(pty.pty_ref.clone(), stream, hub, rec);
                    let p2 = pty.clone();
                    Ok(Done::new(pty).persist(move |txn| {
                        put_pty(txn, &p2)?;
                        match &record {
                            Some(r) => crate::store::recordings::put(txn, r),
                            None => Ok(()),
                        }
                    }))
                },
            )
            .await?;
        Ok(PtyAnswer::new(
            &pty,
            self.executor(&l.backend),
            &l.sandbox_ref,
            &ctx.request_id,
        ))
    }

    /// Read a PTY's output into its hub until it ends; then record the end.
    /// (Not a tracked effect: a shell may run for days, and shutdown must
    /// not wait for it.)
    fn pump(
        &self,
        pty_ref: String,
        mut stream: crate::cube::ProcessStream,
        hub: Arc<Hub>,
        rec: Option<Recorder>,
    ) {
        let b = self.clone();
        tokio::spawn(async move {
            let mut exit = None;
            let mut broken = false;
            loop {
                match stream.next().await {
                    Ok(Some(ProcessEvent::Data(d))) => {
                        for part in [d.pty, d.stdout, d.stderr].into_iter().flatten() {
                            if let Ok(bytes) = decode_data(&part) {
                                hub.push(&bytes);
                                if let Some(r) = &rec {
                                    r.data(Stream::Output, &bytes).await;
                                }
                            }
                        }
                    }
                    Ok(Some(ProcessEvent::End(e))) => exit = e.code(),
                    Ok(Some(_)) => {}
                    Ok(None) => break,
                    Err(e) => {
                        // The shell may still run, but its output from now
                        // on cannot be relayed without a gap: lost.
                        tracing::warn!(pty = %pty_ref, error = %e, "PTY stream broke; the PTY is lost");
                        broken = true;
                        break;
                    }
                }
            }
            hub.end();
            if let Some(rec) = rec {
                if broken {
                    rec.marker("the PTY's stream broke; nothing more was recorded")
                        .await;
                }
                rec.finish().await;
            }
            // Late viewers can still read the end for a minute.
            let hubs = b.clone();
            let r2 = pty_ref.clone();
            tokio::spawn(async move {
                tokio::time::sleep(std::time::Duration::from_secs(60)).await;
                hubs.inner.ptys.remove(&r2);
            });
            let (state, ts) = (
                if broken {
                    PtyState::Lost
                } else {
                    PtyState::Exited
                },
                b.now().0,
            );
            let _ = b
                .inner
                .store
                .write(move |txn, _| {
                    let cur = store::ptys::get(txn, &pty_ref)?;
                    // A kill recorded first (`cancelled`) stands.
                    if let Some(mut p) = cur.filter(Pty::is_running) {
                        p.state = state;
                        p.exit_code = exit;
                        p.updated_at = ts;
                        put_pty(txn, &p)?;
                    }
                    Ok(())
                })
                .await;
        });
    }

    /// `GET /v1/ptys/{ref}/status`.
    pub async fn pty_status(&self, p: &Principal, ctx: &Ctx, pty_ref: &str) -> Result<PtyAnswer> {
        let ev = self.event(p, Action::PtyStatus, ctx);
        self.authorize(p, "pty:status", &ev).await?;
        let (pty, l) = self.owned_pty(p, pty_ref, &ev).await?;
        Ok(PtyAnswer::new(
            &pty,
            self.executor(&l.backend),
            &l.sandbox_ref,
            &ctx.request_id,
        ))
    }

    /// One audited action on a running PTY's process; `input`: the size
    /// and keyed digest of what it sends (input only).
    async fn pty_action<F, Fut>(
        &self,
        p: &Principal,
        ctx: &Ctx,
        pty_ref: &str,
        (action, scope): (Action, &str),
        input: Option<(u64, String)>,
        run: F,
    ) -> Result<(Pty, Lease)>
    where
        F: FnOnce(Broker, Pty, super::leases::Addr) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<Pty>> + Send + 'static,
    {
        let ev = self.event(p, action.clone(), ctx);
        self.authorize(p, scope, &ev).await?;
        let (pty, l) = self.owned_pty(p, pty_ref, &ev).await?;
        let (l, pty) = self
            .effect_on(
                p,
                ctx,
                l,
                action,
                |e| {
                    if let Some((n, d)) = input {
                        e.bytes = Some(n);
                        e.command_digest = Some(d);
                    }
                },
                None,
                move |b: Broker, _l: Lease, addr| async move {
                    let before = pty.clone();
                    let after = run(b, pty, addr).await?;
                    let mut d = Done::new(after.clone());
                    if after.state != before.state
                        || after.rows != before.rows
                        || after.cols != before.cols
                    {
                        d = d.persist(move |txn| save_pty(txn, &after));
                    }
                    Ok(d)
                },
            )
            .await?;
        Ok((pty, l))
    }

    /// `POST /v1/ptys/{ref}/input`.
    pub async fn pty_input(
        &self,
        p: &Principal,
        ctx: &Ctx,
        pty_ref: &str,
        data: Vec<u8>,
    ) -> Result<PtyAnswer> {
        if data.len() > MAX_INPUT {
            return Err(Error::new(
                Code::ValueTooLarge,
                format!("input is limited to {MAX_INPUT} bytes"),
            ));
        }
        // What was typed, as a keyed digest (`command_digest`, kind
        // `pty_input`): comparable with a known input by whoever holds the
        // journal's key, never readable (it may hold a password).
        let n = data.len() as u64;
        let digest = self.inner.journal.digest("pty_input", &data);
        let (pty, l) = self
            .pty_action(
                p,
                ctx,
                pty_ref,
                (Action::PtyInput, "pty:input"),
                Some((n, digest)),
                move |b, pty, addr| async move {
                    if !pty.is_running() {
                        return Err(Error::new(Code::PtyNotRunning, "the PTY is not running"));
                    }
                    // Recorded as it is sent, so that its echo follows it.
                    let rec = b.inner.recordings.get(&pty.pty_ref);
                    if let Some(r) = &rec {
                        r.data(Stream::Input, &data).await;
                    }
                    if let Err(e) = addr.cube.send_pty_input(&addr, pty.pid, &data).await {
                        if let Some(r) = &rec {
                            r.marker("the input above was not delivered").await;
                        }
                        return Err(backend(&e));
                    }
                    Ok(pty)
                },
            )
            .await?;
        Ok(PtyAnswer::new(
            &pty,
            self.executor(&l.backend),
            &l.sandbox_ref,
            &ctx.request_id,
        ))
    }

    /// `POST /v1/ptys/{ref}/resize`.
    pub async fn pty_resize(
        &self,
        p: &Principal,
        ctx: &Ctx,
        pty_ref: &str,
        rows: u32,
        cols: u32,
    ) -> Result<PtyAnswer> {
        check_size(rows, cols)?;
        let (pty, l) = self
            .pty_action(
                p,
                ctx,
                pty_ref,
                (Action::PtyResize, "pty:resize"),
                None,
                move |b, mut pty, addr| async move {
                    if !pty.is_running() {
                        return Err(Error::new(Code::PtyNotRunning, "the PTY is not running"));
                    }
                    addr.cube
                        .resize_pty(&addr, pty.pid, PtySize { rows, cols })
                        .await
                        .map_err(|e| backend(&e))?;
                    if let Some(r) = b.inner.recordings.get(&pty.pty_ref) {
                        r.resize(cols, rows).await;
                    }
                    pty.rows = rows;
                    pty.cols = cols;
                    pty.updated_at = b.now().0;
                    Ok(pty)
                },
            )
            .await?;
        Ok(PtyAnswer::new(
            &pty,
            self.executor(&l.backend),
            &l.sandbox_ref,
            &ctx.request_id,
        ))
    }

    /// `POST /v1/ptys/{ref}/kill`.
    pub async fn pty_kill(&self, p: &Principal, ctx: &Ctx, pty_ref: &str) -> Result<PtyAnswer> {
        let (pty, l) = self
            .pty_action(
                p,
                ctx,
                pty_ref,
                (Action::PtyKill, "pty:kill"),
                None,
                move |b, mut pty, addr| async move {
                    if !pty.is_running() {
                        return Ok(pty);
                    }
                    match addr.cube.signal(&addr, pty.pid, true).await {
                        Ok(()) => {}
                        Err(e) if e.kind == ErrorKind::NotFound => {}
                        Err(e) => return Err(backend(&e)),
                    }
                    // The pump records `exited` when the stream ends; a kill
                    // asked for here is `cancelled`.
                    pty.state = PtyState::Cancelled;
                    pty.exit_code = Some(137);
                    pty.updated_at = b.now().0;
                    Ok(pty)
                },
            )
            .await?;
        Ok(PtyAnswer::new(
            &pty,
            self.executor(&l.backend),
            &l.sandbox_ref,
            &ctx.request_id,
        ))
    }

    /// Open a PTY's event stream (audited once): its current record and hub.
    pub async fn open_pty_events(
        &self,
        p: &Principal,
        ctx: &Ctx,
        pty_ref: &str,
    ) -> Result<(Pty, String, Option<Arc<Hub>>)> {
        let ev = self.event(p, Action::PtyEvents, ctx);
        self.authorize(p, "pty:events", &ev).await?;
        let (pty, l) = self.owned_pty(p, pty_ref, &ev).await?;
        let mut ev = self.lease_event(p, Action::PtyEvents, ctx, &l);
        ev.outcome = Outcome::Ok;
        self.inner.journal.record(ev).await?;
        Ok((
            pty.clone(),
            l.sandbox_ref,
            self.inner.ptys.get(&pty.pty_ref),
        ))
    }

    /// `POST /v1/ptys/{ref}/output`: up to `max` bytes of output from
    /// `offset`, waiting up to `wait` for some when there is none yet (for
    /// clients that cannot hold an event stream, such as MCP tools).
    pub async fn pty_output(
        &self,
        p: &Principal,
        ctx: &Ctx,
        pty_ref: &str,
        offset: u64,
        max: usize,
        wait: std::time::Duration,
    ) -> Result<dto::PtyOutput> {
        let ev = self.event(p, Action::PtyOutput, ctx);
        self.authorize(p, "pty:events", &ev).await?;
        let (_, l) = self.owned_pty(p, pty_ref, &ev).await?;
        let mut ev = self.lease_event(p, Action::PtyOutput, ctx, &l);
        ev.outcome = Outcome::Ok;
        self.inner.journal.record(ev).await?;
        let hub = self.inner.ptys.get(pty_ref);
        let chunk = match &hub {
            Some(h) => {
                let mut tick = h.tick.subscribe();
                let mut c = h.read(offset, max);
                if c.bytes.is_empty() && !c.ended && !wait.is_zero() {
                    let _ = tokio::time::timeout(wait, tick.changed()).await;
                    c = h.read(offset, max);
                }
                Some(c)
            }
            None => None,
        };
        // The record after the read: an end seen in the output is in it.
        let pty = self
            .get_pty(pty_ref)?
            .ok_or_else(|| Error::new(Code::PtyNotFound, "no such PTY"))?;
        let (from, bytes, missed, eof) = match chunk {
            Some(c) => (c.from, c.bytes, c.missed, c.ended),
            // Not running in this process: nothing more will come.
            None => (offset, vec![], None, true),
        };
        use base64::Engine;
        let b64 = base64::engine::general_purpose::STANDARD.encode(&bytes);
        let a = PtyAnswer::new(
            &pty,
            self.executor(&l.backend),
            &l.sandbox_ref,
            &ctx.request_id,
        );
        Ok(dto::PtyOutput {
            cols: a.cols,
            content_base64: b64,
            created_at: a.created_at,
            encoding: dto::OutputEncoding::Base64,
            eof,
            executor: a.executor,
            exit_code: a.exit_code,
            lease_ref: a.lease_ref,
            missed: missed.map(|(from, to)| dto::Missed { from, to }),
            next_offset: from + bytes.len() as u64,
            offset: from,
            pty_ref: a.pty_ref,
            request_id: a.request_id,
            rows: a.rows,
            sandbox_ref: a.sandbox_ref,
            state: a.state,
            updated_at: a.updated_at,
        })
    }
}
