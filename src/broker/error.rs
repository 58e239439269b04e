//! Domain errors: a stable machine code and a message for the caller.
//! HTTP statuses are assigned in one place, `api::status_of`.

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct Error {
    pub code: &'static str,
    pub message: String,
}

impl Error {
    pub fn new(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;

impl From<crate::audit::AuditError> for Error {
    fn from(e: crate::audit::AuditError) -> Self {
        Error::new("audit_unavailable", e.to_string())
    }
}

impl From<crate::store::StoreError> for Error {
    fn from(e: crate::store::StoreError) -> Self {
        tracing::error!(error = %e, "store error");
        Error::new("audit_unavailable", "the appliance's store is unavailable")
    }
}

/// A backend error as the agent sees it: no backend detail beyond its kind.
pub fn backend(e: &crate::cube::CubeError) -> Error {
    use crate::cube::ErrorKind as K;
    tracing::warn!(error = %e, "backend call failed");
    match e.kind {
        K::Timeout => Error::new("timeout", "the sandbox operation timed out"),
        _ => Error::new(
            "execution_failed",
            format!("CubeSandbox operation failed ({:?})", e.kind),
        ),
    }
}
