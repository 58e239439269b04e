//! The MCP gateway of an embedded sandbox: `mcp-gateway --config JSON`, as
//! CubeSandbox's SDK starts it once a sandbox is made (envd
//! `process.Process/Start`, as root, the token in `GATEWAY_ACCESS_TOKEN`).
//!
//! Every namespaced sandbox has this binary, read-only, at `GATEWAY_PATH`
//! (`launch.rs` binds it); run under that name (argv[0]'s file name
//! `mcp-gateway`) it is this gateway. The *starter*:
//! 1. checks its command line (one server, `{"NAME": {"runCmd", "envs"}}`)
//!    and the token: exit 2 when either is wrong;
//! 2. forks, single-threaded and before any runtime, a *daemon* that leaves
//!    envd's session and process group (`setsid`): envd kills the starter's
//!    group at a Start's deadline, and an appliance kills a command's tree
//!    after it; neither reaches the daemon, which ends with the sandbox (its
//!    pid namespace) and nothing else;
//! 3. the daemon binds `127.0.0.1:50005`, starts the server (`/bin/sh -c
//!    runCmd`, a clean environment plus `envs`), MCP-initializes it (30 s at
//!    most), and only then tells the starter, which exits 0; or 1 with the
//!    reason (the port taken, the server gone, no answer to `initialize`).
//!
//! The daemon serves `GET /health` (no token) and `/mcp`, MCP Streamable
//! HTTP behind `Authorization: Bearer TOKEN`, whose `tools/list`,
//! `tools/call` and `ping` go to the one server over its stdio (one server
//! for every session). Nothing it serves changes what it runs: its only
//! configuration is its command line. If the server exits it is not started
//! again: calls get an MCP error and `/health` answers 503.
//!
//! It keeps its files in `STATE_DIR` (mode 0700): `calls.log` (a line per
//! MCP request: its method and, for `tools/call`, the tool and the size of
//! its arguments, never their values), `server.log` (the server's stderr),
//! `gateway.log` (its own) and `server.pid`. The logs are capped
//! (`LOG_CAP`, one older file kept as `NAME.1`).

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use nix::fcntl::OFlag;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, ClientCapabilities, ClientConfig, ClientRequest,
    Implementation, ListToolsResult, PaginatedRequestParams, PingRequest, ServerCapabilities,
};
use rmcp::service::{Peer, RequestContext, RoleClient, RoleServer, ServiceError};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData as McpError, ServiceExt};
use serde::{Deserialize, Serialize};
use tokio::io::AsyncReadExt;

use crate::sys::{self, Forked};
use crate::wire::MCP_GATEWAY_PORT;

/// Where every namespaced sandbox has the gateway (this binary), read-only.
/// The appliance starts it by this path on the embedded backend (and as
/// `mcp-gateway` on a CubeSandbox, whose templates have their own).
pub const GATEWAY_PATH: &str = "/run/cube/mcp-gateway";
/// The read-only directory that holds `GATEWAY_PATH` (a mount point: the
/// sandbox can neither rename it nor add to it).
pub const GATEWAY_DIR: &str = "/run/cube";
/// The program name (argv[0]'s file name) that runs the gateway.
pub const PROGRAM: &str = "mcp-gateway";
/// The hidden first argument that runs the gateway under any name.
pub const HIDDEN_ARG: &str = "__mcp-gateway";
/// The environment variable that holds the bearer token of `/mcp`.
pub const TOKEN_ENV: &str = "GATEWAY_ACCESS_TOKEN";
/// The shortest token accepted.
pub const MIN_TOKEN_LEN: usize = 16;
/// The gateway's own directory in the sandbox (mode 0700).
pub const STATE_DIR: &str = "/run/mcp-gateway";
/// In `STATE_DIR`: a line per MCP request.
pub const CALLS_LOG: &str = "calls.log";
/// In `STATE_DIR`: the server's stderr.
pub const SERVER_LOG: &str = "server.log";
/// In `STATE_DIR`: the gateway's own messages.
pub const GATEWAY_LOG: &str = "gateway.log";
/// In `STATE_DIR`: the server's pid (of its `/bin/sh`, or what it `exec`s).
pub const SERVER_PID: &str = "server.pid";
/// How long the server has to answer `initialize`.
pub const INIT_DEADLINE: Duration = Duration::from_secs(30);
/// Exit code: started.
pub const EXIT_OK: i32 = 0;
/// Exit code: the gateway could not start (the reason on stderr).
pub const EXIT_FAILED: i32 = 1;
/// Exit code: a wrong command line, configuration or token.
pub const EXIT_USAGE: i32 = 2;

/// Past this size a log starts over (its previous content kept as `NAME.1`).
const LOG_CAP: u64 = 1024 * 1024;
/// How long an MCP session may go without a message before it ends (rmcp
/// counts a tool call's silence too: no call may take longer).
pub const SESSION_IDLE: Duration = Duration::from_secs(3600);
/// The largest `/mcp` request body.
const MAX_BODY: usize = 4 * 1024 * 1024;
/// The server's `PATH` (envd's own).
const SERVER_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// The server's `HOME`: the gateway runs as root.
const SERVER_HOME: &str = "/root";
/// Names and tools longer than this are cut in `calls.log`.
const LOG_FIELD_MAX: usize = 128;

/// The one MCP server a gateway runs, from `--config`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewayConfig {
    /// The server's name (the config's only key).
    pub name: String,
    /// The shell command that starts it (`/bin/sh -c`), a stdio MCP server.
    pub run_cmd: String,
    /// Its environment, besides `PATH` and `HOME`.
    pub envs: BTreeMap<String, String>,
}

/// Why a command line or a configuration is refused (exit 2).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("usage: mcp-gateway --config JSON (the access token in {TOKEN_ENV})")]
    Usage,
    #[error("--config is not JSON: {0}")]
    NotJson(String),
    #[error("--config must be a JSON object of MCP servers by name")]
    NotObject,
    #[error("--config names no MCP server: give exactly one")]
    NoServer,
    #[error("--config names {0} MCP servers: this gateway runs exactly one")]
    TooMany(usize),
    #[error(
        "the MCP server name {0:?} must be 1 to 128 characters, none of them control characters"
    )]
    BadName(String),
    #[error(
        "MCP server {0:?} has no runCmd: catalog servers are not available here, \
         give the command that starts a stdio MCP server"
    )]
    NoRunCmd(String),
    #[error("MCP server {name:?}: {reason}")]
    BadEntry { name: String, reason: String },
}

/// Why the token is refused (exit 2).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TokenError {
    #[error("{TOKEN_ENV} is not set: the gateway needs the token /mcp requires")]
    Missing,
    #[error(
        "{TOKEN_ENV} must be at least {MIN_TOKEN_LEN} printable ASCII characters, \
         without spaces"
    )]
    Weak,
}

/// One entry of `--config`, as the SDK's `mcp` object has it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Entry {
    run_cmd: String,
    #[serde(default)]
    envs: BTreeMap<String, String>,
}

/// The configuration of a command line (the arguments after the program).
pub fn parse_args(args: &[String]) -> Result<GatewayConfig, ConfigError> {
    let json = match args {
        [flag, json] if flag == "--config" => json.as_str(),
        [one] => one.strip_prefix("--config=").ok_or(ConfigError::Usage)?,
        _ => return Err(ConfigError::Usage),
    };
    parse_config(json)
}

/// `{"NAME": {"runCmd": "…", "envs": {"K": "V"}}}`, exactly one entry.
pub fn parse_config(json: &str) -> Result<GatewayConfig, ConfigError> {
    let v: serde_json::Value =
        serde_json::from_str(json).map_err(|e| ConfigError::NotJson(e.to_string()))?;
    let serde_json::Value::Object(servers) = v else {
        return Err(ConfigError::NotObject);
    };
    let mut it = servers.into_iter();
    let (name, entry) = match (it.next(), it.len()) {
        (None, _) => return Err(ConfigError::NoServer),
        (Some(one), 0) => one,
        (Some(_), rest) => return Err(ConfigError::TooMany(rest + 1)),
    };
    if name.is_empty() || name.chars().count() > 128 || name.chars().any(char::is_control) {
        return Err(ConfigError::BadName(name));
    }
    let bad = |reason: String| ConfigError::BadEntry {
        name: name.clone(),
        reason,
    };
    let serde_json::Value::Object(fields) = &entry else {
        return Err(bad("the entry must be a JSON object".into()));
    };
    if !fields.contains_key("runCmd") {
        return Err(ConfigError::NoRunCmd(name));
    }
    let e: Entry = serde_json::from_value(entry).map_err(|e| bad(e.to_string()))?;
    if e.run_cmd.trim().is_empty() {
        return Err(bad("runCmd is empty".into()));
    }
    if e.run_cmd.contains('\0') {
        return Err(bad("runCmd holds a NUL character".into()));
    }
    for (k, v) in &e.envs {
        let mut chars = k.chars();
        let name_ok = chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !name_ok {
            return Err(bad(format!(
                "envs: {k:?} is not an environment variable name"
            )));
        }
        if v.contains('\0') {
            return Err(bad(format!("envs: the value of {k} holds a NUL character")));
        }
    }
    Ok(GatewayConfig {
        name,
        run_cmd: e.run_cmd,
        envs: e.envs,
    })
}

/// The token from the environment's value.
pub fn parse_token(value: Option<OsString>) -> Result<String, TokenError> {
    let v = value.ok_or(TokenError::Missing)?;
    let v = v.into_string().map_err(|_| TokenError::Weak)?;
    if v.len() < MIN_TOKEN_LEN || !v.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(TokenError::Weak);
    }
    Ok(v)
}

/// Entry point of `mcp-gateway ARGS…` (`args`: what follows the program
/// name, or `__mcp-gateway`). Must run before any thread is started.
/// Returns the process exit code.
pub fn gateway_main(args: Vec<OsString>) -> i32 {
    sys::close_fds_from(3);
    let args: Option<Vec<String>> = args.into_iter().map(|a| a.into_string().ok()).collect();
    let cfg = match args.ok_or(ConfigError::Usage).and_then(|a| parse_args(&a)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("mcp-gateway: {e}");
            return EXIT_USAGE;
        }
    };
    let token = match parse_token(std::env::var_os(TOKEN_ENV)) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("mcp-gateway: {e}");
            return EXIT_USAGE;
        }
    };
    let (ready_r, ready_w) = match nix::unistd::pipe2(OFlag::O_CLOEXEC) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("mcp-gateway: cannot make a pipe: {e}");
            return EXIT_FAILED;
        }
    };
    match sys::fork_single_threaded() {
        Err(e) => {
            eprintln!("mcp-gateway: cannot fork: {e}");
            EXIT_FAILED
        }
        Ok(Forked::Child) => {
            drop(ready_r);
            std::process::exit(daemon(cfg, token, ready_w))
        }
        Ok(Forked::Parent(child)) => {
            drop(ready_w);
            starter_waits(child, ready_r, &cfg.name)
        }
    }
}

/// The starter: wait for the daemon's word.
fn starter_waits(child: nix::unistd::Pid, ready: OwnedFd, name: &str) -> i32 {
    let mut line = String::new();
    let read = BufReader::new(std::fs::File::from(ready)).read_line(&mut line);
    let line = line.trim();
    if read.is_ok() && line == "ready" {
        println!("mcp-gateway: MCP server {name:?} served on port {MCP_GATEWAY_PORT}");
        return EXIT_OK;
    }
    let status = nix::sys::wait::waitpid(child, None);
    match line.strip_prefix("error ") {
        Some(why) => eprintln!("mcp-gateway: {why}"),
        None => eprintln!("mcp-gateway: the gateway ended during its start ({status:?})"),
    }
    EXIT_FAILED
}

fn tell(fd: &OwnedFd, msg: &str) {
    let line = format!("{}\n", msg.replace('\n', " "));
    let _ = nix::unistd::write(fd, line.as_bytes());
}

/// The daemon: its own session, its directory, then the runtime.
fn daemon(cfg: GatewayConfig, token: String, ready: OwnedFd) -> i32 {
    let _ = nix::unistd::setsid();
    if let Err(e) = set_up_files() {
        tell(&ready, &format!("error {e:#}"));
        return EXIT_FAILED;
    }
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tell(&ready, &format!("error cannot start a runtime: {e}"));
            return EXIT_FAILED;
        }
    };
    rt.block_on(async move {
        let started = match start(cfg, token).await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("mcp-gateway: {e:#}");
                tell(&ready, &format!("error {e:#}"));
                return EXIT_FAILED;
            }
        };
        tell(&ready, "ready");
        drop(ready);
        match axum::serve(started.listener, started.app).await {
            Ok(()) => EXIT_OK,
            Err(e) => {
                eprintln!("mcp-gateway: serving ended: {e}");
                EXIT_FAILED
            }
        }
    })
}

/// Make `STATE_DIR` (0700, a directory of its own, never a link), send
/// stderr to `gateway.log` and stdin/stdout to `/dev/null`: envd's pipes
/// are the starter's, not the daemon's.
fn set_up_files() -> anyhow::Result<()> {
    let dir = Path::new(STATE_DIR);
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let m = std::fs::symlink_metadata(dir)?;
            anyhow::ensure!(
                m.is_dir() && !m.file_type().is_symlink(),
                "{STATE_DIR} is there and is not a directory"
            );
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
        }
        Err(e) => return Err(e).with_context(|| format!("cannot make {STATE_DIR}")),
    }
    let log = open_log(&dir.join(GATEWAY_LOG))
        .with_context(|| format!("cannot open {STATE_DIR}/{GATEWAY_LOG}"))?;
    let null = std::fs::File::open("/dev/null").context("cannot open /dev/null")?;
    nix::unistd::dup2_stdin(&null).context("stdin")?;
    let null_w = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/null")
        .context("cannot open /dev/null")?;
    nix::unistd::dup2_stdout(&null_w).context("stdout")?;
    nix::unistd::dup2_stderr(&log).context("stderr")?;
    Ok(())
}

/// Open a log to append to: 0600, never through a link.
fn open_log(path: &Path) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// A log that starts over past `LOG_CAP`, its previous content kept as
/// `NAME.1`. Appends are small and the file is on the sandbox's `/run`
/// tmpfs: they are written in place.
struct CappedLog {
    path: PathBuf,
    file: Mutex<(std::fs::File, u64)>,
}

impl CappedLog {
    fn open(path: PathBuf) -> std::io::Result<Self> {
        let f = open_log(&path)?;
        let len = f.metadata()?.len();
        Ok(Self {
            path,
            file: Mutex::new((f, len)),
        })
    }

    fn append(&self, data: &[u8]) {
        let Ok(mut g) = self.file.lock() else {
            return;
        };
        if g.1.saturating_add(data.len() as u64) > LOG_CAP {
            let mut old = self.path.clone().into_os_string();
            old.push(".1");
            let _ = std::fs::rename(&self.path, &old);
            if let Ok(f) = open_log(&self.path) {
                *g = (f, 0);
            }
        }
        if g.0.write_all(data).is_ok() {
            g.1 = g.1.saturating_add(data.len() as u64);
        }
    }
}

/// A line of `calls.log`.
#[derive(Serialize)]
struct CallLine<'a> {
    method: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    arguments_bytes: Option<usize>,
}

fn clip(s: &str) -> &str {
    match s.char_indices().nth(LOG_FIELD_MAX) {
        Some((i, _)) => s.get(..i).unwrap_or(s),
        None => s,
    }
}

/// The `calls.log` lines of a `/mcp` POST body (a message or a batch): one
/// per request (notifications and answers are not requests). For
/// `tools/call`, the tool and the size of its arguments (compact JSON),
/// never their values.
pub fn call_lines(body: &[u8]) -> Vec<String> {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) else {
        return vec![];
    };
    let messages = match &v {
        serde_json::Value::Array(batch) => batch.iter().collect(),
        one => vec![one],
    };
    messages
        .into_iter()
        .filter(|m| m.get("id").is_some())
        .filter_map(|m| {
            let method = m.get("method")?.as_str()?;
            let params = m.get("params");
            let call = method == "tools/call";
            let line = CallLine {
                method: clip(method),
                tool: call
                    .then(|| params?.get("name")?.as_str().map(clip))
                    .flatten(),
                arguments_bytes: call.then(|| {
                    params
                        .and_then(|p| p.get("arguments"))
                        .and_then(|a| serde_json::to_vec(a).ok())
                        .map_or(0, |b| b.len())
                }),
            };
            serde_json::to_string(&line).ok()
        })
        .collect()
}

/// What `start` made: the listener and the app to serve on it.
struct Started {
    listener: tokio::net::TcpListener,
    app: Router,
}

/// Bind, start the server, initialize it, and build the app.
async fn start(cfg: GatewayConfig, token: String) -> anyhow::Result<Started> {
    let dir = Path::new(STATE_DIR);
    let listener = tokio::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, MCP_GATEWAY_PORT))
        .await
        .with_context(|| {
            format!("cannot listen on 127.0.0.1:{MCP_GATEWAY_PORT} (does a gateway run already?)")
        })?;
    let calls = Arc::new(CappedLog::open(dir.join(CALLS_LOG)).context("cannot open calls.log")?);
    let server_log =
        Arc::new(CappedLog::open(dir.join(SERVER_LOG)).context("cannot open server.log")?);
    let cwd = if Path::new(SERVER_HOME).is_dir() {
        SERVER_HOME
    } else {
        "/"
    };
    let mut child = tokio::process::Command::new("/bin/sh")
        .arg("-c")
        .arg(&cfg.run_cmd)
        .env_clear()
        .env("PATH", SERVER_PATH)
        .env("HOME", SERVER_HOME)
        .envs(&cfg.envs)
        .current_dir(cwd)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("cannot start the MCP server (/bin/sh -c runCmd)")?;
    if let Some(pid) = child.id() {
        let _ = std::fs::write(dir.join(SERVER_PID), format!("{pid}\n"));
    }
    let (Some(stdin), Some(stdout), Some(mut stderr)) =
        (child.stdin.take(), child.stdout.take(), child.stderr.take())
    else {
        anyhow::bail!("the MCP server has no stdio pipes");
    };
    tokio::spawn(async move {
        let mut buf = vec![0u8; 16 * 1024];
        while let Ok(n) = stderr.read(&mut buf).await {
            if n == 0 {
                break;
            }
            server_log.append(buf.get(..n).unwrap_or_default());
        }
    });
    let running = match tokio::time::timeout(INIT_DEADLINE, Upstream.serve((stdout, stdin))).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            let how = match tokio::time::timeout(Duration::from_secs(2), child.wait()).await {
                Ok(Ok(st)) => format!(" (it exited: {st})"),
                _ => String::new(),
            };
            anyhow::bail!(
                "the MCP server did not initialize: {e}{how}; its stderr is in \
                 {STATE_DIR}/{SERVER_LOG}"
            );
        }
        Err(_) => anyhow::bail!(
            "the MCP server did not answer initialize within {} s; its stderr is in \
             {STATE_DIR}/{SERVER_LOG}",
            INIT_DEADLINE.as_secs()
        ),
    };
    let peer = running.peer().clone();
    let alive = Arc::new(AtomicBool::new(true));
    {
        let alive = alive.clone();
        tokio::spawn(async move {
            let st = child.wait().await;
            alive.store(false, Ordering::SeqCst);
            match st {
                Ok(st) => eprintln!("mcp-gateway: the MCP server exited ({st}); calls now fail"),
                Err(e) => eprintln!("mcp-gateway: the MCP server is gone ({e}); calls now fail"),
            }
        });
    }
    {
        let alive = alive.clone();
        tokio::spawn(async move {
            let _ = running.waiting().await;
            alive.store(false, Ordering::SeqCst);
        });
    }
    let upstream = peer.peer_info();
    let server_info = upstream
        .as_ref()
        .and_then(|i| i.server_info.clone())
        .unwrap_or_else(|| Implementation::new(cfg.name.clone(), "unknown"));
    let mut info =
        rmcp::model::ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(server_info);
    if let Some(i) = upstream.as_ref().and_then(|i| i.instructions.clone()) {
        info = info.with_instructions(i);
    }
    let gateway = Gateway {
        upstream: peer,
        alive: alive.clone(),
        info,
    };
    let mut sessions = LocalSessionManager::default();
    sessions.session_config.keep_alive = Some(SESSION_IDLE);
    let service = StreamableHttpService::new(
        move || Ok(gateway.clone()),
        Arc::new(sessions),
        StreamableHttpServerConfig::default().with_max_request_body_bytes(MAX_BODY),
    );
    let gate = Gate {
        token: Arc::from(token),
        calls,
    };
    let mcp = Router::new()
        .nest_service("/mcp", service)
        .layer(middleware::from_fn_with_state(gate, guard));
    let app = Router::new()
        .route("/health", get(health).with_state(alive))
        .merge(mcp);
    Ok(Started { listener, app })
}

/// The gateway as the client of its server.
struct Upstream;

impl rmcp::ClientHandler for Upstream {
    fn get_info(&self) -> ClientConfig {
        ClientConfig::new(
            ClientCapabilities::default(),
            Implementation::new("cube-mcp-gateway", env!("CARGO_PKG_VERSION")),
        )
    }
}

/// The gateway as a server: each session's handler, all on the one server.
#[derive(Clone)]
struct Gateway {
    upstream: Peer<RoleClient>,
    alive: Arc<AtomicBool>,
    info: rmcp::model::ServerConfig,
}

impl Gateway {
    fn up(&self) -> Result<(), McpError> {
        if self.alive.load(Ordering::SeqCst) {
            Ok(())
        } else {
            eprintln!("mcp-gateway: a request came after the MCP server exited");
            Err(McpError::internal_error(
                "the MCP server has exited; its stderr is in /run/mcp-gateway/server.log",
                None,
            ))
        }
    }
}

/// The server's answer as the gateway's: its own MCP errors pass, anything
/// else (it went away, a broken pipe) is logged and answered generically.
fn upstream_error(e: ServiceError) -> McpError {
    match e {
        ServiceError::McpError(e) => e,
        other => {
            eprintln!("mcp-gateway: the MCP server did not answer: {other}");
            McpError::internal_error(
                "the MCP server did not answer; its stderr is in /run/mcp-gateway/server.log",
                None,
            )
        }
    }
}

impl rmcp::ServerHandler for Gateway {
    fn get_info(&self) -> rmcp::model::ServerConfig {
        self.info.clone()
    }

    async fn ping(&self, _context: RequestContext<RoleServer>) -> Result<(), McpError> {
        self.up()?;
        self.upstream
            .send_request(ClientRequest::PingRequest(PingRequest {
                method: Default::default(),
                extensions: Default::default(),
            }))
            .await
            .map(|_| ())
            .map_err(upstream_error)
    }

    async fn list_tools(
        &self,
        request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        self.up()?;
        self.upstream
            .list_tools(request)
            .await
            .map_err(upstream_error)
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        self.up()?;
        self.upstream
            .call_tool_once(request)
            .await
            .map_err(upstream_error)
    }
}

/// `GET /health`: 200 while the server runs, 503 once it has exited.
async fn health(State(alive): State<Arc<AtomicBool>>) -> Response {
    if alive.load(Ordering::SeqCst) {
        (
            StatusCode::OK,
            axum::Json(serde_json::json!({"status": "ok"})),
        )
            .into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(serde_json::json!({"status": "server_exited"})),
        )
            .into_response()
    }
}

/// What `/mcp` checks and records.
#[derive(Clone)]
struct Gate {
    token: Arc<str>,
    calls: Arc<CappedLog>,
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether the request carries `Authorization: Bearer TOKEN`.
fn authorized(h: &HeaderMap, token: &str) -> bool {
    let Some(v) = h.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let Some((scheme, given)) = v.split_once(' ') else {
        return false;
    };
    scheme.eq_ignore_ascii_case("bearer")
        && constant_time_eq(given.trim().as_bytes(), token.as_bytes())
}

fn json_error(status: StatusCode, code: &str, message: &str) -> Response {
    (
        status,
        axum::Json(serde_json::json!({"error": {"code": code, "message": message}})),
    )
        .into_response()
}

/// `/mcp`: the token first, then a line per request in `calls.log`.
async fn guard(State(g): State<Gate>, req: Request, next: Next) -> Response {
    if !authorized(req.headers(), &g.token) {
        let mut r = json_error(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "this MCP gateway needs Authorization: Bearer with its access token",
        );
        r.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Bearer"),
        );
        return r;
    }
    if req.method() != Method::POST {
        return next.run(req).await;
    }
    let (parts, body) = req.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, MAX_BODY).await else {
        return json_error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            "the request body is too large",
        );
    };
    for line in call_lines(&bytes) {
        g.calls.append(format!("{line}\n").as_bytes());
    }
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    const ONE: &str = r#"{"echo":{"runCmd":"exec node -e \"$JS\"","envs":{"JS":"x","A_1":"y"}}}"#;

    #[test]
    fn one_server_with_its_command_and_environment() {
        let want = GatewayConfig {
            name: "echo".into(),
            run_cmd: "exec node -e \"$JS\"".into(),
            envs: BTreeMap::from([("A_1".into(), "y".into()), ("JS".into(), "x".into())]),
        };
        assert_eq!(parse_args(&args(&["--config", ONE])), Ok(want.clone()));
        assert_eq!(
            parse_args(&args(&[&format!("--config={ONE}")])),
            Ok(want.clone())
        );
        // envs may be left out.
        let c = parse_config(r#"{"github/o/r": {"runCmd": "srv"}}"#).unwrap();
        assert_eq!(c.name, "github/o/r");
        assert!(c.envs.is_empty());
    }

    #[test]
    fn command_lines_other_than_config_json_are_refused() {
        for a in [
            vec![],
            vec!["--config"],
            vec![ONE],
            vec!["--config", ONE, "extra"],
            vec!["--conf", ONE],
            vec!["--help"],
        ] {
            assert_eq!(parse_args(&args(&a)), Err(ConfigError::Usage), "{a:?}");
        }
    }

    #[test]
    fn each_bad_configuration_is_refused_with_its_reason() {
        assert!(matches!(parse_config("{"), Err(ConfigError::NotJson(_))));
        assert_eq!(parse_config("[]"), Err(ConfigError::NotObject));
        assert_eq!(parse_config(r#""x""#), Err(ConfigError::NotObject));
        assert_eq!(parse_config("{}"), Err(ConfigError::NoServer));
        assert_eq!(
            parse_config(r#"{"a":{"runCmd":"x"},"b":{"runCmd":"y"}}"#),
            Err(ConfigError::TooMany(2))
        );
        // A catalog entry (no runCmd), with or without its own fields.
        assert_eq!(
            parse_config(r#"{"brave":{}}"#),
            Err(ConfigError::NoRunCmd("brave".into()))
        );
        assert_eq!(
            parse_config(r#"{"brave":{"braveApiKey":"k"}}"#),
            Err(ConfigError::NoRunCmd("brave".into()))
        );
        assert_eq!(
            parse_config(r#"{"":{"runCmd":"x"}}"#),
            Err(ConfigError::BadName(String::new()))
        );
        assert!(matches!(
            parse_config(r#"{"a\nb":{"runCmd":"x"}}"#),
            Err(ConfigError::BadName(_))
        ));
        let long = "n".repeat(129);
        assert!(matches!(
            parse_config(&format!(r#"{{"{long}":{{"runCmd":"x"}}}}"#)),
            Err(ConfigError::BadName(_))
        ));
        let entry = |json: &str| match parse_config(json) {
            Err(ConfigError::BadEntry { name, reason }) => {
                assert_eq!(name, "s");
                reason
            }
            other => panic!("{json}: {other:?}"),
        };
        assert!(entry(r#"{"s":"srv"}"#).contains("JSON object"));
        assert!(entry(r#"{"s":{"runCmd":"x","installCmd":"y"}}"#).contains("installCmd"));
        assert!(entry(r#"{"s":{"runCmd":7}}"#).contains("string"));
        assert!(entry(r#"{"s":{"runCmd":"  "}}"#).contains("empty"));
        assert!(entry(r#"{"s":{"runCmd":"a\u0000b"}}"#).contains("NUL"));
        assert!(entry(r#"{"s":{"runCmd":"x","envs":["A"]}}"#).contains("map"));
        assert!(entry(r#"{"s":{"runCmd":"x","envs":{"A":1}}}"#).contains("string"));
        assert!(entry(r#"{"s":{"runCmd":"x","envs":{"1A":"v"}}}"#).contains("1A"));
        assert!(entry(r#"{"s":{"runCmd":"x","envs":{"A=B":"v"}}}"#).contains("A=B"));
        assert!(entry(r#"{"s":{"runCmd":"x","envs":{"A":"v\u0000"}}}"#).contains("NUL"));
    }

    #[test]
    fn the_token_is_required_and_long_enough() {
        assert_eq!(parse_token(None), Err(TokenError::Missing));
        for weak in [
            "",
            "short",
            "fifteen-chars!!",
            "sixteen chars ok",
            "sixteen-chars-é!",
        ] {
            assert_eq!(
                parse_token(Some(weak.into())),
                Err(TokenError::Weak),
                "{weak:?}"
            );
        }
        let t = "0f8fad5b-d9cb-469f-a165-70867728950e";
        assert_eq!(parse_token(Some(t.into())), Ok(t.to_string()));
    }

    #[test]
    fn the_bearer_token_is_compared_whole() {
        let mut h = HeaderMap::new();
        assert!(!authorized(&h, "t0123456789abcdef"));
        for (v, ok) in [
            ("Bearer t0123456789abcdef", true),
            ("bearer t0123456789abcdef", true),
            ("Bearer t0123456789abcde", false),
            ("Bearer t0123456789abcdefg", false),
            ("Basic t0123456789abcdef", false),
            ("t0123456789abcdef", false),
        ] {
            h.insert(header::AUTHORIZATION, v.parse().unwrap());
            assert_eq!(authorized(&h, "t0123456789abcdef"), ok, "{v}");
        }
    }

    #[test]
    fn calls_are_logged_without_their_arguments() {
        let body = br#"[
            {"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"echo","arguments":{"text":"secret"}}},
            {"jsonrpc":"2.0","method":"notifications/initialized"},
            {"jsonrpc":"2.0","id":2,"method":"tools/list"},
            {"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"sleep"}}
        ]"#;
        assert_eq!(
            call_lines(body),
            vec![
                r#"{"method":"tools/call","tool":"echo","arguments_bytes":17}"#.to_string(),
                r#"{"method":"tools/list"}"#.to_string(),
                r#"{"method":"tools/call","tool":"sleep","arguments_bytes":0}"#.to_string(),
            ]
        );
        assert!(call_lines(b"not json").is_empty());
        let long = "t".repeat(500);
        let one = format!(r#"{{"id":1,"method":"tools/call","params":{{"name":"{long}"}}}}"#);
        let lines = call_lines(one.as_bytes());
        assert_eq!(lines.len(), 1);
        assert!(lines[0].len() < 200, "{}", lines[0]);
    }

    #[test]
    fn logs_start_over_past_their_cap() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("calls.log");
        let log = CappedLog::open(path.clone()).unwrap();
        let line = vec![b'x'; 1000];
        for _ in 0..(LOG_CAP / 1000 + 10) {
            log.append(&line);
        }
        let now = std::fs::metadata(&path).unwrap().len();
        let old = std::fs::metadata(dir.path().join("calls.log.1"))
            .unwrap()
            .len();
        assert!(now <= LOG_CAP && old <= LOG_CAP, "{now} {old}");
        assert_eq!(now, 10_000);
    }
}
