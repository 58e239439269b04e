//! The CubeProxy part of the embedded backend: requests whose `Host` is
//! `<port>-<sandboxID>[.<domain>]` go to that sandbox's envd over its unix
//! socket; CubeProxy's errors (`{"error": "…"}`) for everything else.
//!
//! Of a sandbox's ports, envd's (`ENVD_PORT`) and the MCP gateway's
//! (`MCP_GATEWAY_PORT`) are reached; the gateway's through envd, under
//! `/_cube/port/PORT/` (`envd/ports.rs`), and only in a sandbox with a
//! network namespace of its own (`Route::own_netns`; otherwise 502).

use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;

use super::envd::MAX_UPLOAD;
use super::sandbox::{Manager, RouteError};
use crate::wire::{ENVD_PORT, MCP_GATEWAY_PORT};

/// Parse a data-plane Host: `^(\d+)-([A-Za-z0-9_-]+)(\.|:|$)`.
pub fn parse_host(host: &str) -> Option<(u16, &str)> {
    let (port, rest) = host.split_once('-')?;
    if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let port: u16 = port.parse().ok()?;
    let end = rest.find(['.', ':']).unwrap_or(rest.len());
    let id = rest.get(..end)?;
    if id.is_empty()
        || !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return None;
    }
    Some((port, id))
}

pub fn proxy_error(status: StatusCode, word: &str) -> Response {
    let mut r = (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        format!("{{\"error\":\"{word}\"}}"),
    )
        .into_response();
    if status == StatusCode::SERVICE_UNAVAILABLE {
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("2"));
    }
    r
}

fn traffic_token(h: &HeaderMap) -> Option<&str> {
    h.get("e2b-traffic-access-token")
        .or_else(|| h.get("cube-traffic-access-token"))
        .and_then(|v| v.to_str().ok())
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Headers not forwarded to envd (either way): the connection's own
/// (`envd::ports::HOP_BY_HOP`), and the data plane's credentials. `X-API-Key`
/// is among them: clients other than ours (the Python SDK) send the CubeAPI
/// key on the data plane too, and it must never reach envd inside the
/// sandbox. (A faithful stand-in forwards it, as the real CubeProxy does:
/// see `API_KEY`.)
const CREDENTIALS: &[&str] = &[
    "e2b-traffic-access-token",
    "cube-traffic-access-token",
    "x-api-key",
];

/// Every header the proxy drops.
fn dropped() -> impl Iterator<Item = &'static &'static str> {
    super::envd::ports::HOP_BY_HOP.iter().chain(CREDENTIALS)
}

const API_KEY: &str = "x-api-key";

/// One data-plane request in flight: its end (the response body finished or
/// dropped) is activity for the sandbox's idle clock, as CubeProxy stamps it
/// in its log phase.
struct InFlight {
    m: Arc<Manager>,
    id: String,
}

impl InFlight {
    fn begin(m: &Arc<Manager>, id: &str) -> Self {
        m.activity(id, true);
        Self {
            m: m.clone(),
            id: id.to_string(),
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.m.activity(&self.id, false);
    }
}

/// A response body that holds its request's `InFlight` until it ends.
struct Tracked {
    body: Body,
    _inflight: InFlight,
}

impl hyper::body::Body for Tracked {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// Forward one data-plane request.
pub async fn forward(m: &Arc<Manager>, port: u16, id: &str, mut req: Request) -> Response {
    if port != ENVD_PORT && port != MCP_GATEWAY_PORT {
        return proxy_error(StatusCode::NOT_FOUND, "not found");
    }
    if req.uri().path().starts_with("/_cube/") {
        return proxy_error(StatusCode::NOT_FOUND, "not found");
    }
    // Counted from before the route is taken, so that an idle timeout
    // checked meanwhile sees it.
    let inflight = InFlight::begin(m, id);
    let route = match m.route(id).await {
        Ok(r) => r,
        Err(RouteError::Unknown) => {
            return proxy_error(StatusCode::SERVICE_UNAVAILABLE, "service unavailable");
        }
        Err(RouteError::Paused) => {
            return proxy_error(StatusCode::SERVICE_UNAVAILABLE, "sandbox paused");
        }
        Err(RouteError::ResumeFailed) => {
            let mut r = proxy_error(StatusCode::SERVICE_UNAVAILABLE, "service unavailable");
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
            return r;
        }
    };
    if let Some(want) = &route.traffic_token {
        match traffic_token(req.headers()) {
            Some(got) if constant_time_eq(got.as_bytes(), want.as_bytes()) => {}
            _ => return proxy_error(StatusCode::FORBIDDEN, "forbidden"),
        }
    }
    if port != ENVD_PORT {
        if !route.own_netns {
            // Its loopback is the host's: nothing on it is the sandbox's.
            return proxy_error(StatusCode::BAD_GATEWAY, "bad gateway");
        }
        let pq = req
            .uri()
            .path_and_query()
            .map_or("/", |pq| pq.as_str())
            .to_string();
        match format!("{}{port}{pq}", super::envd::ports::PREFIX).parse() {
            Ok(uri) => *req.uri_mut() = uri,
            Err(_) => return proxy_error(StatusCode::BAD_REQUEST, "bad request"),
        }
    }
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_UPLOAD as u64) {
        return proxy_error(StatusCode::PAYLOAD_TOO_LARGE, "request entity too large");
    }
    let keep_key = m.settings.faithful.is_some();
    match send(&route.socket, req, keep_key).await {
        Ok(r) => {
            let (parts, body) = r.into_parts();
            Response::from_parts(
                parts,
                Body::new(Tracked {
                    body,
                    _inflight: inflight,
                }),
            )
        }
        Err(e) => {
            tracing::debug!(sandbox = %super::sandbox::short(id), error = %e, "envd unreachable");
            proxy_error(StatusCode::BAD_GATEWAY, "bad gateway")
        }
    }
}

/// Connect to a unix socket whatever the length of its path (through a
/// descriptor of its directory when the path is too long for `sun_path`).
pub async fn connect_unix(socket: &Path) -> std::io::Result<tokio::net::UnixStream> {
    if socket.as_os_str().len() < 100 {
        return tokio::net::UnixStream::connect(socket).await;
    }
    let dir = socket.parent().unwrap_or(Path::new("/"));
    let fd = nix::fcntl::open(
        dir,
        nix::fcntl::OFlag::O_PATH | nix::fcntl::OFlag::O_DIRECTORY | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(std::io::Error::from)?;
    let name = socket
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let short = format!(
        "/proc/self/fd/{}/{name}",
        std::os::fd::AsRawFd::as_raw_fd(&fd)
    );
    let stream = tokio::net::UnixStream::connect(short).await;
    drop(fd);
    stream
}

/// Send a request to envd on a unix socket; the response body streams.
/// `keep_api_key`: forward `X-API-Key` as the real CubeProxy does.
pub async fn send(
    socket: &Path,
    req: Request,
    keep_api_key: bool,
) -> Result<Response, Box<dyn std::error::Error + Send + Sync>> {
    let stream = connect_unix(socket).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let (mut parts, body) = req.into_parts();
    for h in dropped() {
        if !(keep_api_key && *h == API_KEY) {
            parts.headers.remove(*h);
        }
    }
    let body = Body::new(http_body_util::Limited::new(body, MAX_UPLOAD));
    let resp = sender
        .send_request(http::Request::from_parts(parts, body))
        .await?;
    let (mut parts, body) = resp.into_parts();
    for h in dropped() {
        parts.headers.remove(*h);
    }
    Ok(Response::from_parts(
        parts,
        Body::new(body.map_err(axum::Error::new)),
    ))
}

#[cfg(test)]
mod tests {
    use super::parse_host;

    #[test]
    fn hosts() {
        assert_eq!(parse_host("49983-abc123.cube.app"), Some((49983, "abc123")));
        assert_eq!(parse_host("49983-abc123"), Some((49983, "abc123")));
        assert_eq!(parse_host("49983-abc123:8080"), Some((49983, "abc123")));
        assert_eq!(parse_host("127.0.0.1:3000"), None);
        assert_eq!(parse_host("localhost"), None);
        assert_eq!(parse_host("x-abc"), None);
        assert_eq!(parse_host("49983-.cube"), None);
    }
}
