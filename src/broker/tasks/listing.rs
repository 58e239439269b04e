//! The console's view of trusted tasks: the list (filtered, newest first,
//! paged), a task's detail, its receipt, and the receipt checked with the
//! appliance's own keys.
//!
//! Who may look: the task's requester and admins, as on `/v1`, and the
//! approvers and auditors of its tenant (`docs/operations.md`: auditors
//! read task statuses and receipts). Results (exposed output content) go
//! only to those `/v1` gives them to: the requester and admins. Every
//! look is audited as on `/v1` (`task_status`, `task_receipt`), the list
//! as `task_list`.

use super::*;

/// Rows of one page of the list when none is asked for.
pub const LIST_DEFAULT: usize = 50;
/// Most rows of one page of the list.
pub const LIST_MAX: usize = 200;
/// Longest search text (a task or plan reference, or part of one).
pub const MAX_SEARCH: usize = 80;

/// The list's filters (each optional) and page.
#[derive(Debug, Clone, Default)]
pub struct TaskFilter {
    /// A task state (`running`, `succeeded`, …) or `active` (starting or
    /// running).
    pub state: Option<String>,
    pub template: Option<String>,
    /// Part of a task or plan reference.
    pub search: Option<String>,
    /// A tenant (admins see every tenant; others only their own).
    pub tenant: Option<String>,
    /// The cursor: the last task of the previous page.
    pub before: Option<String>,
    pub limit: Option<usize>,
}

/// One task of the list, as last recorded (the detail brings a running
/// task's state up to date).
#[derive(Debug, Clone)]
pub struct TaskRow {
    pub task_ref: String,
    pub plan_ref: String,
    pub tenant: String,
    pub template: String,
    pub profile: String,
    pub state: TaskState,
    pub created_at: String,
    pub completed_at: Option<String>,
    pub exit_code: Option<i32>,
    pub receipt_ready: bool,
}

/// One page of the list.
#[derive(Debug, Clone)]
pub struct TaskPage {
    pub rows: Vec<TaskRow>,
    /// The cursor of the next page, if there is one.
    pub next: Option<String>,
}

/// A task's detail for the console.
#[derive(Debug, Clone)]
pub struct ConsoleTask {
    /// What `GET /v1/tasks/{ref}/status` answers to the same person (the
    /// result only to its requester and admins).
    pub answer: dto::TaskAnswer,
    pub tenant: String,
    /// Identity digests (tasks keep no names).
    pub requester: String,
    pub requested_by_me: bool,
    pub approver: Option<String>,
    /// Who approved it, by name (issue #36), in order.
    pub approvers: Vec<String>,
    pub approved_at: Option<String>,
    pub parameters_sha256: String,
    pub command_sha256: String,
}

/// The audit chain head a receipt names, looked up in the journal.
#[derive(Debug, Clone)]
pub struct HeadCheck {
    pub seq: u64,
    pub chain_hash: String,
    /// The journal's event `seq` has this hash (and its content matches
    /// its hash).
    pub in_journal: bool,
    /// The event after it is this task's `task_finalize` or `task_cancel`
    /// and links to it (`prev_hash`).
    pub next_is_finalize: bool,
}

/// A receipt checked with the appliance's own keys.
#[derive(Debug, Clone)]
pub struct ReceiptCheck {
    /// What `cube-adapter receipt verify --state-dir` prints for it.
    pub verdict: super::super::receipts::Verdict,
    /// Each signature on its own.
    pub signatures: Vec<super::super::receipts::SignatureCheck>,
    /// The Ed25519 key it was checked with.
    pub public_key: dto::PublicKey,
    /// The HS256 key's id.
    pub hs_kid: String,
    /// `None` when the receipt names no head.
    pub head: Option<HeadCheck>,
    /// The receipt as checked (pretty JSON is the caller's).
    pub receipt: Value,
}

impl Broker {
    /// The tasks `p` may follow (its tenant's; every tenant's for admins),
    /// newest first, filtered and paged. Authorized as a task status read
    /// (`task:status`); every listing is a `task_list` event.
    pub async fn list_tasks_in_console(
        &self,
        p: &Principal,
        ctx: &Ctx,
        f: &TaskFilter,
    ) -> Result<TaskPage> {
        let mut ev = self.task_event(p, Action::TaskList, ctx);
        self.authorize(p, "task:status", &ev).await?;
        if !Self::may_see_plans(p) {
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        Code::ApproverRequired,
                        "only approvers, auditors and admins see the list of tasks",
                    ),
                )
                .await);
        }
        let bad = |m: &str| Error::new(Code::InvalidRequest, m.to_string());
        let state = match f.state.as_deref() {
            None | Some("") => None,
            Some("active") => Some(None),
            Some(s) => Some(Some(TaskState::parse(s).ok_or_else(|| {
                bad("state must be a task state (running, succeeded, …) or active")
            })?)),
        };
        let template = f.template.clone().filter(|t| !t.is_empty());
        if template
            .as_deref()
            .is_some_and(|t| !crate::config::valid_profile_name(t))
        {
            return Err(bad("template must match ^[a-z][a-z0-9-]{0,62}$"));
        }
        ev.task_template = template.clone();
        let search = f.search.clone().filter(|s| !s.is_empty());
        if search.as_deref().is_some_and(|s| {
            s.len() > MAX_SEARCH
                || !s
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        }) {
            return Err(bad(
                "search is part of a task or plan reference: letters, digits, _ and -, at most 80",
            ));
        }
        let tenant = if p.is_admin() {
            f.tenant.clone().filter(|t| !t.is_empty())
        } else {
            Some(p.tenant.clone())
        };
        let before = f.before.clone().filter(|b| !b.is_empty());
        if before.as_deref().is_some_and(|b| !valid_ref(b, "task")) {
            return Err(bad("before must be a task reference from the list"));
        }
        let limit = f.limit.unwrap_or(LIST_DEFAULT).clamp(1, LIST_MAX);
        let (tenant_now, admin) = (p.tenant.clone(), p.is_admin());
        let page = self
            .inner
            .store
            .read(move |txn| {
                use crate::store::typed::ReadOps;
                let all: Vec<Task> = txn.records(store::tables::TASKS)?;
                // The cursor: only a task this person sees (`None`: an
                // unknown cursor).
                let after = match &before {
                    None => Some(None),
                    Some(b) => all
                        .iter()
                        .find(|t| &t.task_ref == b && (admin || t.tenant == tenant_now))
                        .map(|t| Some((t.created_at.clone(), t.task_ref.clone()))),
                };
                Ok(after.map(|after| {
                    let mut rows: Vec<TaskRow> = all
                        .into_iter()
                        // `tenant` is the person's own unless an admin's.
                        .filter(|t| tenant.as_ref().is_none_or(|x| &t.tenant == x))
                        .filter(|t| match state {
                            None => true,
                            Some(None) => {
                                matches!(t.state, TaskState::Starting | TaskState::Running)
                            }
                            Some(Some(s)) => t.state == s,
                        })
                        .filter(|t| template.as_ref().is_none_or(|x| &t.template == x))
                        .filter(|t| {
                            search.as_ref().is_none_or(|x| {
                                t.task_ref.contains(x.as_str()) || t.plan_ref.contains(x.as_str())
                            })
                        })
                        .filter(|t| {
                            after
                                .as_ref()
                                .is_none_or(|(c, r)| (&t.created_at, &t.task_ref) < (c, r))
                        })
                        .map(|t| TaskRow {
                            receipt_ready: t.receipt.is_some(),
                            task_ref: t.task_ref,
                            plan_ref: t.plan_ref,
                            tenant: t.tenant,
                            template: t.template,
                            profile: t.profile,
                            state: t.state,
                            created_at: t.created_at,
                            completed_at: t.completed_at,
                            exit_code: t.exit_code,
                        })
                        .collect();
                    rows.sort_by(|a, b| {
                        (&b.created_at, &b.task_ref).cmp(&(&a.created_at, &a.task_ref))
                    });
                    let more = rows.len() > limit;
                    rows.truncate(limit);
                    TaskPage {
                        next: more
                            .then(|| rows.last().map(|r| r.task_ref.clone()))
                            .flatten(),
                        rows,
                    }
                }))
            })
            .await;
        let Some(page) = page? else {
            return Err(bad("before must be a task reference from the list"));
        };
        ev.outcome = Outcome::Ok;
        self.inner.journal.record(ev).await?;
        Ok(page)
    }

    /// A task's detail: what `task_status` answers (the same read, event
    /// and refresh; the result only to its requester and admins), with
    /// what the console shows besides.
    pub async fn task_in_console(
        &self,
        p: &Principal,
        ctx: &Ctx,
        task_ref: &str,
    ) -> Result<ConsoleTask> {
        let task = self.refreshed_task(p, ctx, task_ref).await?;
        let act = self.is_requester(p, &task.tenant, &task.requester);
        Ok(ConsoleTask {
            answer: self.task_answer(&task, ctx, act)?,
            requested_by_me: self.identity(p) == task.requester,
            tenant: task.tenant,
            requester: task.requester,
            approver: task.approver,
            approvers: task
                .approvals
                .iter()
                .map(|a| match &a.reason {
                    Some(r) => format!("{} ({}, {}): {r}", a.subject, a.tenant, a.at),
                    None => format!("{} ({}, {})", a.subject, a.tenant, a.at),
                })
                .collect(),
            approved_at: task.approved_at,
            parameters_sha256: task.parameters_sha256,
            command_sha256: task.command_sha256,
        })
    }

    /// A task's receipt (read as `task_receipt`) checked with the
    /// appliance's own keys by the code of `cube-adapter receipt verify`,
    /// each signature on its own, and the audit chain head it names looked
    /// up in the journal.
    pub async fn check_receipt_in_console(
        &self,
        p: &Principal,
        ctx: &Ctx,
        task_ref: &str,
    ) -> Result<ReceiptCheck> {
        let r = self.task_receipt(p, ctx, task_ref).await?;
        let signer = &self.inner.receipts;
        let (verdict, signatures) = signer
            .check(&r.receipt)
            .map_err(|m| Error::new(Code::InvalidRequest, format!("not a receipt: {m}")))?;
        let audit = r.receipt.get("payload").and_then(|p| p.get("audit"));
        let head = match (
            audit.and_then(|a| a.get("seq")).and_then(Value::as_u64),
            audit
                .and_then(|a| a.get("chain_hash"))
                .and_then(Value::as_str),
        ) {
            (Some(seq), Some(hash)) => {
                let (hash, tr) = (hash.to_string(), r.task_ref.clone());
                let (h2, t2) = (hash.clone(), tr.clone());
                let (in_journal, next_is_finalize) = self
                    .inner
                    .store
                    .read(move |txn| {
                        let at = store::journal::event(txn, seq)?;
                        let next = store::journal::event(txn, seq.saturating_add(1))?;
                        let in_journal =
                            at.is_some_and(|e| e.hash == h2 && e.compute_hash() == e.hash);
                        let next_is_finalize = next.is_some_and(|e| {
                            e.prev_hash == h2
                                && e.task_ref.as_deref() == Some(t2.as_str())
                                && matches!(e.action, Action::TaskFinalize | Action::TaskCancel)
                        });
                        Ok((in_journal, next_is_finalize))
                    })
                    .await?;
                Some(HeadCheck {
                    seq,
                    chain_hash: hash,
                    in_journal,
                    next_is_finalize,
                })
            }
            _ => None,
        };
        Ok(ReceiptCheck {
            verdict,
            signatures,
            public_key: signer.public_key(),
            hs_kid: signer.hs_kid(),
            head,
            receipt: r.receipt,
        })
    }
}
