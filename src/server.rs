//! Serving an axum router on a bound TCP listener, over TLS (handshake per
//! connection, under a timeout, never in the accept loop) or plain HTTP,
//! within [`Limits`]:
//!
//! - a connection must bring a complete request head within the header-read
//!   timeout (counted from the end of the handshake for the first request,
//!   from the request's first byte for the next ones) and its next request
//!   within the idle timeout; a silent or trickling client is dropped. A
//!   connection with a request being answered (an event stream, a long exec)
//!   is never idle. hyper's own `header_read_timeout` is not used: hyper
//!   1.x restarts it as soon as a keep-alive connection goes idle, which
//!   would make it the idle timeout too;
//! - a request body that stalls (no data for the body-read timeout while a
//!   handler waits for it) fails the request and closes the connection;
//! - connections are capped in total and per source address. Over a cap a
//!   connection is still accepted into a small reserve ([`HEALTH_RESERVE`],
//!   the oldest evicted first) and served one request, `/healthz` or
//!   `/readyz` only, under [`OVER_CAP_DEADLINE`]: health checks open a
//!   fresh connection for each probe and are answered at the cap, while
//!   anything else over the cap is answered 503 `connection_limit` with
//!   `Retry-After` and closed. Descriptors stay bounded: caps plus the
//!   reserve.
//!
//! At shutdown the listener closes, every open connection is asked to end
//! gracefully (requests in progress finish; idle keep-alive connections
//! close) and `serve` waits for them for at most [`DRAIN_TIMEOUT`]; what is
//! still open then (an event stream, a stuck client) is dropped.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes, HttpBody};
use axum::http::{Method, Request, Response};
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;

/// How long a client may take to finish the TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long shutdown waits for open connections to finish.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections over a cap served at the same time (health checks only);
/// a newer one evicts the oldest.
pub const HEALTH_RESERVE: usize = 16;

/// How long a connection over a cap may take for its handshake, its one
/// request and the answer.
pub const OVER_CAP_DEADLINE: Duration = Duration::from_secs(5);

/// How long an idle connection being closed may take to close cleanly (TLS
/// close_notify) before it is dropped.
const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// Limits on one listener's connections.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    /// Open connections at most (all addresses).
    pub max_total: usize,
    /// Open connections at most from one source address (loopback exempt).
    pub max_per_address: usize,
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
    /// None: a body may stall for as long as its handler waits.
    pub body_read_timeout: Option<Duration>,
}

impl Limits {
    /// The appliance's listener, as configured.
    pub fn from_config(c: &crate::config::ConnectionsSection) -> Self {
        Self {
            max_total: c.max_total,
            max_per_address: c.max_per_address.min(c.max_total),
            header_read_timeout: Duration::from_secs(c.header_read_timeout_seconds),
            idle_timeout: Duration::from_secs(c.idle_timeout_seconds),
            body_read_timeout: Some(Duration::from_secs(c.body_read_timeout_seconds)),
        }
    }

    /// A sandbox backend's listener (the embedded one on loopback, or
    /// `backend serve`): its clients are brokers with many long streams
    /// from one address, so no caps and no body timeout; the idle timeout
    /// outlasts the broker's pool (60 s), so the client closes first.
    pub fn backend() -> Self {
        Self {
            max_total: usize::MAX,
            max_per_address: usize::MAX,
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(120),
            body_read_timeout: None,
        }
    }

    /// At most half the process's open-file limit goes to client
    /// connections (the rest: the store, sandboxes' pipes and terminals,
    /// backend connections); a larger `max_total` is lowered, with a warning.
    fn fit_to_open_files(mut self) -> Self {
        if self.max_total == usize::MAX {
            return self;
        }
        let Ok((soft, _)) =
            nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        else {
            return self;
        };
        let usable = usize::try_from(soft / 2)
            .unwrap_or(usize::MAX)
            .saturating_sub(HEALTH_RESERVE)
            .max(1);
        if self.max_total > usable {
            tracing::warn!(
                configured = self.max_total,
                open_files = soft,
                "connections.max_total lowered to {usable}, half the open-file limit \
                 (raise LimitNOFILE to allow more)"
            );
            self.max_total = usable;
            self.max_per_address = self.max_per_address.min(usable);
        }
        self
    }
}

/// Accept connections until `shutdown` resolves, within [`Limits::backend`].
pub async fn serve(
    listener: TcpListener,
    app: Router,
    tls: Option<Arc<rustls::ServerConfig>>,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    serve_with_limits(listener, app, tls, Limits::backend(), None, shutdown).await
}

/// Who a client's certificate chain stands for, judged after the
/// handshake (`tls::ClientTrust`); None: none.
pub type PeerJudge = Arc<
    dyn Fn(&[rustls_pki_types::CertificateDer<'_>]) -> Option<crate::auth::PeerCert> + Send + Sync,
>;

/// What every connection task shares.
struct Shared {
    app: Router,
    acceptor: Option<tokio_rustls::TlsAcceptor>,
    limits: Limits,
    /// Judges client certificates; without it, a certificate the handshake
    /// verified identifies by its SHA-256.
    judge: Option<PeerJudge>,
    /// Cancelled at shutdown: connections end gracefully.
    drain: CancellationToken,
}

/// Accept connections until `shutdown` resolves.
pub async fn serve_with_limits(
    listener: TcpListener,
    app: Router,
    tls: Option<Arc<rustls::ServerConfig>>,
    limits: Limits,
    judge: Option<PeerJudge>,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let limits = limits.fit_to_open_files();
    let slots = Arc::new(Slots::new(limits.max_total, limits.max_per_address));
    let shared = Arc::new(Shared {
        app,
        acceptor: tls.map(tokio_rustls::TlsAcceptor::from),
        limits,
        judge,
        drain: CancellationToken::new(),
    });
    // Every connection task, in its handshake or serving; what is still
    // open when the drain times out is dropped.
    let tasks = tokio_util::task::TaskTracker::new();
    let cancel = CancellationToken::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let slot = slots.claim(peer.ip());
        tasks.spawn(cancel.clone().run_until_cancelled_owned(connection(
            stream,
            peer,
            slot,
            shared.clone(),
        )));
    }
    drop(listener);
    tasks.close();
    let open = slots.open();
    shared.drain.cancel();
    let drained = tokio::time::timeout(DRAIN_TIMEOUT, tasks.wait()).await;
    if drained.is_err() {
        tracing::warn!(
            open,
            "connections still open {}s after shutdown began; closing them",
            DRAIN_TIMEOUT.as_secs()
        );
        cancel.cancel();
        tasks.wait().await;
    } else if open > 0 {
        tracing::info!(open, "open connections drained");
    }
    Ok(())
}

/// One connection, from the handshake to its end; its slot is given back
/// when it ends (or is dropped).
async fn connection(stream: TcpStream, peer: SocketAddr, slot: Slot, shared: Arc<Shared>) {
    match &slot {
        Slot::Regular { .. } => handle(stream, peer, false, &shared).await,
        Slot::OverCap { evicted, .. } => {
            tokio::select! {
                r = tokio::time::timeout(OVER_CAP_DEADLINE, handle(stream, peer, true, &shared)) => {
                    if r.is_err() {
                        tracing::debug!(%peer, "over-cap connection timed out");
                    }
                }
                () = evicted.cancelled() => {
                    tracing::debug!(%peer, "over-cap connection evicted by a newer one");
                }
            }
        }
    }
    drop(slot);
}

async fn handle(stream: TcpStream, peer: SocketAddr, over_cap: bool, shared: &Shared) {
    let Some(acceptor) = &shared.acceptor else {
        return drive(stream, peer, None, over_cap, shared).await;
    };
    let tls = tokio::select! {
        r = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)) => match r {
            Ok(Ok(tls)) => tls,
            Ok(Err(e)) => {
                tracing::debug!(%peer, error = %e, "TLS handshake failed");
                return;
            }
            Err(_) => {
                tracing::debug!(%peer, "TLS handshake timed out");
                return;
            }
        },
        () = shared.drain.cancelled() => return,
    };
    // A client certificate, for the handlers: judged, or (verified by the
    // handshake) by its SHA-256.
    let chain = tls.get_ref().1.peer_certificates().unwrap_or_default();
    let peer_cert = match &shared.judge {
        Some(judge) => judge(chain),
        None => chain.first().map(|c| {
            use sha2::Digest;
            crate::auth::PeerCert::own(sha2::Sha256::digest(c.as_ref()).into())
        }),
    };
    drive(tls, peer, peer_cert, over_cap, shared).await
}

/// Serve HTTP on an established connection until it ends, times out (a
/// request head too slow, or idle too long) or shutdown drains it.
async fn drive<I>(
    io: I,
    peer: SocketAddr,
    peer_cert: Option<crate::auth::PeerCert>,
    over_cap: bool,
    shared: &Shared,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let activity = Arc::new(Activity::new());
    let io = Tracked {
        io,
        activity: activity.clone(),
    };
    let service = {
        let app = shared.app.clone();
        let activity = activity.clone();
        let body_timeout = shared.limits.body_read_timeout;
        hyper::service::service_fn(move |req| {
            answer(
                app.clone(),
                req,
                peer,
                peer_cert.clone(),
                over_cap,
                body_timeout,
                activity.clone(),
            )
        })
    };
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    // Over a cap: one request, then close.
    builder
        .http1()
        .header_read_timeout(None)
        .keep_alive(!over_cap);
    let conn = builder.serve_connection_with_upgrades(TokioIo::new(io), service);
    tokio::pin!(conn);
    let watch = activity.expiry(&shared.limits);
    tokio::pin!(watch);
    let mut closing = false;
    let mut grace: Option<Pin<Box<Sleep>>> = None;
    let result = loop {
        tokio::select! {
            r = conn.as_mut() => break r,
            why = &mut watch, if !closing => match why {
                Expired::Head => {
                    tracing::debug!(%peer, "no complete request head in time; connection dropped");
                    return;
                }
                Expired::Idle => {
                    tracing::debug!(%peer, "idle connection closed");
                    conn.as_mut().graceful_shutdown();
                    closing = true;
                    grace = Some(Box::pin(tokio::time::sleep(CLOSE_GRACE)));
                }
            },
            () = shared.drain.cancelled(), if !closing => {
                conn.as_mut().graceful_shutdown();
                closing = true;
            }
            () = async {
                match grace.as_mut() {
                    Some(g) => g.await,
                    None => std::future::pending().await,
                }
            } => return,
        }
    };
    if let Err(e) = result {
        tracing::debug!(%peer, error = %e, "connection ended with an error");
    }
}

/// The answer to a request on a connection over a cap that is not a health
/// check: 503 `connection_limit` with `Retry-After` (both from the code's
/// catalogue entry, through the API's one error envelope), and the
/// connection closes (keep-alive is off over a cap).
fn over_cap_answer(in_flight: InFlight) -> Response<Answer> {
    use axum::response::IntoResponse;
    let mut r = crate::api::ApiError(
        crate::broker::Error::new(
            crate::broker::Code::ConnectionLimit,
            "too many open connections (from this address, or in all); only /healthz and /readyz are answered until some close",
        ),
        None,
    )
    .into_response();
    r.headers_mut().insert(
        axum::http::header::CACHE_CONTROL,
        axum::http::HeaderValue::from_static("no-store"),
    );
    r.map(|body| Answer {
        body,
        _in_flight: in_flight,
    })
}

fn is_health(req: &Request<Incoming>) -> bool {
    matches!(*req.method(), Method::GET | Method::HEAD)
        && matches!(req.uri().path(), "/healthz" | "/readyz")
}

/// One request through the router: it counts as in flight until its
/// response body is done (or dropped).
async fn answer(
    app: Router,
    mut req: Request<Incoming>,
    peer: SocketAddr,
    peer_cert: Option<crate::auth::PeerCert>,
    over_cap: bool,
    body_timeout: Option<Duration>,
    activity: Arc<Activity>,
) -> Result<Response<Answer>, std::convert::Infallible> {
    let in_flight = InFlight::begin(activity);
    if over_cap && !is_health(&req) {
        return Ok(over_cap_answer(in_flight));
    }
    if let Some(pc) = peer_cert {
        req.extensions_mut().insert(pc);
    }
    req.extensions_mut()
        .insert(crate::auth::Source::new(peer.ip()));
    let req = req.map(|body| match body_timeout {
        Some(limit) => Body::new(Stall {
            body,
            limit,
            deadline: None,
            armed: false,
        }),
        None => Body::new(body),
    });
    let resp = match tower::ServiceExt::oneshot(app, req).await {
        Ok(r) => r,
        Err(never) => match never {},
    };
    Ok(resp.map(|body| Answer {
        body,
        _in_flight: in_flight,
    }))
}

/// What a connection is doing, for its timeouts: requests in flight, since
/// when it has been idle, and when the next request's first byte came.
struct Activity {
    phase: Mutex<Phase>,
    changed: Notify,
    /// Whether the next byte read starts a request head (nothing in flight
    /// and no head arriving): a hint read without the lock, so that reads
    /// within a request or a head do not take it. Written under the lock.
    watching: AtomicBool,
}

struct Phase {
    in_flight: usize,
    /// The end of the handshake, or of the last answer.
    idle_since: Instant,
    /// The first byte read while idle: a request head is arriving.
    head_since: Option<Instant>,
    /// A request was received on this connection.
    served: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expired {
    /// No complete request head within the header-read timeout.
    Head,
    /// No request within the idle timeout.
    Idle,
}

impl Activity {
    fn new() -> Self {
        Self {
            phase: Mutex::new(Phase {
                in_flight: 0,
                idle_since: Instant::now(),
                head_since: None,
                served: false,
            }),
            changed: Notify::new(),
            watching: AtomicBool::new(true),
        }
    }

    fn phase(&self) -> MutexGuard<'_, Phase> {
        self.phase.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn bytes_read(&self) {
        if !self.watching.load(AtomicOrdering::Acquire) {
            return;
        }
        let mut p = self.phase();
        if p.in_flight == 0 && p.head_since.is_none() {
            p.head_since = Some(Instant::now());
            self.watching.store(false, AtomicOrdering::Release);
            drop(p);
            self.changed.notify_one();
        }
    }

    /// The next deadline and what it means; none while a request is in
    /// flight.
    fn deadline(&self, limits: &Limits) -> Option<(Instant, Expired)> {
        let p = self.phase();
        if p.in_flight > 0 {
            return None;
        }
        let (from, after, why) = match (p.served, p.head_since) {
            // The first request: its head within the header-read timeout
            // of the handshake, however it trickles in.
            (false, _) => (p.idle_since, limits.header_read_timeout, Expired::Head),
            (true, Some(t)) => (t, limits.header_read_timeout, Expired::Head),
            (true, None) => (p.idle_since, limits.idle_timeout, Expired::Idle),
        };
        from.checked_add(after).map(|at| (at, why))
    }

    /// Resolves when a deadline passes with nothing in flight.
    async fn expiry(&self, limits: &Limits) -> Expired {
        loop {
            match self.deadline(limits) {
                None => self.changed.notified().await,
                Some((at, why)) => tokio::select! {
                    biased;
                    () = self.changed.notified() => {}
                    () = tokio::time::sleep_until(at) => return why,
                },
            }
        }
    }
}

/// A request in flight on a connection, until dropped.
struct InFlight(Arc<Activity>);

impl InFlight {
    fn begin(activity: Arc<Activity>) -> Self {
        {
            let mut p = activity.phase();
            p.in_flight += 1;
            p.head_since = None;
            p.served = true;
            activity.watching.store(false, AtomicOrdering::Release);
        }
        activity.changed.notify_one();
        Self(activity)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        {
            let mut p = self.0.phase();
            p.in_flight = p.in_flight.saturating_sub(1);
            if p.in_flight == 0 {
                p.idle_since = Instant::now();
                // `begin` cleared `head_since`: the next byte starts a head.
                self.0.watching.store(true, AtomicOrdering::Release);
            }
        }
        self.0.changed.notify_one();
    }
}

/// The connection's (decrypted) byte stream, noting when bytes arrive.
struct Tracked<I> {
    io: I,
    activity: Arc<Activity>,
}

impl<I: AsyncRead + Unpin> AsyncRead for Tracked<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.io).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.bytes_read();
        }
        r
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Tracked<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// A response body that keeps its request in flight until it is done.
struct Answer {
    body: Body,
    _in_flight: InFlight,
}

impl HttpBody for Answer {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A request body that fails when a handler waits `limit` for its next
/// piece. The clock runs only while a handler waits: time spent before
/// the handler reads (authentication, queues) does not count.
struct Stall {
    body: Incoming,
    limit: Duration,
    /// One timer for the whole body, reset each time the handler starts
    /// waiting.
    deadline: Option<Pin<Box<Sleep>>>,
    /// Whether `deadline` times the current wait.
    armed: bool,
}

/// A request body that stalled.
#[derive(Debug)]
struct BodyStalled(Duration);

impl std::fmt::Display for BodyStalled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "no request body data for {}s", self.0.as_secs())
    }
}

impl std::error::Error for BodyStalled {}

impl HttpBody for Stall {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        match Pin::new(&mut this.body).poll_frame(cx) {
            Poll::Ready(r) => {
                this.armed = false;
                Poll::Ready(r.map(|r| r.map_err(Into::into)))
            }
            Poll::Pending => {
                let limit = this.limit;
                let at = Instant::now() + limit;
                let deadline = this
                    .deadline
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at)));
                if !this.armed {
                    deadline.as_mut().reset(at);
                    this.armed = true;
                }
                if deadline.as_mut().poll(cx).is_ready() {
                    this.armed = false;
                    return Poll::Ready(Some(Err(BodyStalled(limit).into())));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// Open connections by cap: regular ones (total and per address), and the
/// over-cap reserve.
struct Slots {
    max_total: usize,
    max_per_address: usize,
    table: Mutex<SlotTable>,
}

#[derive(Default)]
struct SlotTable {
    total: usize,
    per_address: HashMap<IpAddr, usize>,
    /// Over-cap connections, oldest first, with what evicts them.
    over_cap: VecDeque<(u64, CancellationToken)>,
    next_id: u64,
    last_warning: Option<Instant>,
}

/// A connection's place under the caps, given back on drop.
enum Slot {
    Regular {
        slots: Arc<Slots>,
        address: Option<IpAddr>,
    },
    OverCap {
        slots: Arc<Slots>,
        id: u64,
        evicted: CancellationToken,
    },
}

/// `Strict-Transport-Security` of every HTTPS answer (#34 L9): a year,
/// this host only (no `includeSubDomains`: the appliance's name may share
/// a domain with hosts it does not speak for; no `preload`).
pub const HSTS: &str = "max-age=31536000";

/// Adds [`HSTS`] to an answer served over TLS (layered only there).
pub async fn hsts(mut r: axum::response::Response) -> axum::response::Response {
    r.headers_mut().insert(
        axum::http::header::STRICT_TRANSPORT_SECURITY,
        axum::http::HeaderValue::from_static(HSTS),
    );
    r
}

/// How often "connection limit reached" is logged at most.
const CAP_WARNING_EVERY: Duration = Duration::from_secs(60);

/// The address a per-address cap counts: IPv4 (an IPv4-mapped IPv6 address
/// too), an IPv6 client's /64 (one subscriber's share), none for loopback
/// (every local client is 127.0.0.1: the total cap covers them).
fn address_key(ip: IpAddr) -> Option<IpAddr> {
    let ip = match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        },
        v4 => v4,
    };
    if ip.is_loopback() {
        return None;
    }
    Some(match ip {
        IpAddr::V6(v6) => {
            let [a, b, c, d, ..] = v6.segments();
            IpAddr::V6(Ipv6Addr::new(a, b, c, d, 0, 0, 0, 0))
        }
        v4 => v4,
    })
}

impl Slots {
    fn new(max_total: usize, max_per_address: usize) -> Self {
        Self {
            max_total,
            max_per_address,
            table: Mutex::new(SlotTable::default()),
        }
    }

    fn table(&self) -> MutexGuard<'_, SlotTable> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A regular slot if both caps allow, else a place in the over-cap
    /// reserve (evicting its oldest connection when it is full).
    fn claim(self: &Arc<Self>, ip: IpAddr) -> Slot {
        let address = address_key(ip);
        let mut t = self.table();
        let from_address = address
            .and_then(|a| t.per_address.get(&a).copied())
            .unwrap_or(0);
        if t.total < self.max_total && from_address < self.max_per_address {
            t.total += 1;
            if let Some(a) = address {
                *t.per_address.entry(a).or_default() += 1;
            }
            return Slot::Regular {
                slots: self.clone(),
                address,
            };
        }
        let now = Instant::now();
        if t.last_warning
            .is_none_or(|w| now.duration_since(w) >= CAP_WARNING_EVERY)
        {
            t.last_warning = Some(now);
            if t.total >= self.max_total {
                tracing::warn!(
                    open = t.total,
                    "connection limit reached (connections.max_total); \
                     new connections get /healthz and /readyz only"
                );
            } else {
                tracing::warn!(
                    address = %ip,
                    open = from_address,
                    "connection limit reached for an address (connections.max_per_address); \
                     its new connections get /healthz and /readyz only"
                );
            }
        }
        if t.over_cap.len() >= HEALTH_RESERVE
            && let Some((_, oldest)) = t.over_cap.pop_front()
        {
            oldest.cancel();
        }
        t.next_id += 1;
        let id = t.next_id;
        let evicted = CancellationToken::new();
        t.over_cap.push_back((id, evicted.clone()));
        Slot::OverCap {
            slots: self.clone(),
            id,
            evicted,
        }
    }

    /// Connections open, regular and over a cap.
    fn open(&self) -> usize {
        let t = self.table();
        t.total + t.over_cap.len()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        match self {
            Slot::Regular { slots, address } => {
                let mut t = slots.table();
                t.total = t.total.saturating_sub(1);
                if let Some(a) = address
                    && let Some(n) = t.per_address.get_mut(a)
                {
                    *n = n.saturating_sub(1);
                    if *n == 0 {
                        t.per_address.remove(a);
                    }
                }
            }
            Slot::OverCap { slots, id, .. } => {
                let mut t = slots.table();
                t.over_cap.retain(|(i, _)| i != id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// At shutdown a request in progress still gets its answer, new
    /// connections are refused, and `serve` returns once it is drained.
    #[tokio::test]
    async fn shutdown_drains_requests_in_progress() {
        let finished = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let f = finished.clone();
        let app = Router::new().route(
            "/slow",
            axum::routing::get(move || async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                f.store(true, std::sync::atomic::Ordering::SeqCst);
                "done"
            }),
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, app, None, async move {
            let _ = rx.await;
        }));
        crate::tls::install_default_provider();
        let http = reqwest::Client::new();
        let inflight = tokio::spawn({
            let http = http.clone();
            async move { http.get(format!("http://{addr}/slow")).send().await }
        });
        // Shut down once the request is in the handler.
        tokio::time::sleep(Duration::from_millis(100)).await;
        tx.send(()).unwrap();
        server.await.unwrap().unwrap();
        assert!(
            finished.load(std::sync::atomic::Ordering::SeqCst),
            "serve returned before the request in progress was answered"
        );
        let r = inflight.await.unwrap().unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.text().await.unwrap(), "done");
        assert!(
            tokio::net::TcpStream::connect(addr).await.is_err(),
            "the listener outlived serve"
        );
    }

    fn limits(ms: u64) -> Limits {
        Limits {
            max_total: 100,
            max_per_address: 100,
            header_read_timeout: Duration::from_millis(ms),
            idle_timeout: Duration::from_millis(ms),
            body_read_timeout: Some(Duration::from_millis(ms)),
        }
    }

    /// Plain HTTP on 127.0.0.1 within `limits`; stopped on drop of the sender.
    async fn start(app: Router, limits: Limits) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(serve_with_limits(
            listener,
            app,
            None,
            limits,
            None,
            async move {
                let _ = rx.await;
            },
        ));
        (addr, tx)
    }

    /// Read until the peer closes; what came (an error counts as closed).
    async fn read_to_close(s: &mut TcpStream) -> String {
        use tokio::io::AsyncReadExt;
        let mut out = vec![];
        let _ = s.read_to_end(&mut out).await;
        String::from_utf8_lossy(&out).into_owned()
    }

    /// An answer that streams for longer than the idle and header timeouts
    /// is not cut; once it is done the keep-alive connection is closed
    /// after the idle timeout.
    #[tokio::test]
    async fn idle_timeout_spares_answers_in_progress() {
        use tokio::io::AsyncWriteExt;
        let app = Router::new().route(
            "/stream",
            axum::routing::get(|| async {
                let chunks = futures_util::stream::unfold(0u32, |i| async move {
                    if i == 6 {
                        return None;
                    }
                    tokio::time::sleep(Duration::from_millis(150)).await;
                    Some((Ok::<_, std::io::Error>(format!("chunk{i};")), i + 1))
                });
                Body::from_stream(chunks)
            }),
        );
        let (addr, _stop) = start(app, limits(300)).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let t0 = Instant::now();
        let got = read_to_close(&mut s).await;
        for i in 0..6 {
            assert!(got.contains(&format!("chunk{i};")), "{got}");
        }
        // The stream took ~900 ms; the connection closed after it, idle.
        assert!(t0.elapsed() >= Duration::from_millis(900), "{got}");
        assert!(t0.elapsed() < Duration::from_secs(10));
    }

    /// A client that sends nothing, or trickles its request head, is
    /// dropped after the header-read timeout; a body that stalls fails.
    #[tokio::test]
    async fn silent_trickling_and_stalled_clients_are_dropped() {
        use tokio::io::AsyncWriteExt;
        let app = Router::new().route(
            "/echo",
            axum::routing::post(|body: Bytes| async move { body }),
        );
        let (addr, _stop) = start(app, limits(400)).await;
        let mut silent = TcpStream::connect(addr).await.unwrap();
        let t0 = Instant::now();
        assert_eq!(read_to_close(&mut silent).await, "");
        assert!(t0.elapsed() >= Duration::from_millis(400));

        let mut trickle = TcpStream::connect(addr).await.unwrap();
        let t0 = Instant::now();
        let mut closed = false;
        for line in [
            "GET / HTTP/1.1\r\n",
            "a: b\r\n",
            "c: d\r\n",
            "e: f\r\n",
            "g: h\r\n",
        ] {
            if trickle.write_all(line.as_bytes()).await.is_err() {
                closed = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        assert!(closed || read_to_close(&mut trickle).await.is_empty());
        assert!(t0.elapsed() < Duration::from_secs(10));

        let mut stalled = TcpStream::connect(addr).await.unwrap();
        stalled
            .write_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\nabc")
            .await
            .unwrap();
        let got = read_to_close(&mut stalled).await;
        assert!(got.starts_with("HTTP/1.1 4"), "{got}");
    }

    #[test]
    fn caps_per_address_and_total_with_a_reserve() {
        let slots = Arc::new(Slots::new(3, 2));
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        let regular = |s: &Slot| matches!(s, Slot::Regular { .. });
        let a1 = slots.claim(a);
        let a2 = slots.claim(a);
        let a3 = slots.claim(a);
        assert!(regular(&a1) && regular(&a2));
        assert!(!regular(&a3), "over the per-address cap");
        let b1 = slots.claim(b);
        assert!(regular(&b1));
        assert!(!regular(&slots.claim(b)), "over the total cap");
        drop(a1);
        // Loopback counts toward the total only.
        let l1 = slots.claim(lo);
        assert!(regular(&l1));
        drop((a2, b1, l1));
        let l: Vec<Slot> = (0..3).map(|_| slots.claim(lo)).collect();
        assert!(l.iter().all(regular));
        // The reserve: the oldest over-cap connection is evicted.
        let over: Vec<Slot> = (0..=HEALTH_RESERVE).map(|_| slots.claim(lo)).collect();
        let evicted = |s: &Slot| match s {
            Slot::OverCap { evicted, .. } => evicted.is_cancelled(),
            Slot::Regular { .. } => panic!("regular"),
        };
        assert!(evicted(&over[0]));
        assert!(over[1..].iter().all(|s| !evicted(s)));
        assert_eq!(slots.open(), 3 + HEALTH_RESERVE);
        drop(a3);
        drop((l, over));
        assert_eq!(slots.open(), 0);
        assert!(slots.table().per_address.is_empty());
    }

    #[test]
    fn address_keys() {
        let k = |s: &str| address_key(s.parse().unwrap());
        assert_eq!(k("10.1.2.3"), Some("10.1.2.3".parse().unwrap()));
        assert_eq!(k("::ffff:10.1.2.3"), Some("10.1.2.3".parse().unwrap()));
        assert_eq!(k("2001:db8:1:2:3:4:5:6"), k("2001:db8:1:2:ffff::1"));
        assert_ne!(k("2001:db8:1:2::1"), k("2001:db8:1:3::1"));
        assert_eq!(k("127.0.0.5"), None);
        assert_eq!(k("::1"), None);
        assert_eq!(k("::ffff:127.0.0.1"), None);
    }
}
