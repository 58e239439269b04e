//! `init`, `status`, `cert show|renew` and `backup`. Exit codes as in
//! `crate::cli`: 0 ok, 1 the check or operation failed, 2 usage,
//! configuration or a refusal, 3 the service state does not allow it
//! (running, not running, not initialised), 4 store or I/O error.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use super::{Manifest, Request, StoreSummary};
use crate::cli::{EXIT_FAIL, EXIT_STATE, EXIT_STORE, EXIT_USAGE, load, runtime};
use crate::config::{Config, Flags};
use crate::store::{Store, StoreError};
use crate::tls::{CertInfo, LocalCa};

/// Whether a service answers on `STATE/admin.sock`.
enum Reach {
    Running(PathBuf),
    Stopped,
}

fn reach(state: &Path) -> Reach {
    let sock = state.join("admin.sock");
    match std::os::unix::net::UnixStream::connect(&sock) {
        Ok(_) => Reach::Running(sock),
        Err(_) => Reach::Stopped,
    }
}

/// One request to the running service; its answer, or an exit code.
fn ask(sock: &Path, req: &Request) -> Result<Value, i32> {
    let out = crate::admin::call(sock, req).map_err(|e| {
        eprintln!("error: {e}");
        EXIT_STATE
    })?;
    match out.into_iter().next() {
        Some(v) if v.get("ok").and_then(Value::as_bool) == Some(true) => Ok(v),
        Some(v) => {
            eprintln!(
                "error: {}",
                v.get("error").and_then(Value::as_str).unwrap_or("refused")
            );
            Err(EXIT_FAIL)
        }
        None => {
            eprintln!("error: no answer from the service");
            Err(EXIT_STATE)
        }
    }
}

fn config(config: Option<&Path>, state: Option<&Path>) -> Result<Config, i32> {
    let flags = Flags {
        state_dir: state.map(Path::to_path_buf),
        ..Flags::default()
    };
    load(config, &flags)
}

/// Open the store of a stopped service (exclusive until dropped).
fn open_stopped(state: &Path) -> Result<Store, i32> {
    match Store::open(state) {
        Ok(s) => Ok(s),
        Err(StoreError::Locked(m)) => {
            eprintln!("error: {m}");
            Err(EXIT_STATE)
        }
        Err(e) => {
            eprintln!("error: {e}");
            Err(EXIT_STORE)
        }
    }
}

fn not_initialised(state: &Path) -> i32 {
    eprintln!(
        "error: {} is not initialised (run `cube-adapter init`, or start the service once)",
        state.display()
    );
    EXIT_STATE
}

/// Run as root on a state directory that belongs to the service user:
/// give what this command created there to that user too, so that the
/// service can read it (systemd re-owns a state directory only when its
/// top level has the wrong owner).
fn adopt_owner(state: &Path) {
    use std::os::unix::fs::MetadataExt;
    if !nix::unistd::geteuid().is_root() {
        return;
    }
    let Ok(m) = std::fs::metadata(state) else {
        return;
    };
    if m.uid() == 0 {
        return;
    }
    let (uid, gid) = (m.uid(), m.gid());
    let mut stack = vec![state.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            // Sandboxes have ids of their own.
            if dir == state && e.file_name() == "embedded" {
                continue;
            }
            let Ok(m) = std::fs::symlink_metadata(&p) else {
                continue;
            };
            if (m.uid() != uid || m.gid() != gid)
                && let Err(err) = std::os::unix::fs::lchown(&p, Some(uid), Some(gid))
            {
                eprintln!("warning: cannot give {} to uid {uid}: {err}", p.display());
            }
            if m.is_dir() {
                stack.push(p);
            }
        }
    }
}

fn print_json(v: &impl serde::Serialize) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
}

// ---------------------------------------------------------------- init

pub fn init(config_path: Option<&Path>, state: Option<&Path>, token_file: Option<&Path>) -> i32 {
    let cfg = match config(config_path, state) {
        Ok(c) => c,
        Err(c) => return c,
    };
    let state = cfg.state_dir.clone();
    if let Reach::Running(_) = reach(&state) {
        eprintln!(
            "error: the service is running on {}: it initialised it already (see `cube-adapter status`)",
            state.display()
        );
        return EXIT_STATE;
    }
    if let Some(f) = token_file
        && f.exists()
    {
        eprintln!(
            "error: {} exists: init never overwrites a token file (choose another path)",
            f.display()
        );
        return EXIT_USAGE;
    }
    let existed = |p: &str| state.join(p).exists();
    let had_store = existed("state.redb");
    let had_ca = existed("tls/ca.pem");
    if let Err(e) = std::fs::create_dir_all(&state) {
        eprintln!("error: create {}: {e}", state.display());
        return EXIT_STORE;
    }
    {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700));
    }
    let store = match open_stopped(&state) {
        Ok(s) => s,
        Err(c) => return c,
    };
    let rt = match runtime() {
        Ok(r) => r,
        Err(c) => return c,
    };
    let r = rt.block_on(async {
        crate::app::random_key(&state.join("hmac.key"))?;
        let ca = LocalCa::load_or_create_sealed(&state.join("tls"), Some(store.sealer.clone()))?;
        let names = crate::app::server_names(&cfg, cfg.listen);
        let (pem, _, reissued) = ca.server_leaf("server", &names, crate::clock::now().1)?;
        let info = crate::tls::cert_info(&pem)?;
        let file = token_file
            .map(Path::to_path_buf)
            .unwrap_or_else(|| state.join("admin.token"));
        let token = crate::app::bootstrap_admin(&store, &file).await?;
        let summary = store.read_now(super::summarize)?;
        Ok::<_, anyhow::Error>((ca.fingerprint(), info, reissued, token, summary))
    });
    drop(store);
    adopt_owner(&state);
    let (fp, info, reissued, token, summary) = match r {
        Ok(x) => x,
        Err(e) => {
            eprintln!("error: {e:#}");
            return EXIT_STORE;
        }
    };
    let kept = |had: bool| if had { "kept" } else { "created" };
    println!("initialised {}", state.display());
    println!(
        "  store:        {} (schema {}, instance {})",
        kept(had_store),
        summary.schema_version,
        summary.instance_id
    );
    println!("  CA:           {}, SHA-256 {fp}", kept(had_ca));
    println!(
        "  server cert:  {} for {}, valid until {}",
        if reissued || !had_ca {
            "issued"
        } else {
            "kept"
        },
        info.names.join(", "),
        info.not_after
    );
    match token {
        Some(f) => println!(
            "  admin token:  written to {} (read it once, then keep it somewhere safe)",
            f.display()
        ),
        None => println!(
            "  admin token:  none issued (tokens exist, or {} is there already)",
            state.join("admin.token").display()
        ),
    }
    println!("next: systemctl enable --now cube-adapter && cube-adapter status");
    0
}

// -------------------------------------------------------------- status

fn offline_status(state: &Path) -> Result<Value, i32> {
    if !state.join("state.redb").exists() {
        return Err(not_initialised(state));
    }
    let store = open_stopped(state)?;
    let summary: StoreSummary = store.read_now(super::summarize).map_err(|e| {
        eprintln!("error: {e}");
        EXIT_STORE
    })?;
    let now = crate::clock::now().1;
    let cert = std::fs::read(state.join("tls/server.pem"))
        .ok()
        .and_then(|p| crate::tls::cert_info(&p).ok())
        .map(|c| {
            let days = c.days_left(now);
            json!({"certificate": c, "days_left": days})
        });
    Ok(json!({
        "running": false,
        "ready": false,
        "version": env!("CARGO_PKG_VERSION"),
        "state_dir": state,
        "audit": {"state": if summary.pending_intents > 0 { "reconciliation_required" } else { "ok" }},
        "store": summary,
        "server_certificate": cert,
    }))
}

fn print_status(v: &Value) {
    let s = |p: &str| {
        v.pointer(p)
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    };
    let n = |p: &str| v.pointer(p).and_then(Value::as_u64).unwrap_or(0);
    let running = v.get("running").and_then(Value::as_bool) == Some(true);
    let ready = v.get("ready").and_then(Value::as_bool) == Some(true);
    if running {
        println!(
            "cube-adapter {}: running (pid {}) at {}, {}",
            s("/version"),
            n("/pid"),
            s("/url"),
            if ready { "ready" } else { "NOT READY" }
        );
        let templates: Vec<String> = v
            .pointer("/backend/templates")
            .and_then(Value::as_object)
            .map(|m| {
                m.iter()
                    .map(|(k, x)| format!("{k}: {}", x.as_str().unwrap_or("")))
                    .collect()
            })
            .unwrap_or_default();
        println!(
            "  backend:      {} ({})",
            s("/backend/description"),
            templates.join(", ")
        );
        println!(
            "  audit:        {} mode, {}",
            s("/audit/mode"),
            s("/audit/state")
        );
    } else {
        println!(
            "cube-adapter {}: not running (state {})",
            s("/version"),
            s("/state_dir")
        );
        println!("  audit:        {}", s("/audit/state"));
    }
    println!(
        "  journal:      {} events, {} pending intents",
        n("/store/audit_last_seq"),
        n("/store/pending_intents")
    );
    let by_state: Vec<String> = v
        .pointer("/store/leases")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(k, x)| format!("{k} {}", x.as_u64().unwrap_or(0)))
                .collect()
        })
        .unwrap_or_default();
    println!(
        "  leases:       {} active ({})",
        n("/store/active_leases"),
        if by_state.is_empty() {
            "none stored".to_string()
        } else {
            by_state.join(", ")
        }
    );
    println!(
        "  tokens:       {} active, {} revoked",
        n("/store/tokens_active"),
        n("/store/tokens_revoked")
    );
    if v.pointer("/server_certificate/certificate").is_some() {
        println!(
            "  certificate:  valid until {} ({} days)",
            s("/server_certificate/certificate/not_after"),
            v.pointer("/server_certificate/days_left")
                .and_then(Value::as_i64)
                .unwrap_or(0)
        );
    }
    if let Some(r) = v.get("last_reload").filter(|r| !r.is_null()) {
        let ok = r.get("ok").and_then(Value::as_bool) == Some(true);
        let restart: Vec<&str> = r
            .get("restart_required")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        println!(
            "  last reload:  {} {}{}",
            r.get("at").and_then(Value::as_str).unwrap_or(""),
            if ok {
                "applied".to_string()
            } else {
                format!(
                    "REFUSED: {}",
                    r.get("error").and_then(Value::as_str).unwrap_or("")
                )
            },
            if restart.is_empty() {
                String::new()
            } else {
                format!("; restart required for {}", restart.join(", "))
            }
        );
    }
}

/// Exit 0 running and ready, 1 running but not ready, 3 not running.
pub fn status(config_path: Option<&Path>, state: Option<&Path>, json: bool) -> i32 {
    let cfg = match config(config_path, state) {
        Ok(c) => c,
        Err(c) => return c,
    };
    let v = match reach(&cfg.state_dir) {
        Reach::Running(sock) => match ask(&sock, &Request::Status) {
            Ok(v) => v.get("status").cloned().unwrap_or_default(),
            Err(c) => return c,
        },
        Reach::Stopped => match offline_status(&cfg.state_dir) {
            Ok(v) => v,
            Err(c) => return c,
        },
    };
    if json {
        print_json(&v);
    } else {
        print_status(&v);
    }
    match (
        v.get("running").and_then(Value::as_bool),
        v.get("ready").and_then(Value::as_bool),
    ) {
        (Some(true), Some(true)) => 0,
        (Some(true), _) => EXIT_FAIL,
        _ => EXIT_STATE,
    }
}

// ---------------------------------------------------------------- cert

fn read_cert(p: &Path) -> Result<CertInfo, String> {
    let pem = std::fs::read(p).map_err(|e| format!("read {}: {e}", p.display()))?;
    crate::tls::cert_info(&pem).map_err(|e| format!("{}: {e}", p.display()))
}

/// Exit 0, or 1 when the server certificate has `warn_days` or fewer left.
pub fn cert_show(
    config_path: Option<&Path>,
    state: Option<&Path>,
    json: bool,
    warn_days: i64,
) -> i32 {
    let cfg = match config(config_path, state) {
        Ok(c) => c,
        Err(c) => return c,
    };
    let tls = cfg.state_dir.join("tls");
    if !tls.join("ca.pem").exists() || !tls.join("server.pem").exists() {
        return not_initialised(&cfg.state_dir);
    }
    let (ca, server) = match (
        read_cert(&tls.join("ca.pem")),
        read_cert(&tls.join("server.pem")),
    ) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("error: {e}");
            return EXIT_STORE;
        }
    };
    let now = crate::clock::now().1;
    let (ca_days, days) = (ca.days_left(now), server.days_left(now));
    if json {
        print_json(&json!({
            "ca": {"file": tls.join("ca.pem"), "certificate": ca, "days_left": ca_days},
            "server": {"file": tls.join("server.pem"), "certificate": server, "days_left": days},
        }));
    } else {
        println!("CA      {}", tls.join("ca.pem").display());
        println!("  subject:   {}", ca.subject);
        println!("  SHA-256:   {}", ca.sha256);
        println!(
            "  valid:     {} .. {} ({ca_days} days left)",
            ca.not_before, ca.not_after
        );
        println!("server  {}", tls.join("server.pem").display());
        println!("  names:     {}", server.names.join(", "));
        println!("  SHA-256:   {}", server.sha256);
        println!(
            "  valid:     {} .. {} ({days} days left)",
            server.not_before, server.not_after
        );
    }
    if days <= warn_days {
        eprintln!(
            "warning: the server certificate has {days} days left: `cube-adapter cert renew`"
        );
        return EXIT_FAIL;
    }
    0
}

/// A new server certificate: issued by the running service and served at
/// once, or written for the next start when the service is stopped.
pub fn cert_renew(config_path: Option<&Path>, state: Option<&Path>, json: bool) -> i32 {
    let cfg = match config(config_path, state) {
        Ok(c) => c,
        Err(c) => return c,
    };
    let state = &cfg.state_dir;
    let (info, live) = match reach(state) {
        Reach::Running(sock) => match ask(&sock, &Request::CertRenew) {
            Ok(v) => match v
                .get("certificate")
                .cloned()
                .and_then(|c| serde_json::from_value::<CertInfo>(c).ok())
            {
                Some(i) => (i, true),
                None => {
                    eprintln!("error: bad answer from the service");
                    return EXIT_FAIL;
                }
            },
            Err(c) => return c,
        },
        Reach::Stopped => {
            if !state.join("secret.key").exists() || !state.join("tls/ca.pem").exists() {
                return not_initialised(state);
            }
            // Held while the files are written: the service cannot start
            // in between and read half of them.
            let store = match open_stopped(state) {
                Ok(s) => s,
                Err(c) => return c,
            };
            let r = (|| {
                let ca =
                    LocalCa::load_or_create_sealed(&state.join("tls"), Some(store.sealer.clone()))?;
                let names = crate::app::server_names(&cfg, cfg.listen);
                let (cert, _) = ca.reissue_server("server", &names)?;
                crate::tls::cert_info(
                    &std::fs::read(&cert).map_err(|e| {
                        crate::tls::TlsError::Io(format!("read {}", cert.display()), e)
                    })?,
                )
            })();
            drop(store);
            adopt_owner(state);
            match r {
                Ok(i) => (i, false),
                Err(e) => {
                    eprintln!("error: {e}");
                    return EXIT_STORE;
                }
            }
        }
    };
    if json {
        print_json(&json!({"certificate": info, "served_now": live}));
    } else {
        println!(
            "server certificate renewed: valid until {}, names {}",
            info.not_after,
            info.names.join(", ")
        );
        println!(
            "  {}",
            if live {
                "the running service serves it now (connections open keep the old one)"
            } else {
                "the service is stopped: it serves it from its next start"
            }
        );
    }
    0
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
        let mut t = super::tar::TarWriter::new(std::io::BufWriter::new(f));
        let now = u64::try_from(crate::clock::now().1).unwrap_or(0);
        let m = serde_json::to_vec_pretty(manifest).unwrap_or_default();
        t.file(
            "MANIFEST.json",
            0o600,
            now,
            m.len() as u64,
            &mut m.as_slice(),
        )?;
        let add = |t: &mut super::tar::TarWriter<_>, name: &str, p: &Path| {
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
pub fn backup(config_path: Option<&Path>, state: Option<&Path>, file: &Path, force: bool) -> i32 {
    let cfg = match config(config_path, state) {
        Ok(c) => c,
        Err(c) => return c,
    };
    let state = &cfg.state_dir;
    if file.exists() && !force {
        eprintln!(
            "error: {} exists (use --force to replace it)",
            file.display()
        );
        return EXIT_USAGE;
    }
    if !state.join("state.redb").exists() {
        return not_initialised(state);
    }
    let (dir, manifest, live) = match reach(state) {
        Reach::Running(sock) => match ask(&sock, &Request::Backup) {
            Ok(v) => {
                let dir = v
                    .get("dir")
                    .and_then(Value::as_str)
                    .map(PathBuf::from)
                    .filter(|d| d.starts_with(state));
                let m = v
                    .get("manifest")
                    .cloned()
                    .and_then(|m| serde_json::from_value::<Manifest>(m).ok());
                match (dir, m) {
                    (Some(d), Some(m)) => (d, m, true),
                    _ => {
                        eprintln!("error: bad answer from the service");
                        return EXIT_FAIL;
                    }
                }
            }
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
            match rt.block_on(super::snapshot(&store, state)) {
                Ok(s) => (s.dir, s.manifest, false),
                Err(e) => {
                    eprintln!("error: {e}");
                    return EXIT_STORE;
                }
            }
        }
    };
    let r = write_archive(file, state, &dir, &manifest);
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(e) = r {
        eprintln!("error: write {}: {e}", file.display());
        return EXIT_STORE;
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
    0
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
            super::tar::check(&e).map_err(|err| format!("{}: {err}", file.display()))?;
        match kind {
            super::tar::Kind::Dir => {
                let p = stage.join(&name);
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(&p)
                    .map_err(|e| format!("create {}: {e}", p.display()))?;
                let _ = std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode & 0o700));
            }
            super::tar::Kind::File { .. } if name == "MANIFEST.json" => {
                let mut b = vec![];
                std::io::Read::read_to_end(&mut e, &mut b).map_err(|e| e.to_string())?;
                manifest = Some(
                    serde_json::from_slice::<Manifest>(&b)
                        .map_err(|e| format!("MANIFEST.json: {e}"))?,
                );
            }
            super::tar::Kind::File { .. } => {
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
pub fn restore(config_path: Option<&Path>, state: Option<&Path>, file: &Path) -> i32 {
    let cfg = match config(config_path, state) {
        Ok(c) => c,
        Err(c) => return c,
    };
    let state = cfg.state_dir.clone();
    if let Reach::Running(_) = reach(&state) {
        eprintln!(
            "error: the service is running on {}: stop it first",
            state.display()
        );
        return EXIT_STATE;
    }
    let owner = match std::fs::read_dir(&state) {
        Ok(mut rd) => {
            if rd.next().is_some() {
                eprintln!(
                    "error: {} is not empty: restore never overwrites a state directory (move it aside first)",
                    state.display()
                );
                return EXIT_USAGE;
            }
            std::fs::metadata(&state).ok()
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => {
            eprintln!("error: {}: {e}", state.display());
            return EXIT_STORE;
        }
    };
    let Some(parent) = state.parent().filter(|p| !p.as_os_str().is_empty()) else {
        eprintln!("error: {} has no parent directory", state.display());
        return EXIT_USAGE;
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
        let digest = super::sha256_file(&db).map_err(|e| format!("read {}: {e}", db.display()))?;
        if digest != m.state_redb_sha256 {
            return Err("state.redb does not match the manifest's digest".to_string());
        }
        for k in KEY_FILES {
            if !stage.join(k).exists() {
                return Err(format!("the archive has no {k}"));
            }
        }
        let found = super::check_copy(&db)?;
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
            return EXIT_FAIL;
        }
    };
    // The empty directory gives way to the checked one (same filesystem).
    if owner.is_some() && std::fs::remove_dir(&state).is_err() {
        let _ = std::fs::remove_dir_all(&stage);
        eprintln!("error: cannot replace {}", state.display());
        return EXIT_STORE;
    }
    if let Err(e) = std::fs::rename(&stage, &state) {
        let _ = std::fs::remove_dir_all(&stage);
        eprintln!("error: move into {}: {e}", state.display());
        return EXIT_STORE;
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
    0
}
