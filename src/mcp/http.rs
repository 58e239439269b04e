//! `/mcp` on the appliance: MCP Streamable HTTP, authenticated exactly like
//! `/v1` (a missing or bad token is 401 before any MCP processing), each
//! session bound to the identity that opened it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};

use super::tools::Host;
use super::{McpServer, Upstream};
use crate::api::{ApiError, AppState};
use crate::auth::Principal;
use crate::broker::{Code, Error};

/// Live MCP sessions one identity may hold (a client that never closes its
/// sessions gets 429 `session_quota_exceeded`; idle ones end after five
/// minutes).
pub const MAX_SESSIONS_PER_IDENTITY: usize = 32;

/// Which identity opened which MCP session.
#[derive(Clone)]
struct Guard {
    st: AppState,
    owners: Arc<Mutex<HashMap<String, String>>>,
    sessions: Arc<LocalSessionManager>,
}

impl Guard {
    /// Forget sessions rmcp no longer has; then how many `who` holds.
    async fn live_sessions(&self, who: &str) -> usize {
        let live: std::collections::HashSet<String> = self
            .sessions
            .sessions
            .read()
            .await
            .keys()
            .map(|k| k.to_string())
            .collect();
        let mut o = self.owners.lock().unwrap_or_else(|e| e.into_inner());
        o.retain(|k, _| live.contains(k));
        o.values().filter(|v| v.as_str() == who).count()
    }
}

fn identity(p: &Principal) -> String {
    format!("{}\0{}", p.tenant, p.subject)
}

/// `/mcp`, over `v1` (the appliance's router without `/mcp`). `hosts`: the
/// names clients may use to reach it (DNS-rebinding protection).
pub fn router(st: AppState, v1: Router, hosts: Vec<String>) -> Router {
    // Bodies as large as /v1 takes (an 8 MiB artifact is ~11 MiB of JSON).
    let config = StreamableHttpServerConfig::default()
        .with_allowed_hosts(hosts)
        .with_max_request_body_bytes(crate::api::MAX_BODY);
    let sessions = Arc::new(LocalSessionManager::default());
    let service = StreamableHttpService::new(
        move || Ok(McpServer::new(Upstream::Local(v1.clone()), Host::default())),
        sessions.clone(),
        config,
    );
    let guard = Guard {
        st,
        owners: Arc::default(),
        sessions,
    };
    Router::new()
        .nest_service("/mcp", service)
        .layer(middleware::from_fn_with_state(guard, authenticate))
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(
            crate::api::panic_response,
        ))
}

/// A 401 with the envelope and the challenge MCP clients look for.
fn unauthorized(message: &str) -> Response {
    let mut r = ApiError(Error::new(Code::Unauthorized, message.to_string()), None).into_response();
    r.headers_mut().insert(
        axum::http::header::WWW_AUTHENTICATE,
        axum::http::HeaderValue::from_static("Bearer"),
    );
    r
}

async fn authenticate(State(g): State<Guard>, req: Request, next: Next) -> Response {
    let mut resp = guarded(g, req, next).await;
    // As on /v1: never cached, never sniffed.
    let h = resp.headers_mut();
    h.insert(
        axum::http::header::CACHE_CONTROL,
        axum::http::HeaderValue::from_static("no-store"),
    );
    h.insert(
        axum::http::header::X_CONTENT_TYPE_OPTIONS,
        axum::http::HeaderValue::from_static("nosniff"),
    );
    resp
}

async fn guarded(g: Guard, req: Request, next: Next) -> Response {
    let p = match crate::api::identify(&g.st.auth, req.headers(), req.extensions()).await {
        Ok(p) => p,
        Err(e) if e.0.code == Code::Unauthorized => return unauthorized(&e.0.message),
        Err(e) => return e.into_response(),
    };
    let who = identity(&p);
    // A session belongs to whoever opened it: another identity (or a
    // session this appliance did not open) gets the answer an unknown
    // session gets, and starts a new one.
    let session = req
        .headers()
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    if let Some(s) = &session {
        let owner = g
            .owners
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(s)
            .cloned();
        if owner.is_none_or(|o| o != who) {
            return (axum::http::StatusCode::NOT_FOUND, "session not found").into_response();
        }
    } else if req.method() == axum::http::Method::POST
        && g.live_sessions(&who).await >= MAX_SESSIONS_PER_IDENTITY
    {
        return ApiError::from(Error::new(
            Code::SessionQuotaExceeded,
            format!(
                "this identity already holds {MAX_SESSIONS_PER_IDENTITY} MCP sessions; \
                 close some (DELETE /mcp) or wait five minutes for idle ones to end"
            ),
        ))
        .into_response();
    }
    let deleting = req.method() == axum::http::Method::DELETE;
    let resp = next.run(req).await;
    if let Some(s) = &session
        && deleting
        && resp.status().is_success()
    {
        g.owners.lock().unwrap_or_else(|e| e.into_inner()).remove(s);
    }
    if session.is_none()
        && let Some(id) = resp
            .headers()
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok())
    {
        g.owners
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_string(), who);
    }
    resp
}
