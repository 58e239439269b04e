//! Back to work after a crash without a person (`[audit] on_crash =
//! "resolve"`, the default). At start, every intent an earlier run left
//! without an outcome gets exactly one `audit_recover` event in the chain,
//! naming it (`operation_id`), before the service serves:
//!
//! - a kill (`release` kill, `gc_release`) is done again (a sandbox already
//!   gone counts) and its lease removed: `ok`;
//! - an `orphan_kill` is `ok`: the sweep below kills what no lease holds;
//! - an `acquire` or `checkpoint_fork` never recorded its lease: `error`
//!   (`interrupted`); the sandbox it may have made holds no lease, and is
//!   killed by the sweep that follows, under its own `orphan_kill`;
//! - a job's start is adopted from its files in the sandbox: a runner
//!   that was started gets the job's record (`ok`: it is read, cancelled
//!   and collected as any other); no files at all, the job never started
//!   (`error`); anything between, or a sandbox that cannot be asked,
//!   `uncertain`;
//! - anything else (an exec, a write, an upload, a PTY's input, a pause…)
//!   may or may not have happened: `uncertain`, for review (`status`
//!   counts them; nothing is run again).
//!
//! A kill whose backend cannot be reached is left `uncertain` too: the
//! lease stays, and a later kill or GC ends it.

use super::leases::Lease;
use super::{Broker, Result};
use crate::audit::event::{Action, Event, Outcome};
use crate::cube::ErrorKind;

/// What a recovery did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Recovered {
    pub done: usize,
    pub failed: usize,
    pub uncertain: usize,
    /// Sandboxes no lease held, killed after.
    pub orphans_killed: usize,
}

impl Broker {
    /// Resolve every pending intent (see the module), then unblock the
    /// journal and sweep the sandboxes no lease holds.
    pub async fn recover_after_crash(&self) -> Result<Recovered> {
        let pending = crate::audit::pending_intents(self.inner.journal.store())?;
        // Held on purpose (a call sent with no answer): an operator's to
        // reconcile, never resolved here.
        let held = crate::audit::held(self.inner.journal.store())?;
        let mut r = Recovered::default();
        let mut sweep = false;
        for (op, intent) in pending {
            if held.contains(&op) {
                continue;
            }
            let (outcome, persist) = self.resolve_intent(&intent).await;
            match outcome {
                Outcome::Ok => r.done += 1,
                Outcome::Error => r.failed += 1,
                _ => r.uncertain += 1,
            }
            sweep |= matches!(
                intent.action,
                Action::Acquire | Action::CheckpointFork | Action::OrphanKill
            );
            let j = &self.inner.journal;
            let mut ev = j.event(Action::AuditRecover);
            ev.outcome = outcome.clone();
            ev.identity_digest = Some(j.digest("identity", b"system\0cube-adapter"));
            ev.tenant_digest = intent.tenant_digest.clone();
            ev.runtime = intent.runtime.clone();
            ev.profile = intent.profile.clone();
            ev.backend = intent.backend.clone();
            ev.lease_ref = intent.lease_ref.clone();
            ev.sandbox_ref = intent.sandbox_ref.clone();
            ev.job_ref = intent.job_ref.clone();
            ev.checkpoint_ref = intent.checkpoint_ref.clone();
            ev.task_ref = intent.task_ref.clone();
            ev.error_code = Some(format!("recovered:{}", intent.action));
            match persist {
                Persist::RemoveLease(l) => {
                    j.resolve(&op, ev, move |txn| {
                        super::upkeep::remove_lease_state(txn, &l)
                    })
                    .await?
                }
                Persist::PutJob(job) => {
                    j.resolve(&op, ev, move |txn| crate::store::jobs::put(txn, &job))
                        .await?
                }
                Persist::Nothing => j.resolve(&op, ev, |_| Ok(())).await?,
            }
            tracing::warn!(
                operation = %op,
                action = %intent.action,
                outcome = %outcome,
                "an intent left by an earlier run is resolved"
            );
        }
        self.inner.journal.unblock_if_clear();
        if sweep {
            for b in self.inner.backends.all() {
                r.orphans_killed += self.kill_unheld(&b.name, &b.client).await;
            }
        }
        Ok(r)
    }

    /// The outcome of one interrupted intent, and what its resolution
    /// writes with it.
    async fn resolve_intent(&self, intent: &Event) -> (Outcome, Persist) {
        let kill = match intent.action {
            Action::Release => intent.release_action.as_deref() != Some("pause"),
            Action::GcRelease => true,
            Action::OrphanKill => return (Outcome::Ok, Persist::Nothing),
            Action::Acquire | Action::CheckpointFork => return (Outcome::Error, Persist::Nothing),
            Action::JobStart => return self.adopt_job(intent).await,
            _ => false,
        };
        if !kill {
            return (Outcome::Uncertain, Persist::Nothing);
        }
        let lease = match &intent.lease_ref {
            Some(lr) => self.get_lease(lr).await.ok().flatten(),
            None => None,
        };
        let Some(l) = lease else {
            // Its lease went with the kill's outcome: the kill was done.
            return (Outcome::Ok, Persist::Nothing);
        };
        let Ok(cube) = self.client(&l.backend) else {
            return (Outcome::Uncertain, Persist::Nothing);
        };
        match cube.kill(&l.sandbox_id).await {
            Ok(()) => {}
            Err(e) if e.kind == ErrorKind::NotFound => {}
            Err(_) => return (Outcome::Uncertain, Persist::Nothing),
        }
        if self
            .delete_lease_snapshots(&l.lease_ref, &l.backend)
            .await
            .is_err()
        {
            return (Outcome::Uncertain, Persist::Nothing);
        }
        self.release_volume(&l).await;
        (Outcome::Ok, Persist::RemoveLease(Box::new(l)))
    }

    /// A job start the crash interrupted, from its files in the sandbox
    /// (`jobs::ADOPT`).
    async fn adopt_job(&self, intent: &Event) -> (Outcome, Persist) {
        const UNKNOWN: (Outcome, Persist) = (Outcome::Uncertain, Persist::Nothing);
        let (Some(jr), Some(lr)) = (&intent.job_ref, &intent.lease_ref) else {
            return UNKNOWN;
        };
        if !super::leases::valid_ref(jr, "job") {
            return UNKNOWN;
        }
        let Ok(Some(l)) = self.get_lease(lr).await else {
            tracing::warn!(job = %jr, lease = %lr, "an interrupted job start: its lease is gone");
            return UNKNOWN;
        };
        let addr = match self.addr(&l) {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(job = %jr, error = %e, "an interrupted job start: its sandbox cannot be reached");
                return UNKNOWN;
            }
        };
        let mut o = crate::cube::StartOptions::shell(super::jobs::ADOPT);
        o.envs = [("J".to_string(), jr.clone())].into();
        o.timeout = Some(std::time::Duration::from_secs(30));
        let out = match addr.cube.run(&addr, &o, 4096).await {
            Ok(out) if out.exit_code == 0 => out,
            Ok(out) => {
                tracing::warn!(job = %jr, exit = out.exit_code, "an interrupted job start: its sandbox could not be asked");
                return UNKNOWN;
            }
            Err(e) => {
                tracing::warn!(job = %jr, error = %e, "an interrupted job start: its sandbox could not be asked");
                return UNKNOWN;
            }
        };
        let said = String::from_utf8_lossy(&out.stdout);
        let said = said.trim().lines().last().unwrap_or_default();
        if said == "none" {
            return (Outcome::Error, Persist::Nothing);
        }
        let Some(pid) = said
            .strip_prefix("pid ")
            .and_then(|p| p.parse::<u32>().ok())
        else {
            tracing::warn!(job = %jr, said, "an interrupted job start: half made, or its runner is unknown");
            return UNKNOWN;
        };
        let (now, _) = self.now();
        let job = crate::store::jobs::Job {
            job_ref: jr.clone(),
            lease_ref: l.lease_ref.clone(),
            tenant: l.tenant.clone(),
            command_digest: intent.command_digest.clone().unwrap_or_default(),
            runner_pid: pid,
            state: crate::store::jobs::JobState::Running,
            exit_code: None,
            cancelled: false,
            created_at: intent.ts.clone(),
            updated_at: now,
            max_seconds: self
                .profile(&l.profile)
                .unwrap_or_default()
                .max_command_seconds,
        };
        (Outcome::Ok, Persist::PutJob(job))
    }
}

/// What resolving an intent writes with its event.
enum Persist {
    Nothing,
    /// A kill done now: the lease's records go.
    RemoveLease(Box<Lease>),
    /// A job adopted from its files.
    PutJob(crate::store::jobs::Job),
}

impl Broker {
    /// Kill every sandbox of this appliance on a backend that no lease
    /// holds (at start, when no create of this process is in flight; with
    /// replicas, only those older than `ORPHAN_AGE`), each under its own
    /// `orphan_kill` intent. How many were killed.
    async fn kill_unheld(&self, name: &str, cube: &crate::cube::CubeClient) -> usize {
        let filter: std::collections::BTreeMap<String, String> =
            [("appliance".to_string(), self.appliance_id())].into();
        let Ok(found) = cube.list(&filter, None).await else {
            return 0;
        };
        let held: std::collections::HashSet<String> = self
            .inner
            .store
            .read(crate::store::leases::all)
            .await
            .unwrap_or_default()
            .into_iter()
            .map(|l| l.sandbox_id)
            .collect();
        // Other replicas of a shared database may be creating sandboxes
        // now: only those old enough that no create can be in flight.
        let shared = self.inner.store.replica().is_some();
        let now = self.now().1;
        let mut n = 0;
        for s in found {
            let started = crate::clock::parse_unix(&s.started_at).unwrap_or(now);
            if shared && now - started < super::upkeep::ORPHAN_AGE {
                continue;
            }
            if !held.contains(&s.sandbox_id)
                && self.kill_orphan(name, &s.sandbox_id, None).await.is_ok()
            {
                n += 1;
            }
        }
        n
    }
}
