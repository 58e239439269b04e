//! Templates imported into the embedded backend's state directory
//! (`cube-adapter template add NAME --rootfs DIR|FILE.tar`): a root
//! filesystem (one made with `mmdebstrap`, a container image's export, a
//! directory) under `templates/NAME/rootfs`, described by
//! `templates/NAME/template.json`. A running backend sees one as soon as it
//! is there (the directory is looked at on every template lookup), beside
//! the built-in `minimal` and `host` and those of the configuration.
//!
//! What is taken from an archive: directories, regular files, symbolic and
//! hard links, each unpacked below the new root only (the `tar` crate
//! refuses a path that leaves it, through `..` or a link); device nodes and
//! FIFOs are passed over (a sandbox's `/dev` is its own). Ownership and
//! modes are kept, so files owned by root stay read-only to the sandbox.

use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Below the backend's state directory.
pub const TEMPLATES_DIR: &str = "templates";
const META: &str = "template.json";

/// One imported template.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Imported {
    pub id: String,
    /// Where its root is (`templates/ID/rootfs`).
    pub rootfs: PathBuf,
    pub imported_at: String,
    /// What it was imported from (the path given).
    pub source: String,
    /// Entries unpacked, and those passed over (devices, FIFOs).
    pub entries: u64,
    pub skipped: u64,
}

/// The host's whole root, read-only.
pub const HOST_TEMPLATE: &str = "host";
/// The default template: of the host's root, only programs, libraries and
/// a filtered `/etc` (`launch::MINIMAL_TOP`, `launch::MINIMAL_ETC`).
pub const MINIMAL_TEMPLATE: &str = "minimal";

/// Names the built-in templates have.
pub const BUILT_IN: &[&str] = &[MINIMAL_TEMPLATE, HOST_TEMPLATE];

/// A template name this backend cannot take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadName {
    #[error(
        "template name '{0}' must be 1 to 63 of a-z, 0-9, '.', '_', '-', starting with a letter or digit"
    )]
    Malformed(String),
    #[error("'{0}' is a built-in template")]
    BuiltIn(String),
}

/// A template name: 1 to 63 of `a-z 0-9 . _ -`, starting with a letter or
/// digit, not a built-in one.
pub fn check_id(id: &str) -> Result<(), BadName> {
    let ok = !id.is_empty()
        && id.len() <= 63
        && id
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b));
    if !ok {
        return Err(BadName::Malformed(id.to_string()));
    }
    if BUILT_IN.contains(&id) {
        return Err(BadName::BuiltIn(id.to_string()));
    }
    Ok(())
}

fn dir(state_dir: &Path) -> PathBuf {
    state_dir.join(TEMPLATES_DIR)
}

/// The imported templates, by name.
pub fn imported(state_dir: &Path) -> Vec<Imported> {
    let mut v: Vec<Imported> = std::fs::read_dir(dir(state_dir))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .filter_map(|e| std::fs::read(e.path().join(META)).ok())
        .filter_map(|b| serde_json::from_slice::<Imported>(&b).ok())
        .collect();
    v.sort_by(|a, b| a.id.cmp(&b.id));
    v
}

/// One imported template, if there is one by that name.
pub fn find(state_dir: &Path, id: &str) -> Option<Imported> {
    check_id(id).ok()?;
    let b = std::fs::read(dir(state_dir).join(id).join(META)).ok()?;
    serde_json::from_slice(&b).ok()
}

/// Import `source` (a directory, or a tar archive, uncompressed) as
/// template `id`. Built aside and renamed into place: a failed import
/// leaves nothing.
pub fn import(state_dir: &Path, id: &str, source: &Path, now: &str) -> io::Result<Imported> {
    check_id(id).map_err(|m| io::Error::new(io::ErrorKind::InvalidInput, m))?;
    let base = dir(state_dir);
    let final_dir = base.join(id);
    if final_dir.exists() {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("template {id} exists already (remove it first)"),
        ));
    }
    std::fs::create_dir_all(&base)?;
    let staging = base.join(format!(".{id}.{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir(&staging)?;
    let r = (|| -> io::Result<Imported> {
        let rootfs = staging.join("rootfs");
        std::fs::create_dir(&rootfs)?;
        let meta = std::fs::metadata(source)?;
        let (entries, skipped) = if meta.is_dir() {
            copy_dir(source, &rootfs)?
        } else {
            unpack(std::fs::File::open(source)?, &rootfs)?
        };
        std::fs::set_permissions(&rootfs, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
        let t = Imported {
            id: id.to_string(),
            rootfs: final_dir.join("rootfs"),
            imported_at: now.to_string(),
            source: source.display().to_string(),
            entries,
            skipped,
        };
        std::fs::write(staging.join(META), serde_json::to_vec_pretty(&t)?)?;
        Ok(t)
    })();
    match r {
        Ok(t) => {
            std::fs::rename(&staging, &final_dir)?;
            Ok(t)
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(&staging);
            Err(e)
        }
    }
}

/// Unpack an archive below `root`; (entries unpacked, entries passed over).
fn unpack(r: impl io::Read, root: &Path) -> io::Result<(u64, u64)> {
    let mut a = tar::Archive::new(r);
    a.set_preserve_permissions(true);
    a.set_preserve_ownerships(true);
    a.set_preserve_mtime(true);
    a.set_unpack_xattrs(false);
    a.set_overwrite(true);
    let (mut n, mut skipped) = (0u64, 0u64);
    for e in a.entries()? {
        let mut e = e?;
        use tar::EntryType as T;
        match e.header().entry_type() {
            T::Regular | T::Continuous | T::Directory | T::Symlink | T::Link => {
                // `unpack_in` refuses what would land outside `root`.
                if e.unpack_in(root)? {
                    n += 1;
                } else {
                    skipped += 1;
                }
            }
            T::XGlobalHeader | T::XHeader | T::GNULongName | T::GNULongLink => {}
            _ => skipped += 1,
        }
    }
    if n == 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the archive holds no files (an uncompressed tar is needed)",
        ));
    }
    Ok((n, skipped))
}

/// Copy a directory tree below `root` (links as links), as an archive
/// streamed from one thread to another.
fn copy_dir(src: &Path, root: &Path) -> io::Result<(u64, u64)> {
    let (reader, writer) = io::pipe()?;
    let src = src.to_path_buf();
    let writing = std::thread::spawn(move || -> io::Result<()> {
        let mut b = tar::Builder::new(writer);
        b.follow_symlinks(false);
        b.mode(tar::HeaderMode::Complete);
        b.append_dir_all(".", &src)?;
        b.finish()
    });
    let unpacked = unpack(reader, root);
    let written = writing
        .join()
        .map_err(|_| io::Error::other("the copying thread panicked"))?;
    written?;
    unpacked
}

/// Remove an imported template.
pub fn remove(state_dir: &Path, id: &str) -> io::Result<()> {
    check_id(id).map_err(|m| io::Error::new(io::ErrorKind::InvalidInput, m))?;
    let d = dir(state_dir).join(id);
    if !d.join(META).exists() {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("no imported template {id}"),
        ));
    }
    // Out of sight first (a backend stops offering it), then deleted.
    let gone = dir(state_dir).join(format!(".{id}.removed.{}", std::process::id()));
    std::fs::rename(&d, &gone)?;
    std::fs::remove_dir_all(&gone)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for ok in ["debian-12", "py3.12", "a", "x_y"] {
            assert!(check_id(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "-x",
            "A",
            "a/b",
            "..",
            ".x",
            "host",
            "minimal",
            &"a".repeat(64),
        ] {
            assert!(check_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_directory_is_copied_with_its_links_and_an_archive_cannot_leave_its_root() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("src");
        std::fs::create_dir_all(src.join("usr/bin")).unwrap();
        std::fs::write(src.join("usr/bin/tool"), "#!/bin/sh\n").unwrap();
        std::os::unix::fs::symlink("usr/bin", src.join("bin")).unwrap();
        let state = d.path().join("state");
        let t = import(&state, "mini", &src, "2026-12-02T00:00:00Z").unwrap();
        assert_eq!(t.rootfs, state.join("templates/mini/rootfs"));
        assert_eq!(
            std::fs::read_link(t.rootfs.join("bin")).unwrap(),
            PathBuf::from("usr/bin")
        );
        assert!(t.rootfs.join("usr/bin/tool").is_file());
        assert_eq!(imported(&state), vec![t.clone()]);
        assert!(
            import(&state, "mini", &src, "now").is_err(),
            "exists already"
        );

        // An archive whose entry climbs out through a link: refused,
        // nothing left behind.
        let outside = d.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        let bad = d.path().join("bad.tar");
        let mut b = tar::Builder::new(std::fs::File::create(&bad).unwrap());
        let mut h = tar::Header::new_gnu();
        h.set_size(2);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_link_name(&outside).unwrap();
        h.set_size(0);
        h.set_cksum();
        b.append_data(&mut h, "escape", io::empty()).unwrap();
        let mut h = tar::Header::new_gnu();
        h.set_size(2);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, "escape/owned", &b"x\n"[..]).unwrap();
        b.finish().unwrap();
        drop(b);
        assert!(import(&state, "bad", &bad, "now").is_err());
        assert!(find(&state, "bad").is_none());
        assert!(!outside.join("owned").exists());
        let left: Vec<_> = std::fs::read_dir(state.join("templates"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(
            left,
            vec![std::ffi::OsString::from("mini")],
            "no staging left"
        );

        remove(&state, "mini").unwrap();
        assert!(imported(&state).is_empty());
    }
}
