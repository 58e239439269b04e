//! Approvals: the queue of plans pending approval and a plan's review,
//! with the approve/deny form. Every read and decision goes through the
//! broker as the signed-in person (`Broker::plan_queue`,
//! `review_plan_in_console`, `decide_plan`): the same policy, audit events
//! and error codes as `/v1`. A decision is POST-redirect-GET: its outcome
//! (or the broker's code) comes back to the review page as a query, and
//! the page shows a fixed message for it (nothing from the query is
//! echoed but a known code).

use askama::Template;
use axum::Form;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use serde::Deserialize;

use super::ConsoleState;
use super::pages::{
    Notice, Outcome, Page, age, broker_refused as refused, checked_form_returning, ctx, html,
    scope_text, session_ctx, signed_in, signed_in_returning, span,
};
use crate::broker::Code;
use crate::broker::tasks::reveal::{Piece, Scan, pieces};

/// How often the queue's script asks whether the queue changed
/// (seconds). The page never reloads itself: focus and a half-read row
/// stay where they are.
pub const QUEUE_REFRESH_SECONDS: u32 = 5;

/// One row of the queue.
pub struct QueueRow {
    pub plan_ref: String,
    pub tenant: String,
    pub template: String,
    pub profile: String,
    /// Who asked: the subject (and the credential's label), or the start
    /// of the identity digest for plans made before names were kept.
    pub requester: String,
    /// What the agent said it is, if it did.
    pub agent: String,
    /// Why, as the agent said (the start of it).
    pub reason: String,
    /// `1 of 2` where a plan needs more than one approval.
    pub approvals: String,
    pub mine: bool,
    pub age: String,
    pub left: String,
}

/// A person or agent in a line: `subject (label)`, the label left out
/// when it says nothing more.
fn named(subject: &str, label: Option<&str>) -> String {
    match label {
        Some(l) if l != subject => format!("{subject} ({l})"),
        _ => subject.to_string(),
    }
}

/// Who asked, in a line: [`named`], or the digest's start for plans made
/// before names were kept.
fn asked_by(r: Option<&crate::store::plans::Requester>, digest: &str) -> String {
    match r {
        Some(r) => named(&r.subject, r.label.as_deref()),
        None => short(digest),
    }
}

/// The start of a text, for a table cell.
fn gist(s: &str, n: usize) -> String {
    let mut out: String = s.chars().take(n).collect();
    if s.chars().count() > n {
        out.push('…');
    }
    out
}

/// Someone's decision, as the review lists it.
pub struct DecisionRow {
    pub who: String,
    pub tenant: String,
    pub at: String,
    pub via: String,
    pub reason: Option<Vec<Piece>>,
}

/// A parameter before (the last approved plan) and now.
pub struct ChangeRow {
    pub name: Vec<Piece>,
    pub before: Vec<Piece>,
    pub now: Vec<Piece>,
    pub changed: bool,
    pub risky: bool,
}

/// The comparison with the last approved plan, for the page.
pub struct Compared {
    pub plan_ref: String,
    pub approved_at: String,
    pub identical: bool,
    /// The names of the parameters that changed.
    pub changed: Vec<String>,
    pub rows: Vec<ChangeRow>,
    /// Its command, when it differs from this one's.
    pub command_before: Option<Vec<Piece>>,
}

impl From<&crate::broker::dto::PlanDecision> for DecisionRow {
    fn from(d: &crate::broker::dto::PlanDecision) -> Self {
        Self {
            who: named(&d.subject, d.label.as_deref()),
            tenant: d.tenant.clone(),
            at: d.at.clone(),
            via: d.via.clone(),
            reason: d.reason.as_deref().map(pieces),
        }
    }
}

#[derive(Template)]
#[template(path = "approvals.html", config = "web/askama.toml")]
struct QueuePage {
    page: Page,
    scope: String,
    refresh: u32,
    rows: Vec<QueueRow>,
    recent: Vec<EndedRow>,
    /// The pending plans' refs, space-separated: the script compares the
    /// queue with them.
    pending: String,
    js_version: String,
}

/// A plan decided, run or expired, as the queue lists it below the
/// pending ones.
pub struct EndedRow {
    pub plan_ref: String,
    pub tenant: String,
    pub template: String,
    pub requester: String,
    pub state: &'static str,
    pub ended_by: String,
    pub ended_at: String,
}

/// One output of the template's contract.
pub struct OutputRow {
    pub name: String,
    pub format: String,
    pub expose: String,
    pub required: bool,
}

#[derive(Template)]
#[template(path = "plan.html", config = "web/askama.toml")]
struct ReviewPage {
    page: Page,
    notice: Option<Notice>,
    plan_ref: String,
    tenant: String,
    template: String,
    template_sha256: String,
    description: String,
    profile: String,
    state: &'static str,
    pending: bool,
    approval_required: bool,
    created_at: String,
    expires_at: String,
    left: String,
    decided_at: Option<String>,
    task_ref: Option<String>,
    /// The task's state, and whether its receipt is ready.
    task_state: Option<&'static str>,
    receipt_ready: bool,
    requester: String,
    /// Who asked, readable: subject and label, tenant, agent, lease.
    asked_by: String,
    agent: Option<String>,
    lease: Option<String>,
    reason: Option<Vec<Piece>>,
    risks: Vec<crate::config::tasks::Risk>,
    previous: Option<Compared>,
    approvals_required: u32,
    approvals: Vec<DecisionRow>,
    /// Whether any approver gave a reason.
    approver_reasons: bool,
    denial: Option<DecisionRow>,
    /// What the parameters and command hide, in a line (a banner).
    hidden: Option<String>,
    parameters_shown: Vec<Piece>,
    command_shown: Vec<Piece>,
    mine: bool,
    command_sha256: String,
    parameters_sha256: String,
    outputs: Vec<OutputRow>,
    /// Pretty JSON, to those who may decide.
    parameters: Option<String>,
    command: Option<String>,
    may_decide: bool,
    /// A reason typed before a session ended, kept for this plan.
    reason_draft: String,
    csrf: String,
}

/// An identity digest, shortened for a table (the whole one in `title`).
fn short(d: &str) -> String {
    d.chars().take(12).collect()
}

pub async fn queue(State(st): State<ConsoleState>, headers: HeaderMap) -> Response {
    let who = match signed_in(&st, &headers).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let (plans, ended) = match st.broker.plan_queue(&who.principal, &ctx()).await {
        Ok(v) => v,
        Err(e) => return refused(&who, &e),
    };
    let now = st.broker.clock().unix();
    let recent = ended
        .into_iter()
        .map(|p| EndedRow {
            requester: asked_by(p.requested_by.as_ref(), &p.requester),
            state: p.state.as_str(),
            ended_by: p.ended_by.unwrap_or_default(),
            ended_at: p.ended_at,
            plan_ref: p.plan_ref,
            tenant: p.tenant,
            template: p.template,
        })
        .collect();
    let rows: Vec<QueueRow> = plans
        .into_iter()
        .map(|p| QueueRow {
            age: age(&p.created_at, now),
            left: span(p.expires_unix - now),
            requester: asked_by(p.requested_by.as_ref(), &p.requester),
            agent: p
                .requested_by
                .as_ref()
                .and_then(|r| r.agent.clone())
                .unwrap_or_default(),
            reason: p.reason.as_deref().map(|r| gist(r, 80)).unwrap_or_default(),
            approvals: if p.approvals_required > 1 {
                format!("{} of {}", p.approvals, p.approvals_required)
            } else {
                String::new()
            },
            mine: p.requested_by_me,
            plan_ref: p.plan_ref,
            tenant: p.tenant,
            template: p.template,
            profile: p.profile,
        })
        .collect();
    let page = QueuePage {
        page: Page::new(Some(&who), "approvals"),
        scope: scope_text(&who.principal),
        refresh: QUEUE_REFRESH_SECONDS,
        pending: rows
            .iter()
            .map(|r: &QueueRow| r.plan_ref.as_str())
            .collect::<Vec<_>>()
            .join(" "),
        rows,
        recent,
        js_version: super::assets::version("console.js"),
    };
    html(StatusCode::OK, &page)
}

/// `GET /console/approvals/pending`: the refs of the plans pending
/// approval, for the queue's script (`{"pending": [...]}`); the same
/// policy as the queue.
pub async fn pending(State(st): State<ConsoleState>, headers: HeaderMap) -> Response {
    let who = match signed_in(&st, &headers).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    match st.broker.plan_queue(&who.principal, &ctx()).await {
        Ok((plans, _)) => {
            let refs: Vec<String> = plans.into_iter().map(|p| p.plan_ref).collect();
            axum::Json(serde_json::json!({ "pending": refs })).into_response()
        }
        Err(e) => refused(&who, &e),
    }
}

/// The message for a decision's outcome or the broker's code.
fn notice(q: &Outcome) -> Option<Notice> {
    match q.done.as_deref() {
        Some("approved") => {
            return Notice::done("Approved. The requester may now submit the task.");
        }
        Some("denied") => return Notice::done("Denied. The plan will not run."),
        Some("counted") => {
            return Notice::done(
                "Your approval is recorded. The plan needs more approvals from other people before it may run.",
            );
        }
        _ => {}
    }
    let code = q.code()?;
    let text = match code {
        Code::SelfApprovalDenied => {
            "You asked for this plan: someone other than its requester must approve it."
        }
        Code::ApproverRequired => {
            "Only approvers and admins decide on plans; your role lets you look, not decide."
        }
        Code::PlanNotPending => {
            "The plan is no longer pending approval: it was decided on or submitted meanwhile."
        }
        Code::PlanExpired => "The plan expired before a decision; the agent must plan again.",
        Code::ActionDenied => {
            "Your scopes do not include deciding on plans (task:approve): your role lets you look, not decide."
        }
        Code::TaskTemplateDenied => "This task template is not available to you.",
        Code::TaskTemplateChanged => {
            "The task template or its profile changed after this plan was made; the agent must plan again."
        }
        Code::ValueTooLarge => "The reason is too long (at most 1024 bytes).",
        Code::AlreadyApproved => {
            "You approved this plan already: it needs approvals from other people."
        }
        Code::InvalidDecision => "The decision must be approve or deny.",
        Code::TaskPlanNotFound => "There is no such plan.",
        _ => "The appliance refused the decision.",
    };
    Notice::refused(code.as_str(), text)
}

fn wire<T: serde::Serialize>(v: &T) -> String {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::String(s)) => s,
        Ok(other) => other.to_string(),
        Err(_) => String::new(),
    }
}

pub async fn review(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    Path(plan_ref): Path<String>,
    Query(q): Query<Outcome>,
) -> Response {
    // Signed out (a notification's link): back here once signed in.
    let back = format!("/console/plans/{plan_ref}");
    let who = match signed_in_returning(&st, &headers, Some(&back)).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let r = match st
        .broker
        .review_plan_in_console(&who.principal, &session_ctx(&who), &plan_ref)
        .await
    {
        Ok(r) => r,
        Err(e) => return refused(&who, &e),
    };
    let now = st.broker.clock().unix();
    let v = r.review;
    let pending = v.state == crate::store::plans::PlanState::PendingApproval;
    let parameters = v
        .parameters
        .as_ref()
        .map(|p| serde_json::to_string_pretty(p).unwrap_or_default());
    let mut scan = Scan::default();
    if let Some(p) = &v.parameters {
        scan.add_json(p);
    }
    if let Some(c) = &r.command {
        scan.add(c);
    }
    if let Some(w) = &v.reason {
        scan.add(w);
    }
    let risky: Vec<&str> = r.risks.iter().map(|x| x.parameter.as_str()).collect();
    let previous = r.previous.as_ref().map(|pv| Compared {
        plan_ref: pv.plan_ref.clone(),
        approved_at: pv.approved_at.clone(),
        identical: pv.identical,
        changed: pv
            .rows
            .iter()
            .filter(|x| x.changed)
            .map(|x| x.name.clone())
            .collect(),
        rows: pv
            .rows
            .iter()
            .map(|x| ChangeRow {
                name: pieces(&x.name),
                before: pieces(x.before.as_deref().unwrap_or("(absent)")),
                now: pieces(x.now.as_deref().unwrap_or("(absent)")),
                changed: x.changed,
                risky: risky.contains(&x.name.as_str()),
            })
            .collect(),
        command_before: pv
            .command
            .as_deref()
            .filter(|c| Some(*c) != r.command.as_deref())
            .map(pieces),
    });
    let by = v.requested_by.as_ref();
    let draft = draft_for(&headers, &plan_ref);
    let page = ReviewPage {
        page: Page::new(Some(&who), "approvals"),
        notice: notice(&q),
        left: crate::clock::parse_unix(&v.expires_at)
            .map(|e| span(e - now))
            .unwrap_or_default(),
        tenant: r.tenant,
        template: v.task_template,
        template_sha256: v.template_sha256,
        description: v.contract.description.clone(),
        profile: v.profile,
        state: v.state.as_str(),
        pending,
        approval_required: v.approval_required,
        created_at: v.created_at,
        expires_at: v.expires_at,
        decided_at: v.decided_at,
        task_ref: v.task_ref,
        asked_by: asked_by(by, &r.requester),
        agent: by.and_then(|b| b.agent.clone()),
        lease: by.and_then(|b| match (&b.lease_ref, &b.runtime) {
            (Some(l), Some(rt)) => Some(format!("{l} (runtime {rt})")),
            (Some(l), None) => Some(l.clone()),
            _ => None,
        }),
        reason: v.reason.as_deref().map(pieces),
        risks: r.risks.clone(),
        previous,
        approvals_required: v.approvals_required,
        approvals: v.approvals.iter().map(DecisionRow::from).collect(),
        approver_reasons: v.approvals.iter().any(|a| a.reason.is_some()),
        denial: v.denial.as_ref().map(DecisionRow::from),
        hidden: (!scan.is_clean()).then(|| scan.summary()),
        parameters_shown: parameters.as_deref().map(pieces).unwrap_or_default(),
        command_shown: r.command.as_deref().map(pieces).unwrap_or_default(),
        requester: r.requester,
        mine: r.requested_by_me,
        command_sha256: v.command_sha256,
        parameters_sha256: v.parameters_sha256,
        outputs: v
            .contract
            .outputs
            .iter()
            .map(|o| OutputRow {
                name: o.name.clone(),
                format: wire(&o.format),
                expose: wire(&o.expose),
                required: o.required,
            })
            .collect(),
        parameters,
        command: r.command,
        may_decide: who.principal.may_approve() && pending,
        reason_draft: draft.clone().unwrap_or_default(),
        task_state: r.task.map(|(s, _)| s.as_str()),
        receipt_ready: r.task.is_some_and(|(_, ready)| ready),
        csrf: who.csrf.clone(),
        plan_ref: v.plan_ref,
    };
    let mut r = html(StatusCode::OK, &page);
    // A draft is used once.
    if draft.is_some()
        && let Ok(v) =
            axum::http::HeaderValue::from_str(&super::session::clear_cookie(DRAFT_COOKIE))
    {
        r.headers_mut().append(axum::http::header::SET_COOKIE, v);
    }
    r
}

#[derive(Deserialize)]
pub struct DecideForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    decision: String,
    #[serde(default)]
    reason: String,
}

/// The cookie that keeps a reason typed into a decision whose session
/// had ended, for the review after signing in again (half an hour).
const DRAFT_COOKIE: &str = "__Host-cube-draft";
const DRAFT_SECONDS: u64 = 1800;

/// The draft cookie's value: the plan and the reason, base64url.
fn draft_value(plan_ref: &str, reason: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(format!("{plan_ref}\n{reason}"))
}

/// The reason a draft cookie keeps for `plan_ref`, if it keeps one.
fn draft_for(headers: &HeaderMap, plan_ref: &str) -> Option<String> {
    use base64::Engine;
    let v = super::session::cookie(headers, DRAFT_COOKIE)?;
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(v)
        .ok()?;
    let text = String::from_utf8(raw).ok()?;
    let (p, reason) = text.split_once('\n')?;
    (p == plan_ref && reason.len() <= crate::broker::tasks::MAX_REASON).then(|| reason.to_string())
}

pub async fn decide(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    Path(plan_ref): Path<String>,
    Form(f): Form<DecideForm>,
) -> Response {
    // A session that ended while the person wrote: to sign in, then back
    // to the plan with what they typed (issue #36).
    let back = format!("/console/plans/{plan_ref}");
    let who = match checked_form_returning(&st, &headers, &f.csrf, &plan_ref, Some(&back)).await {
        Ok(s) => s,
        Err(r) if r.status() != StatusCode::SEE_OTHER => return r,
        Err(mut r) => {
            let reason = f.reason.trim();
            if crate::broker::leases::valid_ref(&plan_ref, "plan")
                && !reason.is_empty()
                && reason.len() <= crate::broker::tasks::MAX_REASON
                && let Ok(v) = axum::http::HeaderValue::from_str(&super::session::set_cookie(
                    DRAFT_COOKIE,
                    &draft_value(&plan_ref, reason),
                    DRAFT_SECONDS,
                ))
            {
                r.headers_mut().append(axum::http::header::SET_COOKIE, v);
            }
            return r;
        }
    };
    let reason = Some(f.reason.trim()).filter(|r| !r.is_empty());
    let to = match st
        .broker
        .decide_plan(
            &who.principal,
            &session_ctx(&who),
            &plan_ref,
            Some(f.decision.as_str()),
            reason,
        )
        .await
    {
        Ok(p) => format!(
            "/console/plans/{plan_ref}?done={}",
            match p.state {
                crate::store::plans::PlanState::Approved => "approved",
                crate::store::plans::PlanState::PendingApproval => "counted",
                _ => "denied",
            }
        ),
        Err(e) => format!("/console/plans/{plan_ref}?error={}", e.code.as_str()),
    };
    Redirect::to(&to).into_response()
}
