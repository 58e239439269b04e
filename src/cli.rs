//! Operator commands behind `main.rs`. Exit codes: 0 success, 1 the check
//! failed (e.g. a broken audit chain), 2 bad usage or configuration, 3 the
//! service state does not allow it (running / not running), 4 store error.

use std::path::{Path, PathBuf};

use crate::admin::{self, Request, TokenInfo};
use crate::auth::{self, Principal, Role};
use crate::config::{Config, Flags};
use crate::store::{Store, StoreError};

pub const EXIT_FAIL: i32 = 1;
pub const EXIT_USAGE: i32 = 2;
pub const EXIT_STATE: i32 = 3;
pub const EXIT_STORE: i32 = 4;

pub(crate) fn env_vars() -> Vec<(String, String)> {
    std::env::vars().collect()
}

pub(crate) fn load(config: Option<&Path>, flags: &Flags) -> Result<Config, i32> {
    match Config::load(config, &env_vars(), flags) {
        Ok((c, warnings)) => {
            for w in warnings {
                eprintln!("warning: {w}");
            }
            Ok(c)
        }
        Err(e) => {
            eprintln!("error: {e}");
            Err(EXIT_USAGE)
        }
    }
}

pub(crate) fn state_dir(config: Option<&Path>, state: Option<&Path>) -> Result<PathBuf, i32> {
    let flags = Flags {
        state_dir: state.map(Path::to_path_buf),
        ..Flags::default()
    };
    Ok(load(config, &flags)?.state_dir)
}

pub(crate) fn runtime() -> Result<tokio::runtime::Runtime, i32> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| {
            eprintln!("error: cannot start the runtime: {e}");
            EXIT_STORE
        })
}

/// The store, or the running service's admin socket.
enum Access {
    Store(Store),
    Socket(PathBuf),
}

fn access(state: &Path) -> Result<Access, i32> {
    if !state.join("state.redb").exists() {
        eprintln!(
            "error: no store at {} (has the service ever started? check --state-dir)",
            state.display()
        );
        return Err(EXIT_STATE);
    }
    match Store::open(state) {
        Ok(s) => Ok(Access::Store(s)),
        Err(StoreError::Locked(_)) if state.join("admin.sock").exists() => {
            Ok(Access::Socket(state.join("admin.sock")))
        }
        Err(e) => {
            eprintln!("error: {e}");
            Err(EXIT_STORE)
        }
    }
}

fn socket_call(path: &Path, req: &Request) -> Result<Vec<serde_json::Value>, i32> {
    let out = admin::call(path, req).map_err(|e| {
        eprintln!("error: {e}");
        EXIT_STATE
    })?;
    if let Some(err) = out
        .iter()
        .find_map(|v| v.get("error").and_then(|e| e.as_str()))
    {
        eprintln!("error: {err}");
        return Err(EXIT_FAIL);
    }
    Ok(out)
}

pub fn serve(config: Option<&Path>, flags: &Flags) -> i32 {
    let cfg = match load(config, flags) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let config_file = config.unwrap_or(Path::new(crate::config::DEFAULT_CONFIG));
    match crate::ops::preflight(config_file, &cfg) {
        Ok(warnings) => {
            for w in warnings {
                tracing::warn!("{w}");
            }
        }
        Err(e) => {
            eprintln!("error: {e}");
            return EXIT_USAGE;
        }
    }
    let launcher = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: cannot find this executable: {e}");
            return EXIT_STORE;
        }
    };
    let secrets = crate::app::EnvSecrets {
        shared_token: std::env::var("CUBE_ADAPTER_TOKEN")
            .ok()
            .filter(|t| !t.is_empty())
            .map(crate::cube::Secret::new),
    };
    let rt = match runtime() {
        Ok(r) => r,
        Err(c) => return c,
    };
    // SIGHUP re-reads the same file with the same environment and flags.
    let reload = crate::app::Reload::Signal(crate::ops::ConfigSource {
        path: config.map(Path::to_path_buf),
        env: env_vars(),
        flags: flags.clone(),
    });
    let result = rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(cfg.listen)
            .await
            .map_err(|e| anyhow::anyhow!("bind {}: {e}", cfg.listen))?;
        crate::app::serve_with(
            cfg,
            secrets,
            listener,
            launcher,
            print_started,
            shutdown_signal(),
            reload,
        )
        .await
    });
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e:#}");
            if e.to_string().contains("in use by another") {
                EXIT_STATE
            } else {
                EXIT_STORE
            }
        }
    }
}

fn print_started(s: &crate::app::Started) {
    use std::io::Write;
    // A closed stdout must not take the service down: ignore write errors.
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "cube-adapter listening on {}", s.url);
    let _ = writeln!(o, "  CA certificate:  {}", s.ca_file.display());
    let _ = writeln!(o, "  CA SHA-256:      {}", s.ca_fingerprint);
    let _ = match &s.admin_token_file {
        Some(f) => writeln!(
            o,
            "  admin token:     {} (written once; keep it safe)",
            f.display()
        ),
        None => writeln!(
            o,
            "  admin token:     issued on first start (see `cube-adapter token list`)"
        ),
    };
    let _ = writeln!(o, "  backend:         {}", s.backend);
    let _ = o.flush();
    crate::systemd::ready(&format!("listening on {}", s.url));
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    crate::systemd::notify(
        "STOPPING=1\nSTATUS=stopping: letting effects in flight record their outcome",
    );
}

pub fn config_check(config: Option<&Path>, flags: &Flags) -> i32 {
    match load(config, flags) {
        Ok(c) => {
            println!("configuration OK");
            match toml::to_string_pretty(&c) {
                Ok(t) => println!("{t}"),
                Err(e) => eprintln!("warning: cannot render the configuration: {e}"),
            }
            0
        }
        Err(code) => code,
    }
}

pub struct TokenCreate {
    pub tenant: String,
    pub subject: Option<String>,
    pub runtimes: Vec<String>,
    pub profiles: Vec<String>,
    pub actions: Vec<String>,
    pub no_actions: bool,
    pub roles: Vec<String>,
    pub task_templates: Vec<String>,
    pub description: Option<String>,
    /// Issue a client certificate for this identity into this directory
    /// instead of a bearer token.
    pub client_cert: Option<PathBuf>,
}

pub fn token_create(config: Option<&Path>, state: Option<&Path>, req: TokenCreate) -> i32 {
    let valid = |t: &str| {
        !t.is_empty()
            && t.len() <= 128
            && t.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_.:-".contains(&b))
    };
    if !valid(&req.tenant) {
        eprintln!("error: --tenant must be 1-128 characters of [A-Za-z0-9_.:-]");
        return EXIT_USAGE;
    }
    let roles: Result<Vec<Role>, String> = req.roles.iter().map(|r| r.parse()).collect();
    let mut roles = match roles {
        Ok(r) if r.is_empty() => vec![Role::Agent],
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return EXIT_USAGE;
        }
    };
    roles.sort();
    roles.dedup();
    for r in &req.runtimes {
        if !crate::config::RUNTIMES.contains(&r.as_str()) {
            eprintln!(
                "error: unknown runtime '{r}' ({})",
                crate::config::RUNTIMES.join(", ")
            );
            return EXIT_USAGE;
        }
    }
    let principal = Principal {
        subject: req.subject.unwrap_or_else(|| req.tenant.clone()),
        tenant: req.tenant,
        roles,
        runtimes: (!req.runtimes.is_empty()).then_some(req.runtimes),
        profiles: (!req.profiles.is_empty()).then_some(req.profiles),
        actions: if req.no_actions {
            vec![]
        } else if req.actions.is_empty() {
            vec!["*".into()]
        } else {
            req.actions
        },
        task_templates: if req.task_templates.is_empty() {
            vec!["*".into()]
        } else {
            req.task_templates
        },
        task: None,
    };
    let state = match state_dir(config, state) {
        Ok(s) => s,
        Err(c) => return c,
    };
    if let Some(dir) = req.client_cert {
        return cert_identity_create(&state, &dir, principal, req.description);
    }
    let token = match access(&state) {
        Err(c) => return c,
        Ok(Access::Socket(p)) => match socket_call(
            &p,
            &Request::TokenCreate {
                principal,
                description: req.description,
            },
        ) {
            Ok(out) => out
                .first()
                .and_then(|v| v.get("token"))
                .and_then(|t| t.as_str())
                .unwrap_or("")
                .to_string(),
            Err(c) => return c,
        },
        Ok(Access::Store(store)) => {
            let rt = match runtime() {
                Ok(r) => r,
                Err(c) => return c,
            };
            let r = rt.block_on(async {
                let (token, rec) = auth::new_token(principal, req.description)?;
                auth::store_token(&store, rec)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok::<_, String>(token)
            });
            match r {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("error: {e}");
                    return EXIT_STORE;
                }
            }
        }
    };
    if token.is_empty() {
        eprintln!("error: no token was issued");
        return EXIT_FAIL;
    }
    println!("{token}");
    0
}

pub fn token_list(config: Option<&Path>, state: Option<&Path>, json: bool) -> i32 {
    let state = match state_dir(config, state) {
        Ok(s) => s,
        Err(c) => return c,
    };
    let tokens: Vec<TokenInfo> = match access(&state) {
        Err(c) => return c,
        Ok(Access::Socket(p)) => match socket_call(&p, &Request::TokenList) {
            Ok(out) => out
                .first()
                .and_then(|v| v.get("tokens").cloned())
                .and_then(|t| serde_json::from_value(t).ok())
                .unwrap_or_default(),
            Err(c) => return c,
        },
        Ok(Access::Store(store)) => match auth::list_tokens(&store) {
            Ok(v) => v.into_iter().map(TokenInfo::from).collect(),
            Err(e) => {
                eprintln!("error: {e}");
                return EXIT_STORE;
            }
        },
    };
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&tokens).unwrap_or_default()
        );
        return 0;
    }
    println!(
        "{:<14} {:<16} {:<20} {:<24} {:<10} CREATED",
        "ID", "TENANT", "SUBJECT", "ROLES", "STATE"
    );
    for t in tokens {
        let roles: Vec<String> = t
            .principal
            .roles
            .iter()
            .map(|r| format!("{r:?}").to_lowercase())
            .collect();
        println!(
            "{:<14} {:<16} {:<20} {:<24} {:<10} {}",
            t.id,
            t.principal.tenant,
            t.principal.subject,
            roles.join(","),
            if t.revoked_at.is_some() {
                "revoked"
            } else {
                "active"
            },
            t.created_at
        );
    }
    0
}

pub fn token_revoke(config: Option<&Path>, state: Option<&Path>, id: &str) -> i32 {
    let state = match state_dir(config, state) {
        Ok(s) => s,
        Err(c) => return c,
    };
    let found = match access(&state) {
        Err(c) => return c,
        Ok(Access::Socket(p)) => {
            match socket_call(&p, &Request::TokenRevoke { id: id.to_string() }) {
                Ok(out) => out
                    .first()
                    .and_then(|v| v.get("revoked"))
                    .and_then(|b| b.as_bool())
                    .unwrap_or(false),
                Err(c) => return c,
            }
        }
        Ok(Access::Store(store)) => {
            let rt = match runtime() {
                Ok(r) => r,
                Err(c) => return c,
            };
            match rt.block_on(auth::revoke_token(&store, id)) {
                Ok(f) => f,
                Err(e) => {
                    eprintln!("error: {e}");
                    return EXIT_STORE;
                }
            }
        }
    };
    if found {
        println!("revoked");
        0
    } else {
        eprintln!("error: no token with id {id}");
        EXIT_FAIL
    }
}

pub fn audit_verify(config: Option<&Path>, state: Option<&Path>) -> i32 {
    let state = match state_dir(config, state) {
        Ok(s) => s,
        Err(c) => return c,
    };
    let r = match access(&state) {
        Err(c) => return c,
        Ok(Access::Socket(p)) => match admin::call(&p, &Request::AuditVerify) {
            Ok(out) => match out.first() {
                Some(v) if v.get("ok").and_then(|o| o.as_bool()) == Some(true) => {
                    Ok(v.get("result").cloned().unwrap_or_default())
                }
                Some(v) => Err(v
                    .get("error")
                    .and_then(|e| e.as_str())
                    .unwrap_or("unknown error")
                    .to_string()),
                None => Err("no answer from the service".into()),
            },
            Err(e) => {
                eprintln!("error: {e}");
                return EXIT_STATE;
            }
        },
        Ok(Access::Store(store)) => {
            crate::audit::verify(&store).map(|v| serde_json::to_value(v).unwrap_or_default())
        }
    };
    match r {
        Ok(v) => {
            println!("audit chain intact: {}", v);
            0
        }
        Err(e) => {
            eprintln!("audit chain BROKEN: {e}");
            EXIT_FAIL
        }
    }
}

pub fn audit_export(config: Option<&Path>, state: Option<&Path>, since: u64) -> i32 {
    use std::io::Write;
    let state = match state_dir(config, state) {
        Ok(s) => s,
        Err(c) => return c,
    };
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    match access(&state) {
        Err(c) => c,
        Ok(Access::Socket(p)) => match socket_call(&p, &Request::AuditExport { since }) {
            Ok(lines) => {
                for v in lines {
                    if let Some(e) = v.get("event")
                        && writeln!(out, "{e}").is_err()
                    {
                        return EXIT_FAIL;
                    }
                }
                0
            }
            Err(c) => c,
        },
        Ok(Access::Store(store)) => {
            match crate::audit::export(&store, since, |e| {
                writeln!(out, "{}", serde_json::to_string(e).unwrap_or_default())
            }) {
                Ok(_) => 0,
                Err(e) => {
                    eprintln!("error: {e}");
                    EXIT_STORE
                }
            }
        }
    }
}

pub fn audit_reconcile(
    config: Option<&Path>,
    state: Option<&Path>,
    operation: Option<&str>,
    note: &str,
) -> i32 {
    if note.trim().is_empty() {
        eprintln!("error: --note must say why (a ticket, what was checked)");
        return EXIT_USAGE;
    }
    let flags = Flags {
        state_dir: state.map(Path::to_path_buf),
        ..Flags::default()
    };
    let cfg = match load(config, &flags) {
        Ok(c) => c,
        Err(c) => return c,
    };
    let store = match access(&cfg.state_dir) {
        Err(c) => return c,
        Ok(Access::Socket(_)) => {
            eprintln!(
                "error: the service is running; stop it first (`systemctl stop cube-adapter`): reconcile works only offline"
            );
            return EXIT_STATE;
        }
        Ok(Access::Store(s)) => s,
    };
    let key = match std::fs::read(cfg.state_dir.join("hmac.key")) {
        Ok(k) => k,
        Err(e) => {
            eprintln!(
                "error: cannot read {}: {e}",
                cfg.state_dir.join("hmac.key").display()
            );
            return EXIT_STORE;
        }
    };
    let journal = match crate::audit::Journal::open(store, cfg.audit.mode, key) {
        Ok(j) => j,
        Err(e) => {
            eprintln!("error: {e}");
            return EXIT_STORE;
        }
    };
    let rt = match runtime() {
        Ok(r) => r,
        Err(c) => return c,
    };
    match rt.block_on(crate::audit::reconcile(&journal, operation, note)) {
        Ok(done) if done.is_empty() => {
            println!("nothing to reconcile: no pending intents");
            0
        }
        Ok(done) => {
            for op in &done {
                println!("reconciled {op}");
            }
            0
        }
        Err(e) => {
            eprintln!("error: {e}");
            EXIT_FAIL
        }
    }
}

/// `token create --client-cert DIR`: a client certificate from the
/// appliance's CA (common name: the subject) that stands for `principal`.
/// Writes `DIR/client.pem`, `DIR/client.key` (0600) and `DIR/ca.pem`;
/// prints the identity's id.
fn cert_identity_create(
    state: &Path,
    dir: &Path,
    principal: Principal,
    description: Option<String>,
) -> i32 {
    let files = ["client.pem", "client.key", "ca.pem"].map(|f| dir.join(f));
    if let Some(f) = files.iter().find(|f| f.exists()) {
        eprintln!(
            "error: {} exists already (nothing was changed)",
            f.display()
        );
        return EXIT_USAGE;
    }
    let access = match access(state) {
        Ok(a) => a,
        Err(c) => return c,
    };
    let issued = crate::store::Sealer::load_or_create(&state.join("secret.key"))
        .map_err(|e| e.to_string())
        .and_then(|sealer| {
            crate::tls::LocalCa::load_or_create_sealed(
                &state.join(crate::tls::IDENTITY_CA_DIR),
                Some(sealer),
            )
            .map_err(|e| e.to_string())
        })
        .and_then(|ca| {
            let (cert, key) = ca
                .issue_client(&principal.subject)
                .map_err(|e| e.to_string())?;
            // The clients' trust: the CA of the appliance's server
            // certificate.
            let p = state.join("tls/ca.pem");
            let server_ca =
                std::fs::read_to_string(&p).map_err(|e| format!("read {}: {e}", p.display()))?;
            Ok((server_ca, cert, key))
        })
        .and_then(|(ca, cert, key)| {
            let der = crate::tls::parse_certs(cert.as_bytes())
                .map_err(|e| e.to_string())?
                .into_iter()
                .next()
                .ok_or("no certificate was issued")?;
            use sha2::Digest;
            let fp = auth::PeerCert(sha2::Sha256::digest(der.as_ref()).into());
            Ok((ca, cert, key, fp))
        });
    let (ca, cert, key, fp) = match issued {
        Ok(v) => v,
        Err(e) => {
            eprintln!("error: cannot issue a client certificate: {e}");
            return EXIT_STATE;
        }
    };
    let rec = auth::cert_record(principal, description, &fp);
    let id = rec.id.clone();
    let stored = match access {
        Access::Socket(p) => {
            socket_call(&p, &Request::CertIdentityCreate { record: rec }).map(|_| ())
        }
        Access::Store(store) => {
            let rt = match runtime() {
                Ok(r) => r,
                Err(c) => return c,
            };
            rt.block_on(auth::store_cert_identity(&store, rec))
                .map_err(|e| {
                    eprintln!("error: {e}");
                    EXIT_STORE
                })
        }
    };
    if let Err(c) = stored {
        return c;
    }
    if let Err(e) = std::fs::create_dir_all(dir)
        .map_err(|e| e.to_string())
        .and_then(|()| {
            crate::tls::write_private(&files[0], cert.as_bytes(), 0o644).map_err(|e| e.to_string())
        })
        .and_then(|()| {
            crate::tls::write_private(&files[1], key.as_bytes(), 0o600).map_err(|e| e.to_string())
        })
        .and_then(|()| {
            crate::tls::write_private(&files[2], ca.as_bytes(), 0o644).map_err(|e| e.to_string())
        })
    {
        eprintln!(
            "error: the identity {id} is registered but its files could not be written ({e}); revoke it: cube-adapter token revoke {id}"
        );
        return EXIT_FAIL;
    }
    eprintln!(
        "wrote {}, {} and {} (the appliance's CA)",
        files[0].display(),
        files[1].display(),
        files[2].display()
    );
    println!("{id}");
    0
}

/// What `cube-adapter user …` was asked.
pub enum UserCommand {
    Add {
        name: String,
        tenant: String,
        roles: Vec<String>,
        actions: Vec<String>,
        profiles: Vec<String>,
        task_templates: Vec<String>,
        password_file: Option<PathBuf>,
    },
    Passwd {
        name: String,
        password_file: Option<PathBuf>,
    },
    Disable {
        name: String,
    },
    Enable {
        name: String,
    },
    Remove {
        name: String,
    },
    List {
        json: bool,
    },
}

/// A password from a file (its first line) or from stdin's first line.
fn read_password(file: Option<&Path>) -> Result<String, String> {
    let text = match file {
        Some(f) => std::fs::read_to_string(f).map_err(|e| format!("read {}: {e}", f.display()))?,
        None => {
            let mut s = String::new();
            std::io::stdin()
                .read_line(&mut s)
                .map_err(|e| format!("read the password from stdin: {e}"))?;
            s
        }
    };
    Ok(text.lines().next().unwrap_or("").to_string())
}

/// `cube-adapter user …`: people (approvers, auditors) who sign in with a
/// password (HTTP Basic on /v1, and the console). Exit 0 done, 1 refused
/// (no such user, exists already), 2 bad arguments.
pub fn user(config: Option<&Path>, state: Option<&Path>, cmd: UserCommand) -> i32 {
    use crate::auth::users::{UserOp, hash_password, valid_name};
    let usage = |m: String| {
        eprintln!("error: {m}");
        EXIT_USAGE
    };
    let (op, list_json) = match cmd {
        UserCommand::Add {
            name,
            tenant,
            roles,
            actions,
            profiles,
            task_templates,
            password_file,
        } => {
            if !valid_name(&name) {
                return usage("a user name must match ^[a-z][a-z0-9._-]{0,63}$".into());
            }
            let valid_tenant = !tenant.is_empty()
                && tenant.len() <= 128
                && tenant
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_.:-".contains(&b));
            if !valid_tenant {
                return usage("--tenant must be 1-128 characters of [A-Za-z0-9_.:-]".into());
            }
            let roles: Result<Vec<Role>, String> = roles.iter().map(|r| r.parse()).collect();
            let mut roles = match roles {
                Ok(r) if r.is_empty() => vec![Role::Approver],
                Ok(r) => r,
                Err(e) => return usage(e),
            };
            roles.sort();
            roles.dedup();
            let hash = match read_password(password_file.as_deref()).and_then(|p| hash_password(&p))
            {
                Ok(h) => h,
                Err(e) => return usage(e),
            };
            let principal = Principal {
                tenant,
                subject: name,
                roles,
                runtimes: None,
                profiles: (!profiles.is_empty()).then_some(profiles),
                actions: if actions.is_empty() {
                    ["task:approve", "task:status", "task:receipt", "lease:list"]
                        .map(String::from)
                        .to_vec()
                } else {
                    actions
                },
                task_templates: if task_templates.is_empty() {
                    vec!["*".into()]
                } else {
                    task_templates
                },
                task: None,
            };
            (UserOp::Add { principal, hash }, false)
        }
        UserCommand::Passwd {
            name,
            password_file,
        } => match read_password(password_file.as_deref()).and_then(|p| hash_password(&p)) {
            Ok(hash) => (UserOp::Passwd { name, hash }, false),
            Err(e) => return usage(e),
        },
        UserCommand::Disable { name } => (
            UserOp::SetDisabled {
                name,
                disabled: true,
            },
            false,
        ),
        UserCommand::Enable { name } => (
            UserOp::SetDisabled {
                name,
                disabled: false,
            },
            false,
        ),
        UserCommand::Remove { name } => (UserOp::Remove { name }, false),
        UserCommand::List { json } => (UserOp::List, json),
    };
    let state = match state_dir(config, state) {
        Ok(s) => s,
        Err(c) => return c,
    };
    let listing = matches!(op, UserOp::List);
    let out: Result<serde_json::Value, String> = match access(&state) {
        Err(c) => return c,
        Ok(Access::Socket(p)) => match socket_call(&p, &Request::User { op }) {
            Ok(out) => Ok(out.into_iter().next().unwrap_or_default()),
            Err(c) => return c,
        },
        Ok(Access::Store(store)) => {
            let rt = match runtime() {
                Ok(r) => r,
                Err(c) => return c,
            };
            rt.block_on(crate::auth::users::user_op(&store, op))
        }
    };
    let v = match out {
        Ok(v) if v.get("ok") == Some(&serde_json::Value::Bool(false)) => {
            eprintln!(
                "error: {}",
                v.get("error").and_then(|e| e.as_str()).unwrap_or("refused")
            );
            return EXIT_FAIL;
        }
        Ok(v) => v,
        Err(e) => {
            eprintln!("error: {e}");
            return EXIT_FAIL;
        }
    };
    if !listing {
        return 0;
    }
    let users = v.get("users").cloned().unwrap_or_default();
    if list_json {
        println!(
            "{}",
            serde_json::to_string_pretty(&users).unwrap_or_default()
        );
        return 0;
    }
    println!(
        "{:<20} {:<16} {:<24} {:<10} PASSWORD CHANGED",
        "NAME", "TENANT", "ROLES", "STATE"
    );
    for u in users.as_array().into_iter().flatten() {
        let at = |p: &str| u.pointer(p).cloned().unwrap_or_default();
        let roles: Vec<String> = at("/principal/roles")
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|r| r.as_str().map(str::to_string))
            .collect();
        println!(
            "{:<20} {:<16} {:<24} {:<10} {}",
            at("/name").as_str().unwrap_or(""),
            at("/principal/tenant").as_str().unwrap_or(""),
            roles.join(","),
            if at("/disabled_at").is_null() {
                "active"
            } else {
                "disabled"
            },
            at("/password_changed_at").as_str().unwrap_or("")
        );
    }
    0
}
