//! CubeAPI (control plane) client and the per-backend transport settings.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::wire::{
    ApiErrorBody, CreateSandbox, RefreshBody, RollbackBody, RollbackDone, Sandbox, SandboxDetail,
    SnapshotBody, SnapshotCreated, SnapshotInfo, TemplateInfo, TimeoutBody,
};
use super::{CubeError, ErrorKind, Result};

/// A secret string: never printed by `Debug`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Self {
        Self(s.into())
    }
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// Time budgets for backend calls.
#[derive(Debug, Clone)]
pub struct Timeouts {
    pub connect: Duration,
    /// Ordinary control-plane and unary data-plane calls.
    pub request: Duration,
    /// Pause, resume, connect, snapshot and rollback (CubeAPI allows 120-240 s).
    pub lifecycle: Duration,
    /// Longest silence on a stream (keepalives arrive every `keepalive`).
    pub stream_idle: Duration,
    pub keepalive: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(5),
            request: Duration::from_secs(30),
            lifecycle: Duration::from_secs(240),
            stream_idle: Duration::from_secs(75),
            keepalive: Duration::from_secs(20),
        }
    }
}

/// How to reach one backend.
#[derive(Debug, Clone)]
pub struct BackendConfig {
    pub name: String,
    /// CubeAPI base URL, e.g. `https://cube.example:3000`.
    pub api_url: String,
    /// CubeProxy address the data plane is sent to (Host routing). Defaults
    /// to `api_url`.
    pub proxy_url: Option<String>,
    /// Sandbox domain when a response does not name one.
    pub domain: String,
    pub api_key: Option<Secret>,
    /// PEM of the CA(s) to trust instead of none.
    pub ca_pem: Option<Vec<u8>>,
    /// Client certificate and key (PEM) for mTLS.
    pub client_cert_pem: Option<Vec<u8>>,
    pub client_key_pem: Option<Secret>,
    /// Allow `http://` to a non-loopback address.
    pub insecure_plain_http: bool,
    pub timeouts: Timeouts,
}

impl BackendConfig {
    pub fn new(name: impl Into<String>, api_url: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            api_url: api_url.into(),
            proxy_url: None,
            domain: "cube.app".into(),
            api_key: None,
            ca_pem: None,
            client_cert_pem: None,
            client_key_pem: None,
            insecure_plain_http: false,
            timeouts: Timeouts::default(),
        }
    }
}

/// What the data plane needs to address one sandbox.
#[derive(Debug, Clone)]
pub struct SandboxAddr {
    pub id: String,
    pub domain: String,
    pub traffic_token: Option<Secret>,
}

/// A client for one backend. Cheap to clone.
#[derive(Clone)]
pub struct CubeClient {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) cfg: BackendConfig,
    pub(crate) api: reqwest::Url,
    pub(crate) proxy: reqwest::Url,
    pub(crate) http: reqwest::Client,
}

fn parse_base(what: &str, s: &str, insecure: bool) -> Result<reqwest::Url> {
    let url = reqwest::Url::parse(s)
        .map_err(|e| CubeError::new(ErrorKind::InvalidArgument, format!("{what} '{s}': {e}")))?;
    match url.scheme() {
        "https" => {}
        "http" => {
            let loopback = match url.host() {
                Some(url::Host::Ipv4(ip)) => IpAddr::V4(ip).is_loopback(),
                Some(url::Host::Ipv6(ip)) => IpAddr::V6(ip).is_loopback(),
                Some(url::Host::Domain(d)) => d.eq_ignore_ascii_case("localhost"),
                None => false,
            };
            if !loopback && !insecure {
                return Err(CubeError::new(
                    ErrorKind::InvalidArgument,
                    format!(
                        "{what} '{s}' uses plain http to a non-loopback host; use https or set insecure_plain_http = true for this backend"
                    ),
                ));
            }
        }
        other => {
            return Err(CubeError::new(
                ErrorKind::InvalidArgument,
                format!("{what} '{s}': unsupported scheme '{other}'"),
            ));
        }
    }
    if url.host().is_none() {
        return Err(CubeError::new(
            ErrorKind::InvalidArgument,
            format!("{what} '{s}' has no host"),
        ));
    }
    Ok(url)
}

impl CubeClient {
    pub fn new(cfg: BackendConfig) -> Result<Self> {
        let api = parse_base("api_url", &cfg.api_url, cfg.insecure_plain_http)?;
        let proxy = match &cfg.proxy_url {
            Some(p) => parse_base("proxy_url", p, cfg.insecure_plain_http)?,
            None => api.clone(),
        };
        let identity = match (&cfg.client_cert_pem, &cfg.client_key_pem) {
            (Some(c), Some(k)) => Some((c.as_slice(), k.expose().as_bytes())),
            (None, None) => None,
            _ => {
                return Err(CubeError::new(
                    ErrorKind::InvalidArgument,
                    "client certificate and key must be given together",
                ));
            }
        };
        let tls = crate::tls::client_config(cfg.ca_pem.as_deref(), identity).map_err(|e| {
            CubeError::new(
                ErrorKind::InvalidArgument,
                format!("backend {} TLS: {e}", cfg.name),
            )
        })?;
        let mut headers = reqwest::header::HeaderMap::new();
        if let Some(k) = &cfg.api_key {
            let mut v = reqwest::header::HeaderValue::from_str(k.expose()).map_err(|_| {
                CubeError::new(
                    ErrorKind::InvalidArgument,
                    "api key contains invalid characters",
                )
            })?;
            v.set_sensitive(true);
            headers.insert("x-api-key", v);
        }
        let http = reqwest::Client::builder()
            .tls_backend_preconfigured(tls)
            .http1_only()
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(cfg.timeouts.connect)
            .read_timeout(cfg.timeouts.stream_idle)
            .pool_idle_timeout(Duration::from_secs(60))
            .tcp_nodelay(true)
            .default_headers(headers)
            .user_agent(concat!("cube-adapter/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| {
                CubeError::new(
                    ErrorKind::InvalidArgument,
                    format!("backend {}: {e}", cfg.name),
                )
            })?;
        Ok(Self {
            inner: Arc::new(Inner {
                cfg,
                api,
                proxy,
                http,
            }),
        })
    }

    pub fn config(&self) -> &BackendConfig {
        &self.inner.cfg
    }

    fn url(&self, path: &str) -> Result<reqwest::Url> {
        self.inner
            .api
            .join(path)
            .map_err(|e| CubeError::protocol(format!("bad path {path}: {e}")))
    }

    async fn call<B: Serialize, T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
        timeout: Duration,
        what: &str,
    ) -> Result<(StatusCode, Option<T>)> {
        let mut req = self
            .inner
            .http
            .request(method, self.url(path)?)
            .timeout(timeout);
        if let Some(b) = body {
            req = req.json(b);
        }
        let resp = req
            .send()
            .await
            .map_err(|e| CubeError::from_reqwest(what, e))?;
        let status = resp.status();
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| CubeError::from_reqwest(what, e))?;
        if !status.is_success() {
            return Err(api_error(what, status, &bytes));
        }
        if bytes.is_empty() || std::any::type_name::<T>() == "()" {
            return Ok((status, None));
        }
        let v = serde_json::from_slice(&bytes)
            .map_err(|e| CubeError::protocol(format!("{what}: invalid response: {e}")))?;
        Ok((status, Some(v)))
    }

    async fn call_json<B: Serialize, T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
        timeout: Duration,
        what: &str,
    ) -> Result<T> {
        match self.call(method, path, body, timeout, what).await? {
            (_, Some(v)) => Ok(v),
            (_, None) => Err(CubeError::protocol(format!("{what}: empty response"))),
        }
    }

    async fn call_empty<B: Serialize>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
        timeout: Duration,
        what: &str,
    ) -> Result<()> {
        self.call::<B, serde_json::Value>(method, path, body, timeout, what)
            .await
            .map(|_| ())
    }

    fn t(&self) -> Duration {
        self.inner.cfg.timeouts.request
    }

    fn lt(&self) -> Duration {
        self.inner.cfg.timeouts.lifecycle
    }

    /// `GET /health`.
    pub async fn health(&self) -> Result<()> {
        self.call_empty::<()>(Method::GET, "/health", None, self.t(), "health")
            .await
    }

    /// `POST /sandboxes`. Keep `trafficAccessToken` from the answer: it is
    /// never returned again.
    pub async fn create(&self, req: &CreateSandbox) -> Result<Sandbox> {
        let mut s: Sandbox = self
            .call_json(
                Method::POST,
                "/sandboxes",
                Some(req),
                self.lt(),
                "create sandbox",
            )
            .await?;
        if s.domain.is_empty() {
            s.domain = self.inner.cfg.domain.clone();
        }
        if s.sandbox_id.is_empty() || s.sandbox_id.contains('.') {
            return Err(CubeError::protocol(
                "create sandbox: invalid sandboxID in response",
            ));
        }
        Ok(s)
    }

    /// Create a sandbox from a snapshot (clone / restore).
    pub async fn create_from_snapshot(
        &self,
        snapshot_id: &str,
        mut req: CreateSandbox,
    ) -> Result<Sandbox> {
        req.template_id = snapshot_id.to_string();
        self.create(&req).await
    }

    pub async fn get(&self, id: &str) -> Result<SandboxDetail> {
        check_id(id)?;
        self.call_json::<(), _>(
            Method::GET,
            &format!("/sandboxes/{id}"),
            None,
            self.t(),
            "get sandbox",
        )
        .await
    }

    /// `GET /v2/sandboxes` with metadata and state filters.
    pub async fn list(
        &self,
        metadata: &BTreeMap<String, String>,
        state: Option<&str>,
    ) -> Result<Vec<SandboxDetail>> {
        let mut url = self.url("/v2/sandboxes")?;
        {
            let mut q = url.query_pairs_mut();
            if !metadata.is_empty() {
                let m: String = url::form_urlencoded::Serializer::new(String::new())
                    .extend_pairs(metadata)
                    .finish();
                q.append_pair("metadata", &m);
            }
            if let Some(s) = state {
                q.append_pair("state", s);
            }
        }
        let resp = self
            .inner
            .http
            .get(url)
            .timeout(self.t())
            .send()
            .await
            .map_err(|e| CubeError::from_reqwest("list sandboxes", e))?;
        let status = resp.status();
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| CubeError::from_reqwest("list sandboxes", e))?;
        if !status.is_success() {
            return Err(api_error("list sandboxes", status, &bytes));
        }
        serde_json::from_slice(&bytes)
            .map_err(|e| CubeError::protocol(format!("list sandboxes: invalid response: {e}")))
    }

    pub async fn kill(&self, id: &str) -> Result<()> {
        check_id(id)?;
        self.call_empty::<()>(
            Method::DELETE,
            &format!("/sandboxes/{id}"),
            None,
            self.t(),
            "kill sandbox",
        )
        .await
    }

    /// The sandbox ends `secs` from now (`-1` = never).
    pub async fn set_timeout(&self, id: &str, secs: i64) -> Result<()> {
        check_id(id)?;
        let body = TimeoutBody {
            timeout: Some(secs),
        };
        self.call_empty(
            Method::POST,
            &format!("/sandboxes/{id}/timeout"),
            Some(&body),
            self.t(),
            "set timeout",
        )
        .await
    }

    pub async fn refresh(&self, id: &str, secs: i64) -> Result<()> {
        check_id(id)?;
        let body = RefreshBody {
            duration: Some(secs),
        };
        self.call_empty(
            Method::POST,
            &format!("/sandboxes/{id}/refreshes"),
            Some(&body),
            self.t(),
            "refresh",
        )
        .await
    }

    pub async fn pause(&self, id: &str) -> Result<()> {
        check_id(id)?;
        self.call_empty(
            Method::POST,
            &format!("/sandboxes/{id}/pause"),
            Some(&serde_json::json!({})),
            self.lt(),
            "pause",
        )
        .await
    }

    /// `POST /sandboxes/{id}/connect`: resumes a paused sandbox.
    pub async fn connect(&self, id: &str, timeout: Option<i64>) -> Result<Sandbox> {
        check_id(id)?;
        let body = TimeoutBody { timeout };
        let mut s: Sandbox = self
            .call_json(
                Method::POST,
                &format!("/sandboxes/{id}/connect"),
                Some(&body),
                self.lt(),
                "connect",
            )
            .await?;
        if s.domain.is_empty() {
            s.domain = self.inner.cfg.domain.clone();
        }
        Ok(s)
    }

    pub async fn create_snapshot(&self, id: &str, name: Option<&str>) -> Result<SnapshotCreated> {
        check_id(id)?;
        let body = SnapshotBody {
            name: name.map(str::to_string),
        };
        self.call_json(
            Method::POST,
            &format!("/sandboxes/{id}/snapshots"),
            Some(&body),
            self.lt(),
            "create snapshot",
        )
        .await
    }

    pub async fn list_snapshots(&self, sandbox_id: Option<&str>) -> Result<Vec<SnapshotInfo>> {
        let mut url = self.url("/snapshots")?;
        if let Some(s) = sandbox_id {
            url.query_pairs_mut().append_pair("sandboxID", s);
        }
        let resp = self
            .inner
            .http
            .get(url)
            .timeout(self.t())
            .send()
            .await
            .map_err(|e| CubeError::from_reqwest("list snapshots", e))?;
        let status = resp.status();
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| CubeError::from_reqwest("list snapshots", e))?;
        if !status.is_success() {
            return Err(api_error("list snapshots", status, &bytes));
        }
        serde_json::from_slice(&bytes)
            .map_err(|e| CubeError::protocol(format!("list snapshots: invalid response: {e}")))
    }

    /// Snapshots are deleted through the templates route.
    pub async fn delete_snapshot(&self, snapshot_id: &str) -> Result<()> {
        check_id(snapshot_id)?;
        self.call_empty::<()>(
            Method::DELETE,
            &format!("/templates/{snapshot_id}"),
            None,
            self.lt(),
            "delete snapshot",
        )
        .await
    }

    pub async fn rollback(&self, id: &str, snapshot_id: &str) -> Result<RollbackDone> {
        check_id(id)?;
        let body = RollbackBody {
            snapshot_id: snapshot_id.to_string(),
        };
        self.call_json(
            Method::POST,
            &format!("/sandboxes/{id}/rollback"),
            Some(&body),
            self.lt(),
            "rollback",
        )
        .await
    }

    pub async fn list_templates(&self) -> Result<Vec<TemplateInfo>> {
        self.call_json::<(), _>(Method::GET, "/templates", None, self.t(), "list templates")
            .await
    }

    pub async fn get_template(&self, id: &str) -> Result<TemplateInfo> {
        check_id(id)?;
        self.call_json::<(), _>(
            Method::GET,
            &format!("/templates/{id}"),
            None,
            self.t(),
            "get template",
        )
        .await
    }

    /// Whether a template exists and is `READY`.
    pub async fn template_ready(&self, id: &str) -> Result<bool> {
        match self.get_template(id).await {
            Ok(t) => Ok(t.is_ready()),
            Err(e) if e.kind == ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The address of a sandbox for the data plane.
    pub fn addr(&self, s: &Sandbox) -> SandboxAddr {
        SandboxAddr {
            id: s.sandbox_id.clone(),
            domain: if s.domain.is_empty() {
                self.inner.cfg.domain.clone()
            } else {
                s.domain.clone()
            },
            traffic_token: s.traffic_access_token.clone().map(Secret::new),
        }
    }
}

/// Sandbox and snapshot ids are `[A-Za-z0-9-]`: never let one rewrite a path.
fn check_id(id: &str) -> Result<()> {
    if super::wire::valid_id(id) {
        Ok(())
    } else {
        Err(CubeError::new(ErrorKind::InvalidArgument, "invalid id"))
    }
}

/// Turn a non-2xx answer into a typed error, reading CubeAPI's
/// `{"code","message"}`, CubeProxy's `{"error"}` or a Connect `{"code": "…"}`.
pub(crate) fn api_error(what: &str, status: StatusCode, body: &[u8]) -> CubeError {
    if let Ok(e) = serde_json::from_slice::<ApiErrorBody>(body) {
        return CubeError::from_status(status.as_u16(), format!("{what}: {}", e.message));
    }
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) {
        if let (Some(code), msg) = (
            v.get("code").and_then(|c| c.as_str()),
            v.get("message").and_then(|m| m.as_str()),
        ) {
            return CubeError::from_connect(code, format!("{what}: {}", msg.unwrap_or(code)));
        }
        if let Some(word) = v.get("error").and_then(|e| e.as_str()) {
            return CubeError::from_status(status.as_u16(), format!("{what}: {word}"));
        }
    }
    let reason = status.canonical_reason().unwrap_or("error");
    CubeError::from_status(
        status.as_u16(),
        format!("{what}: HTTP {} {reason}", status.as_u16()),
    )
}
