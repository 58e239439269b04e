//! `backup` (a consistent, verified copy of the state in a tar archive)
//! and `restore` (checked before it takes the place of an empty state
//! directory). The snapshot and its manifest are `crate::ops`'s.

use std::path::{Path, PathBuf};

use clap::Args;

use super::Exit;
use super::common::{
    Common, Reach, adopt_owner, ask, not_initialised, open_stopped, reach, runtime, unexpected,
};
use crate::admin::{Request, Response};
use crate::ops::Manifest;

#[derive(Args)]
pub struct BackupArgs {
    #[command(flatten)]
    pub common: Common,
    /// The archive to write.
    pub file: PathBuf,
    /// Replace FILE if it exists.
    #[arg(long)]
    pub force: bool,
}

#[derive(Args)]
pub struct RestoreArgs {
    #[command(flatten)]
    pub common: Common,
    /// The archive `backup` wrote.
    pub file: PathBuf,
}

// -------------------------------------------------------------- backup

/// The state files a restore needs besides the store: the keys that seal
/// the CA key and secrets in the store, the audit digest key, the CA and
/// the leaves. Not sandboxes (`embedded/`), not `admin.token`.
const KEY_FILES: &[&str] = &["secret.key", "hmac.key"];

fn write_archive(
    file: &Path,
    state: &Path,
    snap_dir: &Path,
    manifest: &Manifest,
) -> std::io::Result<()> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let tmp = file.with_extension("partial");
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    let r = (|| {
        let mut t = crate::ops::tar::TarWriter::new(std::io::BufWriter::new(f));
        let now = u64::try_from(crate::clock::now().1).unwrap_or(0);
        let m = serde_json::to_vec_pretty(manifest).unwrap_or_default();
        t.file(
            "MANIFEST.json",
            0o600,
            now,
            m.len() as u64,
            &mut m.as_slice(),
        )?;
        let add = |t: &mut crate::ops::tar::TarWriter<_>, name: &str, p: &Path| {
            let mut f = std::fs::File::open(p)?;
            let md = f.metadata()?;
            t.file(
                name,
                md.mode(),
                u64::try_from(md.mtime()).unwrap_or(0),
                md.len(),
                &mut f,
            )
        };
        add(&mut t, "state.redb", &snap_dir.join("state.redb"))?;
        for k in KEY_FILES {
            add(&mut t, k, &state.join(k))?;
        }
        t.dir("tls", 0o700, now)?;
        let mut tls: Vec<_> = std::fs::read_dir(state.join("tls"))?
            .flatten()
            .filter(|e| e.file_type().map(|t| t.is_file()).unwrap_or(false))
            .filter(|e| !e.file_name().to_string_lossy().ends_with(".tmp"))
            .collect();
        tls.sort_by_key(|e| e.file_name());
        for e in tls {
            let name = format!("tls/{}", e.file_name().to_string_lossy());
            add(&mut t, &name, &e.path())?;
        }
        let w = t.finish()?;
        let f = w.into_inner().map_err(|e| e.into_error())?;
        f.sync_all()
    })();
    match r {
        Ok(()) => std::fs::rename(&tmp, file),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// Write a consistent backup of the state to `file` (a tar archive, 0600).
pub fn backup(args: BackupArgs) -> Exit {
    let (file, force) = (args.file.as_path(), args.force);
    let cfg = match args.common.load() {
        Ok(c) => c,
        Err(c) => return c,
    };
    let state = &cfg.state_dir;
    if file.exists() && !force {
        eprintln!(
            "error: {} exists (use --force to replace it)",
            file.display()
        );
        return Exit::Usage;
    }
    if !state.join("state.redb").exists() {
        return not_initialised(state);
    }
    let (dir, manifest, live) = match reach(state) {
        Reach::Running(sock) => match ask(&sock, &Request::Backup) {
            // The copy must be in the state directory: it is removed below.
            Ok(Response::Backup { dir, manifest }) if dir.starts_with(state) => {
                (dir, manifest, true)
            }
            Ok(r) => return unexpected(r),
            Err(c) => return c,
        },
        Reach::Stopped => {
            let store = match open_stopped(state) {
                Ok(s) => s,
                Err(c) => return c,
            };
            let rt = match runtime() {
                Ok(r) => r,
                Err(c) => return c,
            };
            match rt.block_on(crate::ops::snapshot(&store, state)) {
                Ok(s) => (s.dir, s.manifest, false),
                Err(e) => {
                    eprintln!("error: {e}");
                    return Exit::Store;
                }
            }
        }
    };
    let r = write_archive(file, state, &dir, &manifest);
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(e) = r {
        eprintln!("error: write {}: {e}", file.display());
        return Exit::Store;
    }
    println!(
        "backup written to {} ({}): {} audit events (head {}), {} active leases, schema {}",
        file.display(),
        if live {
            "taken while the service ran"
        } else {
            "the service was stopped"
        },
        manifest.audit_events,
        manifest.audit_head.chars().take(16).collect::<String>(),
        manifest.summary.active_leases,
        manifest.summary.schema_version
    );
    println!("  it holds the store's keys: keep it as secret as the state directory");
    Exit::Ok
}

// ------------------------------------------------------------- restore

/// Extract an archive of `backup` into `stage`; its manifest.
fn extract(file: &Path, stage: &Path) -> Result<Manifest, String> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
    let f = std::fs::File::open(file).map_err(|e| format!("open {}: {e}", file.display()))?;
    let mut a = tar::Archive::new(std::io::BufReader::new(f));
    let mut manifest = None;
    let entries = a
        .entries()
        .map_err(|e| format!("{}: {e}", file.display()))?;
    for e in entries {
        let mut e = e.map_err(|e| format!("{}: {e}", file.display()))?;
        let (name, kind, mode) =
            crate::ops::tar::check(&e).map_err(|err| format!("{}: {err}", file.display()))?;
        match kind {
            crate::ops::tar::Kind::Dir => {
                let p = stage.join(&name);
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(&p)
                    .map_err(|e| format!("create {}: {e}", p.display()))?;
                let _ = std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode & 0o700));
            }
            crate::ops::tar::Kind::File { .. } if name == "MANIFEST.json" => {
                let mut b = vec![];
                std::io::Read::read_to_end(&mut e, &mut b).map_err(|e| e.to_string())?;
                manifest = Some(
                    serde_json::from_slice::<Manifest>(&b)
                        .map_err(|e| format!("MANIFEST.json: {e}"))?,
                );
            }
            crate::ops::tar::Kind::File { .. } => {
                let p = stage.join(&name);
                let mut out = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(mode & 0o700)
                    .open(&p)
                    .map_err(|e| format!("create {}: {e}", p.display()))?;
                std::io::copy(&mut e, &mut out).map_err(|e| format!("{}: {e}", file.display()))?;
                out.sync_all().map_err(|e| e.to_string())?;
            }
        }
    }
    manifest.ok_or_else(|| format!("{} has no MANIFEST.json: not a backup", file.display()))
}

/// Restore a backup into an empty (or absent) state directory, after
/// checking it: the store's digest, its audit chain against the manifest.
pub fn restore(args: RestoreArgs) -> Exit {
    let file = args.file.as_path();
    let cfg = match args.common.load() {
        Ok(c) => c,
        Err(c) => return c,
    };
    let state = cfg.state_dir.clone();
    if let Reach::Running(_) = reach(&state) {
        eprintln!(
            "error: the service is running on {}: stop it first",
            state.display()
        );
        return Exit::State;
    }
    let owner = match std::fs::read_dir(&state) {
        Ok(mut rd) => {
            if rd.next().is_some() {
                eprintln!(
                    "error: {} is not empty: restore never overwrites a state directory (move it aside first)",
                    state.display()
                );
                return Exit::Usage;
            }
            std::fs::metadata(&state).ok()
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => {
            eprintln!("error: {}: {e}", state.display());
            return Exit::Store;
        }
    };
    let Some(parent) = state.parent().filter(|p| !p.as_os_str().is_empty()) else {
        eprintln!("error: {} has no parent directory", state.display());
        return Exit::Usage;
    };
    let stage = parent.join(format!(
        ".{}.restore-{:08x}",
        state
            .file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default(),
        rand::random::<u32>()
    ));
    let checked = (|| {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&stage)
            .map_err(|e| format!("create {}: {e}", stage.display()))?;
        let m = extract(file, &stage)?;
        let db = stage.join("state.redb");
        let digest =
            crate::ops::sha256_file(&db).map_err(|e| format!("read {}: {e}", db.display()))?;
        if digest != m.state_redb_sha256 {
            return Err("state.redb does not match the manifest's digest".to_string());
        }
        for k in KEY_FILES {
            if !stage.join(k).exists() {
                return Err(format!("the archive has no {k}"));
            }
        }
        let found = crate::ops::check_copy(&db).map_err(|e| e.to_string())?;
        if (found.audit_events, &found.audit_head) != (m.audit_events, &m.audit_head) {
            return Err(format!(
                "the journal has {} events (head {}), the manifest says {} ({})",
                found.audit_events, found.audit_head, m.audit_events, m.audit_head
            ));
        }
        Ok(m)
    })();
    let m = match checked {
        Ok(m) => m,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&stage);
            eprintln!("error: {e}; nothing was restored");
            return Exit::Failed;
        }
    };
    // The empty directory gives way to the checked one (same filesystem).
    if owner.is_some() && std::fs::remove_dir(&state).is_err() {
        let _ = std::fs::remove_dir_all(&stage);
        eprintln!("error: cannot replace {}", state.display());
        return Exit::Store;
    }
    if let Err(e) = std::fs::rename(&stage, &state) {
        let _ = std::fs::remove_dir_all(&stage);
        eprintln!("error: move into {}: {e}", state.display());
        return Exit::Store;
    }
    if let Some(o) = owner {
        use std::os::unix::fs::MetadataExt;
        let _ = std::os::unix::fs::lchown(&state, Some(o.uid()), Some(o.gid()));
        adopt_owner(&state);
    }
    println!(
        "restored {} into {}: {} audit events (head {}), {} active leases, schema {}, taken {}",
        file.display(),
        state.display(),
        m.audit_events,
        m.audit_head.chars().take(16).collect::<String>(),
        m.summary.active_leases,
        m.summary.schema_version,
        m.created_at
    );
    Exit::Ok
}
