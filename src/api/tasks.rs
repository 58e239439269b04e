//! Trusted tasks: rows 34-42 of the reference endpoint table, and the
//! receipt signing key.

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use serde::Deserialize;

use super::{AppState, Auth, EmptyReq, R, Strict, ctx, header_ctx, ok, with_status};

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/task-templates", get(templates))
        .route("/v1/tasks/plan", post(plan))
        .route("/v1/task-plans/{plan_ref}", get(review))
        .route("/v1/task-plans/{plan_ref}/approve", post(approve))
        .route("/v1/task-plans/{plan_ref}/submit", post(submit))
        .route(
            "/v1/tasks/{task_ref}/status",
            get(status_get).post(status_post),
        )
        .route("/v1/tasks/{task_ref}/result", post(result))
        .route("/v1/tasks/{task_ref}/cancel", post(cancel))
        .route(
            "/v1/tasks/{task_ref}/receipt",
            get(receipt_get).post(receipt_post),
        )
        .route("/v1/receipts/public-key", get(public_key))
}

async fn templates(State(st): State<AppState>, Auth(p): Auth, h: HeaderMap) -> R {
    let c = header_ctx(&h)?;
    ok(st.broker.list_task_templates(&p, &c).await?)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PlanReq {
    template: String,
    /// Missing: 400 `invalid_parameters`, as in the reference.
    #[serde(default)]
    parameters: Option<serde_json::Value>,
    /// Why the agent asks (shown first to approvers).
    #[serde(default)]
    reason: Option<String>,
    /// The lease the agent works in (its own): named to approvers.
    #[serde(default)]
    lease_ref: Option<String>,
    #[serde(default)]
    request_id: Option<String>,
}

/// The header an MCP bridge names its host in (the MCP client info);
/// other clients are known by their `User-Agent`.
pub const AGENT_HEADER: &str = "x-cube-agent";

async fn plan(
    State(st): State<AppState>,
    Auth(p): Auth,
    h: HeaderMap,
    Strict(b): Strict<PlanReq>,
) -> R {
    let mut c = ctx(b.request_id.as_deref())?;
    c.agent = [AGENT_HEADER, "user-agent"]
        .iter()
        .find_map(|n| h.get(*n).and_then(|v| v.to_str().ok()))
        .and_then(crate::broker::Ctx::agent_from);
    let why = crate::broker::tasks::PlanWhy {
        reason: b.reason.as_deref(),
        lease_ref: b.lease_ref.as_deref(),
    };
    let v = st
        .broker
        .plan_task(&p, &c, &b.template, b.parameters.as_ref(), why)
        .await?;
    with_status(StatusCode::CREATED, v)
}

async fn review(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(plan_ref): Path<String>,
    h: HeaderMap,
) -> R {
    let c = header_ctx(&h)?;
    ok(st.broker.review_plan(&p, &c, &plan_ref).await?)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ApproveReq {
    #[serde(default)]
    decision: Option<String>,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    request_id: Option<String>,
}

async fn approve(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(plan_ref): Path<String>,
    Strict(b): Strict<ApproveReq>,
) -> R {
    let c = ctx(b.request_id.as_deref())?;
    ok(st
        .broker
        .decide_plan(
            &p,
            &c,
            &plan_ref,
            b.decision.as_deref(),
            b.reason.as_deref(),
        )
        .await?)
}

async fn submit(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(plan_ref): Path<String>,
    Strict(b): Strict<EmptyReq>,
) -> R {
    let c = ctx(b.request_id.as_deref())?;
    let v = st.broker.submit_plan(&p, &c, &plan_ref).await?;
    with_status(StatusCode::ACCEPTED, v)
}

async fn status_get(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(task_ref): Path<String>,
    h: HeaderMap,
) -> R {
    let c = header_ctx(&h)?;
    ok(st.broker.task_status(&p, &c, &task_ref).await?)
}

async fn status_post(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(task_ref): Path<String>,
    Strict(b): Strict<EmptyReq>,
) -> R {
    let c = ctx(b.request_id.as_deref())?;
    ok(st.broker.task_status(&p, &c, &task_ref).await?)
}

async fn result(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(task_ref): Path<String>,
    Strict(b): Strict<EmptyReq>,
) -> R {
    let c = ctx(b.request_id.as_deref())?;
    ok(st.broker.task_result(&p, &c, &task_ref).await?)
}

async fn cancel(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(task_ref): Path<String>,
    Strict(b): Strict<EmptyReq>,
) -> R {
    let c = ctx(b.request_id.as_deref())?;
    ok(st.broker.cancel_task(&p, &c, &task_ref).await?)
}

async fn receipt_get(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(task_ref): Path<String>,
    h: HeaderMap,
) -> R {
    let c = header_ctx(&h)?;
    ok(st.broker.task_receipt(&p, &c, &task_ref).await?)
}

async fn receipt_post(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(task_ref): Path<String>,
    Strict(b): Strict<EmptyReq>,
) -> R {
    let c = ctx(b.request_id.as_deref())?;
    ok(st.broker.task_receipt(&p, &c, &task_ref).await?)
}

async fn public_key(State(st): State<AppState>, Auth(_p): Auth) -> R {
    ok(st.broker.receipt_public_key())
}
