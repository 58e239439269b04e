//! The `/v1` HTTP API (reference-compatible), health, readiness and metrics.
//!
//! Layers, outermost first: tracing; response headers (`Cache-Control:
//! no-store`, `nosniff`, JSON charset) so that every answer, errors
//! included, carries them; panics become a 500 envelope. Authentication is
//! an extractor on every `/v1` handler.

pub(crate) mod jobs;
pub(crate) mod leases;
pub(crate) mod ptys;
pub(crate) mod tasks;

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::de::DeserializeOwned;
use serde_json::json;

use crate::auth::{AuthError, Authenticator, Principal};
use crate::broker::{Broker, Code, Ctx, Error};

/// Largest request body (reference: 16 MiB).
pub const MAX_BODY: usize = 16 * 1024 * 1024;

#[derive(Clone)]
pub struct AppState {
    pub broker: Broker,
    pub auth: Authenticator,
    pub metrics: Arc<Metrics>,
}

/// What `/metrics` needs beyond the broker: the request histograms, the
/// scrape token, where the TLS certificates are, the last readiness.
#[derive(Debug, Default)]
pub struct Metrics {
    pub http: crate::metrics::Http,
    /// SHA-256 of the token scrapers must send (`[metrics] token_file`).
    token: Option<[u8; 32]>,
    /// The appliance's TLS directory (`server.pem`, `ca.pem`).
    tls_dir: Option<std::path::PathBuf>,
    /// The last `/readyz` answer: 0 not ready, 1 ready, 2 none yet.
    ready: AtomicU8,
}

impl Metrics {
    /// `token`: what scrapers must send, if anything; `tls_dir`: the
    /// certificates whose expiry is exported.
    pub fn new(token: Option<Vec<u8>>, tls_dir: Option<std::path::PathBuf>) -> Self {
        use sha2::Digest;
        Self {
            http: crate::metrics::Http::default(),
            token: token.map(|t| sha2::Sha256::digest(&t).into()),
            tls_dir,
            ready: AtomicU8::new(2),
        }
    }

    /// Does this request carry the scrape token (or is none required)?
    /// Compared in constant time, as digests of equal length.
    fn admits(&self, h: &axum::http::HeaderMap) -> bool {
        use sha2::Digest;
        use subtle::ConstantTimeEq;
        let Some(want) = &self.token else {
            return true;
        };
        let got: [u8; 32] = sha2::Sha256::digest(bearer(h).as_bytes()).into();
        bool::from(got.ct_eq(want))
    }
}

/// The request histograms' layer (outermost but tracing, on the whole
/// app): labelled by the route *template* (`MatchedPath`, never the raw
/// path: bounded cardinality; `unmatched` when no route matched), the
/// method and the status class. Time to the response's head: a stream's
/// body is not included.
pub async fn track(State(m): State<Arc<Metrics>>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .cloned();
    let method = match req.method().as_str() {
        "GET" => "GET",
        "POST" => "POST",
        "PUT" => "PUT",
        "DELETE" => "DELETE",
        "HEAD" => "HEAD",
        "OPTIONS" => "OPTIONS",
        "PATCH" => "PATCH",
        _ => "other",
    };
    let t = std::time::Instant::now();
    let r = next.run(req).await;
    let route = route.as_ref().map_or("unmatched", |p| p.as_str());
    if let Some(h) = m.http.requests.get([
        route,
        method,
        crate::metrics::status_class(r.status().as_u16()),
    ]) {
        h.observe_duration(t.elapsed());
    }
    r
}

/// The error envelope: `{"error": {"code", "message"}}`; with a
/// `Retry-After` of its own (seconds) or the code's.
pub struct ApiError(pub Error, pub Option<u64>);

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        Self(e, None)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        // The one place an error becomes an answer: its status and
        // `Retry-After` come from the catalogue.
        let code = self.0.code;
        let mut r = (
            code.status(),
            axum::Json(json!({"error": {"code": code, "message": self.0.message}})),
        )
            .into_response();
        if let Some(secs) = self.1.or(code.retry_after().map(u64::from)) {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        r
    }
}

fn err(code: Code, msg: impl Into<String>) -> ApiError {
    ApiError(Error::new(code, msg), None)
}

/// A handler's result.
pub(crate) type R = Result<Response, ApiError>;

/// 200 with a JSON body.
pub(crate) fn ok(v: impl serde::Serialize) -> R {
    Ok(axum::Json(v).into_response())
}

/// A status code with a JSON body (201, 202).
pub(crate) fn with_status(status: StatusCode, v: impl serde::Serialize) -> R {
    Ok((status, axum::Json(v)).into_response())
}

/// The context of a body-less request: its `X-Request-Id`, if any.
pub(crate) fn header_ctx(h: &axum::http::HeaderMap) -> Result<Ctx, ApiError> {
    ctx(h.get("x-request-id").and_then(|v| v.to_str().ok()))
}

/// An optional integer field: absent or null gives `None`; otherwise an
/// integer in `range`, or 400 with `code` and `message`. As in JSON Schema,
/// a number with a zero fraction is an integer (`2.0` is 2; exact up to
/// 2^53, and beyond that as near as an f64 is).
pub(crate) fn int_in(
    v: Option<&serde_json::Value>,
    range: std::ops::RangeInclusive<u64>,
    code: Code,
    message: &str,
) -> Result<Option<u64>, ApiError> {
    match v {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .or_else(|| {
                // `u64::MAX as f64` is 2^64, one past the largest u64: the
                // bound is exclusive, or 2^64 would saturate to u64::MAX.
                v.as_f64()
                    .filter(|f| f.fract() == 0.0 && (0.0..u64::MAX as f64).contains(f))
                    .map(|f| f as u64)
            })
            .filter(|n| range.contains(n))
            .map(Some)
            .ok_or_else(|| err(code, message.to_string())),
    }
}

/// A body that carries nothing but an optional `request_id`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct EmptyReq {
    #[serde(default)]
    pub request_id: Option<String>,
}

/// The response for an event stream fed by `rx`.
pub(crate) fn sse(rx: tokio::sync::mpsc::Receiver<axum::response::sse::Event>) -> Response {
    use axum::response::sse::{KeepAlive, Sse};
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|ev| (Ok::<_, std::convert::Infallible>(ev), rx))
    });
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// The bearer token of a request (empty if none).
pub fn bearer(h: &axum::http::HeaderMap) -> String {
    let v = h
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    v.strip_prefix("Bearer ")
        .or_else(|| v.strip_prefix("bearer "))
        .map(str::trim)
        .unwrap_or("")
        .to_string()
}

/// For long streams: is the token that opened one still good? Checked
/// every `STILL_VALID_EVERY`; a revoked token ends the stream.
pub(crate) const STILL_VALID_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// The token behind an open event stream, re-checked now and then.
pub(crate) struct StreamAuth {
    auth: Authenticator,
    authz: Option<String>,
    cert: Option<crate::auth::PeerCert>,
    checked: std::time::Instant,
}

impl StreamAuth {
    pub(crate) fn new(st: &AppState, h: &axum::http::HeaderMap) -> Self {
        Self {
            auth: st.auth.clone(),
            authz: h
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string),
            cert: None,
            checked: std::time::Instant::now(),
        }
    }

    /// The client certificate the stream was opened with (when it carried
    /// no token).
    pub(crate) fn with_cert(mut self, cert: Option<crate::auth::PeerCert>) -> Self {
        self.cert = cert;
        self
    }

    /// False (after sending an `error` event) once the token is no longer
    /// valid; checked at most every `STILL_VALID_EVERY`.
    pub(crate) async fn still_valid(
        &mut self,
        tx: &tokio::sync::mpsc::Sender<axum::response::sse::Event>,
    ) -> bool {
        if self.checked.elapsed() < STILL_VALID_EVERY {
            return true;
        }
        self.checked = std::time::Instant::now();
        let ok = identify_by(&self.auth, self.authz.as_deref(), self.cert.as_ref(), None)
            .await
            .is_ok();
        if ok {
            return true;
        }
        let ev = axum::response::sse::Event::default().event("error").data(
            json!({"code": Code::Unauthorized, "message": "the token is no longer valid"})
                .to_string(),
        );
        let _ = tx.send(ev).await;
        false
    }
}

/// The authenticated caller.
pub struct Auth(pub Principal);

/// Who a request is from: its bearer token, or else the registered
/// client certificate its connection presented. One place for `/v1`,
/// `/mcp` and event streams.
pub async fn identify(
    auth: &Authenticator,
    headers: &axum::http::HeaderMap,
    extensions: &axum::http::Extensions,
) -> Result<Principal, ApiError> {
    let authz = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    identify_by(
        auth,
        authz,
        extensions.get::<crate::auth::PeerCert>(),
        extensions.get::<crate::auth::Source>().copied(),
    )
    .await
}

/// `identify` from the `Authorization` header's value and the
/// connection's client certificate: a bearer token, a user's Basic
/// credentials, or else the certificate.
pub(crate) async fn identify_by(
    auth: &Authenticator,
    authz: Option<&str>,
    cert: Option<&crate::auth::PeerCert>,
    source: Option<crate::auth::Source>,
) -> Result<Principal, ApiError> {
    let authz = authz.map(str::trim).filter(|a| !a.is_empty());
    let basic = authz.and_then(|a| {
        a.strip_prefix("Basic ")
            .or_else(|| a.strip_prefix("basic "))
    });
    let (r, what) = if let Some(b64) = basic {
        use base64::Engine;
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(b64.trim())
            .ok()
            .and_then(|b| String::from_utf8(b).ok());
        let Some((name, password)) = decoded.as_deref().and_then(|d| d.split_once(':')) else {
            return Err(err(Code::Unauthorized, "malformed Basic credentials"));
        };
        (
            auth.authenticate_basic(name, password, source).await,
            "invalid user name or password",
        )
    } else if let Some(a) = authz {
        let token = a
            .strip_prefix("Bearer ")
            .or_else(|| a.strip_prefix("bearer "))
            .map(str::trim)
            .unwrap_or("");
        if token.is_empty() {
            return Err(err(
                Code::Unauthorized,
                "Authorization must be Bearer (a token) or Basic (a user)",
            ));
        }
        (
            auth.authenticate(token, source).await,
            "invalid bearer token",
        )
    } else if let Some(c) = cert {
        (
            auth.authenticate_cert(c).await,
            "this client certificate stands for no identity",
        )
    } else {
        return Err(err(
            Code::Unauthorized,
            "a bearer token (or a user's credentials, or a registered client certificate) is required",
        ));
    };
    match r {
        Ok(p) => Ok(p),
        Err(AuthError::Unauthorized) => Err(err(Code::Unauthorized, what)),
        Err(AuthError::InvalidToken(why)) => Err(err(Code::InvalidToken, why)),
        Err(AuthError::Throttled(secs)) => Err(ApiError(
            Error::new(
                Code::SignInThrottled,
                format!(
                    "too many failed sign-ins with these credentials from this address (or the sign-in queue is full); retry in {secs} s"
                ),
            ),
            Some(secs),
        )),
        Err(AuthError::Unavailable) => Err(err(
            Code::AuditUnavailable,
            "the identity store is unavailable",
        )),
    }
}

impl FromRequestParts<AppState> for Auth {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, st: &AppState) -> Result<Self, ApiError> {
        identify(&st.auth, &parts.headers, &parts.extensions)
            .await
            .map(Auth)
    }
}

/// A strict JSON body: `application/json`, 1 byte .. 16 MiB, an object,
/// no unknown fields.
pub struct Strict<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for Strict<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let ct = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        if ct.split(';').next().map(str::trim) != Some("application/json") {
            return Err(err(
                Code::UnsupportedMediaType,
                "Content-Type must be application/json",
            ));
        }
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|s| s.parse::<usize>().ok());
        if declared.is_some_and(|n| n > MAX_BODY) {
            return Err(err(
                Code::BodyTooLarge,
                format!("request bodies are limited to {MAX_BODY} bytes"),
            ));
        }
        let body = Bytes::from_request(req, state).await.map_err(|_| {
            err(
                Code::BodyTooLarge,
                format!("request bodies are limited to {MAX_BODY} bytes"),
            )
        })?;
        if body.is_empty() {
            return Err(err(
                Code::InvalidBody,
                "a JSON object body is required (send {} for none)",
            ));
        }
        let v: serde_json::Value = serde_json::from_slice(&body)
            .map_err(|_| err(Code::InvalidJson, "the body is not valid JSON"))?;
        if !v.is_object() {
            return Err(err(Code::InvalidJson, "the body must be a JSON object"));
        }
        serde_json::from_value(v).map(Strict).map_err(|e| {
            let m = e.to_string();
            if m.starts_with("unknown field") {
                err(
                    Code::UnknownFields,
                    m.split(", expected").next().unwrap_or(&m).to_string(),
                )
            } else {
                err(Code::InvalidRequest, m)
            }
        })
    }
}

/// `request_id`: echoed; an invalid one is rejected, a missing one made up.
pub fn ctx(request_id: Option<&str>) -> Result<Ctx, ApiError> {
    match request_id {
        Some(r) => {
            let ok = !r.is_empty()
                && r.len() <= 80
                && r.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_.:-".contains(&b));
            if !ok {
                return Err(err(
                    Code::InvalidRequest,
                    "request_id must match ^[A-Za-z0-9_.:-]{1,80}$",
                ));
            }
            Ok(Ctx {
                request_id: r.to_string(),
                ..Ctx::default()
            })
        }
        None => Ok(Ctx {
            request_id: crate::ids::random_hex(8),
            ..Ctx::default()
        }),
    }
}

async fn headers(req: Request, next: Next) -> Response {
    let mut r = next.run(req).await;
    let h = r.headers_mut();
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    if h.get(header::CONTENT_TYPE)
        .is_some_and(|v| v == "application/json")
    {
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json; charset=utf-8"),
        );
    }
    r
}

/// Every route served, as documented in `docs/openapi.yaml` (a test keeps
/// the router, this list and the spec in step).
pub const ROUTES: &[(&str, &str)] = &[
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
    ("POST", "/mcp"),
    ("GET", "/mcp"),
    ("DELETE", "/mcp"),
    ("GET", "/openapi.yaml"),
    ("GET", "/v1/leases"),
    ("POST", "/v1/leases/acquire"),
    ("GET", "/v1/leases/{lease_ref}/status"),
    ("POST", "/v1/leases/{lease_ref}/status"),
    ("POST", "/v1/leases/{lease_ref}/exec"),
    ("POST", "/v1/leases/{lease_ref}/read"),
    ("POST", "/v1/leases/{lease_ref}/write"),
    ("POST", "/v1/leases/{lease_ref}/list"),
    ("POST", "/v1/leases/{lease_ref}/stat"),
    ("POST", "/v1/leases/{lease_ref}/mkdir"),
    ("POST", "/v1/leases/{lease_ref}/remove"),
    ("POST", "/v1/leases/{lease_ref}/move"),
    ("POST", "/v1/leases/{lease_ref}/artifacts/upload"),
    ("POST", "/v1/leases/{lease_ref}/artifacts/download"),
    ("POST", "/v1/leases/{lease_ref}/release"),
    ("POST", "/v1/leases/{lease_ref}/renew"),
    ("GET", "/v1/leases/{lease_ref}/recover"),
    ("GET", "/v1/leases/{lease_ref}/mcp/tools"),
    ("POST", "/v1/leases/{lease_ref}/mcp/call"),
    ("GET", "/v1/profiles"),
    ("POST", "/v1/admin/gc"),
    ("GET", "/v1/leases/{lease_ref}/checkpoints"),
    ("POST", "/v1/leases/{lease_ref}/checkpoints"),
    (
        "POST",
        "/v1/leases/{lease_ref}/checkpoints/{checkpoint_ref}/rollback",
    ),
    (
        "POST",
        "/v1/leases/{lease_ref}/checkpoints/{checkpoint_ref}/delete",
    ),
    (
        "POST",
        "/v1/leases/{lease_ref}/checkpoints/{checkpoint_ref}/fork",
    ),
    ("POST", "/v1/leases/{lease_ref}/jobs"),
    ("GET", "/v1/jobs/{job_ref}/status"),
    ("POST", "/v1/jobs/{job_ref}/status"),
    ("POST", "/v1/jobs/{job_ref}/output"),
    ("POST", "/v1/jobs/{job_ref}/cancel"),
    ("GET", "/v1/jobs/{job_ref}/events"),
    ("GET", "/v1/jobs/{job_ref}/recover"),
    ("POST", "/v1/leases/{lease_ref}/ptys"),
    ("GET", "/v1/ptys/{pty_ref}/status"),
    ("POST", "/v1/ptys/{pty_ref}/input"),
    ("POST", "/v1/ptys/{pty_ref}/resize"),
    ("POST", "/v1/ptys/{pty_ref}/kill"),
    ("GET", "/v1/ptys/{pty_ref}/events"),
    ("POST", "/v1/ptys/{pty_ref}/output"),
    ("GET", "/v1/task-templates"),
    ("POST", "/v1/tasks/plan"),
    ("GET", "/v1/task-plans/{plan_ref}"),
    ("POST", "/v1/task-plans/{plan_ref}/approve"),
    ("POST", "/v1/task-plans/{plan_ref}/submit"),
    ("GET", "/v1/tasks/{task_ref}/status"),
    ("POST", "/v1/tasks/{task_ref}/status"),
    ("POST", "/v1/tasks/{task_ref}/result"),
    ("POST", "/v1/tasks/{task_ref}/cancel"),
    ("GET", "/v1/tasks/{task_ref}/receipt"),
    ("POST", "/v1/tasks/{task_ref}/receipt"),
    ("GET", "/v1/receipts/public-key"),
];

pub fn router(st: AppState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/openapi.yaml", get(openapi))
        .merge(leases::router())
        .merge(jobs::router())
        .merge(ptys::router())
        .merge(tasks::router())
        .fallback(|| async { err(Code::NotFound, "no such route") })
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
        // Innermost: a panic in a handler becomes a logged 500 envelope.
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(
            panic_response,
        ))
        .layer(middleware::from_fn(headers))
        .with_state(st)
}

pub(crate) fn panic_response(_: Box<dyn std::any::Any + Send + 'static>) -> Response {
    tracing::error!("a request handler panicked");
    err(Code::InternalError, "internal error").into_response()
}

const VERSION: &str = env!("CARGO_PKG_VERSION");

async fn healthz(State(st): State<AppState>) -> Response {
    let j = st.broker.journal();
    axum::Json(json!({
        "status": "ok",
        "version": VERSION,
        "state_backend": "durable",
        "audit_mode": j.mode().as_str(),
        "audit_ready": j.is_ready(),
    }))
    .into_response()
}

/// One backend's readiness: CubeAPI and CubeProxy reachable, and whether
/// every template its profiles use is ready.
struct BackendReady {
    cube_api: bool,
    cube_proxy: bool,
    templates: bool,
}

impl BackendReady {
    fn ok(&self) -> bool {
        self.cube_api && self.cube_proxy && self.templates
    }
}

/// One backend's readiness checks: CubeAPI, CubeProxy and its templates,
/// asked at once.
async fn backend_checks(cube: &crate::cube::CubeClient, templates: Vec<String>) -> BackendReady {
    let (reach, template_checks) = tokio::join!(
        cube.reachability(),
        futures_util::future::join_all(templates.iter().map(|t| cube.template_ready(t))),
    );
    BackendReady {
        cube_api: reach.cube_api.is_ok(),
        cube_proxy: reach.cube_proxy.is_ok(),
        templates: template_checks.iter().all(|c| matches!(c, Ok(true))),
    }
}

/// `ok` when every backend passes, `unreachable` (or `not_ready`) when
/// none does, `degraded` between.
fn across(
    results: &[BackendReady],
    pass: fn(&BackendReady) -> bool,
    none: &'static str,
) -> &'static str {
    let n = results.iter().filter(|r| pass(r)).count();
    if n == results.len() {
        "ok"
    } else if n == 0 {
        none
    } else {
        "degraded"
    }
}

/// `GET /readyz`, unauthenticated: ready or not, and generic checks that
/// name no tenant, profile, template or backend (#34 L9; `cube-adapter
/// status` has the detail).
async fn readyz(State(st): State<AppState>) -> Response {
    let j = st.broker.journal();
    if let Err(e) = j.check() {
        st.metrics.ready.store(0, Ordering::Relaxed);
        let body = json!({
            "status": "not_ready", "version": VERSION,
            "checks": {"audit": match e { crate::audit::AuditError::Blocked => "reconciliation_required", _ => "unavailable" }},
            "error": {"code": Code::AuditUnavailable, "message": e.to_string()},
        });
        let code = Code::AuditUnavailable;
        let mut r = (code.status(), axum::Json(body)).into_response();
        if let Some(secs) = code.retry_after() {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        return r;
    }
    let cfg = st.broker.config();
    let backends = st.broker.backends().all();
    let results = futures_util::future::join_all(backends.iter().map(|b| {
        let mut templates: Vec<String> = cfg
            .profiles
            .values()
            .filter(|p| cfg.profile_backend(p) == Some(b.name.as_str()))
            .map(|p| p.template.clone())
            .collect();
        templates.sort_unstable();
        templates.dedup();
        backend_checks(&b.client, templates)
    }))
    .await;
    // Ready while one backend is.
    let ready = results.iter().any(BackendReady::ok);
    let checks = json!({
        "state": "ok",
        "audit": "ok",
        "cube_api": across(&results, |r| r.cube_api, "unreachable"),
        "cube_proxy": across(&results, |r| r.cube_proxy, "unreachable"),
        "templates": across(&results, |r| r.templates, "not_ready"),
    });
    st.metrics.ready.store(u8::from(ready), Ordering::Relaxed);
    if ready {
        return (
            StatusCode::OK,
            axum::Json(json!({"status": "ready", "version": VERSION, "checks": checks})),
        )
            .into_response();
    }
    let code = Code::BackendUnavailable;
    let mut r = (
        code.status(),
        axum::Json(json!({
            "status": "not_ready", "version": VERSION, "checks": checks,
            "error": {"code": code, "message": "no backend is ready"},
        })),
    )
        .into_response();
    if let Some(secs) = code.retry_after() {
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    r
}

/// `GET /metrics`: the Prometheus text (docs/operations.md, "Metrics").
/// With `[metrics] token_file`, only for a request that sends the token,
/// and then with every label; without, open but with no tenant or profile
/// label.
async fn metrics(State(st): State<AppState>, h: axum::http::HeaderMap) -> Response {
    if !st.metrics.admits(&h) {
        return err(
            Code::Unauthorized,
            "/metrics requires the metrics token (Authorization: Bearer …)",
        )
        .into_response();
    }
    let mut series = scrape(&st).await;
    // Open (no token configured): no tenant or profile names (#34 L9).
    if st.metrics.token.is_none() {
        series = crate::metrics::without_labels(series, crate::metrics::PRIVATE_LABELS);
    }
    match crate::metrics::encode(series) {
        Ok(text) => ([(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], text).into_response(),
        Err(_) => err(Code::InternalError, "the metrics could not be encoded").into_response(),
    }
}

/// Every metric, read now: the instruments the components feed, and what
/// is read at scrape time (the store, the certificates, `/proc`).
async fn scrape(st: &AppState) -> Vec<crate::metrics::Metric> {
    use crate::metrics::{Metric, Value};
    let b = &st.broker;
    let j = b.journal();
    let g = |v: f64| Value::Gauge(v);
    let flag = |on: bool| Value::Gauge(if on { 1.0 } else { 0.0 });
    let hist = |h: &crate::metrics::Histogram| Value::Histogram(h.snapshot());
    let count = |c: &crate::metrics::Counter| Value::Counter(c.get());
    let mut out = vec![
        Metric::gauge("cube_adapter_build_info", "The running version (always 1)")
            .with(&[("version", VERSION)], g(1.0)),
        Metric::histogram(
            "cube_adapter_http_request_duration_seconds",
            "HTTP requests by route template, method and status class: time to the response head",
        )
        .with_family(
            &st.metrics.http.requests,
            ["route", "method", "status_class"],
            hist,
        ),
    ];
    // The audit journal.
    let am = j.metrics();
    out.push(
        Metric::counter(
            "cube_adapter_operations_total",
            "Audited operations (outcome and single-step events) by action, outcome, runtime and profile",
        )
        .with_family(
            &am.operations,
            ["action", "outcome", "runtime", "profile"],
            count,
        ),
    );
    out.push(
        Metric::histogram(
            "cube_adapter_operation_duration_seconds",
            "Sandbox effects from intent to outcome, by action, outcome and backend",
        )
        .with_family(&am.effects, ["action", "outcome", "backend"], hist),
    );
    let sm = j.store().metrics();
    out.push(
        Metric::histogram(
            "cube_adapter_audit_commit_duration_seconds",
            "Durable store commits (group commits carrying audit events), including the fsync",
        )
        .with(&[], hist(&sm.commit)),
    );
    out.push(
        Metric::histogram(
            "cube_adapter_audit_events_per_commit",
            "Audit events written by each durable commit",
        )
        .with(&[], hist(&sm.events_per_commit)),
    );
    let check = j.check();
    out.push(
        Metric::gauge("cube_adapter_audit_required", "1 in required audit mode")
            .with(&[], flag(j.mode() == crate::audit::AuditMode::Required)),
    );
    out.push(
        Metric::gauge(
            "cube_adapter_audit_blocked",
            "1 while sandbox effects are refused for audit reasons",
        )
        .with(&[], flag(check.is_err())),
    );
    out.push(
        Metric::gauge(
            "cube_adapter_audit_reconcile_needed",
            "1 while intents without an outcome block sandbox effects until `cube-adapter audit reconcile`",
        )
        .with(&[], flag(matches!(check, Err(crate::audit::AuditError::Blocked)))),
    );
    if let Some(sinks) = am.sinks() {
        out.extend(crate::metrics::sink_metrics(&sinks));
    }
    // Read from the store now.
    match b.gauges().await {
        Ok(s) => out.extend(store_gauges(&s)),
        Err(e) => {
            tracing::warn!(code = e.code.as_str(), error = %e.message, "metrics: the store could not be read");
        }
    }
    // The backends.
    let mut up = Metric::gauge(
        "cube_adapter_backend_up",
        "1 while the backend's health check passes",
    );
    let mut errors = Metric::counter(
        "cube_adapter_backend_errors_total",
        "Failed backend calls by kind (not_found is an ordinary answer and not counted)",
    );
    for be in b.backends().all() {
        up.push(&[("backend", &be.name)], flag(be.is_up()));
        for (kind, n) in be.client.errors() {
            errors.push(&[("backend", &be.name), ("kind", &kind)], Value::Counter(n));
        }
    }
    out.push(up);
    out.push(errors);
    // Garbage collection.
    let gc = b.gc_metrics();
    out.push(
        Metric::counter("cube_adapter_gc_runs_total", "GC passes by result").with_family(
            &gc.runs,
            ["result"],
            count,
        ),
    );
    out.push(
        Metric::counter(
            "cube_adapter_gc_actions_total",
            "What GC did: idle leases collected or failed, orphaned sandboxes killed or failed, plans pruned",
        )
        .with_family(&gc.actions, ["outcome"], count),
    );
    // The egress proxy.
    let eg = &b.egress().metrics;
    out.push(
        Metric::counter(
            "cube_adapter_egress_requests_total",
            "Requests and tunnels sandboxes made through the egress proxy, by profile and result (ok, error, or the refusal's code)",
        )
        .with_family(&eg.requests, ["profile", "result"], count),
    );
    out.push(
        Metric::counter(
            "cube_adapter_egress_bytes_total",
            "Bytes the egress proxy carried for sandboxes, by profile and direction (out: from the sandbox)",
        )
        .with_family(&eg.bytes, ["profile", "direction"], count),
    );
    // Readiness, certificates, the process.
    let ready = st.metrics.ready.load(Ordering::Relaxed);
    if ready < 2 {
        out.push(
            Metric::gauge(
                "cube_adapter_state_backend_ready",
                "The last /readyz result (1 ready)",
            )
            .with(&[], g(f64::from(ready))),
        );
    }
    if let Some(dir) = &st.metrics.tls_dir {
        let mut m = Metric::gauge(
            "cube_adapter_tls_certificate_expiry_timestamp_seconds",
            "When the certificate stops being valid (Unix seconds)",
        );
        for (name, file) in [("server", "server.pem"), ("ca", "ca.pem")] {
            if let Some(info) = std::fs::read(dir.join(file))
                .ok()
                .and_then(|pem| crate::tls::cert_info(&pem).ok())
            {
                m.push(&[("certificate", name)], g(info.not_after_unix as f64));
            }
        }
        out.push(m);
    }
    out.extend(crate::metrics::Process::read().metrics());
    let dropped = st.metrics.http.requests.dropped()
        + am.operations.dropped()
        + am.effects.dropped()
        + gc.runs.dropped()
        + gc.actions.dropped()
        + eg.requests.dropped()
        + eg.bytes.dropped();
    out.push(
        Metric::counter(
            "cube_adapter_metrics_series_dropped_total",
            "Observations not recorded because their metric family was full",
        )
        .with(&[], Value::Counter(dropped)),
    );
    out
}

/// The store's gauges as metrics.
fn store_gauges(s: &crate::broker::gauges::Gauges) -> Vec<crate::metrics::Metric> {
    use crate::metrics::{Metric, Value};
    let g = |v: u64| Value::Gauge(v as f64);
    let mut leases = Metric::gauge(
        "cube_adapter_leases",
        "Lease records by state, tenant and profile",
    );
    let mut active = 0;
    for ((state, tenant, profile), n) in &s.leases {
        leases.push(
            &[("state", state), ("tenant", tenant), ("profile", profile)],
            g(*n),
        );
        if crate::broker::gauges::holds_sandbox(state) {
            active += n;
        }
    }
    let by = |name, help, m: &crate::broker::gauges::ByTenant| {
        let mut x = Metric::gauge(name, help);
        for ((tenant, profile), n) in m {
            x.push(&[("tenant", tenant), ("profile", profile)], g(*n));
        }
        x
    };
    let running: u64 = s.jobs.values().sum::<u64>() + s.ptys.values().sum::<u64>();
    vec![
        Metric::gauge(
            "cube_adapter_active_leases",
            "Leases that hold a sandbox (running or paused)",
        )
        .with(&[], g(active)),
        leases,
        Metric::gauge(
            "cube_adapter_active_jobs",
            "Jobs and PTYs running",
        )
        .with(&[], g(running)),
        by(
            "cube_adapter_jobs_running",
            "Running jobs by tenant and profile",
            &s.jobs,
        ),
        by(
            "cube_adapter_ptys_running",
            "Running PTYs by tenant and profile",
            &s.ptys,
        ),
        Metric::gauge(
            "cube_adapter_plans_pending_approval",
            "Task plans waiting for an approver",
        )
        .with(&[], g(s.plans_pending)),
        Metric::gauge(
            "cube_adapter_plans_oldest_pending_age_seconds",
            "Age of the oldest task plan waiting for an approver (0: none)",
        )
        .with(&[], Value::Gauge(s.oldest_pending_age as f64)),
        Metric::gauge(
            "cube_adapter_audit_incomplete_operations",
            "Audit intents without an outcome (effects in flight, or left by a crash)",
        )
        .with(&[], g(s.open_intents)),
        Metric::gauge(
            "cube_adapter_audit_uncertain_outcomes",
            "Outcomes recorded uncertain (crash recovery could not tell whether the effect happened)",
        )
        .with(&[], g(s.uncertain_outcomes)),
    ]
}

pub const OPENAPI: &str = include_str!("../../docs/openapi.yaml");

async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/yaml")], OPENAPI).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_in_range_and_no_further() {
        let check = |text: &str| {
            let v: serde_json::Value = serde_json::from_str(text).unwrap();
            int_in(Some(&v), 0..=u64::MAX, Code::InvalidOffset, "offset")
                .ok()
                .flatten()
        };
        assert_eq!(check("18446744073709551615"), Some(u64::MAX));
        assert_eq!(check("7.0"), Some(7));
        // 2^64 is a float here, and one past the largest u64.
        assert_eq!(check("18446744073709551616"), None);
        assert_eq!(check("-1"), None);
        assert_eq!(check("1.5"), None);
    }
}
