//! Keeping leases alive and cleaning them up: profiles, renewal, the
//! background keepalive for leases with running jobs or PTYs, idle-lease GC, and
//! lease recovery after a restart.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::dto;
use super::leases::{Done, Lease, LeaseState};
use super::{Broker, Code, Ctx, Error, Result, error::backend};
use crate::audit::event::{Action, Event, Outcome};
use crate::auth::Principal;
use crate::cube::ErrorKind;
use crate::store::{self, StoreError};

/// Remove a killed lease and everything recorded under it.
pub(crate) fn remove_lease_state(
    txn: &crate::store::Wx,
    l: &Lease,
) -> std::result::Result<(), StoreError> {
    store::leases::remove(txn, l)?;
    super::jobs::delete_lease_jobs(txn, &l.lease_ref)?;
    super::checkpoints::delete_lease_checkpoints(txn, &l.lease_ref)?;
    super::ptys::delete_lease_ptys(txn, &l.lease_ref)
}

fn all_leases(txn: &crate::store::Rx) -> std::result::Result<Vec<Lease>, StoreError> {
    store::leases::all(txn)
}

/// Record the idle timeout last set on a lease's sandbox (`None`: the
/// profile's), if the lease still exists.
fn set_ttl(
    txn: &crate::store::Wx,
    lease_ref: &str,
    ttl: Option<u64>,
) -> std::result::Result<(), StoreError> {
    if let Some(mut l) = store::leases::get(txn, lease_ref)? {
        l.ttl_seconds = ttl;
        store::leases::put(txn, &l)?;
    }
    Ok(())
}

/// The end of a lease's keepalive budget (unix seconds): renewals keep its
/// sandbox up at most `max_keepalive_seconds` past its last use.
fn keepalive_until(l: &Lease, max_keepalive: u64) -> i64 {
    l.last_used_unix
        .saturating_add(i64::try_from(max_keepalive).unwrap_or(i64::MAX))
}

/// How old a sandbox no lease holds must be before GC kills it: a create
/// in flight (here, or on another replica) is far younger.
pub(crate) const ORPHAN_AGE: i64 = 300;

impl Broker {
    /// `GET /v1/profiles`: the profiles this caller may acquire with.
    pub async fn list_profiles(&self, p: &Principal, ctx: &Ctx) -> Result<dto::ProfileList> {
        let ev = self.event(p, Action::Profiles, ctx);
        self.authorize(p, "lease:acquire", &ev).await?;
        let profiles = self
            .config()
            .profiles
            .iter()
            .filter(|(name, _)| p.allows_profile(name))
            .map(|(name, pr)| dto::ProfileInfo {
                allow_internet_access: pr.allow_internet_access,
                allowed_runtimes: pr
                    .allowed_runtimes
                    .iter()
                    .filter(|r| p.allows_runtime(r))
                    .cloned()
                    .collect(),
                checkpoints_enabled: pr.checkpoints_enabled,
                keepalive_enabled: pr.keepalive_enabled,
                lease_idle_ttl_seconds: pr.lease_idle_ttl_seconds,
                max_active_leases_per_tenant: pr.max_active_leases_per_tenant,
                max_command_seconds: pr.max_command_seconds,
                max_jobs_per_lease: pr.max_jobs_per_lease,
                max_keepalive_seconds: pr.max_keepalive_seconds,
                name: name.clone(),
                ptys_enabled: pr.ptys_enabled,
                sandbox_timeout_seconds: pr.sandbox_timeout_seconds,
                mcp_policy: pr.mcp_policy.clone(),
            })
            .collect();
        Ok(dto::ProfileList {
            profiles,
            request_id: ctx.request_id.clone(),
        })
    }

    /// `POST /v1/leases/{ref}/renew`: extend the sandbox's timeout, at most
    /// `max_keepalive_seconds` past the lease's last use. A renewal is not a
    /// use: it cannot extend its own budget.
    pub async fn renew(
        &self,
        p: &Principal,
        ctx: &Ctx,
        lease_ref: &str,
        seconds: Option<u64>,
    ) -> Result<dto::RenewResponse> {
        if seconds == Some(0) {
            return Err(Error::new(
                Code::InvalidRequest,
                "seconds must be at least 1",
            ));
        }
        let ev = self.event(p, Action::Renew, ctx);
        self.authorize(p, "lease:renew", &ev).await?;
        let l = self.owned_lease(p, lease_ref, &ev).await?;
        let Some(prof) = self.profile(&l.profile) else {
            return Err(Broker::profile_gone(&l));
        };
        let until = keepalive_until(&l, prof.max_keepalive_seconds);
        let left = until.saturating_sub(self.now().1);
        if left <= 0 {
            return Err(self
                .reject(
                    self.lease_event(p, Action::Renew, ctx, &l),
                    Error::new(
                        Code::KeepaliveExhausted,
                        format!(
                            "the lease was last used more than max_keepalive_seconds ({}) ago; use it or acquire again",
                            prof.max_keepalive_seconds
                        ),
                    ),
                )
                .await);
        }
        let want = seconds.unwrap_or(prof.sandbox_timeout_seconds).max(1);
        let secs = want.min(u64::try_from(left).unwrap_or(0));
        // A real CubeSandbox's timeout is an idle timeout that stays until it
        // is set again: a renewal shorter than the profile's is undone by
        // the next use (`restore_ttl`).
        let ttl = (secs != prof.sandbox_timeout_seconds).then_some(secs);
        let (l, ()) = self
            .effect_on(
                p,
                ctx,
                l,
                Action::Renew,
                |_| {},
                None,
                move |_b: Broker, l: Lease, addr| async move {
                    addr.cube
                        .set_timeout(&l.sandbox_id, i64::try_from(secs).unwrap_or(i64::MAX))
                        .await
                        .map_err(|e| backend(&e))?;
                    let lease_ref = l.lease_ref.clone();
                    Ok(Done::new(())
                        .no_touch()
                        .persist(move |txn| set_ttl(txn, &lease_ref, ttl)))
                },
            )
            .await?;
        Ok(dto::RenewResponse {
            capped: secs < want,
            executor: self.executor(&l.backend),
            keepalive_until: crate::clock::format_unix(until),
            lease_ref: l.lease_ref,
            request_id: ctx.request_id.clone(),
            sandbox_ref: l.sandbox_ref,
            timeout_seconds: secs,
        })
    }

    /// `GET /v1/leases/{ref}/recover`: the lease, its sandbox's state as the
    /// backend sees it now, and its jobs. Nothing is re-run or rebuilt.
    pub async fn recover_lease(
        &self,
        p: &Principal,
        ctx: &Ctx,
        lease_ref: &str,
    ) -> Result<dto::LeaseRecovery> {
        let ev = self.event(p, Action::LeaseRecover, ctx);
        self.authorize(p, "lease:status", &ev).await?;
        let l = self.owned_lease(p, lease_ref, &ev).await?;
        let state = match self.ready_client(&l.backend)?.get(&l.sandbox_id).await {
            Ok(d) => LeaseState::from(d.state),
            Err(e) if e.kind == ErrorKind::NotFound => LeaseState::Gone,
            Err(e) => return Err(backend(&e)),
        };
        Ok(dto::LeaseRecovery {
            created_at: l.created_at,
            executor: self.executor(&l.backend),
            jobs: self.jobs_summary(&l.lease_ref)?,
            last_used_at: l.last_used_at,
            lease_ref: l.lease_ref,
            profile: l.profile,
            recoverable: state != LeaseState::Gone,
            request_id: ctx.request_id.clone(),
            runtime: l.runtime,
            sandbox_ref: l.sandbox_ref,
            state,
        })
    }

    /// An audit event for the appliance's own actions on a lease.
    fn system_event(&self, action: Action, l: &Lease) -> Event {
        let j = &self.inner.journal;
        let mut ev = j.event(action);
        ev.identity_digest = Some(j.digest("identity", b"system\0cube-adapter"));
        ev.tenant_digest = Some(j.digest("tenant", l.tenant.as_bytes()));
        super::leases::with_lease(ev, l)
    }

    /// How long a lease may stay unused before GC collects it: its
    /// profile's `lease_idle_ttl_seconds`; a trusted task's lease gets its
    /// command's whole time limit on top (nobody touches it while the task
    /// runs), so that its outputs are still there when the result is asked
    /// for.
    pub(crate) fn idle_ttl(&self, l: &super::leases::Lease) -> i64 {
        // A lease whose profile is gone is collected at the next pass.
        let Some(p) = self.profile(&l.profile) else {
            return 0;
        };
        let mut ttl = p.lease_idle_ttl_seconds;
        if l.task_ref.is_some() {
            ttl = ttl.saturating_add(p.max_command_seconds);
        }
        i64::try_from(ttl).unwrap_or(i64::MAX)
    }

    /// Kill one idle lease under an audit intent, with its jobs' records.
    /// `Ok(false)`: it was used meanwhile (or is gone), nothing done.
    async fn collect(&self, lease_ref: &str) -> Result<bool> {
        let _lock = self.lock(format!("lease:{lease_ref}")).await?;
        let Some(l) = self.get_lease(lease_ref).await? else {
            return Ok(false);
        };
        // Held for an operator (an unknown result): never collected.
        if self.now().1 - l.last_used_unix < self.idle_ttl(&l) || l.held_by.is_some() {
            return Ok(false);
        }
        // Its backend is down: collected when it is back.
        let Ok(cube) = self.ready_client(&l.backend) else {
            return Ok(false);
        };
        let intent = self
            .inner
            .journal
            .intent(self.system_event(Action::GcRelease, &l))
            .await?;
        let killed = match cube.kill(&l.sandbox_id).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind == ErrorKind::NotFound => Ok(()),
            Err(e) => Err(backend(&e)),
        };
        if killed.is_ok() {
            self.release_volume(&l).await;
        }
        // Its checkpoints go with it (the reference's GC leaked them).
        let cleaned = match killed {
            Ok(()) => self.delete_lease_snapshots(&l.lease_ref, &l.backend).await,
            Err(e) => Err(e),
        };
        if let Err(e) = cleaned {
            self.fail(intent, &e).await?;
            return Err(e);
        }
        let sealed = self.seal_lease_recordings(&l.lease_ref).await;
        let digest = crate::broker::recordings::recordings_digest(&sealed);
        self.inner
            .journal
            .outcome(
                intent,
                Outcome::Ok,
                |ev| ev.recordings_digest = digest,
                move |txn| remove_lease_state(txn, &l),
            )
            .await?;
        Ok(true)
    }

    /// Kill every lease idle past its profile's `lease_idle_ttl_seconds`.
    pub async fn gc(&self) -> Result<(u64, u64)> {
        let m = &self.inner.gc;
        if let Err(e) = self.inner.journal.check() {
            m.runs.inc(["failed"]);
            return Err(e.into());
        }
        match self.prune_plans().await {
            Ok(n) => {
                if let Some(c) = m.actions.get(["plan_pruned"]) {
                    c.add(n);
                }
            }
            Err(e) => {
                tracing::warn!(code = e.code.as_str(), error = %e.message, "gc: could not prune task plans");
            }
        }
        let leases = match self.inner.store.read(all_leases).await {
            Ok(l) => l,
            Err(e) => {
                m.runs.inc(["failed"]);
                return Err(e.into());
            }
        };
        let t = self.now().1;
        let (mut collected, mut failed) = (0, 0);
        for l in leases {
            if t - l.last_used_unix < self.idle_ttl(&l)
                || !self.backend_up(&l.backend)
                || l.held_by.is_some()
            {
                continue;
            }
            match self.collect(&l.lease_ref).await {
                Ok(true) => {
                    collected += 1;
                    m.actions.inc(["collected"]);
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(lease = %l.lease_ref, code = e.code.as_str(), error = %e.message, "gc: could not collect an idle lease");
                    failed += 1;
                    m.actions.inc(["failed"]);
                }
            }
        }
        if collected + failed > 0 {
            tracing::info!(collected, failed, "gc: idle leases");
        }
        for b in self.inner.backends.all() {
            if !b.is_up() {
                continue;
            }
            if let Err(e) = self.sweep_orphans(&b.name, &b.client).await {
                tracing::warn!(backend = %b.name, code = e.code.as_str(), error = %e.message, "gc: could not look for orphaned sandboxes");
            }
        }
        m.runs.inc(["ok"]);
        Ok((collected, failed))
    }

    /// Kill sandboxes this appliance created (its `appliance` mark) that no
    /// lease holds and that started more than `ORPHAN_AGE` ago: a create
    /// that failed on our side but finished on the backend after the
    /// lookups that followed it (or across a restart). Each kill under its
    /// own `orphan_kill` intent.
    async fn sweep_orphans(
        &self,
        backend_name: &str,
        cube: &crate::cube::CubeClient,
    ) -> Result<()> {
        let filter: std::collections::BTreeMap<String, String> =
            [("appliance".to_string(), self.appliance_id())].into();
        let found = cube.list(&filter, None).await.map_err(|e| backend(&e))?;
        if found.is_empty() {
            return Ok(());
        }
        let held: std::collections::HashSet<String> = self
            .inner
            .store
            .read(all_leases)
            .await?
            .into_iter()
            .map(|l| l.sandbox_id)
            .collect();
        let now = self.now().1;
        for s in found {
            let started = crate::clock::parse_unix(&s.started_at).unwrap_or(now);
            if held.contains(&s.sandbox_id) || now - started < ORPHAN_AGE {
                continue;
            }
            match self.kill_orphan(backend_name, &s.sandbox_id, None).await {
                Ok(()) => self.inner.gc.actions.inc(["orphan_killed"]),
                Err(e) => {
                    self.inner.gc.actions.inc(["orphan_failed"]);
                    tracing::warn!(code = e.code.as_str(), error = %e.message, "gc: could not kill a sandbox no lease holds");
                }
            }
        }
        Ok(())
    }

    /// Kill a sandbox no lease holds under an `orphan_kill` intent by the
    /// appliance (with the tenant, runtime, profile and session of `base`,
    /// the failed create's event, when known). Gone already counts as done.
    pub(crate) async fn kill_orphan(
        &self,
        backend_name: &str,
        sandbox_id: &str,
        base: Option<&Event>,
    ) -> Result<()> {
        let cube = self.client(backend_name)?;
        let j = &self.inner.journal;
        let mut ev = j.event(Action::OrphanKill);
        ev.backend = Some(backend_name.to_string());
        ev.identity_digest = Some(j.digest("identity", b"system\0cube-adapter"));
        if let Some(b) = base {
            ev.tenant_digest = b.tenant_digest.clone();
            ev.runtime = b.runtime.clone();
            ev.profile = b.profile.clone();
            ev.session_digest = b.session_digest.clone();
        }
        ev.sandbox_ref = Some(sandbox_id.chars().take(8).collect());
        let intent = j.intent(ev).await?;
        match cube.kill(sandbox_id).await {
            Ok(()) => {
                tracing::warn!(sandbox = %sandbox_id.get(..8).unwrap_or_default(), "killed a sandbox no lease holds");
                j.outcome(intent, Outcome::Ok, |_| {}, |_| Ok(())).await?;
                Ok(())
            }
            Err(e) if e.kind == ErrorKind::NotFound => {
                j.outcome(intent, Outcome::Ok, |_| {}, |_| Ok(())).await?;
                Ok(())
            }
            Err(e) => {
                let e = backend(&e);
                self.fail(intent, &e).await?;
                Err(e)
            }
        }
    }

    /// `POST /v1/admin/gc`: run GC now (admin role and `admin:gc`).
    pub async fn admin_gc(&self, p: &Principal, ctx: &Ctx) -> Result<dto::GcResponse> {
        let ev = self.event(p, Action::AdminGc, ctx);
        if !p.is_admin() {
            return Err(self
                .reject(
                    ev,
                    Error::new(Code::AdminRequired, "this action needs the admin role"),
                )
                .await);
        }
        self.authorize(p, "admin:gc", &ev).await?;
        let (collected, failed) = self.gc().await?;
        // And the recordings' retention (in the journal, not the answer).
        self.recordings_gc().await?;
        Ok(dto::GcResponse {
            collected,
            failed,
            request_id: ctx.request_id.clone(),
        })
    }

    /// Set a lease's sandbox's idle timeout under a system audit intent
    /// (`action`), recording it on the lease when it is not the profile's.
    pub(crate) async fn set_sandbox_timeout(
        &self,
        l: &Lease,
        secs: u64,
        action: Action,
        profile_secs: u64,
    ) -> Result<()> {
        let intent = self
            .inner
            .journal
            .intent(self.system_event(action, l))
            .await?;
        match self
            .client(&l.backend)?
            .set_timeout(&l.sandbox_id, i64::try_from(secs).unwrap_or(i64::MAX))
            .await
        {
            Ok(()) => {
                let lease_ref = l.lease_ref.clone();
                let ttl = (secs != profile_secs).then_some(secs);
                self.inner
                    .journal
                    .outcome(
                        intent,
                        Outcome::Ok,
                        |_| {},
                        move |txn| set_ttl(txn, &lease_ref, ttl),
                    )
                    .await?;
                Ok(())
            }
            Err(e) => {
                let e = backend(&e);
                self.fail(intent, &e).await?;
                Err(e)
            }
        }
    }

    /// Renew the sandboxes of leases that are working: with a call in
    /// flight for a third of the sandbox timeout (always: a real CubeProxy
    /// counts a call as activity only when it ends, so a long command would
    /// otherwise be paused under itself), or with running jobs or PTYs (when
    /// their profile has `keepalive_enabled`); every third of the sandbox
    /// timeout, within the keepalive budget. `last` remembers when each was
    /// renewed.
    pub async fn keepalive(&self, last: &mut HashMap<String, Instant>) -> Result<usize> {
        let busy: HashMap<String, Instant> = self
            .inner
            .busy
            .lock()
            .map(|m| {
                m.iter()
                    .map(|(k, (_, since))| (k.clone(), *since))
                    .collect()
            })
            .unwrap_or_default();
        // Nothing to do (and no scan of every lease each second) unless
        // some profile keeps sandboxes alive or a call is in flight.
        let any = self.config().profiles.values().any(|p| p.keepalive_enabled);
        if (!any && busy.is_empty()) || self.inner.journal.check().is_err() {
            return Ok(0);
        }
        let leases = self.inner.store.read(all_leases).await?;
        let t = self.now().1;
        let mut renewed = 0;
        let live: std::collections::HashSet<String> =
            leases.iter().map(|l| l.lease_ref.clone()).collect();
        last.retain(|k, _| live.contains(k));
        for l in leases {
            let Some(prof) = self.profile(&l.profile) else {
                continue;
            };
            if l.state != LeaseState::Running || !self.backend_up(&l.backend) {
                continue;
            }
            let every = Duration::from_secs((prof.sandbox_timeout_seconds / 3).max(1));
            if last
                .get(&l.lease_ref)
                .is_some_and(|at| at.elapsed() < every)
            {
                continue;
            }
            let in_call = busy
                .get(&l.lease_ref)
                .is_some_and(|since| since.elapsed() >= every);
            let until = keepalive_until(&l, prof.max_keepalive_seconds);
            if !in_call {
                if !prof.keepalive_enabled || t >= until {
                    continue;
                }
                let jobs = self
                    .inner
                    .store
                    .read_now(|txn| super::jobs::lease_jobs(txn, &l.lease_ref))?;
                if !jobs.iter().any(|j| !j.is_terminal()) && self.running_ptys(&l.lease_ref)? == 0 {
                    continue;
                }
            }
            // A call in flight is bounded by its own time limit, not by
            // the keepalive budget.
            let secs = if in_call {
                prof.sandbox_timeout_seconds
            } else {
                prof.sandbox_timeout_seconds
                    .min(u64::try_from(until - t).unwrap_or(0))
                    .max(1)
            };
            if self
                .set_sandbox_timeout(&l, secs, Action::Keepalive, prof.sandbox_timeout_seconds)
                .await
                .is_ok()
            {
                last.insert(l.lease_ref.clone(), Instant::now());
                renewed += 1;
            }
        }
        Ok(renewed)
    }

    /// The background upkeep: keepalive every second or so, GC every
    /// `gc_interval_seconds` (0: never). Stops with the token.
    pub fn spawn_upkeep(&self, stop: tokio_util::sync::CancellationToken) {
        let b = self.clone();
        let gc_every = Duration::from_secs(self.config().gc_interval_seconds);
        // With replicas on a shared database, one of them (the one holding
        // the store's background turn) does this.
        let turn = self.inner.store.turn();
        tokio::spawn(async move {
            let mut last = HashMap::new();
            let mut last_gc = Instant::now();
            let mut last_rec_gc = Instant::now();
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
                // Recordings' retention: every replica, for the files on
                // its own disk.
                if !gc_every.is_zero() && last_rec_gc.elapsed() >= gc_every {
                    last_rec_gc = Instant::now();
                    match b.recordings_gc().await {
                        Ok(0) => {}
                        Ok(n) => tracing::info!(removed = n, "gc: recordings past their retention"),
                        Err(e) => {
                            tracing::warn!(code = e.code.as_str(), error = %e.message, "gc: recordings' retention failed");
                        }
                    }
                }
                if !*turn.borrow() {
                    continue;
                }
                if let Err(e) = b.keepalive(&mut last).await {
                    tracing::warn!(code = e.code.as_str(), error = %e.message, "keepalive pass failed");
                }
                if !gc_every.is_zero() && last_gc.elapsed() >= gc_every {
                    last_gc = Instant::now();
                    if let Err(e) = b.gc().await {
                        tracing::warn!(code = e.code.as_str(), error = %e.message, "gc pass failed");
                    }
                }
            }
        });
    }
}
