//! The embedded backend: a CubeSandbox-compatible service in this binary.
//!
//! It speaks the CubeAPI subset the appliance and the official SDK use, and
//! routes data-plane requests by `Host` (as CubeProxy does) to each sandbox's
//! own envd. Sandboxes are namespaced process trees on this host (see
//! `launch.rs`): good for a single host, evaluation and tests; production
//! uses CubeSandbox MicroVMs.

// Handlers return `Result<_, Response>` to short-circuit with a ready answer.
#![allow(clippy::result_large_err)]

pub mod cgroup;
pub(crate) mod clock;
pub mod disk;
pub mod egress;
pub mod egress_tap;
pub(crate) mod envd;
pub(crate) mod error;
pub mod gateway;
pub mod launch;
pub(crate) mod procs;
pub(crate) mod proxy;
pub mod sandbox;
pub(crate) mod seccomp;
pub mod subids;
pub mod sys;
pub mod templates;
pub(crate) mod tree;
pub(crate) mod volumes;
pub mod wire;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde::de::DeserializeOwned;

use self::sandbox::{BackendError, Manager};
use crate::wire::{
    ApiErrorBody, CreateSandbox, CreateVolume, RefreshBody, RollbackBody, SnapshotBody, TimeoutBody,
};

pub use self::launch::{Isolation, Limits};
pub use self::sandbox::{Settings, TemplateConfig};

/// Largest control-plane request body.
const MAX_API_BODY: usize = 1024 * 1024;

/// Why the backend cannot open.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(transparent)]
    Namespaces(#[from] launch::NoNamespaces),
    #[error(transparent)]
    State(#[from] BackendError),
}

#[derive(Clone)]
pub struct Backend {
    pub manager: Arc<Manager>,
    api_key: Option<Arc<str>>,
}

impl Backend {
    /// Open the state directory (re-adopting live sandboxes). With namespace
    /// isolation, refuses to start when namespaces cannot be created.
    pub fn open(settings: Settings, api_key: Option<String>) -> Result<Self, OpenError> {
        if settings.isolation == Isolation::Namespaces {
            launch::probe_namespaces_with(&settings.launcher)?;
        }
        let manager = Manager::open(settings)?;
        Ok(Self {
            manager,
            api_key: api_key.map(Arc::from),
        })
    }

    /// Background work: timeouts and dead sandboxes. Runs until dropped.
    /// Ends when `stop` is cancelled, between ticks (never halfway through
    /// killing a sandbox).
    pub fn spawn_reaper(
        &self,
        stop: tokio_util::sync::CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let m = self.manager.clone();
        tokio::spawn(async move {
            let mut t = tokio::time::interval(Duration::from_millis(500));
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = t.tick() => m.tick().await,
                    () = stop.cancelled() => return,
                }
            }
        })
    }

    pub fn router(&self) -> Router {
        let api = Router::new()
            .route("/sandboxes", post(create).get(list_v1))
            .route("/v2/sandboxes", get(list_v2))
            .route("/sandboxes/{id}", get(detail).delete(kill))
            .route("/sandboxes/{id}/timeout", post(set_timeout))
            .route("/sandboxes/{id}/refreshes", post(refresh))
            .route("/sandboxes/{id}/pause", post(pause))
            .route("/sandboxes/{id}/resume", post(resume))
            .route("/sandboxes/{id}/connect", post(connect))
            .route("/sandboxes/{id}/snapshots", post(snapshot))
            .route("/sandboxes/{id}/rollback", post(rollback))
            .route("/snapshots", get(list_snapshots))
            .route("/templates", get(templates))
            .route("/templates/{id}", get(template).delete(delete_template))
            .route("/volumes", post(create_volume).get(list_volumes))
            .route("/volumes/{id}", get(get_volume).delete(delete_volume))
            .layer(middleware::from_fn_with_state(
                self.clone(),
                require_api_key,
            ));
        Router::new()
            .route("/health", get(health))
            .merge(api)
            .fallback(|| async { StatusCode::NOT_FOUND })
            .layer(middleware::from_fn_with_state(self.clone(), host_router))
            .with_state(self.clone())
    }
}

impl IntoResponse for BackendError {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        if status.is_server_error() {
            tracing::error!(error = %self, "backend error");
        }
        (
            status,
            axum::Json(ApiErrorBody {
                code: status.as_u16(),
                message: self.to_string(),
            }),
        )
            .into_response()
    }
}

/// Data-plane requests never reach the CubeAPI router.
async fn host_router(State(b): State<Backend>, req: Request, next: Next) -> Response {
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or_else(|| req.uri().host().map(str::to_string));
    if let Some(host) = host
        && let Some((port, id)) = proxy::parse_host(&host)
    {
        let id = id.to_string();
        return proxy::forward(&b.manager, port, &id, req).await;
    }
    next.run(req).await
}

async fn require_api_key(State(b): State<Backend>, req: Request, next: Next) -> Response {
    if let Some(want) = &b.api_key {
        let h = req.headers();
        let got = h
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .or_else(|| h.get("x-api-key").and_then(|v| v.to_str().ok()));
        let ok = got.is_some_and(|g| {
            g.len() == want.len()
                && g.bytes().zip(want.bytes()).fold(0, |a, (x, y)| a | (x ^ y)) == 0
        });
        if !ok {
            return (
                StatusCode::UNAUTHORIZED,
                axum::Json(ApiErrorBody {
                    code: 401,
                    message: "unauthorized".into(),
                }),
            )
                .into_response();
        }
    }
    next.run(req).await
}

fn bad_request(m: impl Into<String>) -> Response {
    BackendError::BadRequest(m.into()).into_response()
}

/// A JSON body that may be empty (then `T::default()`).
fn json_body<T: DeserializeOwned + Default>(body: &Bytes) -> Result<T, Response> {
    if body.len() > MAX_API_BODY {
        let e = ApiErrorBody {
            code: 413,
            message: format!("request body exceeds {MAX_API_BODY} bytes"),
        };
        return Err((StatusCode::PAYLOAD_TOO_LARGE, axum::Json(e)).into_response());
    }
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| bad_request(format!("invalid JSON body: {e}")))
}

fn check_id(id: &str) -> Result<(), Response> {
    if sandbox::valid_id(id) {
        Ok(())
    } else {
        Err(bad_request(format!("invalid id '{id}'")))
    }
}

macro_rules! tri {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(r) => return r.into_response(),
        }
    };
}

async fn health(State(b): State<Backend>) -> Response {
    axum::Json(serde_json::json!({"status": "ok", "sandboxes": b.manager.count()})).into_response()
}

async fn create(State(b): State<Backend>, body: Bytes) -> Response {
    let req: CreateSandbox = tri!(json_body(&body));
    if req.template_id.is_empty() {
        return bad_request("templateID is required");
    }
    match b.manager.create(req).await {
        Ok(s) => (StatusCode::CREATED, axum::Json(s)).into_response(),
        // A real CubeAPI passes CubeMaster's "not found" on as a 500.
        Err(BackendError::TemplateNotFound(_) | BackendError::SnapshotNotFound(_))
            if b.manager.settings.faithful.is_some() =>
        {
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                axum::Json(ApiErrorBody {
                    code: 500,
                    message: "CubeMaster returned error code 130404".into(),
                }),
            )
                .into_response()
        }
        Err(e) => e.into_response(),
    }
}

#[derive(Deserialize, Default)]
struct ListQuery {
    metadata: Option<String>,
    state: Option<String>,
    limit: Option<usize>,
}

fn parse_metadata(q: Option<&str>) -> Vec<(String, String)> {
    let Some(q) = q else { return vec![] };
    url_pairs(q)
}

/// `k1=v1&k2=v2` (already one query value), percent-decoded.
fn url_pairs(s: &str) -> Vec<(String, String)> {
    s.split('&')
        .filter(|p| !p.is_empty())
        .filter_map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            Some((pct_decode(k)?, pct_decode(v)?))
        })
        .collect()
}

fn pct_decode(s: &str) -> Option<String> {
    let mut out = Vec::with_capacity(s.len());
    let b = s.as_bytes();
    let mut i = 0;
    while let Some(&c) = b.get(i) {
        if c == b'%' {
            let h = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(h, 16).ok()?);
            i += 3;
        } else {
            out.push(if c == b'+' { b' ' } else { c });
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

async fn list_v1(State(b): State<Backend>, Query(q): Query<ListQuery>) -> Response {
    axum::Json(
        b.manager
            .list(&parse_metadata(q.metadata.as_deref()), None, 200),
    )
    .into_response()
}

async fn list_v2(State(b): State<Backend>, Query(q): Query<ListQuery>) -> Response {
    let state = q
        .state
        .as_deref()
        .filter(|s| s.split(',').all(|x| x == "running" || x == "paused"));
    let limit = q.limit.unwrap_or(100).clamp(1, 1000);
    axum::Json(
        b.manager
            .list(&parse_metadata(q.metadata.as_deref()), state, limit),
    )
    .into_response()
}

async fn detail(State(b): State<Backend>, Path(id): Path<String>) -> Response {
    tri!(check_id(&id));
    match b.manager.detail(&id) {
        Ok(d) => axum::Json(d).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn kill(State(b): State<Backend>, Path(id): Path<String>) -> Response {
    tri!(check_id(&id));
    match b.manager.kill(&id).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => e.into_response(),
    }
}

async fn set_timeout(State(b): State<Backend>, Path(id): Path<String>, body: Bytes) -> Response {
    tri!(check_id(&id));
    let t: TimeoutBody = tri!(json_body(&body));
    let Some(secs) = t.timeout else {
        return bad_request("timeout is required");
    };
    match b.manager.set_timeout(&id, secs).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => e.into_response(),
    }
}

async fn refresh(State(b): State<Backend>, Path(id): Path<String>, body: Bytes) -> Response {
    tri!(check_id(&id));
    let r: RefreshBody = tri!(json_body(&body));
    match b.manager.refresh(&id, r.duration.unwrap_or(0)).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => e.into_response(),
    }
}

async fn pause(State(b): State<Backend>, Path(id): Path<String>) -> Response {
    tri!(check_id(&id));
    match b.manager.pause(&id).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => e.into_response(),
    }
}

async fn resume(State(b): State<Backend>, Path(id): Path<String>, body: Bytes) -> Response {
    tri!(check_id(&id));
    let t: TimeoutBody = tri!(json_body(&body));
    match b.manager.resume(&id, t.timeout, true).await {
        Ok(s) => (StatusCode::CREATED, axum::Json(s)).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn connect(State(b): State<Backend>, Path(id): Path<String>, body: Bytes) -> Response {
    tri!(check_id(&id));
    let t: TimeoutBody = tri!(json_body(&body));
    if t.timeout.is_some_and(|t| t == 0 || t < -1) {
        return bad_request("timeout must be positive or -1");
    }
    match b.manager.resume(&id, t.timeout, false).await {
        Ok(s) => axum::Json(s).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn snapshot(State(b): State<Backend>, Path(id): Path<String>, body: Bytes) -> Response {
    tri!(check_id(&id));
    let s: SnapshotBody = tri!(json_body(&body));
    match b.manager.create_snapshot(&id, s.name).await {
        Ok(r) => (StatusCode::CREATED, axum::Json(r)).into_response(),
        Err(e) => e.into_response(),
    }
}

#[derive(Deserialize, Default)]
struct SnapQuery {
    #[serde(rename = "sandboxID")]
    sandbox_id: Option<String>,
}

async fn list_snapshots(State(b): State<Backend>, Query(q): Query<SnapQuery>) -> Response {
    axum::Json(b.manager.list_snapshots(q.sandbox_id.as_deref())).into_response()
}

async fn rollback(State(b): State<Backend>, Path(id): Path<String>, body: Bytes) -> Response {
    tri!(check_id(&id));
    let r: RollbackBody = tri!(json_body(&body));
    if r.snapshot_id.is_empty() {
        return bad_request("snapshotID is required");
    }
    match b.manager.rollback(&id, &r.snapshot_id).await {
        Ok(r) => axum::Json(r).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn templates(State(b): State<Backend>) -> Response {
    axum::Json(b.manager.templates()).into_response()
}

async fn template(State(b): State<Backend>, Path(id): Path<String>) -> Response {
    match b
        .manager
        .templates()
        .into_iter()
        .find(|t| t.template_id == id || t.aliases.contains(&id))
    {
        Some(t) => axum::Json(t).into_response(),
        None => BackendError::TemplateNotFound(id).into_response(),
    }
}

/// `DELETE /templates/{id}`: snapshot ids are deleted; real templates are
/// configuration and cannot be deleted here.
async fn delete_template(
    State(b): State<Backend>,
    Path(id): Path<String>,
    _h: HeaderMap,
) -> Response {
    tri!(check_id(&id));
    if id.starts_with("snap-") {
        return match b.manager.delete_snapshot(&id).await {
            Ok(()) => StatusCode::NO_CONTENT.into_response(),
            Err(e) => e.into_response(),
        };
    }
    if b.manager.templates().iter().any(|t| t.template_id == id) {
        return BackendError::Conflict(format!(
            "template {id} is configured on this backend and cannot be deleted"
        ))
        .into_response();
    }
    BackendError::TemplateNotFound(id).into_response()
}

fn check_volume_id(id: &str) -> Result<(), Response> {
    if crate::wire::valid_volume_id(id) {
        Ok(())
    } else {
        Err(bad_request(format!(
            "invalid volume id '{}'",
            id.escape_debug()
        )))
    }
}

async fn create_volume(State(b): State<Backend>, body: Bytes) -> Response {
    let req: CreateVolume = tri!(json_body(&body));
    match b.manager.create_volume(req).await {
        Ok(v) => (StatusCode::CREATED, axum::Json(v)).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn list_volumes(State(b): State<Backend>) -> Response {
    axum::Json(b.manager.list_volumes()).into_response()
}

async fn get_volume(State(b): State<Backend>, Path(id): Path<String>) -> Response {
    tri!(check_volume_id(&id));
    match b.manager.get_volume(&id) {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `DELETE /volumes/{id}`: 204; 404; 409 while a sandbox mounts it.
async fn delete_volume(State(b): State<Backend>, Path(id): Path<String>) -> Response {
    tri!(check_volume_id(&id));
    match b.manager.delete_volume(&id).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => e.into_response(),
    }
}
