//! Server side of the Connect protocol as envd speaks it: unary JSON calls,
//! server-streaming envelopes, and the errors of both.

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use bytes::Bytes;
use futures_util::Stream;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::wire::{self, ConnectError, EnvelopeDecoder};

/// A Connect error: a code string and a message.
#[derive(Debug, Clone)]
pub struct RpcError {
    pub code: &'static str,
    pub message: String,
}

impl RpcError {
    pub fn new(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
    pub fn not_found(m: impl Into<String>) -> Self {
        Self::new("not_found", m)
    }
    pub fn invalid(m: impl Into<String>) -> Self {
        Self::new("invalid_argument", m)
    }
    pub fn internal(m: impl Into<String>) -> Self {
        Self::new("internal", m)
    }
    pub fn to_wire(&self) -> ConnectError {
        ConnectError {
            code: self.code.to_string(),
            message: self.message.clone(),
        }
    }
    pub fn from_io(e: &std::io::Error, what: &str) -> Self {
        match e.kind() {
            std::io::ErrorKind::NotFound => {
                Self::not_found(format!("{what}: no such file or directory"))
            }
            std::io::ErrorKind::PermissionDenied => {
                Self::new("permission_denied", format!("{what}: permission denied"))
            }
            std::io::ErrorKind::AlreadyExists => {
                Self::new("already_exists", format!("{what}: already exists"))
            }
            std::io::ErrorKind::StorageFull => Self::new(
                "resource_exhausted",
                format!("{what}: no space left on device"),
            ),
            // What the request asks cannot be done to this path: a name
            // too long, a file where a directory is needed or the other
            // way round, a mount point, a move across file systems.
            std::io::ErrorKind::InvalidFilename | std::io::ErrorKind::InvalidInput => {
                Self::invalid(format!("{what}: {e}"))
            }
            std::io::ErrorKind::NotADirectory
            | std::io::ErrorKind::IsADirectory
            | std::io::ErrorKind::DirectoryNotEmpty
            | std::io::ErrorKind::ResourceBusy
            | std::io::ErrorKind::CrossesDevices
            | std::io::ErrorKind::ReadOnlyFilesystem => {
                Self::new("failed_precondition", format!("{what}: {e}"))
            }
            _ => Self::internal(format!("{what}: {e}")),
        }
    }
}

/// Unary error response: `{"code","message"}` with the mapped HTTP status.
impl IntoResponse for RpcError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(wire::connect_code_status(self.code))
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = serde_json::to_vec(&self.to_wire()).unwrap_or_default();
        (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
    }
}

fn content_type(headers: &HeaderMap) -> &str {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|s| s.split(';').next().unwrap_or("").trim())
        .unwrap_or("")
}

/// Decode a unary request body. A streaming content type on a unary method
/// answers 415 with `Accept-Post`, like connect-go.
pub fn unary_request<T: DeserializeOwned>(headers: &HeaderMap, body: &[u8]) -> Result<T, Response> {
    let ct = content_type(headers);
    if ct != "application/json" {
        let mut r = (StatusCode::UNSUPPORTED_MEDIA_TYPE, "").into_response();
        r.headers_mut().insert(
            "accept-post",
            HeaderValue::from_static("application/json, application/proto"),
        );
        return Err(r);
    }
    let body = if body.is_empty() {
        b"{}".as_slice()
    } else {
        body
    };
    serde_json::from_slice(body)
        .map_err(|e| RpcError::invalid(format!("invalid request body: {e}")).into_response())
}

/// Unary success.
pub fn unary_ok<T: Serialize>(msg: &T) -> Response {
    let body = serde_json::to_vec(msg).unwrap_or_else(|_| b"{}".to_vec());
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// Decode the single enveloped request of a server-streaming call.
pub fn stream_request<T: DeserializeOwned>(
    headers: &HeaderMap,
    body: &[u8],
) -> Result<T, Response> {
    let ct = content_type(headers);
    if ct != "application/connect+json" {
        let mut r = (StatusCode::UNSUPPORTED_MEDIA_TYPE, "").into_response();
        r.headers_mut().insert(
            "accept-post",
            HeaderValue::from_static("application/connect+json"),
        );
        return Err(r);
    }
    let mut dec = EnvelopeDecoder::new();
    dec.push(body);
    let env = match dec.next_envelope() {
        Ok(Some(e)) => e,
        Ok(None) => {
            return Err(stream_error(RpcError::invalid(
                "request body is not one complete envelope",
            )));
        }
        Err(e) => return Err(stream_error(RpcError::invalid(e.to_string()))),
    };
    if dec.pending() != 0 {
        return Err(stream_error(RpcError::invalid(
            "a server-streaming call takes exactly one request message",
        )));
    }
    serde_json::from_slice(&env.payload)
        .map_err(|e| stream_error(RpcError::invalid(format!("invalid request message: {e}"))))
}

/// A streaming response whose only envelope is an end-stream error (HTTP 200).
pub fn stream_error(e: RpcError) -> Response {
    stream_response(futures_util::stream::once(async move {
        wire::end_stream_envelope(Some(e.to_wire()))
    }))
}

/// A 200 `application/connect+json` response from a stream of envelopes.
pub fn stream_response<S>(s: S) -> Response
where
    S: Stream<Item = Bytes> + Send + 'static,
{
    use futures_util::StreamExt;
    let body = Body::from_stream(s.map(Ok::<_, std::convert::Infallible>));
    let mut r = Response::new(body);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/connect+json"),
    );
    r
}

/// The user an envd call runs as: `Authorization: Basic base64(user:)`,
/// default root.
pub fn basic_user(headers: &HeaderMap) -> Result<String, RpcError> {
    let Some(v) = headers.get(header::AUTHORIZATION) else {
        return Ok("root".into());
    };
    let v = v
        .to_str()
        .map_err(|_| RpcError::new("unauthenticated", "invalid authorization header"))?;
    let Some(b64) = v
        .strip_prefix("Basic ")
        .or_else(|| v.strip_prefix("basic "))
    else {
        return Err(RpcError::new(
            "unauthenticated",
            "authorization must be Basic",
        ));
    };
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .map_err(|_| RpcError::new("unauthenticated", "invalid basic credentials"))?;
    let s = String::from_utf8(raw)
        .map_err(|_| RpcError::new("unauthenticated", "invalid basic credentials"))?;
    let user = s.split(':').next().unwrap_or("").to_string();
    Ok(if user.is_empty() { "root".into() } else { user })
}
