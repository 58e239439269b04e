//! A task's end: status, result and cancel (both finalize: validate the
//! declared outputs, kill the sandbox, sign the receipt), the receipt and
//! the key receipts are signed with.

use super::*;

impl Broker {
    /// `GET|POST /v1/tasks/{ref}/status`.
    pub async fn task_status(
        &self,
        p: &Principal,
        ctx: &Ctx,
        task_ref: &str,
    ) -> Result<dto::TaskAnswer> {
        let task = self.refreshed_task(p, ctx, task_ref).await?;
        let act = self.is_requester(p, &task.tenant, &task.requester);
        self.task_answer(&task, ctx, act)
    }

    /// A task read for its status (authorized, refreshed from its job,
    /// recorded as `task_status`): `task_status` and the console's detail.
    pub(super) async fn refreshed_task(
        &self,
        p: &Principal,
        ctx: &Ctx,
        task_ref: &str,
    ) -> Result<Task> {
        let mut ev = self.task_event(p, Action::TaskStatus, ctx);
        ev.task_ref = shaped(task_ref, "task");
        self.authorize(p, "task:status", &ev).await?;
        self.visible_task(p, task_ref, false)?;
        let lock = self.lock(format!("task:{task_ref}")).await?;
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
        ev.outcome = Outcome::Ok;
        ev.task_state = Some(task.state.to_string());
        self.inner.journal.record(ev).await?;
        Ok(task)
    }

    /// `POST /v1/tasks/{ref}/result`: validate outputs, kill the sandbox,
    /// sign the receipt. Idempotent once signed.
    pub async fn task_result(
        &self,
        p: &Principal,
        ctx: &Ctx,
        task_ref: &str,
    ) -> Result<dto::TaskAnswer> {
        self.finalize(p, ctx, task_ref, false).await
    }

    /// `POST /v1/tasks/{ref}/cancel`: cancel the job, then finalize.
    pub async fn cancel_task(
        &self,
        p: &Principal,
        ctx: &Ctx,
        task_ref: &str,
    ) -> Result<dto::TaskAnswer> {
        self.finalize(p, ctx, task_ref, true).await
    }

    async fn finalize(
        &self,
        p: &Principal,
        ctx: &Ctx,
        task_ref: &str,
        cancel: bool,
    ) -> Result<dto::TaskAnswer> {
        let (action, scope) = if cancel {
            (Action::TaskCancel, "task:cancel")
        } else {
            (Action::TaskFinalize, "task:result")
        };
        let mut ev = self.task_event(p, action, ctx);
        ev.task_ref = shaped(task_ref, "task");
        self.authorize(p, scope, &ev).await?;
        self.visible_task(p, task_ref, true)?;
        let lock = self.lock(format!("task:{task_ref}")).await?;
        let task = self.visible_task(p, task_ref, true)?;
        ev.plan_ref = Some(task.plan_ref.clone());
        ev.task_template = Some(task.template.clone());
        ev.profile = Some(task.profile.clone());
        ev.backend = Some(task.backend.clone());
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
                    task.exit_code = v.exit_code;
                    // Asked to cancel: whatever is left ends with the sandbox.
                    task.state = match v.state {
                        JobState::Running => TaskState::Cancelled,
                        s => s.into(),
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
                let ev2 = self.save_task_event(&task, Action::TaskResult, ctx, Outcome::Ok);
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
            ev.outcome = Outcome::Error;
            ev.error_code = Some("cleanup_pending".into());
            self.save_task(&task, ev).await?;
            return Ok(task);
        }
        task.state = final_state;
        task.completed_at = Some(ts);
        let evidence = result.get("output_evidence").cloned().unwrap_or(json!([]));
        // Its sandbox is gone: its recordings (its job's) are sealed, and
        // the receipt names them.
        let sealed = match &task.lease_ref {
            Some(l) => self.seal_lease_recordings(l).await,
            None => vec![],
        };
        ev.recordings_digest = crate::broker::recordings::recordings_digest(&sealed);
        let mut payload = json!({
            "version": "1",
            "issuer": "cubesandbox-agent-adapter",
            "appliance": concat!("cube-adapter/", env!("CARGO_PKG_VERSION")),
            "task_ref": task.task_ref,
            "plan_ref": task.plan_ref,
            "tenant_hash": &sha256_hex(task.tenant.as_bytes())[..32],
            "requester_hash": task.requester,
            "approver_hash": task.approver,
            "approved_at": task.approved_at,
            // Every person who approved it (a quorum names them all).
            "approvers": task.approvals.iter().map(|a| json!({
                "identity_hash": a.identity,
                "subject": a.subject,
                "tenant_hash": &sha256_hex(a.tenant.as_bytes())[..32],
                "approved_at": a.at,
                "reason": a.reason,
            })).collect::<Vec<_>>(),
            "task_template": task.template,
            "template_sha256": task.template_digest,
            "profile": task.profile,
            "backend": task.backend,
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
        if !sealed.is_empty()
            && let Some(m) = payload.as_object_mut()
        {
            m.insert(
                "recordings".into(),
                json!(
                    sealed
                        .iter()
                        .map(|(r, d, n)| json!({"recording_ref": r, "sha256": d, "bytes": n}))
                        .collect::<Vec<_>>()
                ),
            );
        }
        ev.outcome = Outcome::Ok;
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
                Ok(v) => match v {
                    dto::FileAnswer::Download(d) => base64::engine::general_purpose::STANDARD
                        .decode(d.content_base64)
                        .ok(),
                    _ => None,
                }
                .ok_or_else(|| Error::new(Code::InvalidArtifact, "an output could not be read"))?,
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
    pub async fn task_receipt(
        &self,
        p: &Principal,
        ctx: &Ctx,
        task_ref: &str,
    ) -> Result<dto::ReceiptResponse> {
        let mut ev = self.task_event(p, Action::TaskReceipt, ctx);
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
        ev.outcome = Outcome::Ok;
        self.inner.journal.record(ev).await?;
        Ok(dto::ReceiptResponse {
            receipt: r,
            request_id: ctx.request_id.clone(),
            task_ref: task.task_ref,
        })
    }

    /// `GET /v1/receipts/public-key`: the key receipts are signed with.
    pub fn receipt_public_key(&self) -> dto::PublicKey {
        self.inner.receipts.public_key()
    }
}
