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

use redb::{ReadableTable, WriteTransaction};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use sha2::Digest;

use super::leases::{FileOp, Lease, MAX_COMMAND, new_ref, valid_ref};
use super::{Broker, Ctx, Error, Result};
use crate::audit::event::Event;
use crate::auth::Principal;
use crate::clock::{format_unix, now};
use crate::config::TaskTemplate;
use crate::config::tasks::{Expose, OutputFormat, canonical, check_schema};
use crate::store::{StoreError, codec, get_json, tables};

/// Largest parameters object (canonical JSON, bytes).
pub const MAX_PARAMETERS: usize = 256 * 1024;
/// Longest approval or denial reason (bytes).
pub const MAX_REASON: usize = 1024;
/// The runtime trusted tasks' sandboxes are leased with.
pub const TASK_RUNTIME: &str = "mcp";

/// A plan as stored.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Plan {
    pub plan_ref: String,
    pub tenant: String,
    /// Identity digest of who asked for it.
    pub requester: String,
    pub template: String,
    pub template_digest: String,
    pub profile: String,
    /// The parameters, sealed under the store key.
    pub parameters_sealed: String,
    pub parameters_sha256: String,
    pub command_sha256: String,
    /// `pending_approval`, `ready`, `approved`, `denied`, `expired`, `submitted`.
    pub state: String,
    pub approval_required: bool,
    pub created_at: String,
    pub expires_at: String,
    pub expires_unix: i64,
    #[serde(default)]
    pub approved_at: Option<String>,
    /// Identity digest of who approved or denied it.
    #[serde(default)]
    pub approver: Option<String>,
    #[serde(default)]
    pub decided_at: Option<String>,
    #[serde(default)]
    pub denial_reason_sha256: Option<String>,
    #[serde(default)]
    pub task_ref: Option<String>,
}

/// A trusted task as stored.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Task {
    pub task_ref: String,
    pub plan_ref: String,
    pub tenant: String,
    pub requester: String,
    #[serde(default)]
    pub approver: Option<String>,
    #[serde(default)]
    pub approved_at: Option<String>,
    pub template: String,
    pub template_digest: String,
    pub profile: String,
    pub parameters_sha256: String,
    pub command_sha256: String,
    /// `starting`, `running`, `succeeded`, `failed`, `cancelled`,
    /// `timed_out`, `setup_failed`, `orphaned`, `cleanup_pending`,
    /// `output_validation_failed`.
    pub state: String,
    #[serde(default)]
    pub lease_ref: Option<String>,
    #[serde(default)]
    pub sandbox_ref: Option<String>,
    #[serde(default)]
    pub job_ref: Option<String>,
    #[serde(default)]
    pub exit_code: Option<i32>,
    pub created_at: String,
    pub updated_at: String,
    /// The result (sealed: it may carry output content).
    #[serde(default)]
    pub result_sealed: Option<String>,
    #[serde(default)]
    pub receipt: Option<Value>,
    #[serde(default)]
    pub completed_at: Option<String>,
    /// `verified` or `pending`.
    #[serde(default)]
    pub cleanup: Option<String>,
}

impl Task {
    fn execution_ended(&self) -> bool {
        !matches!(self.state.as_str(), "starting" | "running")
    }
}

fn put_plan(txn: &WriteTransaction, p: &Plan) -> std::result::Result<(), StoreError> {
    let b = codec::encode(p)?;
    txn.open_table(tables::PLANS)?
        .insert(p.plan_ref.as_str(), b.as_slice())?;
    Ok(())
}

fn put_task(txn: &WriteTransaction, t: &Task) -> std::result::Result<(), StoreError> {
    let b = codec::encode(t)?;
    txn.open_table(tables::TASKS)?
        .insert(t.task_ref.as_str(), b.as_slice())?;
    Ok(())
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

/// Plans that can still expire.
fn live(state: &str) -> bool {
    matches!(state, "pending_approval" | "ready" | "approved")
}

impl Broker {
    fn identity(&self, p: &Principal) -> String {
        self.inner.journal.digest(
            "identity",
            format!("{}\0{}", p.tenant, p.subject).as_bytes(),
        )
    }

    fn task_event(&self, p: &Principal, action: &str, ctx: &Ctx) -> Event {
        let mut ev = self.event(p, action, ctx);
        ev.runtime = Some(TASK_RUNTIME.into());
        ev
    }

    fn template(&self, name: &str) -> Option<&TaskTemplate> {
        self.inner.cfg.tasks.get(name)
    }

    /// The template a plan or task was made under, if it has not changed.
    fn same_template(&self, name: &str, digest: &str) -> Option<&TaskTemplate> {
        self.template(name).filter(|t| t.digest(name) == digest)
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
        Ok(self.inner.store.read_now(|txn| {
            let t = txn.open_table(tables::PLANS)?;
            get_json(&t, plan_ref)
        })?)
    }

    fn get_task(&self, task_ref: &str) -> Result<Option<Task>> {
        Ok(self.inner.store.read_now(|txn| {
            let t = txn.open_table(tables::TASKS)?;
            get_json(&t, task_ref)
        })?)
    }

    /// A plan of the caller's tenant (any tenant for admins).
    fn tenant_plan(&self, p: &Principal, plan_ref: &str) -> Result<Plan> {
        let missing = || Error::new("task_plan_not_found", "no such task plan");
        if !valid_ref(plan_ref, "plan") {
            return Err(missing());
        }
        self.get_plan(plan_ref)?
            .filter(|pl| pl.tenant == p.tenant || p.is_admin())
            .ok_or_else(missing)
    }

    /// A task the caller may follow (`act`: false) or act on (true): its
    /// requester and admins; approvers of its tenant may follow it.
    fn visible_task(&self, p: &Principal, task_ref: &str, act: bool) -> Result<Task> {
        let missing = || Error::new("task_not_found", "no such task");
        if !valid_ref(task_ref, "task") {
            return Err(missing());
        }
        let me = self.identity(p);
        self.get_task(task_ref)?
            .filter(|t| {
                p.is_admin()
                    || (t.tenant == p.tenant && (t.requester == me || (!act && p.may_approve())))
            })
            .ok_or_else(missing)
    }

    /// Mark a plan expired if its time is up (saved with an event).
    async fn expire(&self, p: &Principal, ctx: &Ctx, plan: &mut Plan) -> Result<bool> {
        if !live(&plan.state) || now().1 < plan.expires_unix {
            return Ok(false);
        }
        plan.state = "expired".into();
        let mut ev = self.task_event(p, "task_plan_expired", ctx);
        ev.outcome = "ok".into();
        ev.plan_ref = Some(plan.plan_ref.clone());
        ev.task_template = Some(plan.template.clone());
        let p2 = plan.clone();
        self.inner
            .store
            .write(move |txn, chain| {
                put_plan(txn, &p2)?;
                chain.append(txn, ev)?;
                Ok(())
            })
            .await?;
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
            ("result_ready", json!(t.execution_ended())),
            ("receipt_ready", json!(t.receipt.is_some())),
            ("request_id", json!(ctx.request_id)),
        ] {
            m.insert(k.into(), v);
        }
        if with_result {
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
                serde_json::from_slice(&raw)
                    .map_err(|_| Error::new("audit_unavailable", "a stored task result is corrupt"))
            }
        }
    }

    /// `GET /v1/task-templates`: the templates this identity may plan.
    pub async fn list_task_templates(&self, p: &Principal, ctx: &Ctx) -> Result<Value> {
        let ev = self.task_event(p, "task_templates", ctx);
        self.authorize(p, "task:plan", &ev).await?;
        let list: Vec<Value> = self
            .inner
            .cfg
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
        parameters: &Value,
    ) -> Result<Value> {
        let mut ev = self.task_event(p, "task_plan", ctx);
        ev.task_template = Some(template.to_string());
        self.authorize(p, "task:plan", &ev).await?;
        if !crate::config::valid_profile_name(template) {
            return Err(Error::new(
                "invalid_request",
                "template must match ^[a-z][a-z0-9-]{0,62}$",
            ));
        }
        let denied = || {
            Error::new(
                "task_template_denied",
                format!("task template {template} is not available to this identity"),
            )
        };
        let Some(t) = self
            .template(template)
            .filter(|_| p.allows_task_template(template))
        else {
            return Err(self.reject(ev, denied()).await);
        };
        ev.profile = Some(t.profile.clone());
        let prof = self.profile(&t.profile).cloned().unwrap_or_default();
        if !p.allows_profile(&t.profile) {
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        "profile_denied",
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
                        "runtime_denied",
                        format!("trusted tasks run with runtime {TASK_RUNTIME}, which this identity or profile does not allow"),
                    ),
                )
                .await);
        }
        if !parameters.is_object() {
            return Err(self
                .reject(
                    ev,
                    Error::new("invalid_parameters", "parameters must be a JSON object ($)"),
                )
                .await);
        }
        let canon = canonical(parameters);
        if canon.len() > MAX_PARAMETERS {
            return Err(Error::new(
                "value_too_large",
                format!("parameters are larger than {MAX_PARAMETERS} bytes"),
            ));
        }
        let validator = check_schema(&t.parameters, "parameters").map_err(|_| {
            Error::new(
                "execution_failed",
                "the task template's schema does not compile",
            )
        })?;
        if let Err(e) = validator.validate(parameters) {
            // Only where: the value itself may be sensitive.
            let at = dotted(e.instance_path().as_str());
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        "invalid_parameters",
                        format!("parameters do not match the template's schema at {at}"),
                    ),
                )
                .await);
        }
        let command = match t.render(parameters) {
            Ok(c) => c,
            Err(m) => {
                return Err(self.reject(ev, Error::new("invalid_parameters", m)).await);
            }
        };
        if command.len() > MAX_COMMAND {
            return Err(Error::new(
                "value_too_large",
                format!("the rendered command is longer than {MAX_COMMAND} bytes"),
            ));
        }
        self.inner.journal.check()?;
        let (ts, unix) = now();
        let ttl = i64::try_from(t.plan_ttl_seconds).unwrap_or(i64::MAX);
        let expires_unix = unix.saturating_add(ttl);
        let plan = Plan {
            plan_ref: new_ref("plan"),
            tenant: p.tenant.clone(),
            requester: self.identity(p),
            template: template.to_string(),
            template_digest: t.digest(template),
            profile: t.profile.clone(),
            parameters_sealed: self.inner.store.sealer.seal(canon.as_bytes())?,
            parameters_sha256: sha256_hex(canon.as_bytes()),
            command_sha256: sha256_hex(command.as_bytes()),
            state: if t.approval_required {
                "pending_approval".into()
            } else {
                "ready".into()
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
        ev.plan_ref = Some(plan_ref.to_string());
        let scope = if p.may_approve() {
            "task:approve"
        } else {
            "task:status"
        };
        self.authorize(p, scope, &ev).await?;
        let mut plan = self.tenant_plan(p, plan_ref)?;
        if plan.requester != self.identity(p) && !p.may_approve() {
            return Err(Error::new("task_plan_not_found", "no such task plan"));
        }
        ev.task_template = Some(plan.template.clone());
        if plan.state == "expired" || self.expire(p, ctx, &mut plan).await? {
            return Err(self
                .reject(ev, Error::new("plan_expired", "the plan has expired"))
                .await);
        }
        let mut m = self.plan_answer(&plan, ctx);
        let current = self.same_template(&plan.template, &plan.template_digest);
        m.insert(
            "contract".into(),
            current
                .map(|t| t.contract(&plan.template))
                .unwrap_or(Value::Null),
        );
        m.insert("template_changed".into(), json!(current.is_none()));
        if p.may_approve() {
            let raw = self.inner.store.sealer.open(&plan.parameters_sealed)?;
            let v: Value = serde_json::from_slice(&raw)
                .map_err(|_| Error::new("audit_unavailable", "a stored plan is corrupt"))?;
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
                    "invalid_decision",
                    "decision must be approve or deny",
                ));
            }
        };
        if reason.is_some_and(|r| r.len() > MAX_REASON) {
            return Err(Error::new(
                "value_too_large",
                format!("reason is longer than {MAX_REASON} bytes"),
            ));
        }
        let mut ev = self.task_event(p, if approve { "task_approve" } else { "task_deny" }, ctx);
        ev.plan_ref = Some(plan_ref.to_string());
        ev.decision = Some(if approve { "approve" } else { "deny" }.into());
        self.authorize(p, "task:approve", &ev).await?;
        if !p.may_approve() {
            return Err(self
                .reject(
                    ev,
                    Error::new("approver_required", "only approvers decide on task plans"),
                )
                .await);
        }
        let _lock = self.lock(format!("task-plan:{plan_ref}")).await;
        let mut plan = self.tenant_plan(p, plan_ref)?;
        ev.task_template = Some(plan.template.clone());
        ev.profile = Some(plan.profile.clone());
        if plan.state == "expired" || self.expire(p, ctx, &mut plan).await? {
            return Err(self
                .reject(ev, Error::new("plan_expired", "the plan has expired"))
                .await);
        }
        if plan.state != "pending_approval" {
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        "plan_not_pending",
                        format!("the plan is {}, not pending approval", plan.state),
                    ),
                )
                .await);
        }
        if self
            .same_template(&plan.template, &plan.template_digest)
            .is_none()
        {
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        "task_template_changed",
                        "the task template changed after this plan was made; plan again",
                    ),
                )
                .await);
        }
        if !p.allows_task_template(&plan.template) {
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        "task_template_denied",
                        format!(
                            "task template {} is not available to this identity",
                            plan.template
                        ),
                    ),
                )
                .await);
        }
        let me = self.identity(p);
        let admin_may = p.is_admin()
            && self
                .profile(&plan.profile)
                .is_some_and(|pr| pr.admin_self_approval);
        if me == plan.requester && !admin_may {
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        "self_approval_denied",
                        "a plan must be approved by someone other than its requester",
                    ),
                )
                .await);
        }
        self.inner.journal.check()?;
        let (ts, _) = now();
        plan.approver = Some(me.clone());
        plan.decided_at = Some(ts.clone());
        if approve {
            plan.state = "approved".into();
            plan.approved_at = Some(ts);
        } else {
            plan.state = "denied".into();
            plan.denial_reason_sha256 = reason.map(|r| sha256_hex(r.as_bytes()));
        }
        ev.outcome = "ok".into();
        ev.approver_digest = Some(me);
        ev.reason_digest = reason.map(|r| self.inner.journal.digest("reason", r.as_bytes()));
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

    /// `POST /v1/task-plans/{ref}/submit` (202): run an approved (or
    /// ready) plan. Idempotent: a submitted plan answers with its task.
    pub async fn submit_plan(&self, p: &Principal, ctx: &Ctx, plan_ref: &str) -> Result<Value> {
        let mut ev = self.task_event(p, "task_submit", ctx);
        ev.plan_ref = Some(plan_ref.to_string());
        self.authorize(p, "task:submit", &ev).await?;
        let plan_lock = self.lock(format!("task-plan:{plan_ref}")).await;
        let mut plan = self.tenant_plan(p, plan_ref)?;
        if plan.requester != self.identity(p) && !p.is_admin() {
            return Err(Error::new("task_plan_not_found", "no such task plan"));
        }
        ev.task_template = Some(plan.template.clone());
        ev.profile = Some(plan.profile.clone());
        if let Some(tr) = &plan.task_ref
            && let Some(t) = self.get_task(tr)?
        {
            return self.task_answer(&t, ctx, false);
        }
        if plan.state == "expired" || self.expire(p, ctx, &mut plan).await? {
            return Err(self
                .reject(ev, Error::new("plan_expired", "the plan has expired"))
                .await);
        }
        let ok_state = if plan.approval_required {
            plan.state == "approved"
        } else {
            plan.state == "ready"
        };
        if !ok_state {
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        "plan_not_approved",
                        format!("the plan is {}; it runs once approved", plan.state),
                    ),
                )
                .await);
        }
        let changed = || {
            Error::new(
                "task_template_changed",
                "the task template changed after this plan was made; plan again",
            )
        };
        let Some(t) = self
            .same_template(&plan.template, &plan.template_digest)
            .cloned()
        else {
            return Err(self.reject(ev, changed()).await);
        };
        let raw = self.inner.store.sealer.open(&plan.parameters_sealed)?;
        let params: Value = serde_json::from_slice(&raw)
            .map_err(|_| Error::new("audit_unavailable", "a stored plan is corrupt"))?;
        let command = t
            .render(&params)
            .map_err(|m| Error::new("invalid_parameters", m))?;
        if sha256_hex(command.as_bytes()) != plan.command_sha256 {
            return Err(self.reject(ev, changed()).await);
        }
        self.inner.journal.check()?;
        let (ts, _) = now();
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
            state: "starting".into(),
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
        plan.state = "submitted".into();
        plan.task_ref = Some(task.task_ref.clone());
        ev.outcome = "ok".into();
        ev.task_ref = Some(task.task_ref.clone());
        ev.approver_digest = task.approver.clone();
        ev.command_digest = Some(self.inner.journal.digest("command", command.as_bytes()));
        let (p2, t2) = (plan.clone(), task.clone());
        // The lock of the task before the plan's is let go: status and
        // result wait for the setup.
        let task_lock = self.lock(format!("task:{}", task.task_ref)).await;
        self.inner
            .store
            .write(move |txn, chain| {
                put_plan(txn, &p2)?;
                put_task(txn, &t2)?;
                chain.append(txn, ev)?;
                Ok(())
            })
            .await?;
        drop(plan_lock);
        let task = self.start_task(p, ctx, task, &t, &command).await;
        drop(task_lock);
        let task = task?;
        self.task_answer(&task, ctx, false)
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
        let session = format!("trusted-task:{}", task.task_ref);
        let setup = async {
            let (lease, _) = self
                .acquire_lease(
                    &tp,
                    ctx,
                    TASK_RUNTIME,
                    &session,
                    Some(&task.profile),
                    Some(&task.task_ref),
                )
                .await?;
            task.lease_ref = Some(lease.lease_ref.clone());
            task.sandbox_ref = Some(lease.sandbox_ref.clone());
            let v = self
                .start_job(&tp, ctx, &lease.lease_ref, command, Some(&t.command.cwd))
                .await?;
            let job = v
                .get("job_ref")
                .and_then(Value::as_str)
                .map(str::to_string)
                .ok_or_else(|| Error::new("execution_failed", "the task's job did not start"))?;
            Ok::<String, Error>(job)
        };
        let r = setup.await;
        task.updated_at = now().0;
        match r {
            Ok(job) => {
                task.job_ref = Some(job);
                task.state = "running".into();
                let t2 = task.clone();
                self.inner
                    .store
                    .write(move |txn, _| put_task(txn, &t2))
                    .await?;
                Ok(task)
            }
            Err(e) => {
                task.state = "setup_failed".into();
                task.cleanup = Some(self.kill_task_lease(&tp, ctx, &task).await.into());
                let mut ev = self.task_event(p, "task_setup", ctx);
                ev.outcome = "error".into();
                ev.error_code = Some(e.code.to_string());
                ev.plan_ref = Some(task.plan_ref.clone());
                ev.task_ref = Some(task.task_ref.clone());
                ev.task_template = Some(task.template.clone());
                ev.task_state = Some(task.state.clone());
                ev.cleanup = task.cleanup.clone();
                let t2 = task.clone();
                self.inner
                    .store
                    .write(move |txn, chain| {
                        put_task(txn, &t2)?;
                        chain.append(txn, ev)?;
                        Ok(())
                    })
                    .await?;
                Err(e)
            }
        }
    }

    /// The task's lease, wherever its record says it is (or, after an
    /// interrupted setup, wherever the session index has it).
    fn task_lease(&self, task: &Task) -> Result<Option<Lease>> {
        let tr = task.task_ref.clone();
        let known = task.lease_ref.clone();
        Ok(self.inner.store.read_now(move |txn| {
            let t = txn.open_table(tables::LEASES)?;
            if let Some(r) = known {
                return get_json::<Lease>(&t, &r);
            }
            for item in t.iter()? {
                let (_, v) = item?;
                let l: Lease = codec::decode(v.value())?;
                if l.task_ref.as_deref() == Some(tr.as_str()) {
                    return Ok(Some(l));
                }
            }
            Ok(None)
        })?)
    }

    /// Kill the task's sandbox (and forget its lease): `verified` when it
    /// is gone, `pending` when it could not be killed (retried later).
    async fn kill_task_lease(&self, tp: &Principal, ctx: &Ctx, task: &Task) -> &'static str {
        let lease = match self.task_lease(task) {
            Ok(Some(l)) => l,
            Ok(None) => return "verified",
            Err(_) => return "pending",
        };
        match self.release(tp, ctx, &lease.lease_ref, "kill").await {
            Ok(_) => "verified",
            Err(e) if e.code == "lease_not_found" => "verified",
            Err(e) => {
                tracing::warn!(task = %task.task_ref, error = %e, "could not kill a trusted task's sandbox");
                "pending"
            }
        }
    }

    /// Bring a task's execution state up to date (under the task's lock).
    async fn refresh_task(&self, ctx: &Ctx, mut task: Task) -> Result<Task> {
        let tp = self.task_principal(&task.tenant, None, &task.task_ref);
        let before = task.state.clone();
        match task.state.as_str() {
            // Its setup holds the lock while it runs: this one was
            // interrupted (a restart).
            "starting" => {
                task.state = "setup_failed".into();
                task.cleanup = Some(self.kill_task_lease(&tp, ctx, &task).await.into());
            }
            "running" => {
                let job = task.job_ref.clone().unwrap_or_default();
                match self.job_status(&tp, ctx, &job).await {
                    Ok(v) => {
                        let state = v.get("state").and_then(Value::as_str).unwrap_or("running");
                        task.state = match state {
                            "lost" => "orphaned".into(),
                            s => s.to_string(),
                        };
                        task.exit_code = v
                            .get("exit_code")
                            .and_then(Value::as_i64)
                            .and_then(|c| i32::try_from(c).ok());
                    }
                    Err(e) if matches!(e.code, "job_not_found" | "lease_not_found") => {
                        task.state = "orphaned".into();
                    }
                    Err(e) => return Err(e),
                }
            }
            _ => {}
        }
        if task.state != before {
            task.updated_at = now().0;
            let t2 = task.clone();
            self.inner
                .store
                .write(move |txn, _| put_task(txn, &t2))
                .await?;
        }
        Ok(task)
    }

    /// `GET|POST /v1/tasks/{ref}/status`.
    pub async fn task_status(&self, p: &Principal, ctx: &Ctx, task_ref: &str) -> Result<Value> {
        let mut ev = self.task_event(p, "task_status", ctx);
        ev.task_ref = Some(task_ref.to_string());
        self.authorize(p, "task:status", &ev).await?;
        self.visible_task(p, task_ref, false)?;
        let _lock = self.lock(format!("task:{task_ref}")).await;
        let task = self.visible_task(p, task_ref, false)?;
        let task = self.refresh_task(ctx, task).await?;
        ev.outcome = "ok".into();
        ev.task_state = Some(task.state.clone());
        self.inner.journal.record(ev).await?;
        self.task_answer(&task, ctx, false)
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
        ev.task_ref = Some(task_ref.to_string());
        self.authorize(p, scope, &ev).await?;
        self.visible_task(p, task_ref, true)?;
        let _lock = self.lock(format!("task:{task_ref}")).await;
        let task = self.visible_task(p, task_ref, true)?;
        ev.plan_ref = Some(task.plan_ref.clone());
        ev.task_template = Some(task.template.clone());
        ev.profile = Some(task.profile.clone());
        if task.receipt.is_some() {
            return self.task_answer(&task, ctx, true);
        }
        let template = self
            .same_template(&task.template, &task.template_digest)
            .cloned();
        if template.is_none() && !cancel {
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        "task_template_changed",
                        "the task template changed after this task was planned; cancel it to end it",
                    ),
                )
                .await);
        }
        let mut task = self.refresh_task(ctx, task).await?;
        let tp = self.task_principal(&task.tenant, None, &task.task_ref);
        if cancel && task.state == "running" {
            let job = task.job_ref.clone().unwrap_or_default();
            match self.cancel_job(&tp, ctx, &job).await {
                Ok(v) => {
                    task.state = v
                        .get("state")
                        .and_then(Value::as_str)
                        .unwrap_or("cancelled")
                        .to_string();
                    task.exit_code = v
                        .get("exit_code")
                        .and_then(Value::as_i64)
                        .and_then(|c| i32::try_from(c).ok());
                }
                Err(e) if matches!(e.code, "job_not_found" | "lease_not_found") => {
                    task.state = "orphaned".into();
                }
                Err(e) => return Err(e),
            }
        }
        if task.state == "running" {
            return Err(self
                .reject(ev, Error::new("task_running", "the task is still running"))
                .await);
        }
        if task.job_ref.is_none() && task.state == "starting" {
            return Err(self
                .reject(ev, Error::new("task_not_ready", "the task has not started"))
                .await);
        }
        // The result is computed once; a retry after a failed cleanup
        // reuses it.
        let mut result = match self.task_result_value(&task)? {
            Value::Object(m) => m,
            _ => {
                let (outputs, evidence, ok) = match (&template, task.state.as_str()) {
                    (Some(t), "succeeded") => self.collect_outputs(&tp, ctx, &task, t).await?,
                    _ => (Map::new(), vec![], true),
                };
                let mut m = Map::new();
                m.insert("execution_state".into(), json!(task.state));
                m.insert("exit_code".into(), json!(task.exit_code));
                m.insert("sandbox_ref".into(), json!(task.sandbox_ref));
                m.insert("outputs".into(), Value::Object(outputs));
                m.insert("output_evidence".into(), json!(evidence));
                m.insert(
                    "output_validation".into(),
                    json!(if ok { "ok" } else { "failed" }),
                );
                m
            }
        };
        // Kept before the sandbox goes: a crash after the kill must not
        // leave a result that can no longer be computed.
        if task.result_sealed.is_none() {
            task.result_sealed = Some(
                self.inner
                    .store
                    .sealer
                    .seal(Value::Object(result.clone()).to_string().as_bytes())?,
            );
            let t2 = task.clone();
            self.inner
                .store
                .write(move |txn, _| put_task(txn, &t2))
                .await?;
        }
        let validated = result.get("output_validation") == Some(&json!("ok"));
        let execution = result
            .get("execution_state")
            .and_then(Value::as_str)
            .unwrap_or("failed")
            .to_string();
        let cleanup = self.kill_task_lease(&tp, ctx, &task).await;
        let final_state = if !validated {
            "output_validation_failed".to_string()
        } else {
            execution
        };
        result.insert("state".into(), json!(final_state));
        result.insert("cleanup".into(), json!(cleanup));
        let (ts, _) = now();
        task.updated_at = ts.clone();
        task.cleanup = Some(cleanup.into());
        task.result_sealed = Some(
            self.inner
                .store
                .sealer
                .seal(Value::Object(result.clone()).to_string().as_bytes())?,
        );
        ev.task_state = Some(final_state.clone());
        ev.cleanup = Some(cleanup.into());
        ev.exit_code = task.exit_code;
        if cleanup == "pending" {
            // No receipt until the sandbox is known to be gone.
            task.state = "cleanup_pending".into();
            ev.outcome = "error".into();
            ev.error_code = Some("cleanup_pending".into());
            let t2 = task.clone();
            self.inner
                .store
                .write(move |txn, chain| {
                    put_task(txn, &t2)?;
                    chain.append(txn, ev)?;
                    Ok(())
                })
                .await?;
            return self.task_answer(&task, ctx, true);
        }
        task.state = final_state;
        task.completed_at = Some(ts);
        let head = self.inner.store.read_now(|txn| {
            let t = txn.open_table(tables::AUDIT)?;
            Ok(match t.last()? {
                Some((k, v)) => {
                    let e: Event = codec::decode(v.value())?;
                    Some((k.value(), e.hash))
                }
                None => None,
            })
        })?;
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
            "audit": head.map(|(seq, hash)| json!({"seq": seq, "chain_hash": hash})),
        });
        task.receipt = Some(self.inner.receipts.sign(payload));
        ev.outcome = "ok".into();
        let t2 = task.clone();
        self.inner
            .store
            .write(move |txn, chain| {
                put_task(txn, &t2)?;
                chain.append(txn, ev)?;
                Ok(())
            })
            .await?;
        self.task_answer(&task, ctx, true)
    }

    /// Check each declared output: present, within its size, UTF-8, JSON
    /// where declared so, matching its schema. Returns the exposed
    /// contents, the evidence (digests, never content) and whether all
    /// passed.
    async fn collect_outputs(
        &self,
        tp: &Principal,
        ctx: &Ctx,
        task: &Task,
        t: &TaskTemplate,
    ) -> Result<(Map<String, Value>, Vec<Value>, bool)> {
        use base64::Engine;
        let lease = task.lease_ref.clone().unwrap_or_default();
        let mut outputs = Map::new();
        let mut evidence = vec![];
        let mut all_ok = true;
        for o in &t.outputs {
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
            let data = match got {
                Ok(v) => v
                    .get("content_base64")
                    .and_then(Value::as_str)
                    .and_then(|s| base64::engine::general_purpose::STANDARD.decode(s).ok())
                    .ok_or_else(|| Error::new("invalid_artifact", "an output could not be read"))?,
                Err(e) if matches!(e.code, "artifact_not_found" | "invalid_path") => {
                    ev.insert("present".into(), json!(false));
                    ev.insert("exposed".into(), json!(false));
                    if o.required {
                        ev.insert("error".into(), json!("missing"));
                        all_ok = false;
                    }
                    evidence.push(Value::Object(ev));
                    continue;
                }
                // The sandbox went away before its outputs were read.
                Err(e) if e.code == "lease_not_found" => {
                    ev.insert("present".into(), json!(false));
                    ev.insert("exposed".into(), json!(false));
                    ev.insert("error".into(), json!("sandbox_gone"));
                    all_ok = false;
                    evidence.push(Value::Object(ev));
                    continue;
                }
                Err(e) if e.code == "artifact_too_large" => {
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
            let checked: std::result::Result<Value, &str> = (|| {
                if data.len() as u64 > o.max_bytes {
                    return Err("too_large");
                }
                let text = std::str::from_utf8(&data).map_err(|_| "not_utf8")?;
                match o.format {
                    OutputFormat::Text => Ok(Value::String(text.to_string())),
                    OutputFormat::Json => {
                        let v: Value = serde_json::from_str(text).map_err(|_| "invalid_json")?;
                        if let Some(s) = &o.schema {
                            let val = check_schema(s, "output").map_err(|_| "schema")?;
                            if !val.is_valid(&v) {
                                return Err("schema_mismatch");
                            }
                        }
                        Ok(v)
                    }
                }
            })();
            match checked {
                Ok(v) => {
                    let exposed = o.expose == Expose::Content;
                    ev.insert("valid".into(), json!(true));
                    ev.insert("exposed".into(), json!(exposed));
                    if exposed {
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
        Ok((outputs, evidence, all_ok))
    }

    /// `GET|POST /v1/tasks/{ref}/receipt`.
    pub async fn task_receipt(&self, p: &Principal, ctx: &Ctx, task_ref: &str) -> Result<Value> {
        let mut ev = self.task_event(p, "task_receipt", ctx);
        ev.task_ref = Some(task_ref.to_string());
        self.authorize(p, "task:receipt", &ev).await?;
        let task = self.visible_task(p, task_ref, false)?;
        let Some(r) = task.receipt.clone() else {
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        "receipt_not_ready",
                        "the receipt is issued once the task's result is finalized (POST …/result)",
                    ),
                )
                .await);
        };
        ev.outcome = "ok".into();
        self.inner.journal.record(ev).await?;
        Ok(json!({"task_ref": task.task_ref, "receipt": r, "request_id": ctx.request_id}))
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
