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
use crate::api::{ApiError, AppState, bearer};
use crate::auth::{AuthError, Principal};
use crate::broker::Error;

/// Sessions remembered at most (the oldest are forgotten first).
const MAX_SESSIONS: usize = 10_000;

/// Which identity opened which MCP session.
#[derive(Default)]
struct Owners {
    map: HashMap<String, String>,
    order: std::collections::VecDeque<String>,
}

#[derive(Clone)]
struct Guard {
    st: AppState,
    owners: Arc<Mutex<Owners>>,
}

fn identity(p: &Principal) -> String {
    format!("{}\0{}", p.tenant, p.subject)
}

/// `/mcp`, over `v1` (the appliance's router without `/mcp`). `hosts`: the
/// names clients may use to reach it (DNS-rebinding protection).
pub fn router(st: AppState, v1: Router, hosts: Vec<String>) -> Router {
    let config = StreamableHttpServerConfig::default().with_allowed_hosts(hosts);
    let service = StreamableHttpService::new(
        move || Ok(McpServer::new(Upstream::Local(v1.clone()), Host::default())),
        Arc::new(LocalSessionManager::default()),
        config,
    );
    let guard = Guard {
        st,
        owners: Arc::default(),
    };
    Router::new()
        .nest_service("/mcp", service)
        .layer(middleware::from_fn_with_state(guard, authenticate))
}

async fn authenticate(State(g): State<Guard>, req: Request, next: Next) -> Response {
    let token = bearer(req.headers());
    if token.is_empty() {
        return ApiError(Error::new("unauthorized", "a bearer token is required")).into_response();
    }
    let p = match g.st.auth.authenticate(&token).await {
        Ok(p) => p,
        Err(AuthError::Unauthorized) => {
            return ApiError(Error::new("unauthorized", "invalid bearer token")).into_response();
        }
        Err(AuthError::Unavailable) => {
            return ApiError(Error::new(
                "audit_unavailable",
                "the identity store is unavailable",
            ))
            .into_response();
        }
    };
    let who = identity(&p);
    // A session belongs to whoever opened it: another identity (or a
    // session this appliance did not open, or has forgotten) gets the answer
    // an unknown session gets, and starts a new one.
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
            .map
            .get(s)
            .cloned();
        if owner.is_none_or(|o| o != who) {
            return (axum::http::StatusCode::NOT_FOUND, "session not found").into_response();
        }
    }
    let resp = next.run(req).await;
    if session.is_none()
        && let Some(id) = resp
            .headers()
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok())
    {
        let mut o = g.owners.lock().unwrap_or_else(|e| e.into_inner());
        if o.map.insert(id.to_string(), who).is_none() {
            o.order.push_back(id.to_string());
        }
        while o.order.len() > MAX_SESSIONS {
            if let Some(old) = o.order.pop_front() {
                o.map.remove(&old);
            }
        }
    }
    resp
}
