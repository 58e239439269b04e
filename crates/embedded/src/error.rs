//! What the backend answers when it cannot do what was asked, with the
//! HTTP status each maps to.

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("sandbox {0} not found")]
    SandboxNotFound(String),
    #[error("template {0} not found")]
    TemplateNotFound(String),
    #[error("snapshot {0} not found")]
    SnapshotNotFound(String),
    #[error("volume {0} not found")]
    VolumeNotFound(String),
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    Conflict(String),
    /// Too little disk left for another sandbox (507).
    #[error("{0}")]
    StorageLow(String),
    /// What the request needs is missing on this host (501): pasta or
    /// nft for a sandbox with network access.
    #[error("{0}")]
    Unsupported(String),
    #[error("{0}")]
    Internal(String),
}

impl BackendError {
    pub fn status(&self) -> u16 {
        match self {
            Self::SandboxNotFound(_)
            | Self::TemplateNotFound(_)
            | Self::SnapshotNotFound(_)
            | Self::VolumeNotFound(_) => 404,
            Self::BadRequest(_) => 400,
            Self::Conflict(_) => 409,
            Self::StorageLow(_) => 507,
            Self::Unsupported(_) => 501,
            Self::Internal(_) => 500,
        }
    }
}

pub(crate) fn internal(what: &str, e: impl std::fmt::Display) -> BackendError {
    BackendError::Internal(format!("{what}: {e}"))
}
