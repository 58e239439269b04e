//! Trusted tasks (reference rows 34-42): plan → approve → submit → status →
//! result or cancel → receipt.
//!
//! An agent never runs a trusted task's command itself. It asks for a plan
//! of an operator-owned template with parameters (checked against the
//! template's JSON Schema; nothing runs); an independent approver approves
//! or denies it; the requester submits the approved plan, and the appliance
//! leases a sandbox of the template's profile, runs the rendered command as
//! a job, and, when asked for the result, validates the declared outputs,
//! kills the sandbox and signs a receipt of what ran.
//!
//! Independence: nobody approves a plan they requested themselves; an admin
//! may only where the template's profile says `admin_self_approval`.
//! Where the reference fell short, this goes further: the task's sandbox is
//! invisible to agents (the requester cannot exec into it and change its
//! outputs), approvers of the tenant may follow tasks, and parameters and
//! results are sealed at rest.
//!
//! The flows live in submodules: `plan` (templates, plan, review,
//! approve/deny, pruning), `submit` (submit, the task's lease and job) and
//! `result` (status, result and cancel, output validation, finalize,
//! receipts). This file holds the limits, the types and the helpers they
//! share, among them keeping a task's state up to date.

use serde_json::{Map, Value, json};
use sha2::Digest;

use super::dto;
use super::leases::{FileOp, Lease, MAX_COMMAND, new_ref, valid_ref};
use super::{Broker, Code, Ctx, Error, Result};
use crate::audit::event::{Action, Event, Outcome, Phase};
use crate::auth::Principal;
use crate::clock::format_unix;
use crate::config::TaskTemplate;
use crate::config::tasks::{Expose, OutputFormat, canonical};
use crate::store;
use crate::store::jobs::JobState;
mod plan;
pub use plan::{ConsoleReview, DiffRow, PendingPlan, PlanWhy, PreviousPlan};
mod listing;
pub mod reveal;
pub use listing::{
    ConsoleTask, HeadCheck, LIST_DEFAULT, LIST_MAX, ReceiptCheck, TaskFilter, TaskPage, TaskRow,
};
mod result;
mod submit;

/// Largest parameters object (canonical JSON, bytes).
pub const MAX_PARAMETERS: usize = 256 * 1024;
/// Longest approval or denial reason (bytes).
pub const MAX_REASON: usize = 1024;
/// The runtime trusted tasks' sandboxes are leased with.
pub const TASK_RUNTIME: &str = "mcp";
/// Plans one identity may have open (pending, ready or approved) at once.
pub const MAX_OPEN_PLANS: usize = 64;
/// Content a result may expose in all (bytes); beyond it, outputs are
/// digest only.
pub const MAX_EXPOSED: usize = 8 * 1024 * 1024;

pub use crate::store::plans::{Plan, PlanState};
pub use crate::store::tasks::{Task, TaskState};

/// A reference from a request, if it has the shape of one (only such
/// values reach the audit journal).
fn shaped(r: &str, prefix: &str) -> Option<String> {
    valid_ref(r, prefix).then(|| r.to_string())
}

use crate::store::plans::put as put_plan;
use crate::store::tasks::put as put_task;

/// The job state a job answer names.
fn sha256_hex(b: &[u8]) -> String {
    hex::encode(sha2::Sha256::digest(b))
}

/// A JSON pointer (`/a/0/b`) as the reference prints it (`a.0.b`, or `$`).
fn dotted(pointer: &str) -> String {
    let p = pointer.trim_start_matches('/');
    if p.is_empty() {
        "$".into()
    } else {
        p.split('/')
            .map(|s| s.replace("~1", "/").replace("~0", "~"))
            .collect::<Vec<_>>()
            .join(".")
    }
}

impl Broker {
    fn identity(&self, p: &Principal) -> String {
        self.inner
            .journal
            .digest("identity", p.identity_key().as_bytes())
    }

    fn subject_digest(&self, p: &Principal) -> String {
        self.inner.journal.digest("subject", p.subject.as_bytes())
    }

    /// The digest of a profile's settings in one configuration.
    /// The digest of a profile as it resolves: its settings (its template
    /// among them), and the backend it runs on when that is not `default`
    /// (so that digests made before there were several stay the same).
    fn profile_digest(cfg: &crate::config::Config, name: &str) -> String {
        let v = cfg
            .profiles
            .get(name)
            .and_then(|pr| {
                let mut v = serde_json::to_value(pr).ok()?;
                if let (Some(b), Some(m)) = (cfg.profile_backend(pr), v.as_object_mut())
                    && b != crate::config::DEFAULT_BACKEND
                {
                    m.insert("backend".into(), Value::String(b.to_string()));
                }
                Some(v)
            })
            .unwrap_or(Value::Null);
        sha256_hex(canonical(&v).as_bytes())
    }

    fn task_event(&self, p: &Principal, action: Action, ctx: &Ctx) -> Event {
        let mut ev = self.event(p, action, ctx);
        ev.runtime = Some(TASK_RUNTIME.into());
        ev
    }

    fn template(&self, name: &str) -> Option<TaskTemplate> {
        self.config().tasks.get(name).cloned()
    }

    /// The template a task was made under, if it has not changed.
    fn same_template(&self, name: &str, digest: &str) -> Option<TaskTemplate> {
        self.template(name).filter(|t| t.digest(name) == digest)
    }

    /// A plan's template, if neither it nor its profile has changed.
    fn plan_template(&self, plan: &Plan) -> Option<TaskTemplate> {
        // One policy for both checks.
        let cfg = self.config();
        cfg.tasks
            .get(&plan.template)
            .filter(|t| t.digest(&plan.template) == plan.template_digest)
            .filter(|_| {
                plan.profile_digest.is_empty()
                    || plan.profile_digest == Self::profile_digest(&cfg, &plan.profile)
            })
            .cloned()
    }

    fn changed() -> Error {
        Error::new(
            Code::TaskTemplateChanged,
            "the task template or its profile changed after this plan was made; plan again",
        )
    }

    /// The principal a task's own calls run as: the task's tenant, every
    /// action scope on the task's lease only; the submitter's runtimes and
    /// profiles (checked when the lease is acquired).
    fn task_principal(&self, tenant: &str, base: Option<&Principal>, task_ref: &str) -> Principal {
        let mut p = match base {
            Some(b) => b.for_task(task_ref),
            None => Principal {
                label: None,
                tenant: tenant.to_string(),
                subject: format!("trusted-task:{task_ref}"),
                roles: vec![],
                runtimes: None,
                profiles: None,
                actions: vec![],
                task_templates: vec![],
                task: None,
                issuer: None,
            }
            .for_task(task_ref),
        };
        p.tenant = tenant.to_string();
        p
    }

    fn get_plan(&self, plan_ref: &str) -> Result<Option<Plan>> {
        Ok(self
            .inner
            .store
            .read_now(|txn| store::plans::get(txn, plan_ref))?)
    }

    fn get_task(&self, task_ref: &str) -> Result<Option<Task>> {
        Ok(self
            .inner
            .store
            .read_now(|txn| store::tasks::get(txn, task_ref))?)
    }

    /// A plan of the caller's tenant (any tenant for admins).
    fn tenant_plan(&self, p: &Principal, plan_ref: &str) -> Result<Plan> {
        let missing = || Error::new(Code::TaskPlanNotFound, "no such task plan");
        if !valid_ref(plan_ref, "plan") {
            return Err(missing());
        }
        self.get_plan(plan_ref)?
            .filter(|pl| pl.tenant == p.tenant || p.is_admin())
            .ok_or_else(missing)
    }

    /// May `p` act on (submit, finalize, cancel) what `requester` asked for?
    fn is_requester(&self, p: &Principal, tenant: &str, requester: &str) -> bool {
        p.is_admin() || (p.tenant == tenant && self.identity(p) == requester)
    }

    /// A task the caller may follow (`act`: false) or act on (true): its
    /// requester and admins; approvers and auditors of its tenant may
    /// follow it (status and receipt; results stay the requester's).
    fn visible_task(&self, p: &Principal, task_ref: &str, act: bool) -> Result<Task> {
        let missing = || Error::new(Code::TaskNotFound, "no such task");
        if !valid_ref(task_ref, "task") {
            return Err(missing());
        }
        self.get_task(task_ref)?
            .filter(|t| {
                self.is_requester(p, &t.tenant, &t.requester)
                    || (!act && t.tenant == p.tenant && Self::may_see_plans(p))
            })
            .ok_or_else(missing)
    }

    /// Save a plan (re-read in the transaction: only a plan still in the
    /// state it was read in is changed) with its event.
    async fn save_plan(&self, plan: &Plan, was: PlanState, ev: Event) -> Result<()> {
        let p2 = plan.clone();
        let saved = self
            .inner
            .store
            .write(move |txn, chain| {
                let now = store::plans::get(txn, &p2.plan_ref)?;
                if now.is_some_and(|n| n.state != was) {
                    return Ok(false);
                }
                put_plan(txn, &p2)?;
                chain.append(txn, ev)?;
                Ok(true)
            })
            .await?;
        if saved {
            Ok(())
        } else {
            Err(Error::new(
                Code::PlanNotPending,
                "the plan changed meanwhile; look at it again",
            ))
        }
    }

    /// Mark a plan expired if its time is up (saved with an event). The
    /// expiry is the appliance's doing, recorded as such, whoever's look
    /// noticed it.
    async fn expire(&self, ctx: &Ctx, plan: &mut Plan) -> Result<bool> {
        if plan.state == PlanState::Expired {
            return Ok(true);
        }
        if !plan.state.is_live() || self.now().1 < plan.expires_unix {
            return Ok(false);
        }
        let was = plan.state;
        plan.state = PlanState::Expired;
        let j = &self.inner.journal;
        let mut ev = j.event(Action::TaskPlanExpired);
        ev.phase = Phase::Event;
        ev.identity_digest = Some(j.digest("identity", b"system\0cube-adapter"));
        ev.tenant_digest = Some(j.digest("tenant", plan.tenant.as_bytes()));
        if !ctx.request_id.is_empty() {
            ev.request_id = Some(ctx.request_id.clone());
        }
        ev.outcome = Outcome::Ok;
        ev.plan_ref = Some(plan.plan_ref.clone());
        ev.task_template = Some(plan.template.clone());
        self.save_plan(plan, was, ev).await?;
        Ok(true)
    }

    fn plan_answer(&self, plan: &Plan, ctx: &Ctx) -> dto::PlanAnswer {
        dto::PlanAnswer::new(plan, &ctx.request_id)
    }

    /// A task's fields; its result and receipt once they exist, when
    /// `with_result` (callers who may act on it).
    fn task_answer(&self, t: &Task, ctx: &Ctx, with_result: bool) -> Result<dto::TaskAnswer> {
        let (result, receipt) = if with_result && t.result_sealed.is_some() {
            (
                Some(self.task_result_value(t)?),
                Some(t.receipt.clone().unwrap_or(Value::Null)),
            )
        } else {
            (None, None)
        };
        Ok(dto::TaskAnswer {
            cleanup: t.cleanup.clone(),
            completed_at: t.completed_at.clone(),
            created_at: t.created_at.clone(),
            execution_ended: t.execution_ended(),
            exit_code: t.exit_code,
            plan_ref: t.plan_ref.clone(),
            profile: t.profile.clone(),
            receipt,
            receipt_ready: t.receipt.is_some(),
            request_id: ctx.request_id.clone(),
            result,
            result_ready: t.result_sealed.is_some(),
            sandbox_ref: t.sandbox_ref.clone(),
            setup_error: t.setup_error.clone(),
            state: t.state,
            task_ref: t.task_ref.clone(),
            task_template: t.template.clone(),
            template_sha256: t.template_digest.clone(),
            updated_at: t.updated_at.clone(),
        })
    }

    fn task_result_value(&self, t: &Task) -> Result<Value> {
        match &t.result_sealed {
            None => Ok(Value::Null),
            Some(s) => {
                let raw = self.inner.store.sealer.open(s)?;
                serde_json::from_slice(&raw).map_err(|_| {
                    Error::new(Code::AuditUnavailable, "a stored task result is corrupt")
                })
            }
        }
    }

    fn save_task_event(&self, task: &Task, action: Action, ctx: &Ctx, outcome: Outcome) -> Event {
        let j = &self.inner.journal;
        let mut ev = j.event(action);
        ev.identity_digest = Some(task.requester.clone());
        ev.tenant_digest = Some(j.digest("tenant", task.tenant.as_bytes()));
        ev.runtime = Some(TASK_RUNTIME.into());
        if !ctx.request_id.is_empty() {
            ev.request_id = Some(ctx.request_id.clone());
        }
        ev.phase = Phase::Event;
        ev.outcome = outcome;
        ev.plan_ref = Some(task.plan_ref.clone());
        ev.task_ref = Some(task.task_ref.clone());
        ev.task_template = Some(task.template.clone());
        ev.profile = Some(task.profile.clone());
        ev.lease_ref = task.lease_ref.clone();
        ev.sandbox_ref = task.sandbox_ref.clone();
        ev.job_ref = task.job_ref.clone();
        ev.task_state = Some(task.state.to_string());
        ev.cleanup = task.cleanup.clone();
        ev.exit_code = task.exit_code;
        ev
    }

    /// Save a task with an event in the same transaction.
    async fn save_task(&self, task: &Task, ev: Event) -> Result<()> {
        let t2 = task.clone();
        self.inner
            .store
            .write(move |txn, chain| {
                put_task(txn, &t2)?;
                chain.append(txn, ev)?;
                Ok(())
            })
            .await?;
        Ok(())
    }

    /// The task's lease, wherever its record says it is (or, after an
    /// interrupted setup, wherever a lease marked with it is).
    async fn task_lease(&self, task: &Task) -> Result<Option<Lease>> {
        let tr = task.task_ref.clone();
        let known = task.lease_ref.clone();
        // A scan (after an interrupted setup): on the blocking pool.
        Ok(self
            .inner
            .store
            .read(move |txn| {
                if let Some(r) = known {
                    return store::leases::get(txn, &r);
                }
                Ok(store::leases::all(txn)?
                    .into_iter()
                    .find(|l| l.task_ref.as_deref() == Some(tr.as_str())))
            })
            .await?)
    }

    /// Kill the task's sandbox (and forget its lease): `verified` when it
    /// is gone, `pending` when it could not be killed (retried later).
    async fn kill_task_lease(&self, tp: &Principal, ctx: &Ctx, task: &Task) -> &'static str {
        let lease = match self.task_lease(task).await {
            Ok(Some(l)) => l,
            Ok(None) => return "verified",
            Err(_) => return "pending",
        };
        match self.release(tp, ctx, &lease.lease_ref, "kill").await {
            Ok(_) => "verified",
            Err(e) if e.code == Code::LeaseNotFound => "verified",
            Err(e) => {
                tracing::warn!(task = %task.task_ref, error = %e, "could not kill a trusted task's sandbox");
                "pending"
            }
        }
    }

    /// Bring a task's execution state up to date (under the task's lock).
    async fn refresh_task(&self, ctx: &Ctx, mut task: Task) -> Result<Task> {
        let tp = self.task_principal(&task.tenant, None, &task.task_ref);
        let before = task.state;
        if task.state == TaskState::Starting {
            // Its setup holds the lock while it runs: this one was cut
            // short (a restart). A job it started is adopted, never re-run;
            // a sandbox without one is ended.
            let lease = self.task_lease(&task).await?;
            let job = match &lease {
                Some(l) => {
                    let lr = l.lease_ref.clone();
                    self.inner
                        .store
                        .read_now(move |txn| super::jobs::lease_jobs(txn, &lr))?
                        .into_iter()
                        .next()
                }
                None => None,
            };
            match (lease, job) {
                (Some(l), Some(j)) => {
                    task.lease_ref = Some(l.lease_ref);
                    task.sandbox_ref = Some(l.sandbox_ref);
                    task.job_ref = Some(j.job_ref);
                    task.state = TaskState::Running;
                }
                _ => {
                    task.state = TaskState::SetupFailed;
                    task.setup_error = Some(
                        "interrupted: the appliance stopped during the task's setup, before its command started; its sandbox was ended"
                            .into(),
                    );
                    task.cleanup = Some(self.kill_task_lease(&tp, ctx, &task).await.into());
                }
            }
        }
        if task.state == TaskState::Running {
            let job = task.job_ref.clone().unwrap_or_default();
            match self.job_status(&tp, ctx, &job).await {
                Ok(v) => {
                    task.state = match v.state {
                        JobState::Lost => TaskState::Orphaned,
                        s => s.into(),
                    };
                    task.exit_code = v.exit_code;
                }
                Err(e) if matches!(e.code, Code::JobNotFound | Code::LeaseNotFound) => {
                    task.state = TaskState::Orphaned;
                }
                Err(e) => return Err(e),
            }
        }
        if task.state != before {
            task.updated_at = self.now().0;
            let ev = self.save_task_event(&task, Action::TaskState, ctx, Outcome::Ok);
            self.save_task(&task, ev).await?;
        }
        Ok(task)
    }
}

#[cfg(test)]
mod tests {
    use super::dotted;

    #[test]
    fn json_paths_as_the_reference_prints_them() {
        assert_eq!(dotted(""), "$");
        assert_eq!(dotted("/epochs"), "epochs");
        assert_eq!(dotted("/a/0/b~1c"), "a.0.b/c");
    }
}
