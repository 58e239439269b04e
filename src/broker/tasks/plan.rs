//! Plans of trusted tasks: the templates an identity may plan, making a
//! plan (parameters checked, nothing runs), reviewing it, an independent
//! approver's decision, and pruning plans that never ran.

use super::*;

/// A plan waiting for an approver, as the console's queue lists it.
#[derive(Debug, Clone)]
pub struct PendingPlan {
    pub plan_ref: String,
    pub tenant: String,
    pub template: String,
    pub profile: String,
    /// Identity digest of who asked for it (plans keep no names).
    pub requester: String,
    /// Whether the person looking asked for it.
    pub requested_by_me: bool,
    pub created_at: String,
    pub expires_at: String,
    pub expires_unix: i64,
    /// Who asked, readable (absent for plans made before it was kept).
    pub requested_by: Option<crate::store::plans::Requester>,
    /// Why the agent asked.
    pub reason: Option<String>,
    pub approvals: usize,
    pub approvals_required: u32,
    /// Its state as of now (a live plan past its time is `expired`).
    pub state: PlanState,
    /// Who or what ended it: the approvers, the denier, the appliance
    /// (expiry), the task it became.
    pub ended_by: Option<String>,
    /// When it was decided or expired (RFC 3339).
    pub ended_at: String,
}

/// How many ended plans the console's queue lists under the pending ones.
pub const RECENT_PLANS: usize = 20;

impl PendingPlan {
    fn of(pl: Plan, me: &str, now: i64) -> Self {
        let state = if pl.state.is_live() && pl.expires_unix <= now {
            PlanState::Expired
        } else {
            pl.state
        };
        let names = |v: &[crate::store::plans::Decision]| {
            v.iter()
                .map(|d| d.subject.clone())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let ended_by = match state {
            PlanState::Expired => Some("the appliance (its time ran out)".to_string()),
            PlanState::Denied => Some(match &pl.denial {
                Some(d) => format!("denied by {}", d.subject),
                None => "denied".into(),
            }),
            PlanState::Approved if !pl.approvals.is_empty() => {
                Some(format!("approved by {}", names(&pl.approvals)))
            }
            PlanState::Submitted => Some(match (&pl.task_ref, pl.approvals.is_empty()) {
                (Some(t), false) => format!("approved by {}; ran as {t}", names(&pl.approvals)),
                (Some(t), true) => format!("ran as {t}"),
                (None, _) => "submitted".into(),
            }),
            _ => None,
        };
        let ended_at = match state {
            PlanState::Expired => pl.expires_at.clone(),
            _ => pl
                .decided_at
                .clone()
                .or_else(|| pl.approved_at.clone())
                .unwrap_or_else(|| pl.created_at.clone()),
        };
        PendingPlan {
            ended_at,
            requested_by_me: pl.requester == me,
            plan_ref: pl.plan_ref,
            tenant: pl.tenant,
            template: pl.template,
            profile: pl.profile,
            requester: pl.requester,
            created_at: pl.created_at,
            expires_at: pl.expires_at,
            expires_unix: pl.expires_unix,
            requested_by: pl.requested_by,
            reason: pl.reason,
            approvals: pl.approvals.len(),
            approvals_required: pl.approvals_required,
            state,
            ended_by,
        }
    }
}

/// A plan's review for the console.
#[derive(Debug, Clone)]
pub struct ConsoleReview {
    /// What `GET /v1/task-plans/{ref}` answers to the same person.
    pub review: dto::PlanReview,
    pub tenant: String,
    /// Identity digest of who asked for it.
    pub requester: String,
    /// Whether the person looking asked for it.
    pub requested_by_me: bool,
    /// The command exactly as it will run, to those who see the
    /// parameters (absent if it no longer matches `command_sha256`).
    pub command: Option<String>,
    /// The template's risk rules the parameters match (to those who see
    /// the parameters).
    pub risks: Vec<crate::config::tasks::Risk>,
    /// The last plan of the same template and tenant that people approved,
    /// compared with this one (to those who see the parameters).
    pub previous: Option<PreviousPlan>,
    /// The task it became: its state and whether its receipt is ready
    /// (from request to receipt on one page).
    pub task: Option<(TaskState, bool)>,
}

/// The last approved plan of the same template and tenant, and how this
/// one differs from it (issue #36, "what changed").
#[derive(Debug, Clone)]
pub struct PreviousPlan {
    pub plan_ref: String,
    pub approved_at: String,
    /// The same parameters exactly (the same `parameters_sha256`).
    pub identical: bool,
    /// Every top-level parameter of either, by name.
    pub rows: Vec<DiffRow>,
    /// Its command, when it was made under the same template.
    pub command: Option<String>,
}

/// One parameter, before (the approved plan) and now (compact JSON;
/// `None`: absent).
#[derive(Debug, Clone)]
pub struct DiffRow {
    pub name: String,
    pub before: Option<String>,
    pub now: Option<String>,
    pub changed: bool,
}

impl PreviousPlan {
    fn compare(before: &Value, now: &Value) -> Vec<DiffRow> {
        let empty = serde_json::Map::new();
        let (b, n) = (
            before.as_object().unwrap_or(&empty),
            now.as_object().unwrap_or(&empty),
        );
        let mut names: Vec<&String> = b.keys().chain(n.keys()).collect();
        names.sort();
        names.dedup();
        names
            .into_iter()
            .map(|k| {
                let (x, y) = (b.get(k), n.get(k));
                DiffRow {
                    name: k.clone(),
                    before: x.map(Value::to_string),
                    now: y.map(Value::to_string),
                    changed: x != y,
                }
            })
            .collect()
    }
}

impl Broker {
    /// `GET /v1/task-templates`: the templates this identity may plan.
    pub async fn list_task_templates(
        &self,
        p: &Principal,
        ctx: &Ctx,
    ) -> Result<dto::TaskTemplateList> {
        let ev = self.task_event(p, Action::TaskTemplates, ctx);
        self.authorize(p, "task:plan", &ev).await?;
        let task_templates = self
            .config()
            .tasks
            .iter()
            .filter(|(n, t)| p.allows_task_template(n) && p.allows_profile(&t.profile))
            .map(|(n, t)| dto::TaskTemplateContract::new(n, t))
            .collect();
        Ok(dto::TaskTemplateList {
            request_id: ctx.request_id.clone(),
            task_templates,
        })
    }

    /// `POST /v1/tasks/plan` (201): validate parameters and make a plan.
    /// Nothing runs.
    pub async fn plan_task(
        &self,
        p: &Principal,
        ctx: &Ctx,
        template: &str,
        parameters: Option<&Value>,
        why: PlanWhy<'_>,
    ) -> Result<dto::PlanAnswer> {
        let mut ev = self.task_event(p, Action::TaskPlan, ctx);
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
        // Nothing hidden: what the approver reads is what runs.
        if let Some(m) = hidden_fault(t, parameters) {
            return Err(self
                .reject(ev, Error::new(Code::InvalidParameters, m))
                .await);
        }
        let reason = match words(why.reason, "reason") {
            Ok(r) => r,
            Err(e) => return Err(self.reject(ev, e).await),
        };
        if t.reason_required && reason.is_none() {
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        Code::ReasonRequired,
                        format!("task template {template} requires a reason: say why the task is needed (reason, at most {MAX_REASON} bytes)"),
                    ),
                )
                .await);
        }
        // The lease the agent works in, if it names one: its own, usable.
        let lease = match why.lease_ref {
            Some(r) => Some(self.owned_lease(p, r, &ev).await?),
            None => None,
        };
        let command = match t.render(parameters) {
            Ok(c) => c,
            Err(m) => {
                return Err(self
                    .reject(ev, Error::new(Code::InvalidParameters, m.to_string()))
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
        let _quota = self.lock(format!("plans:{me}")).await?;
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
            backend: policy
                .cfg
                .profiles
                .get(&t.profile)
                .and_then(|pr| policy.cfg.profile_backend(pr))
                .unwrap_or(crate::config::DEFAULT_BACKEND)
                .to_string(),
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
            requested_by: Some(crate::store::plans::Requester {
                subject: p.subject.clone(),
                issuer: p.issuer.clone(),
                label: p.label.clone(),
                lease_ref: lease.as_ref().map(|l| l.lease_ref.clone()),
                runtime: lease.as_ref().map(|l| l.runtime.clone()),
                agent: ctx.agent.clone(),
            }),
            reason,
            approvals_required: t.approvals_required,
            approvals: vec![],
            denial: None,
        };
        let j = &self.inner.journal;
        ev.outcome = Outcome::Ok;
        ev.plan_ref = Some(plan.plan_ref.clone());
        ev.backend = Some(plan.backend.clone());
        ev.parameters_digest = Some(j.digest("parameters", canon.as_bytes()));
        ev.command_digest = Some(j.digest("command", command.as_bytes()));
        ev.reason = plan.reason.clone();
        let p2 = plan.clone();
        self.inner
            .store
            .write(move |txn, chain| {
                put_plan(txn, &p2)?;
                chain.append(txn, ev)?;
                Ok(())
            })
            .await?;
        if plan.state == PlanState::PendingApproval {
            // Queued, never awaited: a notification cannot slow or fail planning.
            self.tell_plan_needs_approval(crate::broker::PlanNeedsApproval {
                plan_ref: plan.plan_ref.clone(),
                tenant: plan.tenant.clone(),
                template: plan.template.clone(),
                profile: plan.profile.clone(),
                expires_at: plan.expires_at.clone(),
                requester: p.subject.clone(),
                risks: t
                    .risks(compiled, parameters)
                    .into_iter()
                    .map(|r| format!("{}: {}", r.parameter, r.note))
                    .collect(),
            });
        }
        Ok(self.plan_answer(&plan, ctx))
    }

    /// `GET /v1/task-plans/{ref}`: the plan, the template's contract, and
    /// for approvers the parameters. Its requester, approvers and auditors
    /// of its tenant, and admins, may look at it.
    pub async fn review_plan(
        &self,
        p: &Principal,
        ctx: &Ctx,
        plan_ref: &str,
    ) -> Result<dto::PlanReview> {
        Ok(self.plan_review(p, ctx, plan_ref, false).await?.review)
    }

    /// The console's review of a plan: what `review_plan` answers (same
    /// policy, same event), and for those who may decide on it the command
    /// exactly as it will run (rendered from the template and parameters,
    /// checked against the plan's `command_sha256`).
    pub async fn review_plan_in_console(
        &self,
        p: &Principal,
        ctx: &Ctx,
        plan_ref: &str,
    ) -> Result<ConsoleReview> {
        self.plan_review(p, ctx, plan_ref, true).await
    }

    /// Whether `p` may look at the plans of its tenant (every tenant for
    /// admins) without having asked for them: approvers and auditors.
    pub(super) fn may_see_plans(p: &Principal) -> bool {
        p.may_approve() || p.roles.contains(&crate::auth::Role::Auditor)
    }

    /// The plans waiting for an approver that `p` may look at (its
    /// tenant's; every tenant's for admins), oldest first, and the most
    /// recently ended ones ([`RECENT_PLANS`], newest first: approved,
    /// denied, expired or run, with who or what ended them). The same
    /// authorization as `review_plan`; a refusal is audited.
    pub async fn plan_queue(
        &self,
        p: &Principal,
        ctx: &Ctx,
    ) -> Result<(Vec<PendingPlan>, Vec<PendingPlan>)> {
        let ev = self.task_event(p, Action::TaskPlanList, ctx);
        let scope = if p.may_approve() {
            "task:approve"
        } else {
            "task:status"
        };
        self.authorize(p, scope, &ev).await?;
        if !Self::may_see_plans(p) {
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        Code::ApproverRequired,
                        "only approvers, auditors and admins see the approval queue",
                    ),
                )
                .await);
        }
        let (tenant, admin, now) = (p.tenant.clone(), p.is_admin(), self.now().1);
        let me = self.identity(p);
        let all: Vec<PendingPlan> = self
            .inner
            .store
            .read(move |txn| {
                Ok(store::plans::all(txn)?
                    .into_iter()
                    .filter(|pl| admin || pl.tenant == tenant)
                    .map(|pl| PendingPlan::of(pl, &me, now))
                    .collect())
            })
            .await?;
        let (mut pending, mut ended): (Vec<PendingPlan>, Vec<PendingPlan>) = all
            .into_iter()
            .filter(|pl| pl.state != PlanState::Ready)
            .partition(|pl| pl.state == PlanState::PendingApproval);
        pending.sort_by(|a, b| (&a.created_at, &a.plan_ref).cmp(&(&b.created_at, &b.plan_ref)));
        // Approved plans (still open until submitted) are decided: listed
        // with the ended ones.
        ended.sort_by(|a, b| (&b.ended_at, &b.plan_ref).cmp(&(&a.ended_at, &a.plan_ref)));
        ended.truncate(RECENT_PLANS);
        Ok((pending, ended))
    }

    async fn plan_review(
        &self,
        p: &Principal,
        ctx: &Ctx,
        plan_ref: &str,
        with_command: bool,
    ) -> Result<ConsoleReview> {
        let mut ev = self.task_event(p, Action::TaskPlanReview, ctx);
        ev.plan_ref = shaped(plan_ref, "plan");
        let scope = if p.may_approve() {
            "task:approve"
        } else {
            "task:status"
        };
        self.authorize(p, scope, &ev).await?;
        let _lock = self.lock(format!("task-plan:{plan_ref}")).await?;
        let mut plan = self.tenant_plan(p, plan_ref)?;
        if !self.is_requester(p, &plan.tenant, &plan.requester) && !Self::may_see_plans(p) {
            return Err(Error::new(Code::TaskPlanNotFound, "no such task plan"));
        }
        ev.task_template = Some(plan.template.clone());
        // `/v1` answers an expired plan with 409 plan_expired; the console
        // shows it, expired, for the record.
        if self.expire(ctx, &mut plan).await? && !with_command {
            return Err(self
                .reject(ev, Error::new(Code::PlanExpired, "the plan has expired"))
                .await);
        }
        let Some(t) = self.plan_template(&plan) else {
            return Err(self.reject(ev, Self::changed()).await);
        };
        let contract = dto::TaskTemplateContract::new(&plan.template, &t);
        let parameters = if p.may_approve() {
            let raw = self.inner.store.sealer.open(&plan.parameters_sealed)?;
            let v: Value = serde_json::from_slice(&raw)
                .map_err(|_| Error::new(Code::AuditUnavailable, "a stored plan is corrupt"))?;
            Some(v)
        } else {
            None
        };
        // Exactly what submit will run: the same rendering, the same check.
        let command = match (&parameters, with_command) {
            (Some(v), true) => t
                .render(v)
                .ok()
                .filter(|c| sha256_hex(c.as_bytes()) == plan.command_sha256),
            _ => None,
        };
        let (risks, previous) = match (&parameters, with_command) {
            (Some(v), true) => (
                self.policy()
                    .schemas
                    .get(&plan.template)
                    .map(|c| t.risks(c, v))
                    .unwrap_or_default(),
                self.previous_plan(&plan, &t, v).await?,
            ),
            _ => (vec![], None),
        };
        let task = match (&plan.task_ref, with_command) {
            (Some(r), true) => self.get_task(r)?.map(|t| (t.state, t.receipt.is_some())),
            _ => None,
        };
        ev.outcome = Outcome::Ok;
        self.inner.journal.record(ev).await?;
        Ok(ConsoleReview {
            task,
            risks,
            previous,
            requested_by_me: self.identity(p) == plan.requester,
            requester: plan.requester.clone(),
            tenant: plan.tenant.clone(),
            review: dto::PlanReview::new(self.plan_answer(&plan, ctx), contract, parameters),
            command,
        })
    }

    /// The last plan people approved of `plan`'s template and tenant
    /// (other than `plan`), compared with `plan`'s parameters.
    async fn previous_plan(
        &self,
        plan: &Plan,
        t: &TaskTemplate,
        now: &Value,
    ) -> Result<Option<PreviousPlan>> {
        let (tenant, template, me) = (
            plan.tenant.clone(),
            plan.template.clone(),
            plan.plan_ref.clone(),
        );
        let last = self
            .inner
            .store
            .read(move |txn| {
                Ok(store::plans::all(txn)?
                    .into_iter()
                    .filter(|pl| {
                        pl.tenant == tenant
                            && pl.template == template
                            && pl.plan_ref != me
                            && pl.approval_required
                            && pl.approved_at.is_some()
                    })
                    .max_by(|a, b| {
                        (&a.approved_at, &a.plan_ref).cmp(&(&b.approved_at, &b.plan_ref))
                    }))
            })
            .await?;
        let Some(last) = last else {
            return Ok(None);
        };
        let raw = self.inner.store.sealer.open(&last.parameters_sealed)?;
        let before: Value = serde_json::from_slice(&raw)
            .map_err(|_| Error::new(Code::AuditUnavailable, "a stored plan is corrupt"))?;
        let command = (last.template_digest == plan.template_digest)
            .then(|| t.render(&before).ok())
            .flatten()
            .filter(|c| sha256_hex(c.as_bytes()) == last.command_sha256);
        Ok(Some(PreviousPlan {
            identical: last.parameters_sha256 == plan.parameters_sha256,
            rows: PreviousPlan::compare(&before, now),
            approved_at: last.approved_at.clone().unwrap_or_default(),
            plan_ref: last.plan_ref,
            command,
        }))
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
    ) -> Result<dto::PlanAnswer> {
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
        let reason = words(reason, "reason")?;
        let mut ev = self.task_event(
            p,
            if approve {
                Action::TaskApprove
            } else {
                Action::TaskDeny
            },
            ctx,
        );
        if let Some(s) = &ctx.console_session {
            // A person in the console, recorded as such.
            ev.runtime = Some("console".into());
            ev.session_digest = Some(self.inner.journal.digest("session", s.as_bytes()));
        }
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
        let _lock = self.lock(format!("task-plan:{plan_ref}")).await?;
        let mut plan = self.tenant_plan(p, plan_ref)?;
        ev.task_template = Some(plan.template.clone());
        ev.profile = Some(plan.profile.clone());
        if self.expire(ctx, &mut plan).await? {
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
        let Some(t) = self.plan_template(&plan) else {
            return Err(self.reject(ev, Self::changed()).await);
        };
        // The template's approver group, when it names one.
        if !t.approvers.is_empty() && !t.approvers.contains(&p.subject) {
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        Code::ApproverRequired,
                        format!(
                            "only the approvers task template {} names decide on its plans",
                            plan.template
                        ),
                    ),
                )
                .await);
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
        // A quorum counts people: one person (by subject, in any tenant)
        // approves once.
        let my_subject = self.subject_digest(p);
        if approve
            && plan
                .approvals
                .iter()
                .any(|a| a.identity == me || a.subject_digest == my_subject)
        {
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        Code::AlreadyApproved,
                        format!(
                            "you approved this plan already; it needs {} approvals from distinct people ({} so far)",
                            plan.approvals_required,
                            plan.approvals.len()
                        ),
                    ),
                )
                .await);
        }
        self.inner.journal.check()?;
        let (ts, _) = self.now();
        let decision = crate::store::plans::Decision {
            identity: me.clone(),
            subject_digest: my_subject,
            subject: p.subject.clone(),
            label: p.label.clone(),
            tenant: p.tenant.clone(),
            at: ts.clone(),
            reason: reason.clone(),
            via: if ctx.console_session.is_some() {
                "console"
            } else {
                "api"
            }
            .into(),
        };
        if approve {
            plan.approvals.push(decision);
            if plan.approvals.len() >= plan.approvals_required.max(1) as usize {
                plan.state = PlanState::Approved;
                plan.approved_at = Some(ts.clone());
                plan.approver = Some(me.clone());
                plan.decided_at = Some(ts);
            }
        } else {
            plan.state = PlanState::Denied;
            plan.approver = Some(me.clone());
            plan.decided_at = Some(ts);
            plan.denial_reason_sha256 = reason.as_ref().map(|r| sha256_hex(r.as_bytes()));
            plan.denial = Some(decision);
        }
        ev.outcome = Outcome::Ok;
        ev.approver_digest = Some(me);
        ev.reason_digest = reason
            .as_ref()
            .map(|r| self.inner.journal.digest("reason", r.as_bytes()));
        ev.reason = reason.clone();
        self.save_plan(&plan, PlanState::PendingApproval, ev)
            .await?;
        Ok(self.plan_answer(&plan, ctx))
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
                    let mut ev = j.event(Action::TaskPlanPruned);
                    ev.phase = Phase::Event;
                    ev.outcome = Outcome::Ok;
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
}

/// What an agent says of a plan besides its parameters: why it asks, and
/// the lease it works in.
#[derive(Debug, Clone, Copy, Default)]
pub struct PlanWhy<'a> {
    pub reason: Option<&'a str>,
    pub lease_ref: Option<&'a str>,
}

/// A person's (or an agent's) words as they may be kept: trimmed, at most
/// `MAX_REASON` bytes; blank is none. Whatever they hold is kept: the
/// console shows hidden characters in them escaped, as in parameters.
fn words(r: Option<&str>, what: &str) -> Result<Option<String>> {
    let Some(r) = r.map(str::trim).filter(|r| !r.is_empty()) else {
        return Ok(None);
    };
    if r.len() > MAX_REASON {
        return Err(Error::new(
            Code::ValueTooLarge,
            format!("{what} is longer than {MAX_REASON} bytes"),
        ));
    }
    Ok(Some(r.to_string()))
}

/// Why a template refuses these parameters' characters, if it does:
/// bidirectional controls unless it allows them, anything but printable
/// ASCII where it asks for that.
fn hidden_fault(t: &crate::config::TaskTemplate, parameters: &Value) -> Option<String> {
    if t.parameters_ascii_only
        && let Some((at, c)) =
            reveal::first_fault(parameters, &|c| !(c == ' ' || c.is_ascii_graphic()))
    {
        return Some(format!(
            "parameters.{at} contains {}: this task template accepts printable ASCII only",
            reveal::describe(c)
        ));
    }
    if !t.allow_bidi_controls
        && let Some((at, c)) = reveal::first_fault(parameters, &|c| {
            reveal::hidden(c) == Some(reveal::Hidden::Bidi)
        })
    {
        return Some(format!(
            "parameters.{at} contains a bidirectional control character ({}), which makes text read other than it runs: refused (a template may accept them with allow_bidi_controls)",
            reveal::describe(c)
        ));
    }
    None
}
