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

use serde_json::{Map, Value, json};
use sha2::Digest;

use super::leases::{FileOp, Lease, MAX_COMMAND, new_ref, valid_ref};
use super::{Broker, Code, Ctx, Error, Result};
use crate::audit::event::Event;
use crate::auth::Principal;
use crate::clock::format_unix;
use crate::config::TaskTemplate;
use crate::config::tasks::{Expose, OutputFormat, canonical};
use crate::store;
use crate::store::jobs::JobState;

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
fn job_state(v: &Value) -> Option<JobState> {
    v.get("state")
        .and_then(|s| serde_json::from_value(s.clone()).ok())
}

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
        self.inner.journal.digest(
            "identity",
            format!("{}\0{}", p.tenant, p.subject).as_bytes(),
        )
    }

    fn subject_digest(&self, p: &Principal) -> String {
        self.inner.journal.digest("subject", p.subject.as_bytes())
    }

    /// The digest of a profile's settings in one configuration.
    fn profile_digest(cfg: &crate::config::Config, name: &str) -> String {
        let v = cfg
            .profiles
            .get(name)
            .and_then(|pr| serde_json::to_value(pr).ok())
            .unwrap_or(Value::Null);
        sha256_hex(canonical(&v).as_bytes())
    }

    fn task_event(&self, p: &Principal, action: &str, ctx: &Ctx) -> Event {
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
                tenant: tenant.to_string(),
                subject: format!("trusted-task:{task_ref}"),
                roles: vec![],
                runtimes: None,
                profiles: None,
                actions: vec![],
                task_templates: vec![],
                task: None,
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
    /// requester and admins; approvers of its tenant may follow it.
    fn visible_task(&self, p: &Principal, task_ref: &str, act: bool) -> Result<Task> {
        let missing = || Error::new(Code::TaskNotFound, "no such task");
        if !valid_ref(task_ref, "task") {
            return Err(missing());
        }
        self.get_task(task_ref)?
            .filter(|t| {
                self.is_requester(p, &t.tenant, &t.requester)
                    || (!act && t.tenant == p.tenant && p.may_approve())
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

    /// Mark a plan expired if its time is up (saved with an event).
    async fn expire(&self, p: &Principal, ctx: &Ctx, plan: &mut Plan) -> Result<bool> {
        if plan.state == PlanState::Expired {
            return Ok(true);
        }
        if !plan.state.is_live() || self.now().1 < plan.expires_unix {
            return Ok(false);
        }
        let was = plan.state;
        plan.state = PlanState::Expired;
        let mut ev = self.task_event(p, "task_plan_expired", ctx);
        ev.outcome = "ok".into();
        ev.plan_ref = Some(plan.plan_ref.clone());
        ev.task_template = Some(plan.template.clone());
        self.save_plan(plan, was, ev).await?;
        Ok(true)
    }

    fn plan_answer(&self, plan: &Plan, ctx: &Ctx) -> Map<String, Value> {
        let mut m = Map::new();
        for (k, v) in [
            ("plan_ref", json!(plan.plan_ref)),
            ("task_template", json!(plan.template)),
            ("template_sha256", json!(plan.template_digest)),
            ("parameters_sha256", json!(plan.parameters_sha256)),
            ("command_sha256", json!(plan.command_sha256)),
            ("profile", json!(plan.profile)),
            ("state", json!(plan.state)),
            ("approval_required", json!(plan.approval_required)),
            ("created_at", json!(plan.created_at)),
            ("expires_at", json!(plan.expires_at)),
            ("approved_at", json!(plan.approved_at)),
            ("decided_at", json!(plan.decided_at)),
            ("task_ref", json!(plan.task_ref)),
            ("request_id", json!(ctx.request_id)),
        ] {
            m.insert(k.into(), v);
        }
        m
    }

    /// A task's fields; its result and receipt once they exist, when
    /// `with_result` (callers who may act on it).
    fn task_answer(&self, t: &Task, ctx: &Ctx, with_result: bool) -> Result<Value> {
        let mut m = Map::new();
        for (k, v) in [
            ("task_ref", json!(t.task_ref)),
            ("plan_ref", json!(t.plan_ref)),
            ("task_template", json!(t.template)),
            ("template_sha256", json!(t.template_digest)),
            ("profile", json!(t.profile)),
            ("state", json!(t.state)),
            ("sandbox_ref", json!(t.sandbox_ref)),
            ("exit_code", json!(t.exit_code)),
            ("created_at", json!(t.created_at)),
            ("updated_at", json!(t.updated_at)),
            ("completed_at", json!(t.completed_at)),
            ("cleanup", json!(t.cleanup)),
            ("execution_ended", json!(t.execution_ended())),
            ("result_ready", json!(t.result_sealed.is_some())),
            ("receipt_ready", json!(t.receipt.is_some())),
            ("request_id", json!(ctx.request_id)),
        ] {
            m.insert(k.into(), v);
        }
        if with_result && t.result_sealed.is_some() {
            m.insert("result".into(), self.task_result_value(t)?);
            m.insert("receipt".into(), t.receipt.clone().unwrap_or(Value::Null));
        }
        Ok(Value::Object(m))
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

    /// `GET /v1/task-templates`: the templates this identity may plan.
    pub async fn list_task_templates(&self, p: &Principal, ctx: &Ctx) -> Result<Value> {
        let ev = self.task_event(p, "task_templates", ctx);
        self.authorize(p, "task:plan", &ev).await?;
        let list: Vec<Value> = self
            .config()
            .tasks
            .iter()
            .filter(|(n, t)| p.allows_task_template(n) && p.allows_profile(&t.profile))
            .map(|(n, t)| t.contract(n))
            .collect();
        Ok(json!({"task_templates": list, "request_id": ctx.request_id}))
    }

    /// `POST /v1/tasks/plan` (201): validate parameters and make a plan.
    /// Nothing runs.
    pub async fn plan_task(
        &self,
        p: &Principal,
        ctx: &Ctx,
        template: &str,
        parameters: Option<&Value>,
    ) -> Result<Value> {
        let mut ev = self.task_event(p, "task_plan", ctx);
        self.authorize(p, "task:plan", &ev).await?;
        if !crate::config::valid_profile_name(template) {
            return Err(Error::new(
                Code::InvalidRequest,
                "template must match ^[a-z][a-z0-9-]{0,62}$",
            ));
        }
        ev.task_template = Some(template.to_string());
        let denied = || {
            Error::new(
                Code::TaskTemplateDenied,
                format!("task template {template} is not available to this identity"),
            )
        };
        // One policy for the whole plan, however a reload goes meanwhile.
        let policy = self.policy();
        let Some(t) = policy
            .cfg
            .tasks
            .get(template)
            .filter(|_| p.allows_task_template(template))
        else {
            return Err(self.reject(ev, denied()).await);
        };
        ev.profile = Some(t.profile.clone());
        let prof = policy
            .cfg
            .profiles
            .get(&t.profile)
            .cloned()
            .unwrap_or_default();
        if !p.allows_profile(&t.profile) {
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        Code::ProfileDenied,
                        format!("profile {} is not available to this identity", t.profile),
                    ),
                )
                .await);
        }
        if !p.allows_runtime(TASK_RUNTIME)
            || !prof.allowed_runtimes.iter().any(|r| r == TASK_RUNTIME)
        {
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        Code::RuntimeDenied,
                        format!("trusted tasks run with runtime {TASK_RUNTIME}, which this identity or profile does not allow"),
                    ),
                )
                .await);
        }
        let Some(parameters) = parameters.filter(|v| v.is_object()) else {
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        Code::InvalidParameters,
                        "parameters must be a JSON object ($)",
                    ),
                )
                .await);
        };
        let canon = canonical(parameters);
        if canon.len() > MAX_PARAMETERS {
            return Err(Error::new(
                Code::ValueTooLarge,
                format!("parameters are larger than {MAX_PARAMETERS} bytes"),
            ));
        }
        let Some(compiled) = policy.schemas.get(template) else {
            return Err(Error::new(
                Code::ExecutionFailed,
                "the task template's schema does not compile",
            ));
        };
        if let Err(e) = compiled.parameters.validate(parameters) {
            // Only where: the value itself may be sensitive.
            let at = dotted(e.instance_path().as_str());
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        Code::InvalidParameters,
                        format!("parameters do not match the template's schema at {at}"),
                    ),
                )
                .await);
        }
        let command = match t.render(parameters) {
            Ok(c) => c,
            Err(m) => {
                return Err(self
                    .reject(ev, Error::new(Code::InvalidParameters, m))
                    .await);
            }
        };
        if command.len() > MAX_COMMAND {
            return Err(Error::new(
                Code::ValueTooLarge,
                format!("the rendered command is longer than {MAX_COMMAND} bytes"),
            ));
        }
        self.inner.journal.check()?;
        // One requester's open plans are bounded (each holds up to 256 KiB).
        let me = self.identity(p);
        let _quota = self.lock(format!("plans:{me}")).await;
        let (m2, t_now) = (me.clone(), self.now().1);
        let open = self
            .inner
            .store
            .read(move |txn| {
                Ok(store::plans::all(txn)?
                    .iter()
                    .filter(|pl| {
                        pl.requester == m2 && pl.state.is_live() && pl.expires_unix > t_now
                    })
                    .count())
            })
            .await?;
        if open >= MAX_OPEN_PLANS {
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        Code::PlanQuotaExceeded,
                        format!("this identity already has {open} open plans (at most {MAX_OPEN_PLANS}); submit or let some expire"),
                    ),
                )
                .await);
        }
        let (ts, unix) = self.now();
        let ttl = i64::try_from(t.plan_ttl_seconds).unwrap_or(i64::MAX);
        let expires_unix = unix.saturating_add(ttl);
        let plan = Plan {
            plan_ref: new_ref("plan"),
            tenant: p.tenant.clone(),
            requester: me,
            requester_subject: self.subject_digest(p),
            template: template.to_string(),
            template_digest: t.digest(template),
            profile: t.profile.clone(),
            profile_digest: Self::profile_digest(&policy.cfg, &t.profile),
            parameters_sealed: self.inner.store.sealer.seal(canon.as_bytes())?,
            parameters_sha256: sha256_hex(canon.as_bytes()),
            command_sha256: sha256_hex(command.as_bytes()),
            state: if t.approval_required {
                PlanState::PendingApproval
            } else {
                PlanState::Ready
            },
            approval_required: t.approval_required,
            created_at: ts,
            expires_at: format_unix(expires_unix),
            expires_unix,
            approved_at: None,
            approver: None,
            decided_at: None,
            denial_reason_sha256: None,
            task_ref: None,
        };
        let j = &self.inner.journal;
        ev.outcome = "ok".into();
        ev.plan_ref = Some(plan.plan_ref.clone());
        ev.parameters_digest = Some(j.digest("parameters", canon.as_bytes()));
        ev.command_digest = Some(j.digest("command", command.as_bytes()));
        let p2 = plan.clone();
        self.inner
            .store
            .write(move |txn, chain| {
                put_plan(txn, &p2)?;
                chain.append(txn, ev)?;
                Ok(())
            })
            .await?;
        Ok(Value::Object(self.plan_answer(&plan, ctx)))
    }

    /// `GET /v1/task-plans/{ref}`: the plan, the template's contract, and
    /// for approvers the parameters.
    pub async fn review_plan(&self, p: &Principal, ctx: &Ctx, plan_ref: &str) -> Result<Value> {
        let mut ev = self.task_event(p, "task_plan_review", ctx);
        ev.plan_ref = shaped(plan_ref, "plan");
        let scope = if p.may_approve() {
            "task:approve"
        } else {
            "task:status"
        };
        self.authorize(p, scope, &ev).await?;
        let _lock = self.lock(format!("task-plan:{plan_ref}")).await;
        let mut plan = self.tenant_plan(p, plan_ref)?;
        if !self.is_requester(p, &plan.tenant, &plan.requester) && !p.may_approve() {
            return Err(Error::new(Code::TaskPlanNotFound, "no such task plan"));
        }
        ev.task_template = Some(plan.template.clone());
        if self.expire(p, ctx, &mut plan).await? {
            return Err(self
                .reject(ev, Error::new(Code::PlanExpired, "the plan has expired"))
                .await);
        }
        let Some(t) = self.plan_template(&plan) else {
            return Err(self.reject(ev, Self::changed()).await);
        };
        let mut m = self.plan_answer(&plan, ctx);
        m.insert("contract".into(), t.contract(&plan.template));
        if p.may_approve() {
            let raw = self.inner.store.sealer.open(&plan.parameters_sealed)?;
            let v: Value = serde_json::from_slice(&raw)
                .map_err(|_| Error::new(Code::AuditUnavailable, "a stored plan is corrupt"))?;
            m.insert("parameters".into(), v);
        }
        ev.outcome = "ok".into();
        self.inner.journal.record(ev).await?;
        Ok(Value::Object(m))
    }

    /// `POST /v1/task-plans/{ref}/approve`: an independent approver's
    /// decision.
    pub async fn decide_plan(
        &self,
        p: &Principal,
        ctx: &Ctx,
        plan_ref: &str,
        decision: Option<&str>,
        reason: Option<&str>,
    ) -> Result<Value> {
        let approve = match decision.unwrap_or("approve") {
            "approve" => true,
            "deny" => false,
            _ => {
                return Err(Error::new(
                    Code::InvalidDecision,
                    "decision must be approve or deny",
                ));
            }
        };
        if reason.is_some_and(|r| r.len() > MAX_REASON) {
            return Err(Error::new(
                Code::ValueTooLarge,
                format!("reason is longer than {MAX_REASON} bytes"),
            ));
        }
        let mut ev = self.task_event(p, if approve { "task_approve" } else { "task_deny" }, ctx);
        ev.plan_ref = shaped(plan_ref, "plan");
        ev.decision = Some(if approve { "approve" } else { "deny" }.into());
        self.authorize(p, "task:approve", &ev).await?;
        if !p.may_approve() {
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        Code::ApproverRequired,
                        "only approvers decide on task plans",
                    ),
                )
                .await);
        }
        let _lock = self.lock(format!("task-plan:{plan_ref}")).await;
        let mut plan = self.tenant_plan(p, plan_ref)?;
        ev.task_template = Some(plan.template.clone());
        ev.profile = Some(plan.profile.clone());
        if self.expire(p, ctx, &mut plan).await? {
            return Err(self
                .reject(ev, Error::new(Code::PlanExpired, "the plan has expired"))
                .await);
        }
        if plan.state != PlanState::PendingApproval {
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        Code::PlanNotPending,
                        format!("the plan is {}, not pending approval", plan.state),
                    ),
                )
                .await);
        }
        if self.plan_template(&plan).is_none() {
            return Err(self.reject(ev, Self::changed()).await);
        }
        if !p.allows_task_template(&plan.template) || !p.allows_profile(&plan.profile) {
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        Code::TaskTemplateDenied,
                        format!(
                            "task template {} is not available to this identity",
                            plan.template
                        ),
                    ),
                )
                .await);
        }
        // Independence: not the requester, nor the same subject in another
        // tenant (an admin elsewhere), unless the profile lets admins.
        let me = self.identity(p);
        let same_person = me == plan.requester
            || (p.is_admin() && plan.requester_subject == self.subject_digest(p));
        let admin_may = p.is_admin()
            && self
                .profile(&plan.profile)
                .is_some_and(|pr| pr.admin_self_approval);
        if same_person && !admin_may {
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        Code::SelfApprovalDenied,
                        "a plan must be approved by someone other than its requester",
                    ),
                )
                .await);
        }
        self.inner.journal.check()?;
        let (ts, _) = self.now();
        plan.approver = Some(me.clone());
        plan.decided_at = Some(ts.clone());
        if approve {
            plan.state = PlanState::Approved;
            plan.approved_at = Some(ts);
        } else {
            plan.state = PlanState::Denied;
            plan.denial_reason_sha256 = reason.map(|r| sha256_hex(r.as_bytes()));
        }
        ev.outcome = "ok".into();
        ev.approver_digest = Some(me);
        ev.reason_digest = reason.map(|r| self.inner.journal.digest("reason", r.as_bytes()));
        self.save_plan(&plan, PlanState::PendingApproval, ev)
            .await?;
        Ok(Value::Object(self.plan_answer(&plan, ctx)))
    }

    /// `POST /v1/task-plans/{ref}/submit` (202): run an approved (or
    /// ready) plan. Idempotent: a submitted plan answers with its task.
    pub async fn submit_plan(&self, p: &Principal, ctx: &Ctx, plan_ref: &str) -> Result<Value> {
        let mut ev = self.task_event(p, "task_submit", ctx);
        ev.plan_ref = shaped(plan_ref, "plan");
        self.authorize(p, "task:submit", &ev).await?;
        let plan_lock = self.lock(format!("task-plan:{plan_ref}")).await;
        let mut plan = self.tenant_plan(p, plan_ref)?;
        if !self.is_requester(p, &plan.tenant, &plan.requester) {
            return Err(Error::new(Code::TaskPlanNotFound, "no such task plan"));
        }
        ev.task_template = Some(plan.template.clone());
        ev.profile = Some(plan.profile.clone());
        self.inner.journal.check()?;
        if let Some(tr) = &plan.task_ref
            && let Some(t) = self.get_task(tr)?
        {
            ev.outcome = "ok".into();
            ev.task_ref = Some(t.task_ref.clone());
            ev.reused = Some(true);
            self.inner.journal.record(ev).await?;
            return self.task_answer(&t, ctx, true);
        }
        if self.expire(p, ctx, &mut plan).await? {
            return Err(self
                .reject(ev, Error::new(Code::PlanExpired, "the plan has expired"))
                .await);
        }
        let ok_state = if plan.approval_required {
            plan.state == PlanState::Approved
        } else {
            plan.state == PlanState::Ready
        };
        if !ok_state {
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        Code::PlanNotApproved,
                        format!("the plan is {}; it runs once approved", plan.state),
                    ),
                )
                .await);
        }
        // The submitter may still use what was planned.
        if !p.is_admin()
            && (!p.allows_task_template(&plan.template) || !p.allows_profile(&plan.profile))
        {
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        Code::TaskTemplateDenied,
                        format!(
                            "task template {} is no longer available to this identity",
                            plan.template
                        ),
                    ),
                )
                .await);
        }
        let Some(t) = self.plan_template(&plan) else {
            return Err(self.reject(ev, Self::changed()).await);
        };
        let raw = self.inner.store.sealer.open(&plan.parameters_sealed)?;
        let params: Value = serde_json::from_slice(&raw)
            .map_err(|_| Error::new(Code::AuditUnavailable, "a stored plan is corrupt"))?;
        let command = t
            .render(&params)
            .map_err(|m| Error::new(Code::InvalidParameters, m))?;
        if sha256_hex(command.as_bytes()) != plan.command_sha256 {
            return Err(self.reject(ev, Self::changed()).await);
        }
        let (ts, _) = self.now();
        let task = Task {
            task_ref: new_ref("task"),
            plan_ref: plan.plan_ref.clone(),
            tenant: plan.tenant.clone(),
            requester: plan.requester.clone(),
            approver: plan.approver.clone().filter(|_| plan.approval_required),
            approved_at: plan.approved_at.clone(),
            template: plan.template.clone(),
            template_digest: plan.template_digest.clone(),
            profile: plan.profile.clone(),
            parameters_sha256: plan.parameters_sha256.clone(),
            command_sha256: plan.command_sha256.clone(),
            state: TaskState::Starting,
            lease_ref: None,
            sandbox_ref: None,
            job_ref: None,
            exit_code: None,
            created_at: ts.clone(),
            updated_at: ts,
            result_sealed: None,
            receipt: None,
            completed_at: None,
            cleanup: None,
        };
        let was = plan.state;
        plan.state = PlanState::Submitted;
        plan.task_ref = Some(task.task_ref.clone());
        ev.outcome = "ok".into();
        ev.task_ref = Some(task.task_ref.clone());
        ev.approver_digest = task.approver.clone();
        ev.command_digest = Some(self.inner.journal.digest("command", command.as_bytes()));
        // The task's lock is taken before the plan's is let go: status and
        // result wait for the setup.
        let task_lock = self.lock(format!("task:{}", task.task_ref)).await;
        let t2 = task.clone();
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
                put_task(txn, &t2)?;
                chain.append(txn, ev)?;
                Ok(true)
            })
            .await?;
        if !saved {
            return Err(Error::new(
                Code::PlanNotApproved,
                "the plan changed meanwhile; look at it again",
            ));
        }
        drop(plan_lock);
        // The setup runs to its end (and records it) even if the client
        // goes away; it holds the task's lock until then.
        let b = self.clone();
        let (p2, ctx2) = (p.clone(), ctx.clone());
        let job = self.inner.tracker.spawn(async move {
            let _lock = task_lock;
            b.start_task(&p2, &ctx2, task, &t, &command).await
        });
        let task = job
            .await
            .map_err(|_| Error::new(Code::ExecutionFailed, "the operation was interrupted"))??;
        self.task_answer(&task, ctx, true)
    }

    fn save_task_event(&self, task: &Task, action: &str, ctx: &Ctx, outcome: &str) -> Event {
        let j = &self.inner.journal;
        let mut ev = j.event(action);
        ev.identity_digest = Some(task.requester.clone());
        ev.tenant_digest = Some(j.digest("tenant", task.tenant.as_bytes()));
        ev.runtime = Some(TASK_RUNTIME.into());
        if !ctx.request_id.is_empty() {
            ev.request_id = Some(ctx.request_id.clone());
        }
        ev.phase = "event".into();
        ev.outcome = outcome.into();
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

    /// The session hash of a task's lease: in a domain of its own (a tenant
    /// name has no space), so no session key given to acquire can take it.
    fn task_session(&self, task: &Task) -> String {
        self.hmac_hex(&[
            b"trusted task",
            task.tenant.as_bytes(),
            task.task_ref.as_bytes(),
        ])
        .chars()
        .take(24)
        .collect()
    }

    /// Lease the task's sandbox and start its job; on failure, kill what
    /// was made and record `setup_failed`.
    async fn start_task(
        &self,
        p: &Principal,
        ctx: &Ctx,
        mut task: Task,
        t: &TaskTemplate,
        command: &str,
    ) -> Result<Task> {
        let tp = self.task_principal(&task.tenant, Some(p), &task.task_ref);
        let lease = self
            .acquire_lease(
                &tp,
                ctx,
                TASK_RUNTIME,
                &self.task_session(&task),
                Some(&task.profile),
                Some(&task.task_ref),
            )
            .await;
        let r = match lease {
            Ok((lease, _)) => {
                // Known from here on, so a restart finds and ends it.
                task.lease_ref = Some(lease.lease_ref.clone());
                task.sandbox_ref = Some(lease.sandbox_ref.clone());
                task.updated_at = self.now().0;
                let t2 = task.clone();
                self.inner
                    .store
                    .write(move |txn, _| put_task(txn, &t2))
                    .await?;
                self.start_job(&tp, ctx, &lease.lease_ref, command, Some(&t.command.cwd))
                    .await
                    .and_then(|v| {
                        v.get("job_ref")
                            .and_then(Value::as_str)
                            .map(str::to_string)
                            .ok_or_else(|| {
                                Error::new(Code::ExecutionFailed, "the task's job did not start")
                            })
                    })
            }
            Err(e) => Err(e),
        };
        task.updated_at = self.now().0;
        match r {
            Ok(job) => {
                task.job_ref = Some(job);
                task.state = TaskState::Running;
                let ev = self.save_task_event(&task, "task_started", ctx, "ok");
                self.save_task(&task, ev).await?;
                Ok(task)
            }
            Err(e) => {
                task.state = TaskState::SetupFailed;
                task.cleanup = Some(self.kill_task_lease(&tp, ctx, &task).await.into());
                let mut ev = self.save_task_event(&task, "task_setup", ctx, "error");
                ev.error_code = Some(e.code.to_string());
                self.save_task(&task, ev).await?;
                Err(e)
            }
        }
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
                    task.cleanup = Some(self.kill_task_lease(&tp, ctx, &task).await.into());
                }
            }
        }
        if task.state == TaskState::Running {
            let job = task.job_ref.clone().unwrap_or_default();
            match self.job_status(&tp, ctx, &job).await {
                Ok(v) => {
                    task.state = match job_state(&v) {
                        Some(JobState::Lost) => TaskState::Orphaned,
                        Some(s) => s.into(),
                        None => TaskState::Running,
                    };
                    task.exit_code = v
                        .get("exit_code")
                        .and_then(Value::as_i64)
                        .and_then(|c| i32::try_from(c).ok());
                }
                Err(e) if matches!(e.code, Code::JobNotFound | Code::LeaseNotFound) => {
                    task.state = TaskState::Orphaned;
                }
                Err(e) => return Err(e),
            }
        }
        if task.state != before {
            task.updated_at = self.now().0;
            let ev = self.save_task_event(&task, "task_state", ctx, "ok");
            self.save_task(&task, ev).await?;
        }
        Ok(task)
    }

    /// `GET|POST /v1/tasks/{ref}/status`.
    pub async fn task_status(&self, p: &Principal, ctx: &Ctx, task_ref: &str) -> Result<Value> {
        let mut ev = self.task_event(p, "task_status", ctx);
        ev.task_ref = shaped(task_ref, "task");
        self.authorize(p, "task:status", &ev).await?;
        self.visible_task(p, task_ref, false)?;
        let lock = self.lock(format!("task:{task_ref}")).await;
        let task = self.visible_task(p, task_ref, false)?;
        let b = self.clone();
        let c2 = ctx.clone();
        let task = self
            .inner
            .tracker
            .spawn(async move {
                let _lock = lock;
                b.refresh_task(&c2, task).await
            })
            .await
            .map_err(|_| Error::new(Code::ExecutionFailed, "the operation was interrupted"))??;
        ev.outcome = "ok".into();
        ev.task_state = Some(task.state.to_string());
        self.inner.journal.record(ev).await?;
        let act = self.is_requester(p, &task.tenant, &task.requester);
        self.task_answer(&task, ctx, act)
    }

    /// `POST /v1/tasks/{ref}/result`: validate outputs, kill the sandbox,
    /// sign the receipt. Idempotent once signed.
    pub async fn task_result(&self, p: &Principal, ctx: &Ctx, task_ref: &str) -> Result<Value> {
        self.finalize(p, ctx, task_ref, false).await
    }

    /// `POST /v1/tasks/{ref}/cancel`: cancel the job, then finalize.
    pub async fn cancel_task(&self, p: &Principal, ctx: &Ctx, task_ref: &str) -> Result<Value> {
        self.finalize(p, ctx, task_ref, true).await
    }

    async fn finalize(
        &self,
        p: &Principal,
        ctx: &Ctx,
        task_ref: &str,
        cancel: bool,
    ) -> Result<Value> {
        let (action, scope) = if cancel {
            ("task_cancel", "task:cancel")
        } else {
            ("task_finalize", "task:result")
        };
        let mut ev = self.task_event(p, action, ctx);
        ev.task_ref = shaped(task_ref, "task");
        self.authorize(p, scope, &ev).await?;
        self.visible_task(p, task_ref, true)?;
        let lock = self.lock(format!("task:{task_ref}")).await;
        let task = self.visible_task(p, task_ref, true)?;
        ev.plan_ref = Some(task.plan_ref.clone());
        ev.task_template = Some(task.template.clone());
        ev.profile = Some(task.profile.clone());
        if task.receipt.is_some() {
            return self.task_answer(&task, ctx, true);
        }
        let template = self.same_template(&task.template, &task.template_digest);
        if template.is_none() && !cancel {
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        Code::TaskTemplateChanged,
                        "the task template changed after this task was planned; cancel it to end it",
                    ),
                )
                .await);
        }
        self.inner.journal.check()?;
        // Runs to its recorded end even if the client goes away.
        let b = self.clone();
        let c2 = ctx.clone();
        let task = self
            .inner
            .tracker
            .spawn(async move {
                let _lock = lock;
                b.finalize_locked(&c2, task, template, cancel, ev).await
            })
            .await
            .map_err(|_| Error::new(Code::ExecutionFailed, "the operation was interrupted"))??;
        self.task_answer(&task, ctx, true)
    }

    async fn finalize_locked(
        &self,
        ctx: &Ctx,
        task: Task,
        template: Option<TaskTemplate>,
        cancel: bool,
        mut ev: Event,
    ) -> Result<Task> {
        let mut task = self.refresh_task(ctx, task).await?;
        let tp = self.task_principal(&task.tenant, None, &task.task_ref);
        if cancel && task.state == TaskState::Running {
            let job = task.job_ref.clone().unwrap_or_default();
            match self.cancel_job(&tp, ctx, &job).await {
                Ok(v) => {
                    task.exit_code = v
                        .get("exit_code")
                        .and_then(Value::as_i64)
                        .and_then(|c| i32::try_from(c).ok());
                    // Asked to cancel: whatever is left ends with the sandbox.
                    task.state = match job_state(&v) {
                        Some(JobState::Running) | None => TaskState::Cancelled,
                        Some(s) => s.into(),
                    };
                }
                Err(e) if matches!(e.code, Code::JobNotFound | Code::LeaseNotFound) => {
                    task.state = TaskState::Orphaned;
                }
                Err(e) => return Err(e),
            }
        }
        if task.state == TaskState::Running {
            return Err(self
                .reject(
                    ev,
                    Error::new(Code::TaskRunning, "the task is still running"),
                )
                .await);
        }
        // The result is computed once; a retry after a failed cleanup
        // reuses it.
        let mut result = match self.task_result_value(&task)? {
            Value::Object(m) => m,
            _ => {
                let (outputs, evidence, validation) = match (&template, task.state) {
                    (Some(t), TaskState::Succeeded) => {
                        self.collect_outputs(&tp, ctx, &task, t).await?
                    }
                    // Its outputs can no longer be checked as declared.
                    (None, TaskState::Succeeded) => (Map::new(), vec![], "skipped"),
                    _ => (Map::new(), vec![], "ok"),
                };
                let mut m = Map::new();
                m.insert("execution_state".into(), json!(task.state));
                m.insert("exit_code".into(), json!(task.exit_code));
                m.insert("sandbox_ref".into(), json!(task.sandbox_ref));
                m.insert("outputs".into(), Value::Object(outputs));
                m.insert("output_evidence".into(), json!(evidence));
                m.insert("output_validation".into(), json!(validation));
                // Kept before the sandbox goes: a crash after the kill must
                // not leave a result that can no longer be computed.
                task.result_sealed = Some(
                    self.inner
                        .store
                        .sealer
                        .seal(Value::Object(m.clone()).to_string().as_bytes())?,
                );
                let ev2 = self.save_task_event(&task, "task_result", ctx, "ok");
                self.save_task(&task, ev2).await?;
                m
            }
        };
        let validated = result.get("output_validation") == Some(&json!("ok"));
        let execution = result
            .get("execution_state")
            .and_then(Value::as_str)
            .and_then(TaskState::parse)
            .unwrap_or(TaskState::Failed);
        let cleanup = self.kill_task_lease(&tp, ctx, &task).await;
        let final_state = if !validated {
            TaskState::OutputValidationFailed
        } else {
            execution
        };
        result.insert("state".into(), json!(final_state));
        result.insert("cleanup".into(), json!(cleanup));
        let (ts, _) = self.now();
        task.updated_at = ts.clone();
        task.cleanup = Some(cleanup.into());
        task.result_sealed = Some(
            self.inner
                .store
                .sealer
                .seal(Value::Object(result.clone()).to_string().as_bytes())?,
        );
        ev.task_state = Some(final_state.to_string());
        ev.cleanup = Some(cleanup.into());
        ev.exit_code = task.exit_code;
        ev.lease_ref = task.lease_ref.clone();
        ev.sandbox_ref = task.sandbox_ref.clone();
        if cleanup == "pending" {
            // No receipt until the sandbox is known to be gone.
            task.state = TaskState::CleanupPending;
            ev.outcome = "error".into();
            ev.error_code = Some("cleanup_pending".into());
            self.save_task(&task, ev).await?;
            return Ok(task);
        }
        task.state = final_state;
        task.completed_at = Some(ts);
        let evidence = result.get("output_evidence").cloned().unwrap_or(json!([]));
        let payload = json!({
            "version": "1",
            "issuer": "cubesandbox-agent-adapter",
            "appliance": concat!("cube-adapter/", env!("CARGO_PKG_VERSION")),
            "task_ref": task.task_ref,
            "plan_ref": task.plan_ref,
            "tenant_hash": &sha256_hex(task.tenant.as_bytes())[..32],
            "requester_hash": task.requester,
            "approver_hash": task.approver,
            "approved_at": task.approved_at,
            "task_template": task.template,
            "template_sha256": task.template_digest,
            "profile": task.profile,
            "parameters_sha256": task.parameters_sha256,
            "command_sha256": task.command_sha256,
            "sandbox_ref": task.sandbox_ref,
            "state": task.state,
            "exit_code": task.exit_code,
            "outputs": evidence,
            "cleanup": cleanup,
            "created_at": task.created_at,
            "completed_at": task.completed_at,
        });
        ev.outcome = "ok".into();
        // Signed in the transaction that records the finalize event: the
        // receipt names the journal's head just before it.
        let signer = self.inner.receipts.clone();
        let mut t2 = task.clone();
        let signed = self
            .inner
            .store
            .write(move |txn, chain| {
                let mut payload = payload;
                if let Some(m) = payload.as_object_mut() {
                    m.insert(
                        "audit".into(),
                        json!({"seq": chain.next_seq.saturating_sub(1), "chain_hash": chain.last_hash}),
                    );
                }
                t2.receipt = Some(signer.sign(payload));
                put_task(txn, &t2)?;
                chain.append(txn, ev)?;
                Ok(t2)
            })
            .await?;
        Ok(signed)
    }

    /// Check each declared output: present, within its size, UTF-8, JSON
    /// where declared so, matching its schema. Returns the exposed
    /// contents, the evidence (digests, never content) and `ok` or
    /// `failed`.
    async fn collect_outputs(
        &self,
        tp: &Principal,
        ctx: &Ctx,
        task: &Task,
        t: &TaskTemplate,
    ) -> Result<(Map<String, Value>, Vec<Value>, &'static str)> {
        use base64::Engine;
        let lease = task.lease_ref.clone().unwrap_or_default();
        let compiled = self.policy().schemas.get(&task.template).cloned();
        let mut outputs = Map::new();
        let mut evidence = vec![];
        let mut all_ok = true;
        let mut exposed_total = 0usize;
        for (i, o) in t.outputs.iter().enumerate() {
            let mut ev = Map::new();
            ev.insert("name".into(), json!(o.name));
            ev.insert("path_sha256".into(), json!(sha256_hex(o.path.as_bytes())));
            ev.insert("required".into(), json!(o.required));
            let got = self
                .file_op(
                    tp,
                    ctx,
                    &lease,
                    FileOp::Download {
                        path: o.path.clone(),
                    },
                )
                .await;
            let missing = |ev: &mut Map<String, Value>, error: Option<&str>| {
                ev.insert("present".into(), json!(false));
                ev.insert("exposed".into(), json!(false));
                if let Some(e) = error {
                    ev.insert("error".into(), json!(e));
                }
            };
            let data = match got {
                Ok(v) => v
                    .get("content_base64")
                    .and_then(Value::as_str)
                    .and_then(|s| base64::engine::general_purpose::STANDARD.decode(s).ok())
                    .ok_or_else(|| {
                        Error::new(Code::InvalidArtifact, "an output could not be read")
                    })?,
                Err(e) if matches!(e.code, Code::ArtifactNotFound | Code::InvalidPath) => {
                    missing(&mut ev, o.required.then_some("missing"));
                    all_ok &= !o.required;
                    evidence.push(Value::Object(ev));
                    continue;
                }
                // The sandbox went away before its outputs were read.
                Err(e) if e.code == Code::LeaseNotFound => {
                    missing(&mut ev, Some("sandbox_gone"));
                    all_ok = false;
                    evidence.push(Value::Object(ev));
                    continue;
                }
                Err(e) if e.code == Code::ArtifactTooLarge => {
                    ev.insert("present".into(), json!(true));
                    ev.insert("exposed".into(), json!(false));
                    ev.insert("error".into(), json!("too_large"));
                    all_ok = false;
                    evidence.push(Value::Object(ev));
                    continue;
                }
                Err(e) => return Err(e),
            };
            ev.insert("present".into(), json!(true));
            ev.insert("bytes".into(), json!(data.len()));
            ev.insert("sha256".into(), json!(sha256_hex(&data)));
            let schema = compiled
                .as_ref()
                .and_then(|c| c.outputs.get(i))
                .and_then(Option::as_ref);
            let checked: std::result::Result<Value, &str> = (|| {
                if data.len() as u64 > o.max_bytes {
                    return Err("too_large");
                }
                let text = std::str::from_utf8(&data).map_err(|_| "not_utf8")?;
                match o.format {
                    OutputFormat::Text => Ok(Value::String(text.to_string())),
                    OutputFormat::Json => {
                        let v: Value = serde_json::from_str(text).map_err(|_| "invalid_json")?;
                        match (o.schema.is_some(), schema) {
                            (true, None) => Err("schema"),
                            (_, Some(s)) if !s.is_valid(&v) => Err("schema_mismatch"),
                            _ => Ok(v),
                        }
                    }
                }
            })();
            match checked {
                Ok(v) => {
                    ev.insert("valid".into(), json!(true));
                    let fits = exposed_total + data.len() <= MAX_EXPOSED;
                    let exposed = o.expose == Expose::Content && fits;
                    if o.expose == Expose::Content && !fits {
                        ev.insert("error".into(), json!("exposed_limit"));
                        all_ok = false;
                    }
                    ev.insert("exposed".into(), json!(exposed));
                    if exposed {
                        exposed_total += data.len();
                        outputs.insert(o.name.clone(), v);
                    }
                }
                Err(code) => {
                    all_ok = false;
                    ev.insert("valid".into(), json!(false));
                    ev.insert("exposed".into(), json!(false));
                    ev.insert("error".into(), json!(code));
                }
            }
            evidence.push(Value::Object(ev));
        }
        Ok((outputs, evidence, if all_ok { "ok" } else { "failed" }))
    }

    /// `GET|POST /v1/tasks/{ref}/receipt`.
    pub async fn task_receipt(&self, p: &Principal, ctx: &Ctx, task_ref: &str) -> Result<Value> {
        let mut ev = self.task_event(p, "task_receipt", ctx);
        ev.task_ref = shaped(task_ref, "task");
        self.authorize(p, "task:receipt", &ev).await?;
        let task = self.visible_task(p, task_ref, false)?;
        let Some(r) = task.receipt.clone() else {
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        Code::ReceiptNotReady,
                        "the receipt is issued once the task's result is finalized (POST …/result)",
                    ),
                )
                .await);
        };
        ev.outcome = "ok".into();
        self.inner.journal.record(ev).await?;
        Ok(json!({"task_ref": task.task_ref, "receipt": r, "request_id": ctx.request_id}))
    }

    /// Delete plans that never ran, `plan_retention_seconds` past their
    /// expiry (each with an event in the same transaction). Returns how
    /// many went.
    pub(crate) async fn prune_plans(&self) -> Result<u64> {
        let t = self.now().1;
        let keep = i64::try_from(self.config().plan_retention_seconds).unwrap_or(i64::MAX);
        let old: Vec<Plan> = self
            .inner
            .store
            .read(move |txn| {
                let mut v = store::plans::all(txn)?;
                v.retain(|pl| {
                    let never_ran = pl.task_ref.is_none()
                        && (matches!(pl.state, PlanState::Denied | PlanState::Expired)
                            || pl.state.is_live());
                    never_ran && t.saturating_sub(pl.expires_unix) > keep
                });
                Ok(v)
            })
            .await?;
        let n = old.len() as u64;
        for chunk in old.chunks(256) {
            let j = &self.inner.journal;
            let evs: Vec<Event> = chunk
                .iter()
                .map(|pl| {
                    let mut ev = j.event("task_plan_pruned");
                    ev.phase = "event".into();
                    ev.outcome = "ok".into();
                    ev.identity_digest = Some(j.digest("identity", b"system\0cube-adapter"));
                    ev.tenant_digest = Some(j.digest("tenant", pl.tenant.as_bytes()));
                    ev.plan_ref = Some(pl.plan_ref.clone());
                    ev.task_template = Some(pl.template.clone());
                    ev
                })
                .collect();
            let refs: Vec<String> = chunk.iter().map(|pl| pl.plan_ref.clone()).collect();
            self.inner
                .store
                .write(move |txn, chain| {
                    for (r, ev) in refs.iter().zip(evs) {
                        store::plans::remove(txn, r)?;
                        chain.append(txn, ev)?;
                    }
                    Ok(())
                })
                .await?;
        }
        if n > 0 {
            tracing::info!(plans = n, "gc: pruned plans that never ran");
        }
        Ok(n)
    }

    /// `GET /v1/receipts/public-key`: the key receipts are signed with.
    pub fn receipt_public_key(&self) -> Value {
        self.inner.receipts.public_key()
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
