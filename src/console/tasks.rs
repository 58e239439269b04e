//! Tasks: the list with filters, a task's detail (status, exposed outputs,
//! evidence), its receipt (download, verify) and cancel (admins).
//!
//! Every read goes through the broker as the signed-in person
//! (`list_tasks_in_console`, `task_in_console`, `task_receipt`,
//! `check_receipt_in_console`): the policy, events and codes of `/v1`'s
//! task status and receipt reads, the list audited as `task_list`. Cancel
//! is the broker's `cancel_task` (as `POST /v1/tasks/{ref}/cancel`),
//! POST-redirect-GET with a fixed message per known code.

use askama::Template;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use serde::Deserialize;
use serde_json::Value;

use super::ConsoleState;
use super::pages::{
    CsrfForm, Notice, Outcome, Page, broker_refused as refused, checked_form, ctx, html,
    scope_text, signed_in,
};
use crate::broker::tasks::{LIST_DEFAULT, LIST_MAX, TaskFilter};
use crate::broker::{Code, Error};

/// This page's routes, merged into the console's router.
pub fn routes() -> Router<ConsoleState> {
    Router::new()
        .route("/console/tasks", get(list))
        .route("/console/tasks/{task_ref}", get(detail))
        .route("/console/tasks/{task_ref}/receipt", get(receipt))
        .route("/console/tasks/{task_ref}/verify", get(verify))
        .route("/console/tasks/{task_ref}/cancel", post(cancel))
}

/// The states the list's filter offers (`active`: starting or running).
const STATES: &[&str] = &[
    "active",
    "starting",
    "running",
    "succeeded",
    "failed",
    "cancelled",
    "timed_out",
    "setup_failed",
    "orphaned",
    "cleanup_pending",
    "output_validation_failed",
    "lost",
];

/// An option of a `<select>`.
pub struct Choice {
    pub value: String,
    pub selected: bool,
}

/// One row of the list.
pub struct Row {
    pub task_ref: String,
    pub plan_ref: String,
    pub tenant: String,
    pub template: String,
    pub profile: String,
    pub state: &'static str,
    pub created_at: String,
    pub completed_at: String,
    pub exit_code: String,
    pub receipt_ready: bool,
}

#[derive(Template)]
#[template(path = "tasks.html", config = "web/askama.toml")]
struct ListPage {
    page: Page,
    scope: String,
    admin: bool,
    states: Vec<Choice>,
    templates: Vec<Choice>,
    search: String,
    tenant: String,
    limit: usize,
    filtered: bool,
    rows: Vec<Row>,
    /// The next page's link, if there is one.
    next: Option<String>,
    /// Whether this is a later page (a link back to the first).
    paged: bool,
    first: String,
}

/// The list's query: every field a string, checked by the broker.
#[derive(Deserialize, Default)]
pub struct ListQuery {
    #[serde(default)]
    state: Option<String>,
    #[serde(default)]
    template: Option<String>,
    #[serde(default)]
    q: Option<String>,
    #[serde(default)]
    tenant: Option<String>,
    #[serde(default)]
    before: Option<String>,
    #[serde(default)]
    limit: Option<String>,
}

/// `/console/tasks?…` with these filters (empty ones left out).
fn list_href(fields: &[(&str, &str)]) -> String {
    let mut s = url::form_urlencoded::Serializer::new(String::new());
    for (k, v) in fields {
        if !v.is_empty() {
            s.append_pair(k, v);
        }
    }
    let q = s.finish();
    if q.is_empty() {
        "/console/tasks".into()
    } else {
        format!("/console/tasks?{q}")
    }
}

pub async fn list(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    Query(q): Query<ListQuery>,
) -> Response {
    let who = match signed_in(&st, &headers).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let limit = match q.limit.as_deref().filter(|l| !l.is_empty()) {
        None => None,
        Some(l) => match l.parse::<usize>() {
            Ok(n) if (1..=LIST_MAX).contains(&n) => Some(n),
            _ => {
                return refused(
                    &who,
                    &Error::new(
                        Code::InvalidRequest,
                        format!("limit must be a number from 1 to {LIST_MAX}"),
                    ),
                );
            }
        },
    };
    let admin = who.principal.is_admin();
    let text = |v: &Option<String>| v.as_deref().unwrap_or("").trim().to_string();
    let (state, template, search) = (text(&q.state), text(&q.template), text(&q.q));
    let tenant = if admin {
        text(&q.tenant)
    } else {
        String::new()
    };
    let filter = TaskFilter {
        state: Some(state.clone()),
        template: Some(template.clone()),
        search: Some(search.clone()),
        tenant: Some(tenant.clone()),
        before: q.before.clone(),
        limit,
    };
    let got = match st
        .broker
        .list_tasks_in_console(&who.principal, &ctx(), &filter)
        .await
    {
        Ok(v) => v,
        Err(e) => return refused(&who, &e),
    };
    let limit = limit.unwrap_or(LIST_DEFAULT);
    let limit_text = if limit == LIST_DEFAULT {
        String::new()
    } else {
        limit.to_string()
    };
    let base = [
        ("state", state.as_str()),
        ("template", template.as_str()),
        ("q", search.as_str()),
        ("tenant", tenant.as_str()),
        ("limit", limit_text.as_str()),
    ];
    let next = got.next.as_deref().map(|n| {
        let mut f = base.to_vec();
        f.push(("before", n));
        list_href(&f)
    });
    let mut templates: Vec<Choice> = st
        .broker
        .config()
        .tasks
        .keys()
        .map(|k| Choice {
            selected: *k == template,
            value: k.clone(),
        })
        .collect();
    if !template.is_empty() && !templates.iter().any(|c| c.selected) {
        // A template since removed from the configuration: still a filter.
        templates.push(Choice {
            value: template.clone(),
            selected: true,
        });
    }
    let page = ListPage {
        page: Page::new(Some(&who), "tasks"),
        scope: scope_text(&who.principal),
        admin,
        states: STATES
            .iter()
            .map(|s| Choice {
                value: (*s).into(),
                selected: *s == state,
            })
            .collect(),
        templates,
        filtered: base.iter().any(|(_, v)| !v.is_empty()),
        first: list_href(&base),
        paged: q.before.as_deref().is_some_and(|b| !b.is_empty()),
        search,
        tenant,
        limit,
        next,
        rows: got
            .rows
            .into_iter()
            .map(|r| Row {
                state: r.state.as_str(),
                completed_at: r.completed_at.unwrap_or_default(),
                exit_code: r.exit_code.map(|c| c.to_string()).unwrap_or_default(),
                receipt_ready: r.receipt_ready,
                task_ref: r.task_ref,
                plan_ref: r.plan_ref,
                tenant: r.tenant,
                template: r.template,
                profile: r.profile,
                created_at: r.created_at,
            })
            .collect(),
    };
    html(StatusCode::OK, &page)
}

/// One output's evidence (digests, never content).
pub struct Evidence {
    pub name: String,
    pub present: String,
    pub required: String,
    pub bytes: String,
    pub sha256: String,
    pub exposed: String,
    pub valid: String,
    pub error: String,
}

/// One exposed output's content.
pub struct Exposed {
    pub name: String,
    pub content: String,
}

/// The receipt's summary on the detail page.
pub struct ReceiptSummary {
    pub audit_seq: String,
    pub chain_hash: String,
    pub signatures: Vec<(String, String)>,
}

#[derive(Template)]
#[template(path = "task.html", config = "web/askama.toml")]
struct DetailPage {
    page: Page,
    notice: Option<Notice>,
    task_ref: String,
    plan_ref: String,
    tenant: String,
    template: String,
    template_sha256: String,
    profile: String,
    state: &'static str,
    execution_ended: bool,
    created_at: String,
    updated_at: String,
    completed_at: Option<String>,
    exit_code: Option<i32>,
    sandbox_ref: Option<String>,
    cleanup: Option<String>,
    setup_error: Option<String>,
    requester: String,
    mine: bool,
    approver: Option<String>,
    approvers: Vec<String>,
    approved_at: Option<String>,
    parameters_sha256: String,
    command_sha256: String,
    result_shown: bool,
    result_ready: bool,
    output_validation: String,
    outputs: Vec<Exposed>,
    evidence: Vec<Evidence>,
    receipt_ready: bool,
    receipt: Option<ReceiptSummary>,
    may_cancel: bool,
    csrf: String,
}

/// The message for a cancel's outcome or the broker's code.
fn notice(q: &Outcome) -> Option<Notice> {
    if q.done.as_deref() == Some("cancelled") {
        return Notice::done(
            "Cancelled: the task's job was stopped if it was still running, its sandbox killed and its result finalized.",
        );
    }
    let code = q.code()?;
    let text = match code {
        Code::ActionDenied => {
            "Your identity may not cancel tasks: in the console, admins cancel tasks."
        }
        Code::TaskNotFound => "There is no such task, or it is not yours to cancel.",
        Code::TaskTemplateChanged => "The task template changed after this task was planned.",
        Code::AuditUnavailable => {
            "The audit journal cannot record the cancel now, so nothing was done. Try again shortly."
        }
        Code::ExecutionFailed => "The appliance could not end the task. Try again shortly.",
        _ => "The appliance refused to cancel the task.",
    };
    Notice::refused(code.as_str(), text)
}

fn yes_no(v: Option<&Value>) -> String {
    match v.and_then(Value::as_bool) {
        Some(true) => "yes".into(),
        Some(false) => "no".into(),
        None => String::new(),
    }
}

fn evidence_rows(list: Option<&Value>) -> Vec<Evidence> {
    let s = |e: &Value, k: &str| match e.get(k) {
        Some(Value::String(x)) => x.clone(),
        Some(Value::Number(n)) => n.to_string(),
        _ => String::new(),
    };
    list.and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|e| Evidence {
            name: s(e, "name"),
            present: yes_no(e.get("present")),
            required: yes_no(e.get("required")),
            bytes: s(e, "bytes"),
            sha256: s(e, "sha256"),
            exposed: yes_no(e.get("exposed")),
            valid: yes_no(e.get("valid")),
            error: s(e, "error"),
        })
        .collect()
}

fn summary(receipt: &Value) -> ReceiptSummary {
    let audit = receipt.get("payload").and_then(|p| p.get("audit"));
    let text = |v: Option<&Value>| match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Number(n)) => n.to_string(),
        _ => String::new(),
    };
    let mut signatures = vec![];
    if let Some(s) = receipt.get("signature") {
        signatures.push((text(s.get("alg")), text(s.get("kid"))));
    }
    for s in receipt
        .get("signatures")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        signatures.push((text(s.get("alg")), text(s.get("kid"))));
    }
    ReceiptSummary {
        audit_seq: text(audit.and_then(|a| a.get("seq"))),
        chain_hash: text(audit.and_then(|a| a.get("chain_hash"))),
        signatures,
    }
}

pub async fn detail(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    Path(task_ref): Path<String>,
    Query(q): Query<Outcome>,
) -> Response {
    let who = match signed_in(&st, &headers).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let c = ctx();
    let t = match st
        .broker
        .task_in_console(&who.principal, &c, &task_ref)
        .await
    {
        Ok(t) => t,
        Err(e) => return refused(&who, &e),
    };
    let a = t.answer;
    // The receipt: with the result for those who get it (as on /v1), else
    // read as `GET /v1/tasks/{ref}/receipt` would (audited as such).
    let receipt = match (&a.receipt, a.receipt_ready) {
        (Some(r), _) if !r.is_null() => Some(r.clone()),
        (_, true) if who.principal.allows_action("task:receipt") => {
            match st.broker.task_receipt(&who.principal, &c, &task_ref).await {
                Ok(r) => Some(r.receipt),
                // The page shows the task without its receipt summary; a
                // failure of the appliance (not a refusal) is logged, as
                // `broker_refused` logs it.
                Err(e) => {
                    if e.code.status().is_server_error() {
                        tracing::error!(
                            code = e.code.as_str(),
                            task_ref = %task_ref,
                            "console: the task's receipt could not be read"
                        );
                    }
                    None
                }
            }
        }
        _ => None,
    };
    let result = a.result.as_ref().filter(|r| r.is_object());
    let outputs = result
        .and_then(|r| r.get("outputs"))
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(k, v)| Exposed {
                    name: k.clone(),
                    content: match v {
                        Value::String(s) => s.clone(),
                        other => serde_json::to_string_pretty(other).unwrap_or_default(),
                    },
                })
                .collect()
        })
        .unwrap_or_default();
    // Evidence: the result's, else the receipt's (the same digests).
    let evidence = match result.and_then(|r| r.get("output_evidence")) {
        Some(e) => evidence_rows(Some(e)),
        None => evidence_rows(
            receipt
                .as_ref()
                .and_then(|r| r.get("payload"))
                .and_then(|p| p.get("outputs")),
        ),
    };
    let page = DetailPage {
        page: Page::new(Some(&who), "tasks"),
        notice: notice(&q),
        plan_ref: a.plan_ref,
        tenant: t.tenant,
        template: a.task_template,
        template_sha256: a.template_sha256,
        profile: a.profile,
        state: a.state.as_str(),
        execution_ended: a.execution_ended,
        created_at: a.created_at,
        updated_at: a.updated_at,
        completed_at: a.completed_at,
        exit_code: a.exit_code,
        sandbox_ref: a.sandbox_ref,
        cleanup: a.cleanup,
        setup_error: a.setup_error,
        requester: t.requester,
        mine: t.requested_by_me,
        approver: t.approver,
        approvers: t.approvers,
        approved_at: t.approved_at,
        parameters_sha256: t.parameters_sha256,
        command_sha256: t.command_sha256,
        result_shown: result.is_some(),
        result_ready: a.result_ready,
        output_validation: result
            .and_then(|r| r.get("output_validation"))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string(),
        outputs,
        evidence,
        receipt_ready: a.receipt_ready,
        receipt: receipt.as_ref().map(summary),
        may_cancel: who.principal.is_admin() && !a.receipt_ready,
        csrf: who.csrf.clone(),
        task_ref: a.task_ref,
    };
    html(StatusCode::OK, &page)
}

/// The receipt as `GET /v1/tasks/{ref}/receipt` answers it, as a file.
pub async fn receipt(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    Path(task_ref): Path<String>,
) -> Response {
    let who = match signed_in(&st, &headers).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let r = match st
        .broker
        .task_receipt(&who.principal, &ctx(), &task_ref)
        .await
    {
        Ok(r) => r,
        Err(e) => return refused(&who, &e),
    };
    let body = match serde_json::to_vec(&r) {
        Ok(b) => b,
        Err(_) => {
            return refused(
                &who,
                &Error::new(Code::ExecutionFailed, "the receipt could not be written"),
            );
        }
    };
    // The broker only answers a well-formed reference: safe in a header.
    let disposition = HeaderValue::from_str(&format!(
        "attachment; filename=\"{}.receipt.json\"",
        r.task_ref
    ))
    .unwrap_or_else(|_| HeaderValue::from_static("attachment"));
    (
        StatusCode::OK,
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            ),
            (header::CONTENT_DISPOSITION, disposition),
        ],
        body,
    )
        .into_response()
}

/// One signature's line on the verify page.
pub struct SignatureLine {
    pub alg: String,
    pub kid: String,
    /// `valid`, `invalid` or `not checked`.
    pub result: &'static str,
    pub ok: bool,
}

#[derive(Template)]
#[template(path = "task_verify.html", config = "web/askama.toml")]
struct VerifyPage {
    page: Page,
    task_ref: String,
    valid: bool,
    signatures: Vec<SignatureLine>,
    public_key: String,
    public_kid: String,
    hs_kid: String,
    head: Option<crate::broker::tasks::HeadCheck>,
    /// What `cube-adapter receipt verify` prints for this receipt.
    verdict: String,
}

/// The receipt checked server-side with the code of `receipt verify`.
pub async fn verify(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    Path(task_ref): Path<String>,
) -> Response {
    let who = match signed_in(&st, &headers).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let v = match st
        .broker
        .check_receipt_in_console(&who.principal, &ctx(), &task_ref)
        .await
    {
        Ok(v) => v,
        Err(e) => return refused(&who, &e),
    };
    let page = VerifyPage {
        page: Page::new(Some(&who), "tasks"),
        valid: v.verdict.valid,
        signatures: v
            .signatures
            .into_iter()
            .map(|s| SignatureLine {
                result: match s.valid {
                    Some(true) => "valid",
                    Some(false) => "invalid",
                    None => "not checked (a key this appliance does not hold)",
                },
                ok: s.valid == Some(true),
                alg: s.alg,
                kid: s.kid,
            })
            .collect(),
        public_key: v.public_key.public_key,
        public_kid: v.public_key.kid,
        hs_kid: v.hs_kid,
        head: v.head,
        verdict: serde_json::to_string_pretty(&v.verdict).unwrap_or_default(),
        task_ref,
    };
    html(StatusCode::OK, &page)
}

pub async fn cancel(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    Path(task_ref): Path<String>,
    Form(f): Form<CsrfForm>,
) -> Response {
    let who = match checked_form(&st, &headers, &f.csrf, &task_ref).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let to = match st
        .broker
        .cancel_task(&who.principal, &ctx(), &task_ref)
        .await
    {
        Ok(_) => format!("/console/tasks/{task_ref}?done=cancelled"),
        Err(e) => format!("/console/tasks/{task_ref}?error={}", e.code.as_str()),
    };
    Redirect::to(&to).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::tasks::TaskState;

    #[test]
    fn every_offered_state_is_a_task_state() {
        for s in STATES.iter().filter(|s| **s != "active") {
            assert_eq!(TaskState::parse(s).map(|t| t.as_str()), Some(*s));
        }
    }

    #[test]
    fn list_links_keep_only_set_filters() {
        assert_eq!(list_href(&[("state", ""), ("q", "")]), "/console/tasks");
        assert_eq!(
            list_href(&[("state", "running"), ("tenant", "a b&c"), ("q", "")]),
            "/console/tasks?state=running&tenant=a+b%26c"
        );
    }
}
