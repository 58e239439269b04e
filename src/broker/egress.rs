//! The egress proxy (issue #39): how a lease's sandbox reaches the
//! destinations its profile names (`config::egress`), by name, with the
//! credentials the appliance holds added on the way.
//!
//! **Where it listens.** On the embedded backend, nowhere on the host: each
//! sandbox's agent listens on `127.0.0.1:3128` inside the sandbox's own
//! network namespace and hands every connection to the appliance over the
//! sandbox's `egress.sock` (`cube_embedded::egress_tap`). The connection
//! arrives already tied to its lease: the sandbox presents no token.
//!
//! **What it speaks.** HTTP/1.1 proxy requests: `CONNECT HOST:PORT` (a
//! tunnel, or with a credential marked `intercept`, TLS ended here with a
//! certificate of the egress CA and each request inside forwarded like a
//! plain one) and absolute-form `http://` requests, forwarded with the
//! hop-by-hop and `Proxy-*` headers dropped and the credential's header set
//! (replacing one the sandbox sent). Anything else is refused.
//!
//! **What it checks, in order.** The lease is live and its profile has
//! egress; the lease's request rate (`requests_per_second`, refused with
//! 429 and counted, never journaled, so a flood cannot fill the journal);
//! the destination is one the profile names (and the lease was not narrowed
//! away from); the lease's byte budget; the name resolves (the operator's
//! `[egress.resolve]` first) to an address that is public, unless the
//! operator named the address. Each refusal after the rate check is one
//! `rejected` event with a digest of the destination (its name could carry
//! data out).
//!
//! **What it records.** Each allowed request or tunnel is an
//! `egress_request` intent (the destination in clear, the method) committed
//! before the proxy connects, and an outcome with the status, the bytes
//! both ways and the duration. Never a header, a path, a body or a secret.
//! `/metrics` counts requests by profile and result, and bytes by
//! direction.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, header};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use super::{Broker, Code, Error};
use crate::audit::Intent;
use crate::audit::event::{Action, Event, Outcome};
use crate::config::egress::normal_host;
use crate::config::{Credential, EgressSection, ProfileEgress};
use crate::store::leases::{Lease, LeaseState};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type ProxyBody = BoxBody<Bytes, BoxError>;

/// How long resolving and connecting to a destination may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a sandbox may take to send a request's head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(30);
/// Where a sandbox finds the proxy's network listener, with its lease's
/// token (`[egress] listen`): `http_proxy=…` lines, for `set -a; .
/// FILE` or a tool's own setting.
pub const ENV_FILE: &str = "/run/cube-adapter/egress.env";
/// How long a tunnel may carry nothing either way before it is closed.
const TUNNEL_IDLE: Duration = Duration::from_secs(300);
/// How long a destination may take to answer a forwarded request's head.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a sandbox may take to finish its TLS with the proxy.
const TLS_ACCEPT_TIMEOUT: Duration = Duration::from_secs(30);
/// Open proxy connections at most, all leases and the network listener
/// together; and per lease.
const MAX_CONNS: usize = 1024;
const MAX_CONNS_PER_LEASE: usize = 64;
/// The largest request head (and buffer) the proxy reads.
const MAX_HEAD: usize = 64 * 1024;
/// How often the taps of live leases are checked (a restart, a new lease).
const WATCH_EVERY: Duration = Duration::from_secs(2);

/// The proxy's state in the broker: each lease's rate and bytes, the
/// taps this process holds, and the TLS of intercepted destinations.
pub struct Egress {
    traffic: Mutex<HashMap<String, Arc<Traffic>>>,
    /// Open connections, all together.
    conns: Arc<tokio::sync::Semaphore>,
    /// Cancelled when the appliance stops: open tunnels and connections
    /// end, each request recording its outcome, before the drain.
    stop: std::sync::OnceLock<tokio_util::sync::CancellationToken>,
    taps: Mutex<HashMap<String, tokio::task::AbortHandle>>,
    pub metrics: crate::metrics::Egress,
    /// The egress CA (`STATE/egress`), set once at start.
    ca: std::sync::OnceLock<crate::tls::LocalCa>,
    /// A server configuration per intercepted name, its certificate from
    /// the egress CA (issued on first use, kept while this process runs).
    leaves: Mutex<HashMap<String, Arc<rustls::ServerConfig>>>,
    /// The client configuration for intercepted destinations: the public
    /// roots and `[egress] upstream_ca_file`'s, for that file.
    upstream: Mutex<Option<(Option<PathBuf>, Arc<rustls::ClientConfig>)>>,
}

impl Default for Egress {
    fn default() -> Self {
        Self {
            traffic: Mutex::default(),
            conns: Arc::new(tokio::sync::Semaphore::new(MAX_CONNS)),
            stop: std::sync::OnceLock::new(),
            taps: Mutex::default(),
            metrics: crate::metrics::Egress::default(),
            ca: std::sync::OnceLock::new(),
            leaves: Mutex::default(),
            upstream: Mutex::default(),
        }
    }
}

impl std::fmt::Debug for Egress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Egress")
            .field("metrics", &self.metrics)
            .finish_non_exhaustive()
    }
}

/// The most intercepted names whose certificates are kept (past it, they
/// are issued again as needed).
const LEAF_CACHE_MAX: usize = 4096;

/// One lease's use of the proxy.
#[derive(Debug)]
struct Traffic {
    /// Tokens left and when they were counted.
    bucket: Mutex<(f64, Instant)>,
    bytes: AtomicU64,
    /// Its open connections.
    conns: Arc<tokio::sync::Semaphore>,
}

impl Traffic {
    fn new() -> Self {
        Self {
            bucket: Mutex::new((f64::MAX, Instant::now())),
            bytes: AtomicU64::new(0),
            conns: Arc::new(tokio::sync::Semaphore::new(MAX_CONNS_PER_LEASE)),
        }
    }

    /// Take a request's token: a bucket of `rps`, refilled at `rps` a second.
    fn admit(&self, rps: u32) -> bool {
        let mut b = self.bucket.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let cap = f64::from(rps);
        let refill = now.duration_since(b.1).as_secs_f64() * cap;
        b.0 = (b.0 + refill).min(cap);
        b.1 = now;
        if b.0 >= 1.0 {
            b.0 -= 1.0;
            true
        } else {
            false
        }
    }

    /// Count `n` bytes; false once the lease is past `max`.
    fn take(&self, n: u64, max: u64) -> bool {
        self.bytes.fetch_add(n, Ordering::Relaxed).saturating_add(n) <= max
    }

    fn spent(&self, max: u64) -> bool {
        self.bytes.load(Ordering::Relaxed) >= max
    }
}

impl Egress {
    fn traffic(&self, lease_ref: &str) -> Arc<Traffic> {
        let mut m = self.traffic.lock().unwrap_or_else(|p| p.into_inner());
        m.entry(lease_ref.to_string())
            .or_insert_with(|| Arc::new(Traffic::new()))
            .clone()
    }

    fn stopping(&self) -> tokio_util::sync::CancellationToken {
        self.stop.get().cloned().unwrap_or_default()
    }

    /// Give the proxy its CA (once, at start).
    pub fn set_ca(&self, ca: crate::tls::LocalCa) {
        let _ = self.ca.set(ca);
    }

    /// The egress CA's certificate (PEM), if set.
    pub fn ca_pem(&self) -> Option<&str> {
        self.ca.get().map(|c| c.cert_pem.as_str())
    }

    /// The TLS server configuration the proxy presents for `host`.
    fn leaf(&self, host: &str) -> Result<Arc<rustls::ServerConfig>, Refusal> {
        let failed = |why: String| {
            tracing::error!(host, error = %why, "the egress CA cannot issue a certificate");
            refusal(
                Code::EgressUpstreamFailed,
                "the appliance cannot make a certificate for this destination",
            )
        };
        {
            let m = self.leaves.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(c) = m.get(host) {
                return Ok(c.clone());
            }
        }
        let ca = self.ca.get().ok_or_else(|| failed("no egress CA".into()))?;
        let (cert, key) = ca
            .issue_server(&[host.to_string()])
            .map_err(|e| failed(e.to_string()))?;
        let cfg = crate::tls::server_config(cert.as_bytes(), key.as_bytes(), None)
            .map_err(|e| failed(e.to_string()))?;
        let cfg = Arc::new(cfg);
        let mut m = self.leaves.lock().unwrap_or_else(|p| p.into_inner());
        if m.len() >= LEAF_CACHE_MAX {
            m.clear();
        }
        m.insert(host.to_string(), cfg.clone());
        Ok(cfg)
    }

    /// The TLS client configuration for intercepted destinations.
    fn upstream_tls(&self, sec: &EgressSection) -> Result<Arc<rustls::ClientConfig>, Refusal> {
        let mut u = self.upstream.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((path, c)) = &*u
            && *path == sec.upstream_ca_file
        {
            return Ok(c.clone());
        }
        let mut roots = rustls::RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        };
        if let Some(f) = &sec.upstream_ca_file {
            let bad = |why: String| {
                tracing::error!(file = %f.display(), error = %why, "[egress] upstream_ca_file cannot be used");
                refusal(
                    Code::EgressUpstreamFailed,
                    "the appliance's trust for this destination is not usable ([egress] upstream_ca_file)",
                )
            };
            let pem = std::fs::read(f).map_err(|e| bad(e.to_string()))?;
            for c in crate::tls::parse_certs(&pem).map_err(|e| bad(e.to_string()))? {
                roots.add(c).map_err(|e| bad(e.to_string()))?;
            }
        }
        let mut cfg = rustls::ClientConfig::builder_with_provider(crate::tls::provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| refusal(Code::EgressUpstreamFailed, e.to_string()))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        let cfg = Arc::new(cfg);
        *u = Some((sec.upstream_ca_file.clone(), cfg.clone()));
        Ok(cfg)
    }

    /// The bytes a lease moved through the proxy (this process's count).
    pub fn bytes_of(&self, lease_ref: &str) -> u64 {
        let m = self.traffic.lock().unwrap_or_else(|p| p.into_inner());
        m.get(lease_ref)
            .map_or(0, |t| t.bytes.load(Ordering::Relaxed))
    }
}

/// A refusal or failure, as the sandbox's client gets it.
struct Refusal {
    code: Code,
    message: String,
}

impl From<Error> for Refusal {
    fn from(e: Error) -> Self {
        Self {
            code: e.code,
            message: e.message,
        }
    }
}

fn refusal(code: Code, message: impl Into<String>) -> Refusal {
    Refusal {
        code,
        message: message.into(),
    }
}

fn full(b: impl Into<Bytes>) -> ProxyBody {
    Full::new(b.into()).map_err(|e| match e {}).boxed()
}

fn answer(r: Refusal) -> Response<ProxyBody> {
    let body = serde_json::json!({"error": {"code": r.code.as_str(), "message": r.message}});
    let mut resp = Response::new(full(body.to_string()));
    *resp.status_mut() = r.code.status();
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Ok(v) = HeaderValue::from_str(r.code.as_str()) {
        h.insert("x-cube-egress-error", v);
    }
    if let Some(s) = r.code.retry_after() {
        h.insert(header::RETRY_AFTER, HeaderValue::from(s));
    }
    if r.code == Code::EgressProxyAuthRequired {
        h.insert(
            header::PROXY_AUTHENTICATE,
            HeaderValue::from_static("Basic realm=\"cube-adapter egress\""),
        );
    }
    resp
}

/// Whether a resolver's answer may be used: not the host's own networks,
/// private ranges, link-local (cloud metadata) or anything not unicast.
pub fn public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || v4.is_documentation()
                || o[0] == 0
                || (o[0] == 100 && (o[1] & 0xc0) == 64)
                || (o[0] == 192 && o[1] == 0 && o[2] == 0)
                || (o[0] == 198 && (o[1] & 0xfe) == 18)
                || o[0] >= 240)
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return public(IpAddr::V4(v4));
            }
            let s = v6.segments();
            let o = v6.octets();
            let embedded = |at: usize| {
                let b = |k: usize| o.get(at + k).copied().unwrap_or(0);
                std::net::Ipv4Addr::new(b(0), b(1), b(2), b(3))
            };
            // NAT64 (64:ff9b::/96) and 6to4 (2002::/16) carry an IPv4
            // address: judge that one. The local NAT64 range, and the
            // deprecated IPv4-compatible form, are never public.
            if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
                return public(IpAddr::V4(embedded(12)));
            }
            if s[0] == 0x2002 {
                return public(IpAddr::V4(embedded(2)));
            }
            if (s[0] == 0x64 && s[1] == 0xff9b && s[2] == 1) || s[..6] == [0; 6] {
                return false;
            }
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (s[0] & 0xfe00) == 0xfc00
                || (s[0] & 0xffc0) == 0xfe80)
        }
    }
}

/// Where a destination is: the operator's pin, the literal address, or
/// the resolver's public answers.
async fn resolve(sec: &EgressSection, host: &str, port: u16) -> Result<Vec<SocketAddr>, Refusal> {
    if let Some(ip) = sec.resolve.get(host) {
        return Ok(vec![SocketAddr::new(*ip, port)]);
    }
    if let Ok(ip) = host.parse::<IpAddr>() {
        // The profile names this address (`matches` compared it whole).
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    let found = tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::lookup_host((host, port)))
        .await
        .map_err(|_| {
            refusal(
                Code::EgressUpstreamFailed,
                format!("resolving {host} timed out"),
            )
        })?
        .map_err(|e| {
            refusal(
                Code::EgressUpstreamFailed,
                format!("cannot resolve {host}: {e}"),
            )
        })?
        .collect::<Vec<_>>();
    let ok: Vec<_> = found.iter().copied().filter(|a| public(a.ip())).collect();
    if ok.is_empty() && !found.is_empty() {
        return Err(refusal(
            Code::EgressDestinationDenied,
            format!(
                "{host} resolves only to private or local addresses (name it in [egress.resolve] to allow one)"
            ),
        ));
    }
    if ok.is_empty() {
        return Err(refusal(
            Code::EgressUpstreamFailed,
            format!("{host} has no address"),
        ));
    }
    Ok(ok)
}

async fn connect(addrs: &[SocketAddr]) -> Result<TcpStream, Refusal> {
    let mut last = String::from("no address");
    // One deadline for all the addresses together.
    let deadline = tokio::time::Instant::now() + CONNECT_TIMEOUT;
    for a in addrs {
        match tokio::time::timeout_at(deadline, TcpStream::connect(a)).await {
            Ok(Ok(s)) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Ok(Err(e)) => last = e.to_string(),
            Err(_) => last = "timed out".into(),
        }
    }
    Err(refusal(
        Code::EgressUpstreamFailed,
        format!("cannot connect: {last}"),
    ))
}

/// The header a credential sets, with its secret read now.
fn credential_header(c: &Credential) -> Result<(HeaderName, HeaderValue), Refusal> {
    let unavailable = || {
        refusal(
            Code::EgressCredentialUnavailable,
            "the destination's credential cannot be read on the appliance; the request was not sent",
        )
    };
    let raw = std::fs::read_to_string(&c.secret_file).map_err(|e| {
        tracing::warn!(file = %c.secret_file.display(), error = %e, "an egress credential's secret file cannot be read");
        unavailable()
    })?;
    let secret = raw.strip_suffix('\n').unwrap_or(&raw);
    let secret = secret.strip_suffix('\r').unwrap_or(secret);
    let (name, value) = match &c.basic_user {
        Some(user) => {
            use base64::Engine;
            let b64 = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{secret}"));
            (header::AUTHORIZATION, format!("Basic {b64}"))
        }
        None => (
            HeaderName::from_bytes(c.header.as_bytes()).map_err(|_| unavailable())?,
            format!("{}{secret}", c.prefix),
        ),
    };
    let mut v = HeaderValue::from_str(&value).map_err(|_| unavailable())?;
    v.set_sensitive(true);
    Ok((name, v))
}

/// Headers that end at the proxy (RFC 9110 §7.6.1) and the proxy's own.
fn strip_hop_by_hop(h: &mut HeaderMap) {
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        h.remove(n);
    }
    for n in [
        "connection",
        "proxy-connection",
        "keep-alive",
        "proxy-authorization",
        "proxy-authenticate",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    ] {
        h.remove(n);
    }
}

/// What one request of a sandbox is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `CONNECT HOST:PORT`.
    Connect,
    /// An absolute-form `http://` request.
    Plain,
}

/// One sandbox connection: its lease, and for one inside an intercepted
/// `CONNECT`, the destination it named.
#[derive(Clone)]
struct Conn {
    b: Broker,
    /// None: the network listener's, each request naming its lease.
    lease_ref: Option<String>,
    inner: Option<(String, u16)>,
}

/// What a connection to a destination is, plain or TLS.
trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

impl Broker {
    pub fn egress(&self) -> &Egress {
        &self.inner.egress
    }

    /// Serve one connection a lease's sandbox made to the proxy.
    pub async fn egress_serve(&self, lease_ref: String, stream: TcpStream) {
        let _ = stream.set_nodelay(true);
        let eg = &self.inner.egress;
        let Ok(all) = eg.conns.clone().try_acquire_owned() else {
            tracing::warn!(lease = %lease_ref, "egress: {MAX_CONNS} connections are open; one more is closed");
            return;
        };
        let Ok(own) = eg.traffic(&lease_ref).conns.clone().try_acquire_owned() else {
            tracing::debug!(lease = %lease_ref, "egress: the lease has {MAX_CONNS_PER_LEASE} connections open; one more is closed");
            return;
        };
        let conn = Conn {
            b: self.clone(),
            lease_ref: Some(lease_ref),
            inner: None,
        };
        conn.serve(stream).await;
        drop((all, own));
    }

    /// Serve the proxy's network listener (`[egress] listen`) until `stop`.
    pub fn spawn_egress_listener(
        &self,
        listener: tokio::net::TcpListener,
        stop: tokio_util::sync::CancellationToken,
    ) {
        let b = self.clone();
        tokio::spawn(async move {
            loop {
                let (stream, _) = tokio::select! {
                    _ = stop.cancelled() => return,
                    r = listener.accept() => match r {
                        Ok(x) => x,
                        Err(e) => {
                            tracing::warn!(error = %e, "the egress listener could not accept");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            continue;
                        }
                    },
                };
                let _ = stream.set_nodelay(true);
                let Ok(permit) = b.inner.egress.conns.clone().try_acquire_owned() else {
                    tracing::warn!("egress: {MAX_CONNS} connections are open; one more is closed");
                    continue;
                };
                let conn = Conn {
                    b: b.clone(),
                    lease_ref: None,
                    inner: None,
                };
                b.inner.tracker.spawn(async move {
                    conn.serve(stream).await;
                    drop(permit);
                });
            }
        });
    }

    /// The lease a network listener's request names with its token.
    fn egress_lease_by_token(&self, headers: &HeaderMap) -> Option<String> {
        use base64::Engine;
        let v = headers.get(header::PROXY_AUTHORIZATION)?.to_str().ok()?;
        let b64 = v
            .strip_prefix("Basic ")
            .or_else(|| v.strip_prefix("basic "))?;
        let raw = base64::engine::general_purpose::STANDARD
            .decode(b64.trim())
            .ok()?;
        let text = String::from_utf8(raw).ok()?;
        let (lease_ref, token) = text.split_once(':')?;
        if !super::leases::valid_ref(lease_ref, "lease") {
            return None;
        }
        let l = self
            .inner
            .store
            .read_now(|txn| crate::store::leases::get(txn, lease_ref))
            .ok()??;
        let sealed = l.egress_token.as_ref()?;
        let want = self.inner.store.sealer.open(sealed).ok()?;
        use subtle::ConstantTimeEq;
        bool::from(want.ct_eq(token.as_bytes())).then(|| l.lease_ref.clone())
    }

    /// The audit event of a lease's sandbox's own request.
    fn egress_event(&self, action: Action, l: &Lease, method: Option<&Method>) -> Event {
        let j = &self.inner.journal;
        let mut ev = j.event(action);
        ev.tenant_digest = Some(j.digest("tenant", l.tenant.as_bytes()));
        let mut ev = super::leases::with_lease(ev, l);
        ev.method = method.map(|m| m.as_str().chars().take(16).collect());
        ev
    }

    /// Attach to the taps of live leases with egress on this process's
    /// embedded backends, until `stop`: new leases, and those of sandboxes
    /// that outlived a restart.
    pub fn spawn_egress_watch(&self, stop: tokio_util::sync::CancellationToken) {
        let _ = self.inner.egress.stop.set(stop.clone());
        let b = self.clone();
        tokio::spawn(async move {
            loop {
                b.egress_watch_pass();
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(WATCH_EVERY) => {}
                }
            }
            let taps = std::mem::take(
                &mut *b
                    .inner
                    .egress
                    .taps
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()),
            );
            for (_, t) in taps {
                t.abort();
            }
        });
    }

    pub(crate) fn egress_watch_pass(&self) {
        let leases = match self.inner.store.read_now(crate::store::leases::all) {
            Ok(l) => l,
            Err(e) => {
                tracing::debug!(error = %e, "egress watch: leases unreadable");
                return;
            }
        };
        let cfg = self.config();
        let live: HashMap<String, Lease> = leases
            .into_iter()
            .filter(|l| matches!(l.state, LeaseState::Running | LeaseState::Paused))
            .filter(|l| {
                cfg.profiles
                    .get(&l.profile)
                    .is_some_and(|p| p.egress.is_some())
            })
            .map(|l| (l.lease_ref.clone(), l))
            .collect();
        {
            let mut t = self
                .inner
                .egress
                .traffic
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            t.retain(|r, _| live.contains_key(r));
        }
        let mut taps = self
            .inner
            .egress
            .taps
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        taps.retain(|r, h| {
            let keep = live.contains_key(r) && !h.is_finished();
            if !keep {
                h.abort();
            }
            keep
        });
        for (r, l) in live {
            if taps.contains_key(&r) {
                continue;
            }
            let Some(path) = self.egress_socket(&l) else {
                continue;
            };
            if !path.exists() {
                continue;
            }
            let b = self.clone();
            let h = tokio::spawn(async move {
                let mut rx = match crate::embedded::egress_tap::attach(&path).await {
                    Ok(rx) => rx,
                    Err(e) => {
                        tracing::debug!(lease = %r, error = %e, "cannot attach to a sandbox's egress tap");
                        return;
                    }
                };
                while let Some(stream) = rx.recv().await {
                    let b2 = b.clone();
                    let r2 = r.clone();
                    b.inner
                        .tracker
                        .spawn(async move { b2.egress_serve(r2, stream).await });
                }
            });
            taps.insert(l.lease_ref.clone(), h.abort_handle());
        }
    }

    /// What every command, job and PTY of a lease with egress gets in its
    /// environment: the proxy (`http_proxy` and its companions, as most
    /// tools read them), and `no_proxy` for the sandbox's own loopback.
    /// Inside an embedded sandbox's own network, `127.0.0.1:3128`; else
    /// the network listener with the lease's token. Empty without egress.
    pub(crate) fn egress_env(&self, l: &Lease) -> std::collections::BTreeMap<String, String> {
        let mut env = std::collections::BTreeMap::new();
        let cfg = self.config();
        if cfg
            .profiles
            .get(&l.profile)
            .is_none_or(|p| p.egress.is_none())
        {
            return env;
        }
        let embedded = self
            .inner
            .backends
            .get(&l.backend)
            .is_some_and(|b| b.embedded_state_dir().is_some());
        let url = match (&l.egress_token, cfg.egress.advertised()) {
            (Some(sealed), Some(at)) if !embedded => match self.inner.store.sealer.open(sealed) {
                Ok(t) => format!(
                    "http://{}:{}@{at}",
                    l.lease_ref,
                    String::from_utf8_lossy(&t)
                ),
                Err(_) => return env,
            },
            _ if embedded => format!(
                "http://127.0.0.1:{}",
                crate::embedded::wire::EGRESS_PROXY_PORT
            ),
            _ => return env,
        };
        for k in ["http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"] {
            env.insert(k.to_string(), url.clone());
        }
        for k in ["no_proxy", "NO_PROXY"] {
            env.insert(k.to_string(), "localhost,127.0.0.1,::1".to_string());
        }
        env
    }

    /// For the proxy's network listener: a new lease's token, sealed, and
    /// the sandbox's `ENV_FILE` naming the proxy with it
    /// (`http://LEASE:TOKEN@HOST:PORT`). The caller kills the sandbox on an
    /// error.
    pub(crate) async fn write_egress_env(
        &self,
        cube: &crate::cube::CubeClient,
        sb: &crate::cube::SandboxAddr,
        lease_ref: &str,
        at: &str,
    ) -> Result<String, Error> {
        let token = crate::ids::random_hex(32);
        let sealed = self
            .inner
            .store
            .sealer
            .seal(token.as_bytes())
            .map_err(|_| Error::new(Code::ExecutionFailed, "the sandbox could not be recorded"))?;
        let url = format!("http://{lease_ref}:{token}@{at}");
        let text = format!(
            "# cube-adapter: the egress proxy of lease {lease_ref}\nhttp_proxy={url}\nhttps_proxy={url}\nHTTP_PROXY={url}\nHTTPS_PROXY={url}\n"
        );
        cube.upload(sb, ENV_FILE, text.into_bytes())
            .await
            .map_err(|e| {
                tracing::warn!(error = %e, "the egress proxy's address could not be written in a new sandbox");
                Error::new(
                    Code::ExecutionFailed,
                    "the sandbox's egress proxy settings could not be written",
                )
            })?;
        Ok(sealed)
    }

    /// A live lease's egress destinations (`only` none): the profile's,
    /// less those an operator narrowed away. With `only`, narrow them to
    /// those entries first (each one the lease has now, as the profile
    /// writes it; none: no egress at all), recorded as `egress_narrow` in
    /// the same transaction. Requests already past their check (an open
    /// tunnel) run to their end.
    pub async fn egress_destinations(
        &self,
        lease_ref: &str,
        only: Option<Vec<String>>,
    ) -> Result<Vec<String>, Error> {
        self.egress_narrow_as(None, lease_ref, only).await
    }

    /// [`Broker::egress_destinations`] for a person of the console: an
    /// admin only (`admin_required`), named in the event by a digest.
    pub async fn egress_narrow(
        &self,
        p: &crate::auth::Principal,
        lease_ref: &str,
        only: Vec<String>,
    ) -> Result<Vec<String>, Error> {
        if !p.is_admin() {
            return Err(Error::new(
                Code::AdminRequired,
                "narrowing a lease's egress is for admins",
            ));
        }
        self.egress_narrow_as(Some(p), lease_ref, Some(only)).await
    }

    async fn egress_narrow_as(
        &self,
        by: Option<&crate::auth::Principal>,
        lease_ref: &str,
        only: Option<Vec<String>>,
    ) -> Result<Vec<String>, Error> {
        let missing = || Error::new(Code::LeaseNotFound, format!("no live lease {lease_ref}"));
        let l = self
            .get_lease(lease_ref)
            .await?
            .filter(|l| matches!(l.state, LeaseState::Running | LeaseState::Paused))
            .ok_or_else(missing)?;
        let cfg = self.config();
        let Some(eg) = cfg.profiles.get(&l.profile).and_then(|p| p.egress.clone()) else {
            return Err(Error::new(
                Code::InvalidRequest,
                format!("lease {lease_ref}: its profile {} has no egress", l.profile),
            ));
        };
        let now: Vec<String> = eg
            .destinations
            .iter()
            .filter(|d| l.egress_only.as_ref().is_none_or(|o| o.contains(d)))
            .cloned()
            .collect();
        let Some(only) = only else {
            return Ok(now);
        };
        if let Some(d) = only.iter().find(|d| !now.contains(d)) {
            return Err(Error::new(
                Code::InvalidRequest,
                format!(
                    "{d:?} is not one of the lease's destinations (it has: {}); a lease's destinations can only be narrowed",
                    if now.is_empty() {
                        "none".to_string()
                    } else {
                        now.join(", ")
                    }
                ),
            ));
        }
        let kept: Vec<String> = now.iter().filter(|d| only.contains(d)).cloned().collect();
        let j = &self.inner.journal;
        let mut ev = self.egress_event(Action::EgressNarrow, &l, None);
        // The operator's socket is root's; a person of the console is named.
        ev.identity_digest = by.map(|p| j.digest("identity", p.identity_key().as_bytes()));
        ev.phase = crate::audit::event::Phase::Event;
        ev.outcome = Outcome::Ok;
        ev.parameters_digest = Some(j.digest("egress_destinations", kept.join("\n").as_bytes()));
        // The entries left, as the profile writes them (the operator's
        // names; a list too long for a field is kept as its digest).
        ev.destination = Some(kept.join(" "));
        let r = lease_ref.to_string();
        let k2 = kept.clone();
        j.check()?;
        self.inner
            .store
            .write(move |txn, chain| {
                let Some(mut l) = crate::store::leases::get(txn, &r)? else {
                    return Ok(());
                };
                // A narrowing that committed meanwhile stays narrowed.
                let k2 = match &l.egress_only {
                    Some(o) => k2.into_iter().filter(|d| o.contains(d)).collect(),
                    None => k2,
                };
                l.egress_only = Some(k2);
                crate::store::leases::put(txn, &l)?;
                chain.append(txn, ev)?;
                Ok(())
            })
            .await?;
        Ok(kept)
    }

    /// The egress socket of a lease's sandbox, on an embedded backend of
    /// this process.
    fn egress_socket(&self, l: &Lease) -> Option<PathBuf> {
        let be = self.inner.backends.get(&l.backend)?;
        let dir = be.embedded_state_dir()?;
        Some(crate::embedded::egress_tap::egress_socket(
            dir,
            &l.sandbox_id,
        ))
    }
}

impl Conn {
    /// Serve a connection's requests (with upgrades: `CONNECT`).
    async fn serve<I: Io + 'static>(self, io: I) {
        let conn_stop = self.b.inner.egress.stopping();
        let conn = self;
        let svc = hyper::service::service_fn(move |req| {
            let conn = conn.clone();
            async move { Ok::<_, Infallible>(conn.handle(req).await) }
        });
        let stop = conn_stop;
        let served = hyper::server::conn::http1::Builder::new()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(HEAD_TIMEOUT)
            .max_buf_size(MAX_HEAD)
            .serve_connection(TokioIo::new(io), svc)
            .with_upgrades();
        // At a stop the connection is dropped: a request under way records
        // its outcome as it goes (`Job`'s and `Counted`'s drop).
        tokio::select! {
            r = served => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "an egress connection ended with an error");
                }
            }
            () = stop.cancelled() => {}
        }
    }

    /// An intercepted `CONNECT`: answer 200, end the sandbox's TLS with a
    /// certificate of the egress CA for `host`, and serve the requests
    /// inside, each checked, recorded and forwarded like a plain one. No
    /// connection is made for the `CONNECT` itself.
    fn intercept(
        &self,
        req: Request<Incoming>,
        lease_ref: &str,
        host: String,
        port: u16,
    ) -> Result<Response<ProxyBody>, Refusal> {
        let tls = self.b.inner.egress.leaf(&host)?;
        let inner = Conn {
            b: self.b.clone(),
            lease_ref: Some(lease_ref.to_string()),
            inner: Some((host, port)),
        };
        self.b.inner.tracker.spawn(async move {
            let Ok(up) = hyper::upgrade::on(req).await else {
                return;
            };
            let accept = tokio_rustls::TlsAcceptor::from(tls).accept(TokioIo::new(up));
            match tokio::time::timeout(TLS_ACCEPT_TIMEOUT, accept)
                .await
                .unwrap_or_else(|_| Err(std::io::Error::other("timed out")))
            {
                Ok(s) => inner.serve(s).await,
                Err(e) => {
                    tracing::debug!(error = %e, "a sandbox's TLS to the egress proxy failed (does it trust the egress CA?)");
                }
            }
        });
        Ok(Response::new(full(Bytes::new())))
    }

    async fn handle(&self, req: Request<Incoming>) -> Response<ProxyBody> {
        match self.route(req).await {
            Ok(r) => r,
            Err(r) => answer(r),
        }
    }

    async fn route(&self, req: Request<Incoming>) -> Result<Response<ProxyBody>, Refusal> {
        let b = &self.b;
        let gone = || refusal(Code::EgressDestinationDenied, "the lease is gone");
        let lease_ref = match &self.lease_ref {
            Some(r) => r.clone(),
            None => b.egress_lease_by_token(req.headers()).ok_or_else(|| {
                b.inner
                    .egress
                    .metrics
                    .requests
                    .inc(["", Code::EgressProxyAuthRequired.as_str()]);
                refusal(
                    Code::EgressProxyAuthRequired,
                    "name the lease and its proxy token: http://LEASE:TOKEN@HOST:PORT (the sandbox's /run/cube-adapter/egress.env)",
                )
            })?,
        };
        let l = b
            .get_lease(&lease_ref)
            .await?
            .filter(|l| matches!(l.state, LeaseState::Running | LeaseState::Paused))
            .ok_or_else(gone)?;
        let cfg = b.config();
        let Some(eg) = cfg.profiles.get(&l.profile).and_then(|p| p.egress.clone()) else {
            return Err(refusal(
                Code::EgressDestinationDenied,
                "the lease's profile has no egress",
            ));
        };
        // A destination that echoes the request would hand the credential
        // back to the sandbox.
        if matches!(req.method().as_str(), "TRACE" | "TRACK") {
            return Err(refusal(
                Code::InvalidRequest,
                "TRACE and TRACK are not forwarded",
            ));
        }
        let kind = if req.method() == Method::CONNECT {
            Kind::Connect
        } else {
            Kind::Plain
        };
        let (host, port) = match &self.inner {
            Some((h, p)) if kind == Kind::Plain => (h.clone(), *p),
            Some(_) => {
                return Err(refusal(
                    Code::InvalidRequest,
                    "CONNECT inside an intercepted connection",
                ));
            }
            None => target(&req, kind)?,
        };
        let traffic = b.inner.egress.traffic(&l.lease_ref);
        let metrics = &b.inner.egress.metrics;
        if !traffic.admit(eg.requests_per_second) {
            metrics
                .requests
                .inc([&l.profile, Code::EgressRateLimited.as_str()]);
            return Err(refusal(
                Code::EgressRateLimited,
                format!(
                    "more than {} requests a second through the egress proxy",
                    eg.requests_per_second
                ),
            ));
        }
        let mut ev = b.egress_event(Action::EgressRequest, &l, Some(req.method()));
        let dest = format!("{host}:{port}");
        let Some(entry) = allowed(&eg, l.egress_only.as_deref(), &host, port) else {
            ev.destination_digest = Some(b.inner.journal.digest("destination", dest.as_bytes()));
            return Err(self
                .reject(
                    &l,
                    ev,
                    refusal(
                        Code::EgressDestinationDenied,
                        format!("{dest} is not a destination this lease may reach"),
                    ),
                )
                .await);
        };
        ev.destination = Some(dest.clone());
        if traffic.spent(eg.max_bytes) {
            return Err(self
                .reject(
                    &l,
                    ev,
                    refusal(
                        Code::EgressBudgetExceeded,
                        format!(
                            "the lease moved its {} bytes through the egress proxy",
                            eg.max_bytes
                        ),
                    ),
                )
                .await);
        }
        let cred = eg.credentials.get(&entry).cloned();
        if kind == Kind::Connect && cred.as_ref().is_some_and(|c| c.intercept) {
            return self.intercept(req, &l.lease_ref, host, port);
        }
        let upstream_tls = match self.inner {
            Some(_) => Some(b.inner.egress.upstream_tls(&cfg.egress)?),
            None => None,
        };
        let addrs = match resolve(&cfg.egress, &host, port).await {
            Ok(a) => a,
            Err(r) => return Err(self.reject(&l, ev, r).await),
        };
        let intent = b.inner.journal.intent(ev).await.map_err(|e| {
            metrics
                .requests
                .inc([&l.profile, Code::AuditUnavailable.as_str()]);
            Refusal::from(Error::from(e))
        })?;
        let job = Job {
            conn: self.clone(),
            profile: l.profile.clone(),
            traffic,
            max_bytes: eg.max_bytes,
            intent: Some(intent),
            moved: Arc::new(AtomicU64::new(0)),
        };
        match kind {
            Kind::Connect => job.tunnel(req, &addrs).await,
            Kind::Plain => {
                // An intercepted credential goes out over TLS only (never in
                // a plain request to the same name).
                let cred = cred.filter(|c| !c.intercept || self.inner.is_some());
                let header = match cred.as_ref().map(credential_header).transpose() {
                    Ok(h) => h,
                    Err(r) => return Err(job.fail(r).await),
                };
                job.forward(req, &addrs, &host, port, header, upstream_tls)
                    .await
            }
        }
    }

    /// Record a refusal (`rejected`) and count it.
    async fn reject(&self, l: &Lease, mut ev: Event, r: Refusal) -> Refusal {
        self.b
            .inner
            .egress
            .metrics
            .requests
            .inc([&l.profile, r.code.as_str()]);
        ev.outcome = Outcome::Rejected;
        ev.error_code = Some(r.code.as_str().to_string());
        if let Err(e) = self.b.inner.journal.record(ev).await {
            return Error::from(e).into();
        }
        r
    }
}

/// The destination of a request: `CONNECT`'s authority, or an
/// absolute-form `http://` URI's.
fn target(req: &Request<Incoming>, kind: Kind) -> Result<(String, u16), Refusal> {
    let bad = |why: &str| refusal(Code::InvalidRequest, why.to_string());
    let uri = req.uri();
    let auth = uri.authority().ok_or_else(|| {
        bad("send requests as to a proxy: CONNECT HOST:PORT, or an absolute http:// URI")
    })?;
    let port = match (kind, auth.port_u16()) {
        (_, Some(p)) => p,
        (Kind::Connect, None) => return Err(bad("CONNECT needs HOST:PORT")),
        (Kind::Plain, None) => 80,
    };
    if kind == Kind::Plain && uri.scheme_str() != Some("http") {
        return Err(bad(
            "only http:// requests are forwarded; use CONNECT for https://",
        ));
    }
    let host = auth.host();
    if host.starts_with('[') {
        return Err(refusal(
            Code::EgressDestinationDenied,
            "IPv6 destinations are not supported",
        ));
    }
    Ok((normal_host(host), port))
}

/// The profile's destination entry (as written) that allows `host:port`,
/// among those the lease was not narrowed away from.
fn allowed(eg: &ProfileEgress, only: Option<&[String]>, host: &str, port: u16) -> Option<String> {
    eg.parsed()
        .into_iter()
        .filter(|(raw, _)| only.is_none_or(|o| o.contains(raw)))
        .find(|(_, d)| d.matches(host, port))
        .map(|(raw, _)| raw)
}

/// One allowed request under its committed intent.
struct Job {
    conn: Conn,
    profile: String,
    traffic: Arc<Traffic>,
    max_bytes: u64,
    intent: Option<Intent>,
    /// Bytes of this request, both ways.
    moved: Arc<AtomicU64>,
}

impl Job {
    /// Record the outcome (once).
    async fn finish(mut self, outcome: Outcome, status: Option<u16>, code: Option<Code>) {
        if let Some(f) = self.outcome(outcome, status, code) {
            f.await;
        }
    }

    /// The outcome's write, taking the intent (none if already taken).
    fn outcome(
        &mut self,
        outcome: Outcome,
        status: Option<u16>,
        code: Option<Code>,
    ) -> Option<impl std::future::Future<Output = ()> + Send + 'static> {
        let intent = self.intent.take()?;
        let moved = self.moved.load(Ordering::Relaxed);
        let result = code.map_or_else(|| outcome.to_string(), |c| c.as_str().to_string());
        self.conn
            .b
            .inner
            .egress
            .metrics
            .requests
            .inc([&self.profile, &result]);
        let b = self.conn.b.clone();
        Some(async move {
            let r = b
                .inner
                .journal
                .outcome(
                    intent,
                    outcome,
                    move |e| {
                        e.bytes = Some(moved);
                        e.http_status = status;
                        e.error_code = code.map(|c| c.as_str().to_string());
                    },
                    |_| Ok(()),
                )
                .await;
            if let Err(e) = r {
                tracing::error!(error = %e, "an egress request's outcome could not be recorded");
            }
        })
    }

    async fn fail(self, r: Refusal) -> Refusal {
        let code = r.code;
        self.finish(code.outcome(), None, Some(code)).await;
        r
    }

    /// `CONNECT`: connect, answer 200, then carry bytes both ways.
    async fn tunnel(
        self,
        req: Request<Incoming>,
        addrs: &[SocketAddr],
    ) -> Result<Response<ProxyBody>, Refusal> {
        let upstream = match connect(addrs).await {
            Ok(s) => s,
            Err(r) => return Err(self.fail(r).await),
        };
        let tracker = self.conn.b.inner.tracker.clone();
        tracker.spawn(async move {
            let client = match hyper::upgrade::on(req).await {
                Ok(u) => TokioIo::new(u),
                Err(_) => {
                    self.finish(Outcome::Error, Some(200), Some(Code::EgressUpstreamFailed))
                        .await;
                    return;
                }
            };
            let over = self.pump(client, upstream).await;
            let code = over.then_some(Code::EgressBudgetExceeded);
            let outcome = if over { Outcome::Rejected } else { Outcome::Ok };
            self.finish(outcome, Some(200), code).await;
        });
        Ok(Response::new(full(Bytes::new())))
    }

    /// Carry bytes both ways until both ends are done or the lease's
    /// budget is spent (true then).
    async fn pump<A, B>(&self, a: A, b: B) -> bool
    where
        A: AsyncRead + AsyncWrite + Unpin,
        B: AsyncRead + AsyncWrite + Unpin,
    {
        let (mut ar, mut aw) = tokio::io::split(a);
        let (mut br, mut bw) = tokio::io::split(b);
        let out = self.copy(&mut ar, &mut bw, "out");
        let inn = self.copy(&mut br, &mut aw, "in");
        let stop = self.conn.b.inner.egress.stopping();
        tokio::select! {
            (o, i) = async { tokio::join!(out, inn) } => o || i,
            () = stop.cancelled() => false,
        }
    }

    /// Copy one way; true if stopped by the budget.
    async fn copy<R, W>(&self, r: &mut R, w: &mut W, direction: &str) -> bool
    where
        R: AsyncRead + Unpin,
        W: AsyncWrite + Unpin,
    {
        let mut buf = vec![0u8; 16 * 1024];
        let over = loop {
            // A tunnel idle both ways ends: each side's reads time out.
            let n = match tokio::time::timeout(TUNNEL_IDLE, r.read(&mut buf)).await {
                Ok(Ok(0) | Err(_)) | Err(_) => break false,
                Ok(Ok(n)) => n,
            };
            let n64 = n as u64;
            self.moved.fetch_add(n64, Ordering::Relaxed);
            self.conn
                .b
                .inner
                .egress
                .metrics
                .bytes
                .add([&self.profile, direction], n64);
            if !self.traffic.take(n64, self.max_bytes) {
                break true;
            }
            if w.write_all(buf.get(..n).unwrap_or_default()).await.is_err() {
                break false;
            }
        };
        let _ = w.shutdown().await;
        over
    }

    /// A plain request: forward it with the credential's header, stream
    /// the answer back; the outcome is recorded when the answer's body
    /// ends.
    async fn forward(
        self,
        req: Request<Incoming>,
        addrs: &[SocketAddr],
        host: &str,
        port: u16,
        credential: Option<(HeaderName, HeaderValue)>,
        tls: Option<Arc<rustls::ClientConfig>>,
    ) -> Result<Response<ProxyBody>, Refusal> {
        let tcp = match connect(addrs).await {
            Ok(s) => s,
            Err(r) => return Err(self.fail(r).await),
        };
        let upstream: Box<dyn Io> = match &tls {
            None => Box::new(tcp),
            Some(cfg) => {
                let name = match rustls_pki_types::ServerName::try_from(host.to_string()) {
                    Ok(n) => n,
                    Err(_) => {
                        return Err(self
                            .fail(refusal(Code::EgressUpstreamFailed, "not a TLS server name"))
                            .await);
                    }
                };
                match tokio_rustls::TlsConnector::from(cfg.clone())
                    .connect(name, tcp)
                    .await
                {
                    Ok(s) => Box::new(s),
                    Err(e) => {
                        return Err(self
                            .fail(refusal(
                                Code::EgressUpstreamFailed,
                                format!("TLS with the destination failed: {e}"),
                            ))
                            .await);
                    }
                }
            }
        };
        let (mut sender, driver) =
            match hyper::client::conn::http1::handshake(TokioIo::new(upstream)).await {
                Ok(x) => x,
                Err(e) => {
                    return Err(self
                        .fail(refusal(Code::EgressUpstreamFailed, e.to_string()))
                        .await);
                }
            };
        tokio::spawn(async move {
            let _ = driver.await;
        });
        let (mut parts, body) = req.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        let default_port = if tls.is_some() { 443 } else { 80 };
        let authority = if port == default_port {
            host.to_string()
        } else {
            format!("{host}:{port}")
        };
        if let Ok(v) = HeaderValue::from_str(&authority) {
            parts.headers.insert(header::HOST, v);
        }
        if let Some((n, v)) = credential {
            parts.headers.insert(n, v);
        }
        let path = parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_string();
        parts.uri = match path.parse() {
            Ok(u) => u,
            Err(_) => {
                return Err(self
                    .fail(refusal(
                        Code::InvalidRequest,
                        "the request's path is not valid",
                    ))
                    .await);
            }
        };
        parts.version = http::Version::HTTP_11;
        // The head counts toward the budget too (as sent, roughly).
        let head = parts.uri.to_string().len()
            + parts
                .headers
                .iter()
                .map(|(n, v)| n.as_str().len() + v.len() + 4)
                .sum::<usize>()
            + 16;
        let head = head as u64;
        self.moved.fetch_add(head, Ordering::Relaxed);
        if !self.traffic.take(head, self.max_bytes) {
            return Err(self
                .fail(refusal(
                    Code::EgressBudgetExceeded,
                    "the lease's egress budget is spent",
                ))
                .await);
        }
        let counted = Counted::new(body, &self, "out", None);
        let sent = tokio::time::timeout(
            ANSWER_TIMEOUT,
            sender.send_request(Request::from_parts(parts, counted.boxed())),
        )
        .await
        .map_err(|_| format!("no answer within {} s", ANSWER_TIMEOUT.as_secs()))
        .and_then(|r| r.map_err(|e| e.to_string()));
        let resp = match sent {
            Ok(r) => r,
            Err(e) => {
                let code = if self.traffic.spent(self.max_bytes) {
                    Code::EgressBudgetExceeded
                } else {
                    Code::EgressUpstreamFailed
                };
                return Err(self.fail(refusal(code, e)).await);
            }
        };
        let status = resp.status().as_u16();
        let (mut parts, body) = resp.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        let traffic = self.traffic.clone();
        let moved = self.moved.clone();
        let profile = self.profile.clone();
        let max = self.max_bytes;
        let b = self.conn.b.clone();
        let counted = Counted {
            inner: body.map_err(|e| Box::new(e) as BoxError).boxed(),
            traffic,
            moved,
            max,
            b,
            profile,
            direction: "in",
            end: Some((self, status)),
        };
        Ok(Response::from_parts(parts, counted.boxed()))
    }
}

impl Drop for Job {
    /// A request dropped under its intent (the sandbox went away while the
    /// proxy connected, or the appliance stops): it failed, and says so.
    fn drop(&mut self) {
        if let Some(f) = self.outcome(Outcome::Error, None, Some(Code::EgressUpstreamFailed)) {
            self.conn.b.inner.tracker.spawn(f);
        }
    }
}

/// A body whose bytes count toward the lease's budget, and, for an
/// answer, records its request's outcome when it ends (or is dropped).
struct Counted {
    inner: ProxyBody,
    traffic: Arc<Traffic>,
    moved: Arc<AtomicU64>,
    max: u64,
    b: Broker,
    profile: String,
    direction: &'static str,
    end: Option<(Job, u16)>,
}

impl Counted {
    fn new<B>(body: B, job: &Job, direction: &'static str, end: Option<(Job, u16)>) -> Self
    where
        B: Body<Data = Bytes> + Send + Sync + 'static,
        B::Error: Into<BoxError>,
    {
        Self {
            inner: body.map_err(Into::into).boxed(),
            traffic: job.traffic.clone(),
            moved: job.moved.clone(),
            max: job.max_bytes,
            b: job.conn.b.clone(),
            profile: job.profile.clone(),
            direction,
            end,
        }
    }

    fn settle(&mut self, outcome: Outcome, code: Option<Code>) {
        if let Some((job, status)) = self.end.take() {
            let tracker = self.b.inner.tracker.clone();
            tracker.spawn(job.finish(outcome, Some(status), code));
        }
    }
}

impl Body for Counted {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(d) = frame.data_ref() {
                    let n = d.len() as u64;
                    this.moved.fetch_add(n, Ordering::Relaxed);
                    this.b
                        .inner
                        .egress
                        .metrics
                        .bytes
                        .add([&this.profile, this.direction], n);
                    if !this.traffic.take(n, this.max) {
                        this.settle(Outcome::Rejected, Some(Code::EgressBudgetExceeded));
                        return Poll::Ready(Some(Err("the lease's egress budget is spent".into())));
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.settle(Outcome::Error, Some(Code::EgressUpstreamFailed));
                Poll::Ready(Some(Err(e)))
            }
            Poll::Ready(None) => {
                this.settle(Outcome::Ok, None);
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        // A body with nothing to read is whole; any other one dropped here
        // was cut short (the sandbox went away): what was carried counts.
        if self.inner.is_end_stream() {
            self.settle(Outcome::Ok, None);
        } else {
            self.settle(Outcome::Error, Some(Code::EgressUpstreamFailed));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_public_addresses_come_from_a_resolver() {
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "255.255.255.255",
            "224.0.0.1",
            "::1",
            "fe80::1",
            "fd00::1",
            "::ffff:10.0.0.1",
            "192.0.0.8",
            "198.18.0.1",
            "64:ff9b::a9fe:a9fe",
            "64:ff9b:1::1",
            "2002:7f00:1::1",
            "::7f00:1",
        ] {
            assert!(!public(ip.parse().unwrap()), "{ip} taken for public");
        }
        for ip in [
            "1.1.1.1",
            "93.184.216.34",
            "2606:4700::1111",
            "64:ff9b::101:101",
        ] {
            assert!(public(ip.parse().unwrap()), "{ip} taken for private");
        }
    }

    #[test]
    fn a_bucket_admits_its_rate_and_a_budget_stops() {
        let t = Traffic::new();
        let admitted = (0..10).filter(|_| t.admit(3)).count();
        assert_eq!(admitted, 3);
        assert!(t.take(10, 15));
        assert!(!t.take(10, 15));
        assert!(t.spent(15));
    }

    #[test]
    fn narrowing_leaves_only_the_named_entries() {
        let eg: ProfileEgress =
            toml::from_str(r#"destinations = ["a.test.invalid", "*.b.test.invalid:8080"]"#)
                .unwrap();
        assert_eq!(
            allowed(&eg, None, "x.b.test.invalid", 8080).as_deref(),
            Some("*.b.test.invalid:8080")
        );
        assert_eq!(allowed(&eg, None, "a.test.invalid", 8080), None);
        let only = vec!["a.test.invalid".to_string()];
        assert_eq!(allowed(&eg, Some(&only), "x.b.test.invalid", 8080), None);
        assert!(allowed(&eg, Some(&only), "a.test.invalid", 80).is_some());
    }
}
