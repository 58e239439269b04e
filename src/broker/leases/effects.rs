//! The intent → effect → outcome machinery every change to a lease's
//! sandbox runs under: the effect runs in a drained task of its own, so a
//! committed intent always gets its outcome.

use super::*;

impl Broker {
    /// Run one effect on a lease's sandbox under intent/outcome.
    ///
    /// Once the intent is committed, the effect and its outcome run in a
    /// task of their own: a client that disconnects, or a shutdown (which
    /// drains these tasks), never leaves an intent without its outcome.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn effect<T, F, Fut>(
        &self,
        p: &Principal,
        ctx: &Ctx,
        lease_ref: &str,
        action: Action,
        scope: &str,
        fill: impl FnOnce(&mut Event),
        run: F,
    ) -> Result<(Lease, T)>
    where
        T: Send + 'static,
        F: FnOnce(Broker, Lease, Addr) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<Done<T>>> + Send + 'static,
    {
        let ev = self.event(p, action.clone(), ctx);
        self.authorize(p, scope, &ev).await?;
        let l = self.owned_lease(p, lease_ref, &ev).await?;
        self.effect_on(p, ctx, l, action, fill, None, run).await
    }

    /// As `effect`, on a lease already looked up (and authorized), holding
    /// `hold` (a lock) until the outcome is committed.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn effect_on<T, F, Fut>(
        &self,
        p: &Principal,
        ctx: &Ctx,
        l: Lease,
        action: Action,
        fill: impl FnOnce(&mut Event),
        hold: Option<crate::broker::LockGuard>,
        run: F,
    ) -> Result<(Lease, T)>
    where
        T: Send + 'static,
        F: FnOnce(Broker, Lease, Addr) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<Done<T>>> + Send + 'static,
    {
        let mut ev = self.lease_event(p, action, ctx, &l);
        // A profile a reload removed does not fall back to defaults (which
        // could be looser): its leases only release.
        if self.profile(&l.profile).is_none() {
            return Err(self.reject(ev, Self::profile_gone(&l)).await);
        }
        // A call whose result nobody knows holds the lease until an
        // operator reconciles it: nothing else runs on it meanwhile.
        if let Some(op) = &l.held_by {
            return Err(self.reject(ev, Self::blocked(op)).await);
        }
        fill(&mut ev);
        let addr = self.addr(&l)?;
        let intent = self.inner.journal.intent(ev).await?;
        crate::broker::failpoint("after_intent");
        let b = self.clone();
        let task = self.inner.tracker.spawn(async move {
            let busy = Busy::begin(&b, &l.lease_ref);
            let r = match b.wake(&l).await {
                Ok(()) => run(b.clone(), l.clone(), addr).await,
                Err(e) => Err(e),
            };
            drop(busy);
            // A backend failure on a sandbox that no longer exists is
            // `sandbox_gone`, and the lease is marked so (the session's
            // next acquire replaces it).
            let r = match r {
                Err(e) if e.code == Code::ExecutionFailed && b.sandbox_gone(&l).await => {
                    b.mark_gone(&l).await;
                    Err(Self::gone())
                }
                r => r,
            };
            let restore = l.ttl_seconds.is_some();
            // Sent, and no answer: the intent stays pending and the lease
            // is held (no outcome is made up).
            if let Err(e) = &r
                && e.code.holds_lease()
            {
                b.hold(intent, &l).await;
                drop(hold);
                return Err(e.clone());
            }
            crate::broker::failpoint_for("before_outcome", intent.action());
            let r = b.finish(intent, l, r).await;
            drop(hold);
            if restore && let Ok((l, _)) = &r {
                b.restore_ttl(l).await;
            }
            r
        });
        task.await
            .map_err(|_| Error::new(Code::ExecutionFailed, "the operation was interrupted"))?
    }

    /// The answer for a lease an unknown result holds.
    pub(crate) fn blocked(op: &str) -> Error {
        Error::new(
            Code::LeaseBlocked,
            format!(
                "the lease is blocked: operation {op} was sent and its result is unknown (it may have run); \
                 an operator must check and reconcile it (cube-adapter audit reconcile --operation {op} --note ...)"
            ),
        )
    }

    /// Leave an intent pending and hold its lease (`Lease::held_by`), so
    /// that nothing runs on it until the operation is reconciled.
    async fn hold(&self, intent: Intent, l: &Lease) {
        let op = intent.operation_id.clone();
        let lease_ref = l.lease_ref.clone();
        tracing::warn!(lease = %lease_ref, operation = %op, action = %intent.action(), "a call's result is unknown: its intent stays pending and the lease is blocked until reconciled");
        let r = self
            .inner
            .store
            .write(move |txn, _| store::leases::hold(txn, &lease_ref, &op))
            .await;
        if let Err(e) = r {
            tracing::error!(error = %e, "could not record a held lease");
        }
    }

    /// The answer for a lease whose sandbox is gone.
    pub(crate) fn gone() -> Error {
        Error::new(
            Code::SandboxGone,
            "the sandbox behind this lease is gone (it ended, was killed, timed out or died); \
             acquire again with the same session_key for a new, empty one",
        )
    }

    /// Record that a lease's sandbox is gone (if the lease still exists).
    pub(crate) async fn mark_gone(&self, l: &Lease) {
        let lease_ref = l.lease_ref.clone();
        let r = self
            .inner
            .store
            .write(move |txn, _| {
                if let Some(mut l) = store::leases::get(txn, &lease_ref)? {
                    l.state = LeaseState::Gone;
                    put_lease(txn, &l)?;
                }
                Ok(())
            })
            .await;
        if let Err(e) = r {
            tracing::warn!(error = %e, "could not mark a lease gone");
        }
    }

    /// A lease released with `pause` (or found paused) is resumed before
    /// it is used: a real deployment resumes on traffic only with
    /// `cube-lifecycle-manager`, and without it requests reach a frozen VM.
    /// `connect` keeps the traffic token from create.
    async fn wake(&self, l: &Lease) -> Result<()> {
        if l.state != LeaseState::Paused {
            return Ok(());
        }
        let ttl = self
            .profile(&l.profile)
            .map(|p| i64::try_from(p.sandbox_timeout_seconds).unwrap_or(i64::MAX));
        self.client(&l.backend)?
            .connect(&l.sandbox_id, ttl)
            .await
            .map(|_| ())
            .map_err(|e| backend(&e))
    }

    /// After a capped renewal set a shorter idle timeout on the sandbox, the
    /// next use sets the profile's back (a real CubeSandbox keeps a timeout
    /// until it is set again), under its own audit intent.
    pub(crate) async fn restore_ttl(&self, l: &Lease) {
        let Some(prof) = self.profile(&l.profile) else {
            return;
        };
        let secs = prof.sandbox_timeout_seconds;
        let r = self
            .set_sandbox_timeout(l, secs, Action::Keepalive, secs)
            .await;
        if let Err(e) = r {
            tracing::warn!(lease = %l.lease_ref, code = e.code.as_str(), error = %e.message, "could not restore a sandbox's idle timeout");
        }
    }

    /// Record an effect's outcome; on success, touch the lease in the same
    /// transaction (if it still exists: a concurrent kill wins).
    async fn finish<T>(
        &self,
        intent: Intent,
        mut l: Lease,
        r: Result<Done<T>>,
    ) -> Result<(Lease, T)> {
        match r {
            Ok(Done {
                value: t,
                exit_code: exit,
                bytes,
                persist,
                touch,
                fill,
            }) => {
                if touch {
                    let (ts, unix) = self.now();
                    l.last_used_at = ts;
                    l.last_used_unix = unix;
                    l.state = LeaseState::Running;
                }
                let l2 = l.clone();
                self.inner
                    .journal
                    .outcome(
                        intent,
                        Outcome::Ok,
                        |e| {
                            e.exit_code = exit;
                            e.bytes = bytes;
                            if let Some(f) = fill {
                                f(e);
                            }
                        },
                        move |txn| {
                            let exists = store::leases::exists(txn, &l2.lease_ref)?;
                            if exists && touch {
                                put_lease(txn, &l2)?;
                            }
                            // Nothing is recorded under a lease that is gone.
                            match persist {
                                Some(f) if exists => f(txn),
                                _ => Ok(()),
                            }
                        },
                    )
                    .await?;
                Ok((l, t))
            }
            Err(e) => {
                self.fail(intent, &e).await?;
                Err(e)
            }
        }
    }
}
