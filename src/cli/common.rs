//! What the commands share: the `--config`/`--state-dir` flags
//! ([`Common`]), loading the configuration, the runtime, the one shutdown
//! signal, and the two ways to reach the appliance: the store, or the
//! running service's admin socket (STATE/admin.sock).

use std::path::{Path, PathBuf};

use super::Exit;
use crate::admin::{self, Request, Response};
use crate::config::{Config, Flags};
use crate::store::{Store, StoreError};

#[derive(clap::Args, Clone)]
pub struct Common {
    /// Config file (default /etc/cube-adapter/config.toml; missing is fine).
    #[arg(long, env = "CUBE_ADAPTER_CONFIG")]
    pub config: Option<PathBuf>,
    /// State directory (overrides the config file).
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
}

impl Common {
    /// The configuration with `--state-dir` as its only flag.
    pub fn load(&self) -> Result<Config, Exit> {
        let flags = Flags {
            state_dir: self.state_dir.clone(),
            ..Flags::default()
        };
        load(self.config.as_deref(), &flags)
    }

    /// The state directory the configuration and `--state-dir` name.
    pub fn state_dir(&self) -> Result<PathBuf, Exit> {
        Ok(self.load()?.state_dir)
    }
}

pub fn env_vars() -> Vec<(String, String)> {
    std::env::vars().collect()
}

/// Defaults < the file < CUBE_ADAPTER_* environment < flags; warnings on
/// stderr; exit 2 when the configuration is invalid.
pub fn load(config: Option<&Path>, flags: &Flags) -> Result<Config, Exit> {
    match Config::load(config, &env_vars(), flags) {
        Ok((c, warnings)) => {
            for w in warnings {
                eprintln!("warning: {w}");
            }
            Ok(c)
        }
        Err(e) => {
            eprintln!("error: {e}");
            Err(Exit::Usage)
        }
    }
}

pub fn runtime() -> Result<tokio::runtime::Runtime, Exit> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| {
            eprintln!("error: cannot start the runtime: {e}");
            Exit::Store
        })
}

/// Resolves at the first SIGTERM or SIGINT (never, if SIGTERM cannot be
/// watched). The one signal every long-running command stops on.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

pub fn print_json(v: &impl serde::Serialize) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
}

// ------------------------------------ the store, or the socket (token, user, audit)

/// The store, or the running service's admin socket.
pub enum Access {
    Store(Store),
    Socket(PathBuf),
}

/// As `access`, for the store the configuration names: a PostgreSQL one
/// (`[store] kind = "postgres"`) is opened in its database when the
/// service is stopped (as this state directory's replica).
pub fn access_config(cfg: &crate::config::Config) -> Result<Access, Exit> {
    let state = &cfg.state_dir;
    let Some(settings) = cfg.store.postgres() else {
        return access(state);
    };
    if let Reach::Running(sock) = reach(state) {
        return Ok(Access::Socket(sock));
    }
    match Store::open_postgres(state, &settings) {
        Ok(s) => Ok(Access::Store(s)),
        Err(StoreError::Locked(m)) => {
            eprintln!("error: {m}");
            Err(Exit::State)
        }
        Err(e) => {
            eprintln!("error: {e}");
            Err(Exit::Store)
        }
    }
}

/// Opens the store; while the service holds it, its admin socket instead.
pub fn access(state: &Path) -> Result<Access, Exit> {
    // A running service first: a replica of a PostgreSQL store has no
    // file to lock, and the service is how the CLI reaches its database.
    if let Reach::Running(sock) = reach(state) {
        return Ok(Access::Socket(sock));
    }
    if !state.join("state.redb").exists() {
        eprintln!(
            "error: no store at {} (has the service ever started? check --state-dir; \
             a PostgreSQL store is reached through its running service)",
            state.display()
        );
        return Err(Exit::State);
    }
    match Store::open(state) {
        Ok(s) => Ok(Access::Store(s)),
        Err(StoreError::Locked(_)) if state.join("admin.sock").exists() => {
            Ok(Access::Socket(state.join("admin.sock")))
        }
        Err(e) => {
            eprintln!("error: {e}");
            Err(Exit::Store)
        }
    }
}

/// One `admin::Request` to the running service; its answers, or an exit
/// code (3 when it cannot be reached, 1 when it answers with an error).
pub fn socket_call(path: &Path, req: &Request) -> Result<Vec<Response>, Exit> {
    let out = admin::call(path, req).map_err(|e| {
        eprintln!("error: {e}");
        Exit::State
    })?;
    if let Some(message) = out.iter().find_map(|r| match r {
        Response::Error { message } => Some(message),
        _ => None,
    }) {
        eprintln!("error: {message}");
        return Err(Exit::Failed);
    }
    Ok(out)
}

/// One `admin::Request` to the running service, its answers handed to
/// `each` as they arrive (nothing is collected); an exit code as
/// [`socket_call`]'s (3 when it cannot be reached, 1 when it answers with an
/// error, 1 when `each` fails: its message is printed).
pub fn socket_each(
    path: &Path,
    req: &Request,
    mut each: impl FnMut(Response) -> Result<(), String>,
) -> Result<(), Exit> {
    // Which side failed: the service's answer, `each`, or the socket.
    let mut failed = None;
    let r = admin::call_each(path, req, |r| {
        let e = match r {
            Response::Error { message } => message,
            r => match each(r) {
                Ok(()) => return Ok(()),
                Err(e) => e,
            },
        };
        failed = Some(e.clone());
        Err(e)
    });
    match (r, failed) {
        (Ok(()), _) => Ok(()),
        (Err(_), Some(message)) => {
            eprintln!("error: {message}");
            Err(Exit::Failed)
        }
        (Err(e), None) => {
            eprintln!("error: {e}");
            Err(Exit::State)
        }
    }
}

/// The one answer to a request (3 when there is none).
pub fn ask(path: &Path, req: &Request) -> Result<Response, Exit> {
    socket_call(path, req)?.into_iter().next().ok_or_else(|| {
        eprintln!("error: no answer from the service");
        Exit::State
    })
}

/// An answer of another kind than the request calls for: exit 1.
pub fn unexpected(_: Response) -> Exit {
    eprintln!("error: bad answer from the service");
    Exit::Failed
}

// ------------------------ the socket first, then the store (init, status, cert, backup)

/// Whether a service answers on `STATE/admin.sock`.
pub enum Reach {
    Running(PathBuf),
    Stopped,
}

pub fn reach(state: &Path) -> Reach {
    let sock = state.join("admin.sock");
    match std::os::unix::net::UnixStream::connect(&sock) {
        Ok(_) => Reach::Running(sock),
        Err(_) => Reach::Stopped,
    }
}

/// Open the store of a stopped service (exclusive until dropped).
pub fn open_stopped(state: &Path) -> Result<Store, Exit> {
    match Store::open(state) {
        Ok(s) => Ok(s),
        Err(StoreError::Locked(m)) => {
            eprintln!("error: {m}");
            Err(Exit::State)
        }
        Err(e) => {
            eprintln!("error: {e}");
            Err(Exit::Store)
        }
    }
}

pub fn not_initialised(state: &Path) -> Exit {
    eprintln!(
        "error: {} is not initialised (run `cube-adapter init`, or start the service once)",
        state.display()
    );
    Exit::State
}

/// Run as root on a state directory that belongs to the service user:
/// give what this command created there to that user too, so that the
/// service can read it (systemd re-owns a state directory only when its
/// top level has the wrong owner).
pub fn adopt_owner(state: &Path) {
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
