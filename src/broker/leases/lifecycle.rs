//! A lease's life after acquire: listing, status, and release (pause or
//! kill) with its effect.

use super::*;

/// The leases `GET /v1/leases` shows: every lease to an admin, else the
/// tenant's that are not a trusted task's (a trusted task's lease is the
/// task's, not the agent's); to anyone, only those of the profiles and
/// runtimes their identity may use (`Broker::usable`); newest first.
/// Leases whose running jobs a live list reads before it answers.
pub const LIVE_REFRESH_LEASES: usize = 16;
/// How long a live list waits for those reads.
pub const LIVE_REFRESH_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

fn visible_leases(
    txn: &crate::store::Rx,
    p: &Principal,
) -> std::result::Result<Vec<Lease>, StoreError> {
    let admin = p.is_admin();
    let mut v = store::leases::all(txn)?;
    v.retain(|l| {
        (admin || (l.tenant == p.tenant && l.task_ref.is_none()))
            && p.allows_profile(&l.profile)
            && p.allows_runtime(&l.runtime)
    });
    v.sort_by(|a, b| {
        b.created_at
            .cmp(&a.created_at)
            .then(b.lease_ref.cmp(&a.lease_ref))
    });
    Ok(v)
}

/// A lease's brokered egress as its status and the console show it (none
/// when its profile has none): the profile's destinations less those an
/// operator narrowed away, as `Broker::egress_destinations` counts them.
/// Never a credential, nor where one is kept.
pub(crate) fn lease_egress(cfg: &crate::config::Config, l: &Lease) -> Option<dto::LeaseEgress> {
    let eg = cfg.profiles.get(&l.profile)?.egress.as_ref()?;
    let destinations = eg
        .destinations
        .iter()
        .filter(|d| l.egress_only.as_ref().is_none_or(|o| o.contains(d)))
        .cloned()
        .collect();
    Some(dto::LeaseEgress {
        destinations,
        narrowed: l.egress_only.is_some(),
        // Inside an embedded sandbox's own network; else the network
        // listener, which wants the lease's token (the sandbox's
        // `egress::ENV_FILE`; never shown here).
        proxy: match cfg.egress.advertised() {
            Some(at)
                if !cfg
                    .backend_defs()
                    .get(&l.backend)
                    .is_some_and(|d| d.is_embedded()) =>
            {
                format!("http://{at}")
            }
            _ => format!(
                "http://127.0.0.1:{}",
                crate::embedded::wire::EGRESS_PROXY_PORT
            ),
        },
    })
}

impl Broker {
    /// `GET /v1/leases`.
    pub async fn list_leases(&self, p: &Principal, ctx: &Ctx) -> Result<dto::LeaseList> {
        let ev = self.event(p, Action::LeaseList, ctx);
        self.authorize(p, "lease:list", &ev).await?;
        let admin = p.is_admin();
        let who = p.clone();
        let leases: Vec<Lease> = self
            .inner
            .store
            .read(move |txn| visible_leases(txn, &who))
            .await?;
        let leases = leases
            .into_iter()
            .map(|l| dto::LeaseItem {
                created_at: l.created_at,
                last_used_at: l.last_used_at,
                lease_ref: l.lease_ref,
                profile: l.profile,
                runtime: l.runtime,
                sandbox_ref: l.sandbox_ref,
                state: l.state,
                tenant: admin.then_some(l.tenant),
            })
            .collect();
        Ok(dto::LeaseList { leases })
    }

    /// The console's live list (`/console/leases`): the leases `GET
    /// /v1/leases` shows this person (their tenant's, not a trusted task's;
    /// every lease to an admin), newest first, at most `limit`, each with
    /// its newest jobs and PTYs as stored (at most `LIVE_PROCS` of each).
    /// The same policy as `GET /v1/leases`: `lease:list` (a refusal is
    /// recorded as `lease_list`), jobs only with `job:status`, PTYs only
    /// with `pty:status`. Also says whether more leases were left out.
    pub async fn live_leases(
        &self,
        p: &Principal,
        ctx: &Ctx,
        limit: usize,
    ) -> Result<(Vec<crate::broker::LiveLease>, bool)> {
        let ev = self.event(p, Action::LeaseList, ctx);
        self.authorize(p, "lease:list", &ev).await?;
        let who = p.clone();
        let with_jobs = p.allows_action("job:status");
        let with_ptys = p.allows_action("pty:status");
        if with_jobs {
            self.refresh_live_jobs(p, limit).await;
        }
        let cfg = self.config();
        self.inner
            .store
            .read(move |txn| {
                let mut v = visible_leases(txn, &who)?;
                let more = v.len() > limit;
                v.truncate(limit);
                let mut out = Vec::with_capacity(v.len());
                for l in v {
                    let mut jobs = if with_jobs {
                        store::jobs::of_lease(txn, &l.lease_ref)?
                    } else {
                        vec![]
                    };
                    jobs.sort_by(|a, b| {
                        b.created_at
                            .cmp(&a.created_at)
                            .then(b.job_ref.cmp(&a.job_ref))
                    });
                    let mut ptys = if with_ptys {
                        store::ptys::of_lease(txn, &l.lease_ref)?
                    } else {
                        vec![]
                    };
                    ptys.sort_by(|a, b| {
                        b.created_at
                            .cmp(&a.created_at)
                            .then(b.pty_ref.cmp(&a.pty_ref))
                    });
                    let (jobs_total, ptys_total) = (jobs.len(), ptys.len());
                    jobs.truncate(crate::broker::LIVE_PROCS);
                    ptys.truncate(crate::broker::LIVE_PROCS);
                    out.push(crate::broker::LiveLease {
                        egress: lease_egress(&cfg, &l),
                        preset: l.preset.zip(l.preset_digest),
                        lease_ref: l.lease_ref,
                        tenant: l.tenant,
                        runtime: l.runtime,
                        profile: l.profile,
                        sandbox_ref: l.sandbox_ref,
                        state: l.state,
                        created_at: l.created_at,
                        last_used_unix: l.last_used_unix,
                        task_ref: l.task_ref,
                        jobs,
                        jobs_total,
                        ptys,
                        ptys_total,
                    });
                }
                Ok((out, more))
            })
            .await
            .map_err(Into::into)
    }

    /// Bring the jobs a live list shows as running up to date (issue #36:
    /// a job that ended long ago was shown running): each lease among the
    /// first `limit` with a job still recorded as running has its jobs
    /// read once, at most [`LIVE_REFRESH_LEASES`] leases and
    /// [`LIVE_REFRESH_WAIT`] in all. A read that fails or takes longer
    /// leaves the recorded state (the list says "as recorded").
    async fn refresh_live_jobs(&self, p: &Principal, limit: usize) {
        let who = p.clone();
        let leases = self
            .inner
            .store
            .read(move |txn| {
                let mut v = visible_leases(txn, &who)?;
                v.truncate(limit);
                let mut out = vec![];
                for l in v {
                    if store::jobs::of_lease(txn, &l.lease_ref)?
                        .iter()
                        .any(|j| !j.is_terminal())
                    {
                        out.push(l);
                    }
                }
                Ok(out)
            })
            .await
            .unwrap_or_default();
        let reads = leases
            .into_iter()
            .take(LIVE_REFRESH_LEASES)
            .filter_map(|l| self.addr(&l).ok().map(|a| (a, l.lease_ref)))
            .map(|(addr, lr)| async move {
                let _ = self.running_jobs(&addr, &lr).await;
            });
        let _ =
            tokio::time::timeout(LIVE_REFRESH_WAIT, futures_util::future::join_all(reads)).await;
    }

    /// `GET|POST /v1/leases/{ref}/status`.
    pub async fn lease_status(
        &self,
        p: &Principal,
        ctx: &Ctx,
        lease_ref: &str,
        refresh: bool,
    ) -> Result<dto::LeaseStatus> {
        let ev = self.event(p, Action::Status, ctx);
        self.authorize(p, "lease:status", &ev).await?;
        let mut l = self.owned_lease(p, lease_ref, &ev).await?;
        if refresh {
            self.inner.journal.check()?;
            match self.ready_client(&l.backend)?.get(&l.sandbox_id).await {
                Ok(d) => l.state = LeaseState::from(d.state),
                Err(e) if e.kind == ErrorKind::NotFound => l.state = LeaseState::Gone,
                Err(e) => return Err(backend(&e)),
            }
            let (ts, unix) = self.now();
            l.last_used_at = ts;
            l.last_used_unix = unix;
            let l2 = l.clone();
            self.inner
                .store
                .write(move |txn, _| put_lease(txn, &l2))
                .await?;
        }
        let prof = self.profile(&l.profile).unwrap_or_default();
        let idle = self.now().1 - l.last_used_unix;
        let expires = i64::try_from(prof.lease_idle_ttl_seconds)
            .unwrap_or(i64::MAX)
            .saturating_sub(idle)
            .max(0);
        let checkpoint_list = self.checkpoints_summary(&l)?;
        let job_list = self.jobs_summary(&l.lease_ref)?;
        let egress = lease_egress(&self.config(), &l);
        Ok(dto::LeaseStatus {
            checkpoints: checkpoint_list.len(),
            checkpoint_list,
            created_at: l.created_at,
            egress,
            executor: self.executor(&l.backend),
            expires_in_seconds: expires,
            jobs: job_list.len(),
            job_list,
            last_used_at: l.last_used_at,
            lease_ref: l.lease_ref,
            preset: l.preset,
            preset_digest: l.preset_digest,
            profile: l.profile,
            recoverable: true,
            request_id: ctx.request_id.clone(),
            runtime: l.runtime,
            sandbox_ref: l.sandbox_ref,
            state: l.state,
            volume_attached: l.volume.is_some(),
        })
    }

    /// `POST /v1/leases/{ref}/release` (`pause` or `kill`).
    pub async fn release(
        &self,
        p: &Principal,
        ctx: &Ctx,
        lease_ref: &str,
        action: &str,
    ) -> Result<dto::ReleaseResponse> {
        let release_action = match action {
            "pause" => dto::ReleaseAction::Pause,
            "kill" => dto::ReleaseAction::Kill,
            _ => {
                return Err(Error::new(
                    Code::InvalidAction,
                    "action must be pause or kill",
                ));
            }
        };
        let ev = self.event(p, Action::Release, ctx);
        self.authorize(p, "lease:release", &ev).await?;
        let l = self.owned_lease(p, lease_ref, &ev).await?;
        let lock = self.lock(format!("lease:{}", l.lease_ref)).await?;
        // Looked up again under the lock: a concurrent release may have won.
        let l = self.visible_lease(p, &l.lease_ref).await?;
        // A backend that is down: nothing is done (and no intent left).
        self.ready_client(&l.backend)?;
        let mut ev = self.lease_event(p, Action::Release, ctx, &l);
        ev.release_action = Some(action.to_string());
        if let Some(op) = &l.held_by {
            return Err(self.reject(ev, Self::blocked(op)).await);
        }
        let intent = self.inner.journal.intent(ev).await?;
        // From here the release runs to its recorded outcome even if the
        // client goes away (drained at shutdown).
        let b = self.clone();
        let kill = action == "kill";
        let l2 = l.clone();
        let task = self.inner.tracker.spawn(async move {
            let _lock = lock;
            b.release_effect(intent, l2, kill).await
        });
        task.await
            .map_err(|_| Error::new(Code::ExecutionFailed, "the operation was interrupted"))??;
        Ok(dto::ReleaseResponse {
            action: release_action,
            executor: self.executor(&l.backend),
            request_id: ctx.request_id.clone(),
            sandbox_ref: l.sandbox_ref,
        })
    }

    /// The effect of a release, after its intent: pause or kill, the
    /// checkpoints' snapshots, and the outcome with the lease's new state.
    pub(super) async fn release_effect(&self, intent: Intent, l: Lease, kill: bool) -> Result<()> {
        let cube = match self.client(&l.backend) {
            Ok(c) => c,
            Err(e) => {
                self.fail(intent, &e).await?;
                return Err(e);
            }
        };
        let r = if !kill {
            match cube.pause(&l.sandbox_id).await {
                Ok(()) => Ok(()),
                Err(e) if e.kind == ErrorKind::Conflict => Ok(()), // already paused
                Err(e) => Err(backend(&e)),
            }
        } else {
            match cube.kill(&l.sandbox_id).await {
                Ok(()) => Ok(()),
                Err(e) if e.kind == ErrorKind::NotFound => Ok(()), // already gone
                Err(e) => Err(backend(&e)),
            }
        };
        if r.is_ok() && kill {
            self.release_volume(&l).await;
        }
        // Killed: its checkpoints go too. If one cannot be deleted, the lease
        // stays (as `released`) so that the release can be retried.
        let r = match r {
            Ok(()) if kill => match self.delete_lease_snapshots(&l.lease_ref, &l.backend).await {
                Err(e) => {
                    let mut l2 = l.clone();
                    l2.state = LeaseState::Released;
                    self.inner
                        .journal
                        .outcome(
                            intent,
                            Outcome::Error,
                            |ev| ev.error_code = Some(e.code.to_string()),
                            move |txn| put_lease(txn, &l2),
                        )
                        .await?;
                    return Err(e);
                }
                Ok(()) => Ok(()),
            },
            other => other,
        };
        if let Err(e) = r {
            self.fail(intent, &e).await?;
            return Err(e);
        }
        // Killed: its recordings end here, and the outcome names them.
        let sealed = if kill {
            self.seal_lease_recordings(&l.lease_ref).await
        } else {
            vec![]
        };
        let digest = crate::broker::recordings::recordings_digest(&sealed);
        let mut l2 = l.clone();
        self.inner
            .journal
            .outcome(
                intent,
                Outcome::Ok,
                |ev| ev.recordings_digest = digest,
                move |txn| {
                    if kill {
                        crate::broker::upkeep::remove_lease_state(txn, &l2)?;
                    } else {
                        l2.state = LeaseState::Paused;
                        put_lease(txn, &l2)?;
                    }
                    Ok(())
                },
            )
            .await?;
        Ok(())
    }

    /// A killed lease's workspace volume: destroyed if the appliance made
    /// it, it is not to be retained, and no other lease mounts it; the
    /// operator's volumes (`existing-volume`) never are. A failure is
    /// logged: the volume stays.
    pub(crate) async fn release_volume(&self, l: &Lease) {
        let Some(v) = l.volume.clone().filter(|v| v.owned && !v.retain) else {
            return;
        };
        let (lref, backend, id) = (l.lease_ref.clone(), l.backend.clone(), v.volume_id.clone());
        let shared = self
            .inner
            .store
            .read(move |txn| {
                Ok(store::leases::all(txn)?.iter().any(|o| {
                    o.lease_ref != lref
                        && o.backend == backend
                        && o.volume.as_ref().is_some_and(|w| w.volume_id == id)
                }))
            })
            .await;
        match shared {
            Ok(false) => {}
            Ok(true) => return,
            Err(e) => {
                tracing::warn!(error = %e, "a workspace volume was kept: its other leases could not be read");
                return;
            }
        }
        let Ok(cube) = self.client(&l.backend) else {
            return;
        };
        match cube.delete_volume(&v.volume_id).await {
            Ok(()) => {}
            Err(e) if e.kind == ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(lease = %l.lease_ref, error = %e, "could not destroy a workspace volume; it is kept");
            }
        }
    }
}
