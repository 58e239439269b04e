//! Secrets at rest: AES-256-GCM under a key kept in `STATE/secret.key`
//! (0600), and private files written whole (`write_private`). The lowest
//! layer: the store, the CA and the receipts' signer seal with it.

use aes_gcm::aead::{Aead, KeyInit};
use aes_gcm::{Aes256Gcm, Nonce};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;

/// A secret could not be sealed, opened or kept.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SecretsError {
    #[error("{0}")]
    Io(String),
    #[error("{0}")]
    Corrupt(String),
}

#[derive(Clone)]
pub struct Sealer {
    cipher: std::sync::Arc<Aes256Gcm>,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sealer(***)")
    }
}

impl Sealer {
    /// Load the key from `path`, creating it (0600) on first use.
    pub fn load_or_create(path: &std::path::Path) -> Result<Self, SecretsError> {
        let key = match std::fs::read(path) {
            Ok(k) if k.len() == 32 => k,
            Ok(_) => {
                return Err(SecretsError::Corrupt(format!(
                    "{} is not a 32-byte key",
                    path.display()
                )));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let k = crate::ids::random_bytes(32);
                write_private(path, &k, 0o600)
                    .map_err(|e| SecretsError::Io(format!("write {}: {e}", path.display())))?;
                k
            }
            Err(e) => return Err(SecretsError::Io(format!("read {}: {e}", path.display()))),
        };
        let cipher = Aes256Gcm::new_from_slice(&key)
            .map_err(|_| SecretsError::Corrupt("bad key length".into()))?;
        Ok(Self {
            cipher: std::sync::Arc::new(cipher),
        })
    }

    /// `base64(nonce ‖ ciphertext)`.
    pub fn seal(&self, plain: &[u8]) -> Result<String, SecretsError> {
        let nonce_bytes: [u8; 12] = rand::random();
        let ct = self
            .cipher
            .encrypt(Nonce::from_slice(&nonce_bytes), plain)
            .map_err(|_| SecretsError::Corrupt("seal failed".into()))?;
        let mut out = nonce_bytes.to_vec();
        out.extend_from_slice(&ct);
        Ok(B64.encode(out))
    }

    pub fn open(&self, sealed: &str) -> Result<Vec<u8>, SecretsError> {
        let raw = B64
            .decode(sealed)
            .map_err(|_| SecretsError::Corrupt("sealed value is not base64".into()))?;
        if raw.len() < 12 + 16 {
            return Err(SecretsError::Corrupt("sealed value too short".into()));
        }
        let (nonce, ct) = raw.split_at(12);
        self.cipher
            .decrypt(Nonce::from_slice(nonce), ct)
            .map_err(|_| {
                SecretsError::Corrupt("sealed value does not decrypt under this key".into())
            })
    }
}

/// Write `data` to `path` with `mode`, whole or not at all, never through
/// a link: a new temporary file of a random name beside `path` (created
/// with `O_CREAT|O_EXCL|O_NOFOLLOW` and mode 0600, so nothing planted at
/// that name is opened or followed, and no one else can open it while it
/// is written), synced, given `mode` on its descriptor, then renamed over
/// `path` (`rename` replaces a symbolic link at `path` itself, never the
/// file it points to), and the directory synced so that the rename lasts.
pub fn write_private(path: &std::path::Path, data: &[u8], mode: u32) -> std::io::Result<()> {
    write_private_via(path, data, mode, || crate::ids::random_hex(8))
}

/// `write_private`, the temporary names' random parts from `random`.
fn write_private_via(
    path: &std::path::Path,
    data: &[u8],
    mode: u32,
    mut random: impl FnMut() -> String,
) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let name = path.file_name().ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{} names no file", path.display()),
        )
    })?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => std::path::Path::new("."),
    };
    // A name taken (by a crash's leftover, or by something planted) is
    // never reused: another random one is tried.
    let mut attempt = 0;
    let (tmp, mut f) = loop {
        let mut n = std::ffi::OsString::from(".");
        n.push(name);
        n.push(format!(".{}.tmp", random()));
        let tmp = dir.join(n);
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)
        {
            Ok(f) => break (tmp, f),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && attempt < 8 => {
                attempt += 1;
            }
            Err(e) => return Err(e),
        }
    };
    let written = (|| {
        f.write_all(data)?;
        f.set_permissions(std::fs::Permissions::from_mode(mode))?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(dir)?
        .sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_tamper() {
        let dir = tempfile::tempdir().unwrap();
        let s = Sealer::load_or_create(&dir.path().join("k")).unwrap();
        let sealed = s.seal(b"traffic-token").unwrap();
        assert!(!sealed.contains("traffic"));
        assert_eq!(s.open(&sealed).unwrap(), b"traffic-token");
        let again = Sealer::load_or_create(&dir.path().join("k")).unwrap();
        assert_eq!(again.open(&sealed).unwrap(), b"traffic-token");
        let mut raw = B64.decode(&sealed).unwrap();
        let last = raw.len() - 1;
        raw[last] ^= 1;
        assert!(s.open(&B64.encode(raw)).is_err());
    }

    fn mode_of(p: &std::path::Path) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
    }

    fn entries(d: &std::path::Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn write_private_writes_whole_files_with_their_mode() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("ca.key");
        write_private(&p, b"one", 0o600).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"one");
        assert_eq!(mode_of(&p), 0o600);
        write_private(&p, b"two", 0o644).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        assert_eq!(mode_of(&p), 0o644);
        // Files of the same stem do not share a temporary name (the old
        // one was `ca.tmp` for both `ca.key` and `ca.pem`), and none is
        // left behind.
        write_private(&dir.path().join("ca.pem"), b"cert", 0o644).unwrap();
        assert_eq!(entries(dir.path()), ["ca.key", "ca.pem"]);
        // A path that names no file is refused.
        assert!(write_private(std::path::Path::new("/"), b"x", 0o600).is_err());
    }

    #[test]
    fn write_private_replaces_a_link_at_the_target_not_what_it_points_to() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "unchanged").unwrap();
        let p = dir.path().join("secret.key");
        std::os::unix::fs::symlink(&victim, &p).unwrap();
        write_private(&p, b"new secret", 0o600).unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "unchanged");
        assert!(std::fs::symlink_metadata(&p).unwrap().is_file());
        assert_eq!(std::fs::read(&p).unwrap(), b"new secret");
        assert_eq!(mode_of(&p), 0o600);
        // A dangling link too: nothing is created where it points.
        let nowhere = dir.path().join("nowhere");
        let q = dir.path().join("other.key");
        std::os::unix::fs::symlink(&nowhere, &q).unwrap();
        write_private(&q, b"x", 0o600).unwrap();
        assert!(!nowhere.exists());
        assert_eq!(std::fs::read(&q).unwrap(), b"x");
    }

    #[test]
    fn write_private_never_opens_a_link_planted_at_a_temporary_name() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "unchanged").unwrap();
        // The old fixed name, and the shape of the new ones: links there
        // are neither followed nor removed.
        let p = dir.path().join("secret.key");
        let planted = dir.path().join("secret.tmp");
        std::os::unix::fs::symlink(&victim, &planted).unwrap();
        for _ in 0..20 {
            write_private(&p, b"new secret", 0o600).unwrap();
        }
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "unchanged");
        assert!(std::fs::symlink_metadata(&planted).unwrap().is_symlink());
        assert_eq!(entries(dir.path()), ["secret.key", "secret.tmp", "victim"]);
    }

    #[test]
    fn write_private_never_follows_a_link_at_its_temporary_name() {
        // Links planted at the exact temporary names it draws: each is
        // skipped (O_EXCL|O_NOFOLLOW), left alone, and the next name tried.
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "unchanged").unwrap();
        let p = dir.path().join("secret.key");
        for r in ["a", "b", "c"] {
            std::os::unix::fs::symlink(&victim, dir.path().join(format!(".secret.key.{r}.tmp")))
                .unwrap();
        }
        let mut names = ["a", "b", "c", "d"].into_iter().map(String::from);
        write_private_via(&p, b"new secret", 0o600, || names.next().unwrap()).unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "unchanged");
        assert_eq!(std::fs::read(&p).unwrap(), b"new secret");
        assert_eq!(
            entries(dir.path()),
            [
                ".secret.key.a.tmp",
                ".secret.key.b.tmp",
                ".secret.key.c.tmp",
                "secret.key",
                "victim"
            ]
        );
        // Every name it tries taken: it gives up, nothing written anywhere.
        let q = dir.path().join("other.key");
        let e = write_private_via(&q, b"x", 0o600, || "a".into());
        std::os::unix::fs::symlink(&victim, dir.path().join(".other.key.a.tmp")).unwrap();
        assert!(e.is_ok(), "the first try had a free name");
        let e = write_private_via(&q, b"y", 0o600, || "a".into()).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "unchanged");
        assert_eq!(std::fs::read(&q).unwrap(), b"x");
    }
}
