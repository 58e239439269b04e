//! Path policy: only `/workspace` and `/tmp` (and below); `..` is denied.

use super::{Code, Error, Result};

pub const MAX_PATH: usize = 4096;

/// Validate and normalise a sandbox path.
pub fn check(path: &str) -> Result<String> {
    if !path.starts_with('/') {
        return Err(Error::new(Code::InvalidPath, "path must be absolute"));
    }
    if path.len() > MAX_PATH || path.contains('\0') {
        return Err(Error::new(
            Code::InvalidPath,
            "path is too long or contains NUL",
        ));
    }
    let mut parts = vec![];
    for seg in path.split('/') {
        match seg {
            "" | "." => {}
            ".." => return Err(Error::new(Code::PathDenied, "'..' is not allowed in paths")),
            s => parts.push(s),
        }
    }
    let norm = format!("/{}", parts.join("/"));
    let allowed = ["/workspace", "/tmp"]
        .iter()
        .any(|root| norm == *root || norm.starts_with(&format!("{root}/")));
    if !allowed {
        return Err(Error::new(
            Code::PathDenied,
            "only paths under /workspace and /tmp are allowed",
        ));
    }
    Ok(norm)
}

#[cfg(test)]
mod tests {
    use super::{Code, check};

    #[test]
    fn policy() {
        assert_eq!(check("/workspace").unwrap(), "/workspace");
        assert_eq!(check("/workspace//a/./b/").unwrap(), "/workspace/a/b");
        assert_eq!(check("/tmp/x").unwrap(), "/tmp/x");
        assert_eq!(
            check("/workspace/../etc").unwrap_err().code,
            Code::PathDenied
        );
        assert_eq!(check("/etc/passwd").unwrap_err().code, Code::PathDenied);
        assert_eq!(check("/workspacefoo").unwrap_err().code, Code::PathDenied);
        assert_eq!(check("relative").unwrap_err().code, Code::InvalidPath);
    }
}
