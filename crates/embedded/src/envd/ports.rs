//! `/_cube/port/PORT/…`: a request the backend's proxy received for a port
//! of the sandbox other than envd's own (`Host: PORT-ID.DOMAIN`), forwarded
//! here, inside the sandbox's network namespace, to `127.0.0.1:PORT`. Both
//! ways stream (Streamable HTTP answers with server-sent events).
//!
//! Only `MCP_GATEWAY_PORT` is forwarded. A sandbox without a network
//! namespace of its own (`AgentEnv::own_netns` false: `isolation = "none"`,
//! or the host's network) never is: its `127.0.0.1` is the host's, where
//! the port is anybody's. The proxy refuses such requests from outside
//! (`/_cube/` is not forwarded), so only it sends them.

use std::net::Ipv4Addr;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;

use super::Agent;
use crate::wire::MCP_GATEWAY_PORT;

/// The path prefix the proxy puts before the original path and query.
pub const PREFIX: &str = "/_cube/port/";

/// Headers that concern one connection, not the request: never forwarded
/// (by the proxy either, which drops its own credentials besides).
pub const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// The port and the original path-and-query of `/_cube/port/PORT/REST?Q`.
pub fn split(uri: &Uri) -> Option<(u16, String)> {
    let rest = uri.path().strip_prefix(PREFIX)?;
    let (port, path) = match rest.split_once('/') {
        Some((p, path)) => (p, format!("/{path}")),
        None => (rest, "/".to_string()),
    };
    if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let port = port.parse().ok()?;
    Some(match uri.query() {
        Some(q) => (port, format!("{path}?{q}")),
        None => (port, path),
    })
}

fn error(status: StatusCode, word: &str) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        format!("{{\"error\":\"{word}\"}}"),
    )
        .into_response()
}

/// Forward one request to `127.0.0.1:PORT` in the sandbox.
pub async fn forward(State(a): State<Agent>, req: Request) -> Response {
    let Some((port, path)) = split(req.uri()) else {
        return error(StatusCode::NOT_FOUND, "not found");
    };
    if port != MCP_GATEWAY_PORT {
        return error(StatusCode::NOT_FOUND, "not found");
    }
    if !a.procs.env().own_netns {
        // Its loopback is the host's: nothing there is the sandbox's.
        return error(StatusCode::BAD_GATEWAY, "bad gateway");
    }
    let Ok(uri) = path.parse::<Uri>() else {
        return error(StatusCode::BAD_REQUEST, "bad request");
    };
    let stream = match tokio::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port)).await {
        Ok(s) => s,
        // Nothing listens there (no gateway started, or it ended).
        Err(_) => return error(StatusCode::BAD_GATEWAY, "bad gateway"),
    };
    let _ = stream.set_nodelay(true);
    let (mut sender, conn) = match hyper::client::conn::http1::handshake(TokioIo::new(stream)).await
    {
        Ok(x) => x,
        Err(_) => return error(StatusCode::BAD_GATEWAY, "bad gateway"),
    };
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let (mut parts, body) = req.into_parts();
    parts.uri = uri;
    for h in HOP_BY_HOP {
        parts.headers.remove(*h);
    }
    // The server sees a loopback client of its own (an MCP server's
    // DNS-rebinding check allows loopback names); the name the client
    // used goes along as X-Forwarded-Host.
    if let Some(host) = parts.headers.remove(header::HOST) {
        parts.headers.insert("x-forwarded-host", host);
    }
    if let Ok(v) = HeaderValue::from_str(&format!("127.0.0.1:{port}")) {
        parts.headers.insert(header::HOST, v);
    }
    let resp = match sender
        .send_request(http::Request::from_parts(parts, body))
        .await
    {
        Ok(r) => r,
        Err(_) => return error(StatusCode::BAD_GATEWAY, "bad gateway"),
    };
    let (mut parts, body) = resp.into_parts();
    for h in HOP_BY_HOP {
        parts.headers.remove(*h);
    }
    Response::from_parts(parts, Body::new(body.map_err(axum::Error::new)))
}

#[cfg(test)]
mod tests {
    use super::split;

    #[test]
    fn paths() {
        let s = |u: &str| split(&u.parse().unwrap());
        assert_eq!(s("/_cube/port/50005/mcp"), Some((50005, "/mcp".into())));
        assert_eq!(
            s("/_cube/port/50005/mcp/x?a=1&b"),
            Some((50005, "/mcp/x?a=1&b".into()))
        );
        assert_eq!(s("/_cube/port/50005"), Some((50005, "/".into())));
        assert_eq!(s("/_cube/port/50005/"), Some((50005, "/".into())));
        assert_eq!(s("/_cube/port/70000/mcp"), None);
        assert_eq!(s("/_cube/port/x/mcp"), None);
        assert_eq!(s("/_cube/port//mcp"), None);
        assert_eq!(s("/mcp"), None);
    }
}
