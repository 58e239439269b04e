//! envd `filesystem.Filesystem` (Stat, ListDir, MakeDir, Move, Remove) and
//! the plain-HTTP `/files` upload and download.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use super::rpc::RpcError;
use super::users::{Names, User};
use crate::wire::{EntryInfo, FILE_TYPE_DIRECTORY, FILE_TYPE_FILE, FILE_TYPE_UNSPECIFIED};

/// `-rw-r--r--` style permissions (Go's `FileMode.String()` for the bits we
/// report; symlinks start with `L`).
pub fn permissions_string(mode: u32, symlink: bool, dir: bool) -> String {
    let mut s = String::with_capacity(10);
    s.push(if symlink {
        'L'
    } else if dir {
        'd'
    } else {
        '-'
    });
    let bits = [
        (0o400, 'r'),
        (0o200, 'w'),
        (0o100, 'x'),
        (0o40, 'r'),
        (0o20, 'w'),
        (0o10, 'x'),
        (0o4, 'r'),
        (0o2, 'w'),
        (0o1, 'x'),
    ];
    for (bit, c) in bits {
        s.push(if mode & bit != 0 { c } else { '-' });
    }
    s
}

/// Build `EntryInfo` for `shown` (the sandbox path) stored at `real`.
pub fn entry_info(shown: &Path, real: &Path, names: &Names) -> std::io::Result<EntryInfo> {
    let lmeta = std::fs::symlink_metadata(real)?;
    let is_link = lmeta.file_type().is_symlink();
    let (meta, target) = if is_link {
        let target = std::fs::read_link(real)
            .ok()
            .map(|t| t.to_string_lossy().into_owned());
        (std::fs::metadata(real).ok(), target)
    } else {
        (Some(lmeta.clone()), None)
    };
    let m = meta.as_ref().unwrap_or(&lmeta);
    let kind = if meta.is_none() {
        FILE_TYPE_UNSPECIFIED
    } else if m.is_dir() {
        FILE_TYPE_DIRECTORY
    } else if m.is_file() {
        FILE_TYPE_FILE
    } else {
        FILE_TYPE_UNSPECIFIED
    };
    let mode = m.permissions().mode() & 0o777;
    let modified = OffsetDateTime::from_unix_timestamp(m.mtime())
        .ok()
        .and_then(|t| {
            t.replace_nanosecond(u32::try_from(m.mtime_nsec()).unwrap_or(0))
                .ok()
        })
        .and_then(|t| t.format(&Rfc3339).ok());
    Ok(EntryInfo {
        name: shown
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "/".into()),
        kind: kind.into(),
        path: shown.to_string_lossy().into_owned(),
        size: m.len(),
        mode,
        permissions: permissions_string(mode, is_link, m.is_dir()),
        owner: names.user(lmeta.uid()),
        group: names.group(lmeta.gid()),
        modified_time: modified,
        symlink_target: target,
    })
}

/// The sandbox path and the real path for an RPC path argument.
pub struct Resolved {
    pub shown: PathBuf,
    pub real: PathBuf,
}

pub fn resolve(p: &str, user: &User, map: &dyn Fn(&Path) -> PathBuf) -> Result<Resolved, RpcError> {
    if p.is_empty() {
        return Err(RpcError::invalid("path is required"));
    }
    if p.contains('\0') {
        return Err(RpcError::invalid("path contains a NUL byte"));
    }
    let shown = normalize(&super::process::expand_user_path(p, user));
    let real = map(&shown);
    Ok(Resolved { shown, real })
}

/// Lexical normalisation (`.` and `..`), as Go's `filepath.Clean`.
pub fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in p.components() {
        match c {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::Normal(n) => out.push(n),
            _ => {}
        }
    }
    out
}

pub fn stat(r: &Resolved) -> Result<EntryInfo, RpcError> {
    entry_info(&r.shown, &r.real, &Names::load()).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => {
            RpcError::not_found(format!("file not found: {}", r.shown.display()))
        }
        _ => RpcError::from_io(&e, &r.shown.to_string_lossy()),
    })
}

pub fn list_dir(r: &Resolved, depth: u32) -> Result<Vec<EntryInfo>, RpcError> {
    let depth = depth.max(1);
    match std::fs::metadata(&r.real) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(RpcError::invalid(format!(
                "path is not a directory: {}",
                r.shown.display()
            )));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(RpcError::not_found(format!(
                "directory not found: {}",
                r.shown.display()
            )));
        }
        Err(e) => return Err(RpcError::from_io(&e, &r.shown.to_string_lossy())),
    }
    let names = Names::load();
    let mut out = vec![];
    walk(&r.shown, &r.real, depth, &names, &mut out)?;
    Ok(out)
}

fn walk(
    shown: &Path,
    real: &Path,
    depth: u32,
    names: &Names,
    out: &mut Vec<EntryInfo>,
) -> Result<(), RpcError> {
    let rd =
        std::fs::read_dir(real).map_err(|e| RpcError::from_io(&e, &shown.to_string_lossy()))?;
    let mut entries: Vec<_> = rd.filter_map(Result::ok).collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let s = shown.join(e.file_name());
        let rp = e.path();
        let Ok(info) = entry_info(&s, &rp, names) else {
            continue;
        };
        let is_real_dir = e.file_type().map(|t| t.is_dir()).unwrap_or(false);
        out.push(info);
        if depth > 1 && is_real_dir {
            walk(&s, &rp, depth - 1, names, out)?;
        }
    }
    Ok(())
}

pub fn make_dir(r: &Resolved, user: &User) -> Result<EntryInfo, RpcError> {
    match std::fs::symlink_metadata(&r.real) {
        Ok(m) if m.is_dir() => {
            return Err(RpcError::new(
                "already_exists",
                format!("directory already exists: {}", r.shown.display()),
            ));
        }
        Ok(_) => {
            return Err(RpcError::invalid(format!(
                "path already exists and is not a directory: {}",
                r.shown.display()
            )));
        }
        Err(_) => {}
    }
    create_dirs_owned(&r.real, user)
        .map_err(|e| RpcError::from_io(&e, &r.shown.to_string_lossy()))?;
    stat(r)
}

/// `mkdir -p`, chowning each directory it creates to the user.
pub fn create_dirs_owned(p: &Path, user: &User) -> std::io::Result<()> {
    if p.is_dir() {
        return Ok(());
    }
    if let Some(parent) = p.parent() {
        create_dirs_owned(parent, user)?;
    }
    match std::fs::create_dir(p) {
        Ok(()) => {
            let _ = std::os::unix::fs::chown(p, Some(user.uid), Some(user.gid));
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && p.is_dir() => Ok(()),
        // A file where a directory is needed: the caller's path is wrong
        // (a 4xx), not the sandbox (this used to answer 502).
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Err(std::io::Error::new(
            std::io::ErrorKind::NotADirectory,
            "a file is where a directory of the path is needed",
        )),
        Err(e) => Err(e),
    }
}

pub fn move_entry(src: &Resolved, dst: &Resolved, user: &User) -> Result<EntryInfo, RpcError> {
    if std::fs::symlink_metadata(&src.real).is_err() {
        return Err(RpcError::not_found(format!(
            "source not found: {}",
            src.shown.display()
        )));
    }
    if let Some(parent) = dst.real.parent() {
        create_dirs_owned(parent, user)
            .map_err(|e| RpcError::from_io(&e, &dst.shown.to_string_lossy()))?;
    }
    match std::fs::rename(&src.real, &dst.real) {
        Ok(()) => {}
        // Across mounts (/workspace and /tmp): copy, then remove the source.
        Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {
            copy_recursive(&src.real, &dst.real)
                .map_err(|e| RpcError::from_io(&e, &dst.shown.to_string_lossy()))?;
            let md = std::fs::symlink_metadata(&src.real)
                .map_err(|e| RpcError::from_io(&e, &src.shown.to_string_lossy()))?;
            let removed = if md.is_dir() {
                std::fs::remove_dir_all(&src.real)
            } else {
                std::fs::remove_file(&src.real)
            };
            removed.map_err(|e| RpcError::from_io(&e, &src.shown.to_string_lossy()))?;
        }
        Err(e) => return Err(RpcError::from_io(&e, &src.shown.to_string_lossy())),
    }
    stat(dst)
}

/// Copy a file, symlink or directory tree, keeping modes and owners.
fn copy_recursive(from: &Path, to: &Path) -> std::io::Result<()> {
    let md = std::fs::symlink_metadata(from)?;
    if md.file_type().is_symlink() {
        std::os::unix::fs::symlink(std::fs::read_link(from)?, to)?;
    } else if md.is_dir() {
        std::fs::create_dir(to)?;
        for e in std::fs::read_dir(from)? {
            let e = e?;
            copy_recursive(&e.path(), &to.join(e.file_name()))?;
        }
        std::fs::set_permissions(to, md.permissions())?;
    } else {
        std::fs::copy(from, to)?;
    }
    let _ = std::os::unix::fs::lchown(to, Some(md.uid()), Some(md.gid()));
    Ok(())
}

pub fn remove(r: &Resolved) -> Result<(), RpcError> {
    match std::fs::symlink_metadata(&r.real) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(RpcError::from_io(&e, &r.shown.to_string_lossy())),
        // A mount point (`/workspace` itself) is emptied and then refused
        // as busy: a failed precondition, not a failure of the agent.
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(&r.real)
            .map_err(|e| RpcError::from_io(&e, &r.shown.to_string_lossy())),
        Ok(_) => std::fs::remove_file(&r.real)
            .map_err(|e| RpcError::from_io(&e, &r.shown.to_string_lossy())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn perms_and_normalize() {
        assert_eq!(permissions_string(0o644, false, false), "-rw-r--r--");
        assert_eq!(permissions_string(0o755, false, true), "drwxr-xr-x");
        assert_eq!(permissions_string(0o777, true, false), "Lrwxrwxrwx");
        assert_eq!(normalize(Path::new("/a/./b/../c")), PathBuf::from("/a/c"));
        assert_eq!(normalize(Path::new("/../../etc")), PathBuf::from("/etc"));
    }
}
