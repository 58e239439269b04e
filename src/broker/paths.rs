//! The path policy (`config::paths`) with the broker's error codes:
//! `invalid_path` for what is not a path, `path_denied` for what the policy
//! refuses.

use super::{Code, Error, Result};
use crate::config::paths::{self, PathError};

impl From<PathError> for Error {
    fn from(e: PathError) -> Self {
        match e {
            PathError::Invalid(m) => Error::new(Code::InvalidPath, m),
            PathError::Denied(m) => Error::new(Code::PathDenied, m),
        }
    }
}

/// Validate and normalise a sandbox path.
pub fn check(path: &str) -> Result<String> {
    Ok(paths::check(path)?)
}

#[cfg(test)]
mod tests {
    use super::{Code, check};

    #[test]
    fn codes() {
        assert_eq!(check("/workspace/a/").unwrap(), "/workspace/a");
        assert_eq!(
            check("/workspace/../etc").unwrap_err().code,
            Code::PathDenied
        );
        assert_eq!(check("relative").unwrap_err().code, Code::InvalidPath);
    }
}
