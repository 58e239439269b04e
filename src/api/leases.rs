//! `/v1/leases…`: rows 5–18 of the reference endpoint table.

use axum::Router;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::routing::{get, post};
use serde::Deserialize;

use super::{AppState, Auth, EmptyReq, R, Strict, ctx, header_ctx, int_in, ok, with_status};
use crate::broker::Code;
use crate::broker::leases::FileOp;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/leases", get(list))
        .route("/v1/leases/acquire", post(acquire))
        .route(
            "/v1/leases/{lease_ref}/status",
            get(status_get).post(status_post),
        )
        .route("/v1/leases/{lease_ref}/exec", post(exec))
        .route("/v1/leases/{lease_ref}/read", post(read))
        .route("/v1/leases/{lease_ref}/write", post(write))
        .route("/v1/leases/{lease_ref}/list", post(list_files))
        .route("/v1/leases/{lease_ref}/stat", post(stat))
        .route("/v1/leases/{lease_ref}/mkdir", post(mkdir))
        .route("/v1/leases/{lease_ref}/remove", post(remove))
        .route("/v1/leases/{lease_ref}/move", post(move_))
        .route("/v1/leases/{lease_ref}/artifacts/upload", post(upload))
        .route("/v1/leases/{lease_ref}/artifacts/download", post(download))
        .route("/v1/leases/{lease_ref}/release", post(release))
        .route("/v1/leases/{lease_ref}/renew", post(renew))
        .route("/v1/leases/{lease_ref}/recover", get(recover))
        .route("/v1/leases/{lease_ref}/mcp/tools", get(mcp_tools))
        .route("/v1/leases/{lease_ref}/mcp/call", post(mcp_call))
        .route("/v1/profiles", get(profiles))
        .route(
            "/v1/leases/{lease_ref}/checkpoints",
            get(checkpoints_list).post(checkpoint_create),
        )
        .route(
            "/v1/leases/{lease_ref}/checkpoints/{checkpoint_ref}/rollback",
            post(checkpoint_rollback),
        )
        .route(
            "/v1/leases/{lease_ref}/checkpoints/{checkpoint_ref}/delete",
            post(checkpoint_delete),
        )
        .route(
            "/v1/leases/{lease_ref}/checkpoints/{checkpoint_ref}/fork",
            post(checkpoint_fork),
        )
        .route("/v1/admin/gc", post(admin_gc))
}

async fn list(State(st): State<AppState>, Auth(p): Auth, h: HeaderMap) -> R {
    let c = header_ctx(&h)?;
    ok(st.broker.list_leases(&p, &c).await?)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AcquireReq {
    runtime: String,
    session_key: String,
    #[serde(default)]
    profile: Option<String>,
    #[serde(default)]
    request_id: Option<String>,
}

async fn acquire(State(st): State<AppState>, Auth(p): Auth, Strict(b): Strict<AcquireReq>) -> R {
    let c = ctx(b.request_id.as_deref())?;
    ok(st
        .broker
        .acquire(&p, &c, &b.runtime, &b.session_key, b.profile.as_deref())
        .await?)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StatusReq {
    #[serde(default)]
    refresh: Option<bool>,
    #[serde(default)]
    request_id: Option<String>,
}

async fn status_get(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(lease): Path<String>,
    h: HeaderMap,
) -> R {
    let c = header_ctx(&h)?;
    ok(st.broker.lease_status(&p, &c, &lease, false).await?)
}

async fn status_post(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(lease): Path<String>,
    Strict(b): Strict<StatusReq>,
) -> R {
    let c = ctx(b.request_id.as_deref())?;
    ok(st
        .broker
        .lease_status(&p, &c, &lease, b.refresh.unwrap_or(true))
        .await?)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ExecReq {
    command: String,
    #[serde(default)]
    cwd: Option<String>,
    #[serde(default)]
    timeout_ms: Option<serde_json::Value>,
    #[serde(default)]
    request_id: Option<String>,
}

async fn exec(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(lease): Path<String>,
    Strict(b): Strict<ExecReq>,
) -> R {
    let c = ctx(b.request_id.as_deref())?;
    let timeout = int_in(
        b.timeout_ms.as_ref(),
        1..=u64::MAX,
        Code::InvalidTimeout,
        "timeout_ms must be an integer of at least 1",
    )?;
    ok(st
        .broker
        .exec(&p, &c, &lease, &b.command, b.cwd.as_deref(), timeout)
        .await?)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PathReq {
    path: String,
    #[serde(default)]
    request_id: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WriteReq {
    path: String,
    content: String,
    #[serde(default)]
    request_id: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MoveReq {
    path: String,
    destination: String,
    #[serde(default)]
    request_id: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct UploadReq {
    path: String,
    content_base64: String,
    #[serde(default)]
    request_id: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReleaseReq {
    #[serde(default)]
    action: Option<String>,
    #[serde(default)]
    request_id: Option<String>,
}

async fn file(
    st: &AppState,
    p: &crate::auth::Principal,
    lease: &str,
    rid: Option<&str>,
    op: FileOp,
) -> R {
    let c = ctx(rid)?;
    ok(st.broker.file_op(p, &c, lease, op).await?)
}

async fn read(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(l): Path<String>,
    Strict(b): Strict<PathReq>,
) -> R {
    file(
        &st,
        &p,
        &l,
        b.request_id.as_deref(),
        FileOp::Read { path: b.path },
    )
    .await
}

async fn write(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(l): Path<String>,
    Strict(b): Strict<WriteReq>,
) -> R {
    file(
        &st,
        &p,
        &l,
        b.request_id.as_deref(),
        FileOp::Write {
            path: b.path,
            content: b.content,
        },
    )
    .await
}

async fn list_files(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(l): Path<String>,
    Strict(b): Strict<PathReq>,
) -> R {
    file(
        &st,
        &p,
        &l,
        b.request_id.as_deref(),
        FileOp::List { path: b.path },
    )
    .await
}

async fn stat(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(l): Path<String>,
    Strict(b): Strict<PathReq>,
) -> R {
    file(
        &st,
        &p,
        &l,
        b.request_id.as_deref(),
        FileOp::Stat { path: b.path },
    )
    .await
}

async fn mkdir(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(l): Path<String>,
    Strict(b): Strict<PathReq>,
) -> R {
    file(
        &st,
        &p,
        &l,
        b.request_id.as_deref(),
        FileOp::Mkdir { path: b.path },
    )
    .await
}

async fn remove(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(l): Path<String>,
    Strict(b): Strict<PathReq>,
) -> R {
    file(
        &st,
        &p,
        &l,
        b.request_id.as_deref(),
        FileOp::Remove { path: b.path },
    )
    .await
}

async fn move_(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(l): Path<String>,
    Strict(b): Strict<MoveReq>,
) -> R {
    file(
        &st,
        &p,
        &l,
        b.request_id.as_deref(),
        FileOp::Move {
            path: b.path,
            destination: b.destination,
        },
    )
    .await
}

async fn upload(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(l): Path<String>,
    Strict(b): Strict<UploadReq>,
) -> R {
    file(
        &st,
        &p,
        &l,
        b.request_id.as_deref(),
        FileOp::Upload {
            path: b.path,
            content_base64: b.content_base64,
        },
    )
    .await
}

async fn download(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(l): Path<String>,
    Strict(b): Strict<PathReq>,
) -> R {
    file(
        &st,
        &p,
        &l,
        b.request_id.as_deref(),
        FileOp::Download { path: b.path },
    )
    .await
}

async fn release(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(l): Path<String>,
    Strict(b): Strict<ReleaseReq>,
) -> R {
    let c = ctx(b.request_id.as_deref())?;
    let action = b.action.unwrap_or_else(|| "pause".into());
    ok(st.broker.release(&p, &c, &l, &action).await?)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RenewReq {
    #[serde(default)]
    seconds: Option<serde_json::Value>,
    #[serde(default)]
    request_id: Option<String>,
}

async fn renew(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(lease): Path<String>,
    Strict(b): Strict<RenewReq>,
) -> R {
    let c = ctx(b.request_id.as_deref())?;
    let seconds = int_in(
        b.seconds.as_ref(),
        1..=86_400,
        Code::InvalidRequest,
        "seconds must be an integer in 1..=86400",
    )?;
    ok(st.broker.renew(&p, &c, &lease, seconds).await?)
}

async fn recover(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(lease): Path<String>,
    h: HeaderMap,
) -> R {
    let c = header_ctx(&h)?;
    ok(st.broker.recover_lease(&p, &c, &lease).await?)
}

async fn mcp_tools(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(lease): Path<String>,
    h: HeaderMap,
) -> R {
    let c = header_ctx(&h)?;
    ok(st.broker.mcp_tools(&p, &c, &lease).await?)
}

/// A governed MCP call: a tool of the lease's policy and its arguments.
/// No server, command or address: those are the operator's.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct McpCallReq {
    tool: String,
    #[serde(default = "empty_object")]
    arguments: serde_json::Value,
    #[serde(default)]
    request_id: Option<String>,
}

fn empty_object() -> serde_json::Value {
    serde_json::Value::Object(serde_json::Map::new())
}

async fn mcp_call(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(lease): Path<String>,
    Strict(b): Strict<McpCallReq>,
) -> R {
    let c = ctx(b.request_id.as_deref())?;
    ok(st
        .broker
        .mcp_call(&p, &c, &lease, &b.tool, b.arguments)
        .await?)
}

async fn profiles(State(st): State<AppState>, Auth(p): Auth, h: HeaderMap) -> R {
    let c = header_ctx(&h)?;
    ok(st.broker.list_profiles(&p, &c).await?)
}

async fn admin_gc(State(st): State<AppState>, Auth(p): Auth, Strict(b): Strict<EmptyReq>) -> R {
    let c = ctx(b.request_id.as_deref())?;
    ok(st.broker.admin_gc(&p, &c).await?)
}

async fn checkpoints_list(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(lease): Path<String>,
    h: HeaderMap,
) -> R {
    let c = header_ctx(&h)?;
    ok(st.broker.list_checkpoints(&p, &c, &lease).await?)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CheckpointReq {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    request_id: Option<String>,
}

async fn checkpoint_create(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(lease): Path<String>,
    Strict(b): Strict<CheckpointReq>,
) -> R {
    let c = ctx(b.request_id.as_deref())?;
    let v = st
        .broker
        .create_checkpoint(&p, &c, &lease, b.name.as_deref())
        .await?;
    with_status(axum::http::StatusCode::CREATED, v)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RollbackReq {
    /// Accepted and ignored, as in the reference.
    #[serde(default)]
    #[allow(dead_code)]
    branch: Option<String>,
    #[serde(default)]
    request_id: Option<String>,
}

async fn checkpoint_rollback(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path((lease, ckpt)): Path<(String, String)>,
    Strict(b): Strict<RollbackReq>,
) -> R {
    let c = ctx(b.request_id.as_deref())?;
    ok(st.broker.rollback_checkpoint(&p, &c, &lease, &ckpt).await?)
}

async fn checkpoint_delete(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path((lease, ckpt)): Path<(String, String)>,
    Strict(b): Strict<EmptyReq>,
) -> R {
    let c = ctx(b.request_id.as_deref())?;
    ok(st.broker.delete_checkpoint(&p, &c, &lease, &ckpt).await?)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ForkReq {
    #[serde(default)]
    branch: Option<String>,
    #[serde(default)]
    request_id: Option<String>,
}

async fn checkpoint_fork(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path((lease, ckpt)): Path<(String, String)>,
    Strict(b): Strict<ForkReq>,
) -> R {
    let c = ctx(b.request_id.as_deref())?;
    let v = st
        .broker
        .fork_checkpoint(&p, &c, &lease, &ckpt, b.branch.as_deref())
        .await?;
    with_status(axum::http::StatusCode::CREATED, v)
}
