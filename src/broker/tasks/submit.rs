//! Submitting an approved plan: the task's record, its lease (in a
//! session domain of its own) and its job.

use super::*;

impl Broker {
    /// `POST /v1/task-plans/{ref}/submit` (202): run an approved (or
    /// ready) plan. Idempotent: a submitted plan answers with its task.
    pub async fn submit_plan(
        &self,
        p: &Principal,
        ctx: &Ctx,
        plan_ref: &str,
    ) -> Result<dto::TaskAnswer> {
        let mut ev = self.task_event(p, Action::TaskSubmit, ctx);
        ev.plan_ref = shaped(plan_ref, "plan");
        self.authorize(p, "task:submit", &ev).await?;
        let plan_lock = self.lock(format!("task-plan:{plan_ref}")).await?;
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
            ev.outcome = Outcome::Ok;
            ev.task_ref = Some(t.task_ref.clone());
            ev.reused = Some(true);
            self.inner.journal.record(ev).await?;
            return self.task_answer(&t, ctx, true);
        }
        if self.expire(ctx, &mut plan).await? {
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
            .map_err(|m| Error::new(Code::InvalidParameters, m.to_string()))?;
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
            approvals: plan.approvals.clone(),
            template: plan.template.clone(),
            template_digest: plan.template_digest.clone(),
            profile: plan.profile.clone(),
            backend: plan.backend.clone(),
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
            setup_error: None,
        };
        let was = plan.state;
        plan.state = PlanState::Submitted;
        plan.task_ref = Some(task.task_ref.clone());
        ev.outcome = Outcome::Ok;
        ev.task_ref = Some(task.task_ref.clone());
        ev.approver_digest = task.approver.clone();
        ev.command_digest = Some(self.inner.journal.digest("command", command.as_bytes()));
        // The task's lock is taken before the plan's is let go: status and
        // result wait for the setup.
        let task_lock = self.lock(format!("task:{}", task.task_ref)).await?;
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
                    .map(|v| v.job_ref)
            }
            Err(e) => Err(e),
        };
        task.updated_at = self.now().0;
        match r {
            Ok(job) => {
                task.job_ref = Some(job);
                task.state = TaskState::Running;
                let ev = self.save_task_event(&task, Action::TaskStarted, ctx, Outcome::Ok);
                self.save_task(&task, ev).await?;
                Ok(task)
            }
            Err(e) => {
                task.state = TaskState::SetupFailed;
                task.setup_error = Some(setup_error(&e));
                task.cleanup = Some(self.kill_task_lease(&tp, ctx, &task).await.into());
                let mut ev = self.save_task_event(&task, Action::TaskSetup, ctx, Outcome::Error);
                ev.error_code = Some(e.code.to_string());
                self.save_task(&task, ev).await?;
                Err(e)
            }
        }
    }
}

/// Why a task's setup failed, as the task keeps it: the code and the
/// message (at most 512 characters).
fn setup_error(e: &Error) -> String {
    let m: String = e.message.chars().take(512).collect();
    format!("{}: {m}", e.code.as_str())
}
