//! CubeAPI (control plane) client and the per-backend transport settings.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::wire::{
    ApiErrorBody, CreateSandbox, CreateVolume, RefreshBody, RollbackBody, RollbackDone, Sandbox,
    SandboxDetail, SnapshotBody, SnapshotCreated, SnapshotInfo, TemplateInfo, TimeoutBody, Volume,
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

/// Time budgets for backend calls. Each control-plane call gets CubeAPI's
/// own route budget plus a margin, so that we never record as failed an
/// operation the server goes on to finish; only streams and downloads have
/// an idle (stall) timer.
#[derive(Debug, Clone)]
pub struct Timeouts {
    pub connect: Duration,
    /// Ordinary control-plane and unary data-plane calls.
    pub request: Duration,
    /// `POST /sandboxes` (CubeAPI route budget 30 s, then 408).
    pub create: Duration,
    /// Pause, and connect (resume) (route budget 120 s).
    pub pause: Duration,
    /// Snapshot, rollback and snapshot delete (route budget 240 s).
    pub snapshot: Duration,
    /// Uploads, in all.
    pub lifecycle: Duration,
    /// Longest silence on a stream or a download (keepalives arrive every
    /// `keepalive` on process streams).
    pub stream_idle: Duration,
    pub keepalive: Duration,
    /// Retries of an idempotent control-plane call answered 503 or 429 with
    /// `Retry-After`, and the most time spent waiting for them in all.
    pub retries: u32,
    pub retry_total: Duration,
}

/// Added to each CubeAPI route budget.
pub const BUDGET_MARGIN: Duration = Duration::from_secs(15);

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(5),
            request: Duration::from_secs(30),
            create: Duration::from_secs(30) + BUDGET_MARGIN,
            pause: Duration::from_secs(120) + BUDGET_MARGIN,
            snapshot: Duration::from_secs(240) + BUDGET_MARGIN,
            lifecycle: Duration::from_secs(240),
            stream_idle: Duration::from_secs(75),
            keepalive: Duration::from_secs(20),
            retries: 3,
            retry_total: Duration::from_secs(30),
        }
    }
}

/// Whether a call may be sent again (it has no effect, or the same effect).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Idempotent {
    Yes,
    No,
}

/// Where the data plane (envd through CubeProxy) is sent.
///
/// As a string, CubeProxy's URL: requests go there with
/// `Host: <port>-<id>.<domain>` (TLS names the URL's host). As a table
/// `{ url = "https://cube.app", dial = "10.0.0.5:443" }`, the request URL
/// itself carries `<port>-<id>.<domain>` (so TLS SNI and `Host` match a
/// `*.<domain>` proxy certificate) while the TCP connection goes to `dial`,
/// as the Go SDK does with `CUBE_PROXY_NODE_IP`. `url` then gives the scheme
/// and must name the sandbox domain.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ProxyUrl {
    Url(String),
    Dial { url: String, dial: String },
}

impl ProxyUrl {
    pub fn url(&self) -> &str {
        match self {
            Self::Url(u) | Self::Dial { url: u, .. } => u,
        }
    }

    pub fn dial(&self) -> Option<&str> {
        match self {
            Self::Url(_) => None,
            Self::Dial { dial, .. } => Some(dial),
        }
    }

    /// What `config check` can say without connecting: the URL parses, its
    /// scheme is allowed, a dial address is `host:port` and `url` names the
    /// sandbox domain.
    pub fn check(&self, domain: &str, insecure_plain_http: bool) -> Result<()> {
        let url = parse_base("proxy_url", self.url(), insecure_plain_http)?;
        if let Some(d) = self.dial() {
            dial_target(d)?;
            if url
                .host_str()
                .is_none_or(|h| !h.eq_ignore_ascii_case(domain))
            {
                return Err(CubeError::new(
                    ErrorKind::InvalidArgument,
                    format!(
                        "proxy_url.url '{}' must name the sandbox domain '{domain}' (e.g. https://{domain}) when dial is set",
                        self.url()
                    ),
                ));
            }
        }
        Ok(())
    }
}

impl From<&str> for ProxyUrl {
    fn from(s: &str) -> Self {
        Self::Url(s.to_string())
    }
}

/// Split a dial address `host:port` (port defaults to 443).
fn dial_target(d: &str) -> Result<(String, u16)> {
    let bad = || {
        CubeError::new(
            ErrorKind::InvalidArgument,
            format!("proxy dial address '{d}' is not host:port"),
        )
    };
    if let Ok(sa) = d.parse::<std::net::SocketAddr>() {
        return Ok((sa.ip().to_string(), sa.port()));
    }
    if let Ok(ip) = d.parse::<IpAddr>() {
        return Ok((ip.to_string(), 443));
    }
    let (host, port) = match d.rsplit_once(':') {
        Some((h, p)) => (h, p.parse::<u16>().map_err(|_| bad())?),
        None => (d, 443),
    };
    if host.is_empty()
        || !host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
    {
        return Err(bad());
    }
    Ok((host.to_string(), port))
}

/// Resolves `<port>-<id>.<domain>` (the data-plane hosts) to the proxy's
/// dial address; every other name as usual.
struct DialResolver {
    domain: String,
    host: String,
    port: u16,
}

impl DialResolver {
    fn is_sandbox_host(&self, name: &str) -> bool {
        name.len() > self.domain.len() + 1
            && name
                .get(name.len() - self.domain.len()..)
                .is_some_and(|d| d.eq_ignore_ascii_case(&self.domain))
            && name.as_bytes().get(name.len() - self.domain.len() - 1) == Some(&b'.')
            && name
                .get(..name.len() - self.domain.len() - 1)
                .and_then(|label| label.split_once('-'))
                .is_some_and(|(port, id)| {
                    !port.is_empty()
                        && port.bytes().all(|b| b.is_ascii_digit())
                        && super::wire::valid_id(id)
                })
    }
}

impl reqwest::dns::Resolve for DialResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let (host, port) = if self.is_sandbox_host(name.as_str()) {
            (self.host.clone(), self.port)
        } else {
            (name.as_str().to_string(), 0)
        };
        Box::pin(async move {
            let addrs: Vec<std::net::SocketAddr> = tokio::net::lookup_host((host.as_str(), port))
                .await?
                .collect();
            let addrs: reqwest::dns::Addrs = Box::new(addrs.into_iter());
            Ok(addrs)
        })
    }
}

/// How to reach one backend.
#[derive(Debug, Clone)]
pub struct BackendConfig {
    pub name: String,
    /// CubeAPI base URL, e.g. `https://cube.example:3000`.
    pub api_url: String,
    /// CubeProxy: where the data plane is sent. Real CubeAPI serves no data
    /// plane, so a configured backend must name it (`config check` says so);
    /// only the embedded backend, which serves both on one address, leaves
    /// it to default to `api_url`.
    pub proxy_url: Option<ProxyUrl>,
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

/// The answer of [`CubeClient::reachability`]: each error names its side.
#[derive(Debug, Clone)]
pub struct Reachability {
    pub cube_api: Result<()>,
    pub cube_proxy: Result<()>,
}

impl Reachability {
    pub fn ok(&self) -> bool {
        self.cube_api.is_ok() && self.cube_proxy.is_ok()
    }

    /// `None` when both answer, else which one(s) did not, for a status line:
    /// `CubeAPI: …; CubeProxy unreachable: …`.
    pub fn problem(&self) -> Option<String> {
        let v: Vec<String> = [&self.cube_api, &self.cube_proxy]
            .into_iter()
            .filter_map(|r| r.as_ref().err().map(|e| e.message.clone()))
            .collect();
        (!v.is_empty()).then(|| v.join("; "))
    }
}

/// What the data plane needs to address one sandbox.
#[derive(Debug, Clone)]
pub struct SandboxAddr {
    pub id: String,
    pub domain: String,
    pub traffic_token: Option<Secret>,
    /// envd's version as CubeAPI reported it (`envdVersion`); `None`: a
    /// current one. Older envds get the SDK's fallbacks (see `EnvdVersion`).
    pub envd_version: Option<String>,
}

impl SandboxAddr {
    /// What this sandbox's envd can do.
    pub fn envd(&self) -> EnvdVersion {
        EnvdVersion::parse(self.envd_version.as_deref())
    }
}

pub use super::wire::EnvdVersion;

/// A client for one backend. Cheap to clone.
#[derive(Clone)]
pub struct CubeClient {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) cfg: BackendConfig,
    pub(crate) api: reqwest::Url,
    pub(crate) proxy: reqwest::Url,
    /// The URL carries the sandbox host and the connection goes to the
    /// proxy's dial address.
    pub(crate) dial: bool,
    /// Control-plane and unary calls: per-call budgets, no read timeout.
    pub(crate) http: reqwest::Client,
    /// Streams and downloads: a read (stall) timeout of `stream_idle`.
    pub(crate) stream_http: reqwest::Client,
    /// `X-API-Key` for CubeAPI only: CubeProxy forwards every header to envd
    /// inside the sandbox, where root could read it.
    api_key: Option<reqwest::header::HeaderValue>,
    /// Failed calls by `ErrorKind` (not `not_found`: an ordinary answer),
    /// for `cube_adapter_backend_errors_total`.
    pub(crate) errors: crate::metrics::Family<1, crate::metrics::Counter>,
    /// Real calls' outcomes, for the health watch (passive health).
    pub(crate) outcomes: Outcomes,
}

/// What the backend's real calls found: when one was last answered, and
/// how many have failed in a row since (no answer, a timeout, a 5xx or
/// something that is not the protocol).
#[derive(Debug)]
pub(crate) struct Outcomes {
    born: std::time::Instant,
    /// Milliseconds from `born` to the last answer, plus one (0: none yet).
    answered_at: std::sync::atomic::AtomicU64,
    failed_in_a_row: std::sync::atomic::AtomicU32,
}

impl Outcomes {
    fn new() -> Self {
        Self {
            born: std::time::Instant::now(),
            answered_at: std::sync::atomic::AtomicU64::new(0),
            failed_in_a_row: std::sync::atomic::AtomicU32::new(0),
        }
    }

    fn record(&self, kind: Option<ErrorKind>) {
        use std::sync::atomic::Ordering;
        let failed = matches!(
            kind,
            Some(
                ErrorKind::Unavailable
                    | ErrorKind::Timeout
                    | ErrorKind::Internal
                    | ErrorKind::Protocol
            )
        );
        if failed {
            self.failed_in_a_row.fetch_add(1, Ordering::AcqRel);
        } else {
            let ms = u64::try_from(self.born.elapsed().as_millis()).unwrap_or(u64::MAX - 1);
            self.answered_at.store(ms + 1, Ordering::Release);
            self.failed_in_a_row.store(0, Ordering::Release);
        }
    }
}

/// Real calls that fail one after another before a backend whose health
/// probe fails no longer counts as serving (`CubeClient::serving`).
pub const FAILED_IN_A_ROW: u32 = 3;

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
            Some(p) => {
                p.check(&cfg.domain, cfg.insecure_plain_http)?;
                parse_base("proxy_url", p.url(), cfg.insecure_plain_http)?
            }
            None => api.clone(),
        };
        let resolver = match cfg.proxy_url.as_ref().and_then(ProxyUrl::dial) {
            Some(d) => {
                let (host, port) = dial_target(d)?;
                Some(Arc::new(DialResolver {
                    domain: cfg.domain.clone(),
                    host,
                    port,
                }))
            }
            None => None,
        };
        let dial = resolver.is_some();
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
        let api_key = match &cfg.api_key {
            Some(k) => {
                let mut v = reqwest::header::HeaderValue::from_str(k.expose()).map_err(|_| {
                    CubeError::new(
                        ErrorKind::InvalidArgument,
                        "api key contains invalid characters",
                    )
                })?;
                v.set_sensitive(true);
                Some(v)
            }
            None => None,
        };
        let build = |read_timeout: Option<Duration>| {
            let mut builder = reqwest::Client::builder();
            if let Some(r) = &resolver {
                builder = builder.dns_resolver(r.clone());
            }
            if let Some(t) = read_timeout {
                builder = builder.read_timeout(t);
            }
            builder
                .tls_backend_preconfigured(tls.clone())
                .http1_only()
                .no_proxy()
                .redirect(reqwest::redirect::Policy::none())
                .connect_timeout(cfg.timeouts.connect)
                .pool_idle_timeout(Duration::from_secs(60))
                .tcp_nodelay(true)
                .user_agent(concat!("cube-adapter/", env!("CARGO_PKG_VERSION")))
                .build()
                .map_err(|e| {
                    CubeError::new(
                        ErrorKind::InvalidArgument,
                        format!("backend {}: {e}", cfg.name),
                    )
                })
        };
        let http = build(None)?;
        let stream_http = build(Some(cfg.timeouts.stream_idle))?;
        Ok(Self {
            inner: Arc::new(Inner {
                cfg,
                api,
                proxy,
                dial,
                http,
                stream_http,
                api_key,
                errors: crate::metrics::Family::with_capacity(crate::metrics::Counter::default, 16),
                outcomes: Outcomes::new(),
            }),
        })
    }

    /// Count a failed call (`cube_adapter_backend_errors_total{kind}`);
    /// `not_found` is an ordinary answer and not counted.
    pub(crate) fn count<T>(&self, r: Result<T>) -> Result<T> {
        self.inner.outcomes.record(r.as_ref().err().map(|e| e.kind));
        if let Err(e) = &r
            && e.kind != ErrorKind::NotFound
        {
            self.inner.errors.inc([e.kind.as_str()]);
        }
        r
    }

    /// Whether its real calls are being answered: one was answered within
    /// `within`, and fewer than `FAILED_IN_A_ROW` have failed since (a
    /// backend whose calls complete is busy, not down, however slow its
    /// health probe).
    pub fn serving(&self, within: Duration) -> bool {
        use std::sync::atomic::Ordering;
        let o = &self.inner.outcomes;
        let at = o.answered_at.load(Ordering::Acquire);
        at != 0
            && o.born
                .elapsed()
                .saturating_sub(Duration::from_millis(at - 1))
                <= within
            && o.failed_in_a_row.load(Ordering::Acquire) < FAILED_IN_A_ROW
    }

    /// Failed calls so far, by kind.
    pub fn errors(&self) -> Vec<(String, u64)> {
        let mut v: Vec<(String, u64)> = self
            .inner
            .errors
            .iter()
            .map(|(k, c)| (k.join(""), c.get()))
            .collect();
        v.sort();
        v
    }

    /// The URL checks [`CubeClient::new`] makes, for `config check`.
    pub fn check_urls(
        api_url: &str,
        proxy: &ProxyUrl,
        domain: &str,
        insecure_plain_http: bool,
    ) -> Result<()> {
        parse_base("api_url", api_url, insecure_plain_http)?;
        proxy.check(domain, insecure_plain_http)
    }

    pub fn config(&self) -> &BackendConfig {
        &self.inner.cfg
    }

    /// A control-plane (CubeAPI) request: the only kind that carries the key.
    fn api_request(&self, method: Method, url: reqwest::Url) -> reqwest::RequestBuilder {
        let req = self.inner.http.request(method, url);
        match &self.inner.api_key {
            Some(k) => req.header("x-api-key", k.clone()),
            None => req,
        }
    }

    fn url(&self, path: &str) -> Result<reqwest::Url> {
        self.inner
            .api
            .join(path)
            .map_err(|e| CubeError::protocol(format!("bad path {path}: {e}")))
    }

    /// Send one control-plane request and read the whole answer; a non-2xx
    /// answer is an error. An idempotent call answered 503 or 429 with
    /// `Retry-After: <seconds>` is sent again, at most `retries` times and
    /// `retry_total` of waiting in all.
    async fn exchange(
        &self,
        method: Method,
        url: reqwest::Url,
        body: Option<Vec<u8>>,
        timeout: Duration,
        what: &str,
        idem: Idempotent,
    ) -> Result<(StatusCode, bytes::Bytes)> {
        let r = self
            .exchange_once(method, url, body, timeout, what, idem)
            .await;
        self.count(r)
    }

    async fn exchange_once(
        &self,
        method: Method,
        url: reqwest::Url,
        body: Option<Vec<u8>>,
        timeout: Duration,
        what: &str,
        idem: Idempotent,
    ) -> Result<(StatusCode, bytes::Bytes)> {
        let t = &self.inner.cfg.timeouts;
        let mut waited = Duration::ZERO;
        let mut attempt = 0u32;
        loop {
            let mut req = self
                .api_request(method.clone(), url.clone())
                .timeout(timeout);
            if let Some(b) = &body {
                req = req
                    .header(reqwest::header::CONTENT_TYPE, "application/json")
                    .body(b.clone());
            }
            let resp = req
                .send()
                .await
                .map_err(|e| CubeError::from_reqwest(what, e))?;
            let status = resp.status();
            let wait = retry_after(&resp);
            let bytes = resp
                .bytes()
                .await
                .map_err(|e| CubeError::from_reqwest(what, e))?;
            if status.is_success() {
                return Ok((status, bytes));
            }
            let retryable = idem == Idempotent::Yes
                && matches!(
                    status,
                    StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS
                );
            match wait {
                Some(w) if retryable && attempt < t.retries && waited + w <= t.retry_total => {
                    attempt += 1;
                    waited += w;
                    tracing::debug!(
                        what,
                        status = status.as_u16(),
                        wait_ms = w.as_millis() as u64,
                        attempt,
                        "retrying after Retry-After"
                    );
                    tokio::time::sleep(w).await;
                }
                _ => return Err(api_error(what, status, &bytes)),
            }
        }
    }

    async fn call<B: Serialize, T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
        timeout: Duration,
        what: &str,
    ) -> Result<(StatusCode, Option<T>)> {
        let idem = if method == Method::GET || method == Method::DELETE {
            Idempotent::Yes
        } else {
            Idempotent::No
        };
        self.call_with(method, path, body, timeout, what, idem)
            .await
    }

    async fn call_with<B: Serialize, T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
        timeout: Duration,
        what: &str,
        idem: Idempotent,
    ) -> Result<(StatusCode, Option<T>)> {
        let body = match body {
            Some(b) => Some(
                serde_json::to_vec(b).map_err(|e| CubeError::protocol(format!("{what}: {e}")))?,
            ),
            None => None,
        };
        let (status, bytes) = self
            .exchange(method, self.url(path)?, body, timeout, what, idem)
            .await?;
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

    /// A call whose answer, if any, is not needed.
    async fn call_empty<B: Serialize>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
        timeout: Duration,
        what: &str,
        idem: Idempotent,
    ) -> Result<()> {
        self.call_with::<B, serde_json::Value>(method, path, body, timeout, what, idem)
            .await
            .map(|_| ())
    }

    fn t(&self) -> Duration {
        self.inner.cfg.timeouts.request
    }

    /// `GET /health`.
    pub async fn health(&self) -> Result<()> {
        // A probe reports at once: no Retry-After waits.
        self.call_empty::<()>(
            Method::GET,
            "/health",
            None,
            self.t(),
            "health",
            Idempotent::No,
        )
        .await
    }

    /// Whether CubeProxy answers: `GET /health` with
    /// `Host: 49983-probe.<domain>`, a sandbox that does not exist, so that a
    /// real CubeProxy answers with its own error. Any HTTP answer counts
    /// (the status is returned); only a transport failure is an error.
    pub async fn probe_proxy(&self) -> Result<u16> {
        let host = format!("{}-probe.{}", super::wire::ENVD_PORT, self.inner.cfg.domain);
        let resp = self
            .proxy_request(Method::GET, &host, "/health", false)?
            .timeout(self.t())
            .send()
            .await
            .map_err(|e| CubeError::from_reqwest("CubeProxy unreachable", e))?;
        Ok(resp.status().as_u16())
    }

    /// Which of CubeAPI and CubeProxy can be reached, checked side by side.
    pub async fn reachability(&self) -> Reachability {
        // A probe reports at once: no Retry-After waits. Its errors name
        // CubeAPI, whether it could not be reached or answered an error.
        let api = async {
            self.exchange(
                Method::GET,
                self.url("/health")?,
                None,
                self.t(),
                "CubeAPI",
                Idempotent::No,
            )
            .await
            .map(|_| ())
        };
        let (api, proxy) = tokio::join!(api, self.probe_proxy());
        Reachability {
            cube_api: api,
            cube_proxy: proxy.map(|_| ()),
        }
    }

    /// `POST /sandboxes`. Keep `trafficAccessToken` from the answer: it is
    /// never returned again.
    pub async fn create(&self, req: &CreateSandbox) -> Result<Sandbox> {
        let mut s: Sandbox = self
            .call_json(
                Method::POST,
                "/sandboxes",
                Some(req),
                self.inner.cfg.timeouts.create,
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
        let (_, bytes) = self
            .exchange(
                Method::GET,
                url,
                None,
                self.t(),
                "list sandboxes",
                Idempotent::Yes,
            )
            .await?;
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
            Idempotent::Yes,
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
            Idempotent::Yes,
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
            Idempotent::Yes,
        )
        .await
    }

    pub async fn pause(&self, id: &str) -> Result<()> {
        check_id(id)?;
        self.call_empty(
            Method::POST,
            &format!("/sandboxes/{id}/pause"),
            Some(&serde_json::json!({})),
            self.inner.cfg.timeouts.pause,
            "pause",
            Idempotent::No,
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
                self.inner.cfg.timeouts.pause,
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
            self.inner.cfg.timeouts.snapshot,
            "create snapshot",
        )
        .await
    }

    pub async fn list_snapshots(&self, sandbox_id: Option<&str>) -> Result<Vec<SnapshotInfo>> {
        let mut url = self.url("/snapshots")?;
        if let Some(s) = sandbox_id {
            url.query_pairs_mut().append_pair("sandboxID", s);
        }
        let (_, bytes) = self
            .exchange(
                Method::GET,
                url,
                None,
                self.t(),
                "list snapshots",
                Idempotent::Yes,
            )
            .await?;
        serde_json::from_slice(&bytes)
            .map_err(|e| CubeError::protocol(format!("list snapshots: invalid response: {e}")))
    }

    /// Snapshots are deleted through the templates route, where a real
    /// CubeAPI deletes a *template* given a template's id: anything but a
    /// snapshot id (`snap-` + hex) is refused before it is sent.
    pub async fn delete_snapshot(&self, snapshot_id: &str) -> Result<()> {
        check_id(snapshot_id)?;
        if !is_snapshot_id(snapshot_id) {
            return Err(CubeError::new(
                ErrorKind::InvalidArgument,
                format!("'{snapshot_id}' is not a snapshot id (snap-…); not deleting it"),
            ));
        }
        self.call_empty::<()>(
            Method::DELETE,
            &format!("/templates/{snapshot_id}"),
            None,
            self.inner.cfg.timeouts.snapshot,
            "delete snapshot",
            Idempotent::Yes,
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
            self.inner.cfg.timeouts.snapshot,
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

    /// `POST /volumes`: 201 `{volumeID, name, token}`. An empty name lets
    /// the server pick the ID.
    pub async fn create_volume(&self, req: &CreateVolume) -> Result<Volume> {
        let v: Volume = self
            .call_json(
                Method::POST,
                "/volumes",
                Some(req),
                self.t(),
                "create volume",
            )
            .await?;
        if !super::wire::valid_volume_id(&v.volume_id) {
            return Err(CubeError::protocol(
                "create volume: invalid volumeID in response",
            ));
        }
        Ok(v)
    }

    /// `GET /volumes/{id}`.
    pub async fn get_volume(&self, id: &str) -> Result<Volume> {
        check_volume_id(id)?;
        self.call_json::<(), _>(
            Method::GET,
            &format!("/volumes/{id}"),
            None,
            self.t(),
            "get volume",
        )
        .await
    }

    /// `DELETE /volumes/{id}`: a missing volume is a `NotFound` error.
    pub async fn delete_volume(&self, id: &str) -> Result<()> {
        check_volume_id(id)?;
        self.call_empty::<()>(
            Method::DELETE,
            &format!("/volumes/{id}"),
            None,
            self.t(),
            "delete volume",
            Idempotent::Yes,
        )
        .await
    }

    /// `GET /volumes` (the list carries no tokens: each `token` is "").
    pub async fn list_volumes(&self) -> Result<Vec<Volume>> {
        self.call_json::<(), _>(Method::GET, "/volumes", None, self.t(), "list volumes")
            .await
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
            envd_version: Some(s.envd_version.clone()).filter(|v| !v.is_empty()),
        }
    }
}

/// `Retry-After` in seconds (the only form CubeAPI and CubeProxy send).
fn retry_after(resp: &reqwest::Response) -> Option<Duration> {
    resp.headers()
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()
        .map(Duration::from_secs)
}

/// A CubeSandbox snapshot id: `snap-` and hex digits (CubeMaster makes 24).
pub fn is_snapshot_id(id: &str) -> bool {
    id.strip_prefix("snap-")
        .is_some_and(|h| !h.is_empty() && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Sandbox and snapshot ids are `[A-Za-z0-9-]`: never let one rewrite a path.
fn check_id(id: &str) -> Result<()> {
    if super::wire::valid_id(id) {
        Ok(())
    } else {
        Err(CubeError::new(ErrorKind::InvalidArgument, "invalid id"))
    }
}

/// Volume ids are `[A-Za-z0-9_-]`, 1 to 128: never let one rewrite a path.
fn check_volume_id(id: &str) -> Result<()> {
    if super::wire::valid_volume_id(id) {
        Ok(())
    } else {
        Err(CubeError::new(
            ErrorKind::InvalidArgument,
            "invalid volume id",
        ))
    }
}

/// Turn a non-2xx answer into a typed error, reading CubeAPI's
/// `{"code","message"}`, CubeProxy's `{"error"}` or a Connect `{"code": "…"}`.
pub(crate) fn api_error(what: &str, status: StatusCode, body: &[u8]) -> CubeError {
    if let Ok(e) = serde_json::from_slice::<ApiErrorBody>(body) {
        // CubeAPI passes CubeMaster's "not found" (an unknown template or
        // snapshot on create) on as a 500; newer builds answer 404.
        if status == StatusCode::INTERNAL_SERVER_ERROR && e.message.contains("130404") {
            return CubeError::new(ErrorKind::NotFound, format!("{what}: {}", e.message));
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dial_targets() {
        assert_eq!(
            dial_target("10.0.0.5:8443").unwrap(),
            ("10.0.0.5".into(), 8443)
        );
        assert_eq!(dial_target("10.0.0.5").unwrap(), ("10.0.0.5".into(), 443));
        assert_eq!(dial_target("[::1]:9").unwrap(), ("::1".into(), 9));
        assert_eq!(
            dial_target("proxy.example").unwrap(),
            ("proxy.example".into(), 443)
        );
        assert!(dial_target("proxy.example:x").is_err());
        assert!(dial_target("a/b:1").is_err());
    }

    #[test]
    fn only_sandbox_hosts_are_sent_to_the_dial_address() {
        let r = DialResolver {
            domain: "cube.app".into(),
            host: "10.0.0.5".into(),
            port: 443,
        };
        assert!(r.is_sandbox_host("49983-abc123.cube.app"));
        assert!(r.is_sandbox_host("49983-probe.CUBE.app"));
        assert!(!r.is_sandbox_host("cube.app"));
        assert!(!r.is_sandbox_host("api.cube.app"));
        assert!(!r.is_sandbox_host("49983-abc.evilcube.app"));
        assert!(!r.is_sandbox_host("49983-a.b.cube.app"));
        assert!(!r.is_sandbox_host("x-abc.cube.app"));
    }

    #[test]
    fn budgets_cover_the_server_route_budgets() {
        let t = Timeouts::default();
        assert!(t.create > Duration::from_secs(30));
        assert!(t.pause > Duration::from_secs(120));
        assert!(t.snapshot > Duration::from_secs(240));
    }
}
