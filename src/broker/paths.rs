//! Path policy: only `/workspace` and `/tmp` (and below); `..` is denied.

use super::{Error, Result};

pub const MAX_PATH: usize = 4096;

/// Validate and normalise a sandbox path.
pub fn check(path: &str) -> Result<String> {
    if !path.starts_with('/') {
        return Err(Error::new("invalid_path", "path must be absolute"));
    }
    if path.len() > MAX_PATH || path.contains('\0') {
        return Err(Error::new(
            "invalid_path",
            "path is too long or contains NUL",
        ));
    }
    let mut parts = vec![];
    for seg in path.split('/') {
        match seg {
            "" | "." => {}
            ".." => return Err(Error::new("path_denied", "'..' is not allowed in paths")),
            s => parts.push(s),
        }
    }
    let norm = format!("/{}", parts.join("/"));
    let allowed = ["/workspace", "/tmp"]
        .iter()
        .any(|root| norm == *root || norm.starts_with(&format!("{root}/")));
    if !allowed {
        return Err(Error::new(
            "path_denied",
            "only paths under /workspace and /tmp are allowed",
        ));
    }
    Ok(norm)
}

#[cfg(test)]
mod tests {
    use super::check;

    #[test]
    fn policy() {
        assert_eq!(check("/workspace").unwrap(), "/workspace");
        assert_eq!(check("/workspace//a/./b/").unwrap(), "/workspace/a/b");
        assert_eq!(check("/tmp/x").unwrap(), "/tmp/x");
        assert_eq!(check("/workspace/../etc").unwrap_err().code, "path_denied");
        assert_eq!(check("/etc/passwd").unwrap_err().code, "path_denied");
        assert_eq!(check("/workspacefoo").unwrap_err().code, "path_denied");
        assert_eq!(check("relative").unwrap_err().code, "invalid_path");
    }
}
