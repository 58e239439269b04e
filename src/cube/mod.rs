//! The CubeSandbox client: CubeAPI (REST control plane) and envd (Connect RPC
//! data plane reached through CubeProxy by `Host`). One code path for real
//! clusters and for the embedded backend.

pub(crate) mod client;
pub(crate) mod envd;
pub(crate) mod mcp;
/// The wire types, shared with the embedded backend (`cube_embedded::wire`).
pub use cube_embedded::wire;

pub use client::{
    BackendConfig, CubeClient, EnvdVersion, ProxyUrl, Reachability, SandboxAddr, Secret, Timeouts,
};
pub use envd::{CommandOutput, ProcessStream, StartOptions};

/// What went wrong, as the broker needs to know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The sandbox, template, snapshot, process or path does not exist.
    NotFound,
    /// The backend refused our credentials or the operation.
    Denied,
    /// The call did not finish in time.
    Timeout,
    /// The backend (or the sandbox) cannot be reached or is not serving.
    Unavailable,
    /// The backend rejected the request as invalid.
    InvalidArgument,
    /// The request conflicts with the current state (already exists, busy).
    Conflict,
    /// The request or the response is larger than allowed.
    TooLarge,
    /// The backend failed internally.
    Internal,
    /// The backend answered something that is not the protocol.
    Protocol,
    /// The backend cannot do what was asked on its host (a program it
    /// needs is missing): the operator's to fix, not the caller's.
    Unsupported,
}

impl ErrorKind {
    /// The kind's name in metrics (`cube_adapter_backend_errors_total{kind}`).
    pub const fn as_str(self) -> &'static str {
        match self {
            ErrorKind::NotFound => "not_found",
            ErrorKind::Denied => "denied",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::InvalidArgument => "invalid_argument",
            ErrorKind::Conflict => "conflict",
            ErrorKind::TooLarge => "too_large",
            ErrorKind::Internal => "internal",
            ErrorKind::Protocol => "protocol",
            ErrorKind::Unsupported => "unsupported",
        }
    }
}

/// A typed backend error. Messages never carry secrets (no API keys, traffic
/// tokens or request headers).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{kind:?}: {message}")]
pub struct CubeError {
    pub kind: ErrorKind,
    pub message: String,
}

impl CubeError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    pub fn protocol(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Protocol, message)
    }

    /// Map an HTTP status (CubeAPI, CubeProxy or envd-HTTP) to a kind.
    pub fn from_status(status: u16, message: impl Into<String>) -> Self {
        let kind = match status {
            404 | 410 => ErrorKind::NotFound,
            401 | 403 => ErrorKind::Denied,
            408 | 504 => ErrorKind::Timeout,
            400 | 422 | 415 => ErrorKind::InvalidArgument,
            409 => ErrorKind::Conflict,
            413 => ErrorKind::TooLarge,
            429 | 502 | 503 => ErrorKind::Unavailable,
            507 => ErrorKind::TooLarge,
            501 => ErrorKind::Unsupported,
            _ => ErrorKind::Internal,
        };
        Self::new(kind, message)
    }

    /// Map a Connect error code to a kind.
    pub fn from_connect(code: &str, message: impl Into<String>) -> Self {
        let kind = match code {
            "not_found" => ErrorKind::NotFound,
            "permission_denied" | "unauthenticated" => ErrorKind::Denied,
            "deadline_exceeded" | "canceled" => ErrorKind::Timeout,
            "unavailable" | "resource_exhausted" => ErrorKind::Unavailable,
            "invalid_argument" | "failed_precondition" | "out_of_range" => {
                ErrorKind::InvalidArgument
            }
            "already_exists" | "aborted" => ErrorKind::Conflict,
            "unimplemented" => ErrorKind::Protocol,
            _ => ErrorKind::Internal,
        };
        Self::new(kind, message)
    }

    /// From a transport error; the URL is dropped (it names internal hosts).
    pub fn from_reqwest(what: &str, e: reqwest::Error) -> Self {
        let kind = if e.is_timeout() {
            ErrorKind::Timeout
        } else if e.is_connect() || e.is_request() || e.is_body() {
            ErrorKind::Unavailable
        } else if e.is_decode() {
            ErrorKind::Protocol
        } else {
            ErrorKind::Unavailable
        };
        let e = e.without_url();
        let mut msg = e.to_string();
        let mut src = std::error::Error::source(&e);
        while let Some(s) = src {
            msg.push_str(": ");
            msg.push_str(&s.to_string());
            src = s.source();
        }
        Self::new(kind, format!("{what}: {msg}"))
    }
}

pub type Result<T> = std::result::Result<T, CubeError>;
