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

/// Write `data` to `path` with `mode`, whole or not at all: a temporary
/// file, synced, then renamed over `path`.
pub fn write_private(path: &std::path::Path, data: &[u8], mode: u32) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)?;
    f.write_all(data)?;
    f.sync_all()?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))?;
    std::fs::rename(&tmp, path)
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
}
