//! `/mcp` on the appliance: MCP Streamable HTTP, authenticated exactly like
//! `/v1` (a missing or bad token is 401 before any MCP processing), each
//! session bound to the identity that opened it.
//!
//! Sessions end when the host closes them (`DELETE /mcp`), after
//! `[mcp] session_idle_timeout_seconds` idle (no request or event stream in
//! progress: a long tool call keeps its session), or, when the identity
//! that opened them already holds `MAX_SESSIONS_PER_IDENTITY` and opens
//! another, as that identity's least recently used idle session, recorded
//! in the audit journal (`mcp_session_evicted`). Only when all of them are
//! busy is a new session refused (429 `session_quota_exceeded`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use rmcp::transport::streamable_http_server::session::SessionManager;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};

use super::tools::Host;
use super::{McpServer, Upstream};
use crate::api::{ApiError, AppState};
use crate::audit::event::{Action, Outcome};
use crate::auth::Principal;
use crate::broker::{Code, Error};

/// Live MCP sessions one identity may hold. Opening one more ends the
/// least recently used idle one; when none is idle the new one is refused
/// (429 `session_quota_exceeded`).
pub const MAX_SESSIONS_PER_IDENTITY: usize = 32;

/// One session as the guard knows it.
#[derive(Debug, Clone)]
pub struct Held {
    /// The identity that opened it (`identity`).
    pub owner: String,
    /// When a request on it last started or ended.
    pub last_used: Instant,
    /// Requests (and streams) on it still being answered.
    pub in_flight: usize,
}

/// The session `who` gives up for a new one: its least recently used
/// session with nothing in progress; `None` when all are busy.
pub fn evictable(held: &HashMap<String, Held>, who: &str) -> Option<String> {
    held.iter()
        .filter(|(_, h)| h.owner == who && h.in_flight == 0)
        .min_by_key(|(id, h)| (h.last_used, id.as_str()))
        .map(|(id, _)| id.clone())
}

/// The sessions idle for `idle` or longer at `now` (nothing in progress).
pub fn expired(held: &HashMap<String, Held>, now: Instant, idle: Duration) -> Vec<String> {
    held.iter()
        .filter(|(_, h)| h.in_flight == 0 && now.saturating_duration_since(h.last_used) >= idle)
        .map(|(id, _)| id.clone())
        .collect()
}

type Table = Arc<Mutex<HashMap<String, Held>>>;

fn lock(t: &Table) -> std::sync::MutexGuard<'_, HashMap<String, Held>> {
    t.lock().unwrap_or_else(|e| e.into_inner())
}

/// Which identity opened which MCP session, and which are in use.
#[derive(Clone)]
struct Guard {
    st: AppState,
    held: Table,
    sessions: Arc<LocalSessionManager>,
}

/// A request in progress on a session: the session is busy until its
/// answer (an event stream included) is done.
struct Busy {
    held: Table,
    id: String,
}

impl Busy {
    /// A request of `who` on session `id`: `None` unless `who` opened it
    /// (checked and counted at once, so that it cannot end meanwhile).
    fn start(held: &Table, id: &str, who: &str) -> Option<Self> {
        let mut t = lock(held);
        let h = t.get_mut(id).filter(|h| h.owner == who)?;
        h.in_flight += 1;
        h.last_used = Instant::now();
        Some(Self {
            held: held.clone(),
            id: id.to_string(),
        })
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        if let Some(h) = lock(&self.held).get_mut(&self.id) {
            h.in_flight = h.in_flight.saturating_sub(1);
            h.last_used = Instant::now();
        }
    }
}

impl Guard {
    /// Forget sessions rmcp no longer has (ended while idle); then how
    /// many `who` holds.
    async fn live_sessions(&self, who: &str) -> usize {
        let live: std::collections::HashSet<String> = self
            .sessions
            .sessions
            .read()
            .await
            .keys()
            .map(|k| k.to_string())
            .collect();
        let mut held = lock(&self.held);
        held.retain(|k, _| live.contains(k));
        held.values().filter(|h| h.owner == who).count()
    }

    /// Make room for one more session of `p`: end its least recently used
    /// idle session, recorded in the audit journal first (unrecorded, it
    /// stays). An answer when there is no room.
    async fn make_room(&self, p: &Principal, who: &str) -> Result<(), Response> {
        let victim = {
            let mut held = lock(&self.held);
            let Some(id) = evictable(&held, who) else {
                return Err(ApiError::from(Error::new(
                    Code::SessionQuotaExceeded,
                    format!(
                        "this identity already holds {MAX_SESSIONS_PER_IDENTITY} MCP sessions, \
                         all in use; close some (DELETE /mcp) or let one finish its request"
                    ),
                ))
                .into_response());
            };
            // Out of the table at once: no request starts on it from now.
            held.remove(&id).map(|h| (id, h))
        };
        let Some((id, h)) = victim else {
            return Ok(());
        };
        let j = self.st.broker.journal();
        let mut ev = j.event(Action::McpSessionEvicted);
        ev.outcome = Outcome::Ok;
        ev.tenant_digest = Some(j.digest("tenant", p.tenant.as_bytes()));
        ev.identity_digest = Some(j.digest("identity", p.identity_key().as_bytes()));
        ev.session_digest = Some(j.digest("mcp_session", id.as_bytes()));
        // How long it had been idle.
        let idle_ms = u64::try_from(h.last_used.elapsed().as_millis()).unwrap_or(u64::MAX);
        ev.duration_ms = Some(idle_ms);
        if let Err(e) = j.record(ev).await {
            lock(&self.held).insert(id, h);
            return Err(ApiError::from(Error::from(e)).into_response());
        }
        if let Err(e) = self.sessions.close_session(&id.clone().into()).await {
            tracing::warn!(error = %e, "an evicted MCP session did not close cleanly");
        }
        tracing::info!(
            idle_ms,
            "MCP session limit reached: the least recently used idle session was ended"
        );
        Ok(())
    }
}

fn identity(p: &Principal) -> String {
    p.identity_key()
}

/// `/mcp`, over `v1` (the appliance's router without `/mcp`). `hosts`: the
/// names clients may use to reach it (DNS-rebinding protection).
pub fn router(st: AppState, v1: Router, hosts: Vec<String>) -> Router {
    // Bodies as large as /v1 takes (an 8 MiB artifact is ~11 MiB of JSON).
    let config = StreamableHttpServerConfig::default()
        .with_allowed_hosts(hosts)
        .with_max_request_body_bytes(crate::api::MAX_BODY);
    let idle = Duration::from_secs(st.broker.config().mcp.session_idle_timeout_seconds);
    let held: Table = Arc::default();
    let mut manager = LocalSessionManager::default();
    // rmcp's own expiry counts a tool call's silence as idle (and would end
    // a session in the middle of a long command): the guard's reaper ends
    // idle sessions instead. Outside a runtime (no reaper), rmcp's.
    let runtime = tokio::runtime::Handle::try_current().ok();
    manager.session_config.keep_alive = match runtime {
        Some(_) => None,
        None => Some(idle),
    };
    let sessions = Arc::new(manager);
    if let Some(rt) = runtime {
        rt.spawn(reap(Arc::downgrade(&held), Arc::downgrade(&sessions), idle));
    }
    let service = StreamableHttpService::new(
        move || Ok(McpServer::new(Upstream::Local(v1.clone()), Host::default())),
        sessions.clone(),
        config,
    );
    let guard = Guard { st, held, sessions };
    Router::new()
        .nest_service("/mcp", service)
        .layer(middleware::from_fn_with_state(guard, authenticate))
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(
            crate::api::panic_response,
        ))
}

/// End the sessions idle for `idle`, until `/mcp` is gone.
async fn reap(
    held: std::sync::Weak<Mutex<HashMap<String, Held>>>,
    sessions: std::sync::Weak<LocalSessionManager>,
    idle: Duration,
) {
    let every = (idle / 10).clamp(Duration::from_secs(1), Duration::from_secs(30));
    loop {
        tokio::time::sleep(every).await;
        let (Some(held), Some(sessions)) = (held.upgrade(), sessions.upgrade()) else {
            return;
        };
        let ended = {
            let mut h = lock(&held);
            let ids = expired(&h, Instant::now(), idle);
            for id in &ids {
                h.remove(id);
            }
            ids
        };
        for id in ended {
            if let Err(e) = sessions.close_session(&id.into()).await {
                tracing::warn!(error = %e, "an idle MCP session did not close cleanly");
            }
        }
    }
}

/// Whether a JSON-RPC body (one message or a batch) asks to `initialize`.
fn initializes(body: &[u8]) -> bool {
    let is_init = |v: &serde_json::Value| v["method"] == "initialize";
    match serde_json::from_slice::<serde_json::Value>(body) {
        Ok(serde_json::Value::Array(batch)) => batch.iter().any(is_init),
        Ok(v) => is_init(&v),
        Err(_) => false,
    }
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
    // The host's runtime (`?runtime=`) is checked here, before any session.
    if let Some(r) = req.uri().query().and_then(|q| super::host_query(q).1)
        && !crate::auth::RUNTIMES.contains(&r.as_str())
    {
        return ApiError::from(Error::new(
            Code::InvalidRuntime,
            format!(
                "runtime (in the /mcp URL) must be one of {}",
                crate::auth::RUNTIMES.join(", ")
            ),
        ))
        .into_response();
    }
    let who = identity(&p);
    // A session belongs to whoever opened it: another identity (or a
    // session this appliance did not open, or one it ended) gets the
    // answer an unknown session gets, and starts a new one.
    let session = req
        .headers()
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let mut busy = None;
    let mut req = req;
    if let Some(s) = &session {
        let Some(b) = Busy::start(&g.held, s, &who) else {
            return (axum::http::StatusCode::NOT_FOUND, "session not found").into_response();
        };
        busy = Some(b);
    } else if req.method() == axum::http::Method::POST
        && g.live_sessions(&who).await >= MAX_SESSIONS_PER_IDENTITY
    {
        // Only a request that opens a session may end another: read the
        // body (as much as /mcp takes) to see, then pass it on.
        let (parts, body) = req.into_parts();
        let bytes = match axum::body::to_bytes(body, crate::api::MAX_BODY).await {
            Ok(b) => b,
            Err(_) => {
                return ApiError::from(Error::new(
                    Code::BodyTooLarge,
                    format!(
                        "request bodies are limited to {} bytes",
                        crate::api::MAX_BODY
                    ),
                ))
                .into_response();
            }
        };
        if initializes(&bytes)
            && let Err(r) = g.make_room(&p, &who).await
        {
            return r;
        }
        req = Request::from_parts(parts, Body::from(bytes));
    }
    let deleting = req.method() == axum::http::Method::DELETE;
    let resp = next.run(req).await;
    if let Some(s) = &session
        && deleting
        && resp.status().is_success()
    {
        lock(&g.held).remove(s);
    }
    if session.is_none()
        && let Some(id) = resp
            .headers()
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok())
    {
        lock(&g.held).insert(
            id.to_string(),
            Held {
                owner: who,
                last_used: Instant::now(),
                in_flight: 0,
            },
        );
    }
    match busy {
        // Busy until the answer's last byte (or the client goes away).
        Some(b) => resp.map(|body| {
            Body::new(body.map_frame(move |f| {
                let _ = &b;
                f
            }))
        }),
        None => resp,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_recently_used_idle_session_of_the_identity_goes() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let h = |owner: &str, last: u64, in_flight: usize| Held {
            owner: owner.into(),
            last_used: at(last),
            in_flight,
        };
        let mut held = HashMap::from([
            ("a-old-busy".to_string(), h("a", 1, 1)),
            ("a-mid".to_string(), h("a", 5, 0)),
            ("a-new".to_string(), h("a", 9, 0)),
            ("b-oldest".to_string(), h("b", 0, 0)),
        ]);
        assert_eq!(evictable(&held, "a").as_deref(), Some("a-mid"));
        assert_eq!(evictable(&held, "b").as_deref(), Some("b-oldest"));
        assert_eq!(evictable(&held, "c"), None);
        held.get_mut("a-mid").unwrap().in_flight = 2;
        assert_eq!(evictable(&held, "a").as_deref(), Some("a-new"));
        held.get_mut("a-new").unwrap().in_flight = 1;
        assert_eq!(evictable(&held, "a"), None, "all busy: nothing to end");
    }

    #[test]
    fn idle_sessions_expire_busy_ones_do_not() {
        // Later than every `last_used` below (an `Instant` cannot go below
        // the clock's start).
        let now = Instant::now() + Duration::from_secs(4000);
        let idle = Duration::from_secs(300);
        let h = |ago: u64, in_flight: usize| Held {
            owner: "a".into(),
            last_used: now - Duration::from_secs(ago),
            in_flight,
        };
        let held = HashMap::from([
            ("fresh".to_string(), h(10, 0)),
            ("idle".to_string(), h(301, 0)),
            ("long-call".to_string(), h(3600, 1)),
        ]);
        assert_eq!(expired(&held, now, idle), vec!["idle".to_string()]);
        assert!(initializes(
            br#"{"jsonrpc":"2.0","id":1,"method":"initialize"}"#
        ));
        assert!(initializes(
            br#"[{"jsonrpc":"2.0","id":1,"method":"initialize"}]"#
        ));
        assert!(!initializes(
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#
        ));
        assert!(!initializes(b"not json"));
    }

    #[test]
    fn a_request_keeps_its_session_busy_until_it_is_done() {
        let t: Table = Arc::default();
        let old = Instant::now();
        lock(&t).insert(
            "s".into(),
            Held {
                owner: "a".into(),
                last_used: old,
                in_flight: 0,
            },
        );
        assert!(Busy::start(&t, "s", "b").is_none(), "not b's session");
        let one = Busy::start(&t, "s", "a");
        let two = Busy::start(&t, "s", "a");
        assert_eq!(lock(&t)["s"].in_flight, 2);
        assert!(lock(&t)["s"].last_used >= old);
        drop(one);
        assert_eq!(evictable(&lock(&t), "a"), None);
        drop(two);
        assert_eq!(evictable(&lock(&t), "a").as_deref(), Some("s"));
        // A session gone (closed, evicted): no request starts on it, and
        // one that outlives it updates nothing.
        assert!(Busy::start(&t, "gone", "a").is_none());
        let late = Busy::start(&t, "s", "a");
        lock(&t).remove("s");
        drop(late);
        assert!(lock(&t).is_empty());
    }
}
