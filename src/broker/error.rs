//! Domain errors: a code from the catalogue (`code.rs`) and a message for
//! the caller. HTTP statuses come from the code, in one place (`api`).

use super::code::Code;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct Error {
    pub code: Code,
    pub message: String,
}

impl Error {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;

impl From<crate::audit::AuditError> for Error {
    fn from(e: crate::audit::AuditError) -> Self {
        Error::new(Code::AuditUnavailable, e.to_string())
    }
}

impl From<crate::store::StoreError> for Error {
    fn from(e: crate::store::StoreError) -> Self {
        tracing::error!(error = %e, "store error");
        Error::new(
            Code::AuditUnavailable,
            "the appliance's store is unavailable",
        )
    }
}

impl From<crate::secrets::SecretsError> for Error {
    fn from(e: crate::secrets::SecretsError) -> Self {
        crate::store::StoreError::from(e).into()
    }
}

/// A backend error as the agent sees it: no backend detail beyond its kind.
pub fn backend(e: &crate::cube::CubeError) -> Error {
    use crate::cube::ErrorKind as K;
    tracing::warn!(error = %e, "backend call failed");
    match e.kind {
        K::Timeout => Error::new(Code::Timeout, "the sandbox operation timed out"),
        _ => Error::new(
            Code::ExecutionFailed,
            format!("CubeSandbox operation failed ({:?})", e.kind),
        ),
    }
}
