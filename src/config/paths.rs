//! Path policy: only `/workspace` and `/tmp` (and below); `..` is denied.
//! Used by the broker for every file call and by task templates at load.

pub const MAX_PATH: usize = 4096;

/// Why a path was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    /// Not a path at all (relative, too long, NUL).
    #[error("{0}")]
    Invalid(&'static str),
    /// A path the policy does not allow.
    #[error("{0}")]
    Denied(&'static str),
}

/// Validate and normalise a sandbox path.
pub fn check(path: &str) -> Result<String, PathError> {
    if !path.starts_with('/') {
        return Err(PathError::Invalid("path must be absolute"));
    }
    if path.len() > MAX_PATH || path.contains('\0') {
        return Err(PathError::Invalid("path is too long or contains NUL"));
    }
    let mut parts = vec![];
    for seg in path.split('/') {
        match seg {
            "" | "." => {}
            ".." => return Err(PathError::Denied("'..' is not allowed in paths")),
            s => parts.push(s),
        }
    }
    let norm = format!("/{}", parts.join("/"));
    let allowed = ["/workspace", "/tmp"]
        .iter()
        .any(|root| norm == *root || norm.starts_with(&format!("{root}/")));
    if !allowed {
        return Err(PathError::Denied(
            "only paths under /workspace and /tmp are allowed",
        ));
    }
    Ok(norm)
}

#[cfg(test)]
mod tests {
    use super::{PathError, check};

    #[test]
    fn policy() {
        assert_eq!(check("/workspace").unwrap(), "/workspace");
        assert_eq!(check("/workspace//a/./b/").unwrap(), "/workspace/a/b");
        assert_eq!(check("/tmp/x").unwrap(), "/tmp/x");
        assert!(matches!(
            check("/workspace/../etc"),
            Err(PathError::Denied(_))
        ));
        assert!(matches!(check("/etc/passwd"), Err(PathError::Denied(_))));
        assert!(matches!(check("/workspacefoo"), Err(PathError::Denied(_))));
        assert!(matches!(check("relative"), Err(PathError::Invalid(_))));
    }
}
