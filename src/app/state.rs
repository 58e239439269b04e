//! Start-up, phase 1: the state directory, the store and the journal.

use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::audit::Journal;
use crate::auth::{self, Principal, Role};
use crate::config::Config;
use crate::store::Store;

/// The open state: what every later phase reads or writes.
pub(super) struct Opened {
    /// The state directory, absolute (sandboxes mask it by path).
    pub state: PathBuf,
    pub store: Store,
    pub journal: Journal,
    /// The journal's HMAC key (`STATE/hmac.key`); receipts derive theirs
    /// from it unless `[receipts] hmac_key_file` is set.
    pub key: Vec<u8>,
}

/// Create the state directory (0700), open the store on it (redb, or the
/// PostgreSQL of `[store]`), open the journal (it reports intents a crash
/// left without an outcome).
pub(super) async fn open(cfg: &Config) -> anyhow::Result<Opened> {
    let clock = &cfg.clock;
    std::fs::create_dir_all(&cfg.state_dir)
        .with_context(|| format!("create {}", cfg.state_dir.display()))?;
    let state = std::fs::canonicalize(&cfg.state_dir)
        .with_context(|| format!("resolve {}", cfg.state_dir.display()))?;
    {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700));
    }
    let store = match cfg.store.postgres() {
        Some(pg) => Store::open_postgres(&state, &pg),
        None => Store::open(&state),
    }?;
    let key = random_key(&state.join("hmac.key"))?;
    let journal =
        Journal::open(store.clone(), cfg.audit.mode, key.clone())?.with_clock(clock.clone());
    Ok(Opened {
        state,
        store,
        journal,
        key,
    })
}

/// A 32-byte key kept in `path` (0600), made on first use.
pub(crate) fn random_key(path: &Path) -> anyhow::Result<Vec<u8>> {
    match std::fs::read(path) {
        Ok(k) if k.len() == 32 => Ok(k),
        Ok(_) => anyhow::bail!("{} is not a 32-byte key", path.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let k = crate::ids::random_bytes(32);
            crate::tls::write_private(path, &k, 0o600)?;
            Ok(k)
        }
        Err(e) => Err(e).with_context(|| format!("read {}", path.display())),
    }
}

/// The first start's admin token: issued and written to `file` (0600) when
/// the store has no token and `file` does not exist; `None` otherwise.
pub(crate) async fn bootstrap_admin(
    store: &Store,
    file: &Path,
    clock: &crate::clock::Clock,
) -> anyhow::Result<Option<PathBuf>> {
    if !auth::list_tokens(store)?.is_empty() || file.exists() {
        return Ok(None);
    }
    let principal = Principal::unrestricted("admin", "bootstrap-admin", Role::Admin);
    let (token, rec) = auth::new_token(principal, Some("bootstrap admin".into()), clock);
    auth::store_token(store, rec).await?;
    crate::tls::write_private(file, format!("{token}\n").as_bytes(), 0o600)?;
    Ok(Some(file.to_path_buf()))
}
