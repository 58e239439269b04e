//! The `cube-adapter` command line. Everything else lives in the library.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use cube_adapter::embedded::{Isolation, Limits, TemplateConfig};

#[derive(Parser)]
#[command(
    name = "cube-adapter",
    version,
    about = "An appliance between AI coding agents and CubeSandbox sandboxes",
    after_help = EXIT_CODES
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The exit codes every operator command keeps (scripts may rely on them).
const EXIT_CODES: &str = "Exit codes: 0 success; 1 the check or operation failed (a broken audit \
chain, a service that is not ready, a certificate about to expire, a token that does not exist); \
2 bad usage or configuration, or a refusal (a file init or backup would overwrite, a state \
directory restore would overwrite); 3 the service state does not allow it (running when it \
must be stopped, not running, not initialised); 4 store or I/O error. Operator commands need the state directory (root or the cube-adapter \
user); while the service runs they reach it through STATE/admin.sock.";

#[derive(Subcommand)]
enum CertCommand {
    /// The CA and the server certificate: names, validity, fingerprints.
    ///
    /// Reads the public files in STATE/tls (running or not). Exit 1 when
    /// the server certificate has --warn-days or fewer left, so that a
    /// timer can alert.
    #[command(after_help = EXIT_CODES)]
    Show {
        #[command(flatten)]
        common: Common,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Exit 1 at this many days left or fewer.
        #[arg(long, default_value_t = 30)]
        warn_days: i64,
    },
    /// Issue a new server certificate from the local CA.
    ///
    /// With the service running, it issues the certificate and serves it
    /// at once (open connections keep the old one); stopped, the next start
    /// serves it. The names are the host's names and addresses plus
    /// `server_names` from the configuration. The CA (ten years) is kept:
    /// agents keep trusting the appliance. The service also reissues the
    /// certificate by itself at start and on reload (SIGHUP) when it no
    /// longer covers the names or has 30 days or fewer left.
    #[command(after_help = EXIT_CODES)]
    Renew {
        #[command(flatten)]
        common: Common,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum IsolationArg {
    /// User, mount, pid, ipc, uts and network namespaces (default).
    Namespaces,
    /// No isolation at all: sandboxes are plain processes on this host.
    None,
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Every scenario below with its defaults, one after the other; with
    /// --json-dir, one JSON report per scenario.
    All {
        #[arg(long)]
        json_dir: Option<PathBuf>,
    },
    /// Added latency of the appliance: the same exec through /v1 and
    /// directly with the cube client, and what a durable commit costs.
    Overhead {
        #[arg(long, default_value_t = 300)]
        iterations: usize,
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// acquire → exec → release(kill) cycles with 1, 16 and 64 agents.
    Cycle {
        #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
        concurrency: Vec<usize>,
        #[arg(long, default_value_t = 4)]
        cycles_per_agent: usize,
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Exec on existing leases with many concurrent agents.
    Hot {
        #[arg(long, default_value_t = 64)]
        agents: usize,
        #[arg(long, default_value_t = 30)]
        ops_per_agent: usize,
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Journal commits: group commit vs one fsync per event.
    Audit {
        #[arg(long, value_delimiter = ',', default_value = "1,64")]
        writers: Vec<usize>,
        #[arg(long, default_value_t = 200)]
        events_per_writer: usize,
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Job-output throughput: a job's stdout and stderr read to the end by
    /// per-stream cursors and by SSE.
    Jobs {
        /// MiB the job writes to each stream.
        #[arg(long, default_value_t = 32)]
        mib: usize,
        /// Full reads by each method.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// RSS idle and with many live leases, and start-to-ready time, of a
    /// real `serve` process.
    Memory {
        #[arg(long, default_value_t = 1000)]
        leases: usize,
        #[arg(long, default_value_t = 10)]
        starts: usize,
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// The embedded backend through the cube client over mTLS: sandbox
    /// create → exec → kill cycles and exec round-trips on a live sandbox.
    Backend {
        /// Create/exec/kill cycles to time.
        #[arg(long, default_value_t = 100)]
        cycles: usize,
        /// Exec round-trips on one live sandbox.
        #[arg(long, default_value_t = 1000)]
        execs: usize,
        /// Also write the report as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
    },
}

#[derive(clap::Args, Clone)]
struct Common {
    /// Config file (default /etc/cube-adapter/config.toml; missing is fine).
    #[arg(long, env = "CUBE_ADAPTER_CONFIG")]
    config: Option<PathBuf>,
    /// State directory (overrides the config file).
    #[arg(long)]
    state_dir: Option<PathBuf>,
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Load the configuration with every override, validate it, print it.
    ///
    /// Precedence: defaults < the file < CUBE_ADAPTER_* environment <
    /// flags. Unknown keys and non-boolean booleans are errors. Exit 0 and
    /// the effective configuration; 2 and the reason when it is invalid.
    #[command(after_help = EXIT_CODES)]
    Check {
        #[command(flatten)]
        common: Common,
        #[arg(long)]
        listen: Option<SocketAddr>,
    },
}

#[derive(Subcommand)]
enum TokenCommand {
    /// Issue a bearer token; prints the token alone on stdout.
    ///
    /// The token is shown once (only its argon2 hash is kept). Works while
    /// the service runs (through its admin socket) and while it is
    /// stopped. Exit 2 for an invalid tenant, role or runtime.
    #[command(after_help = EXIT_CODES)]
    Create {
        #[command(flatten)]
        common: Common,
        /// Tenant the token acts for.
        #[arg(long)]
        tenant: String,
        /// Subject (who holds it); defaults to the tenant.
        #[arg(long)]
        subject: Option<String>,
        /// Allowed runtime (repeatable; default: any).
        #[arg(long = "runtime")]
        runtimes: Vec<String>,
        /// Allowed profile (repeatable; default: any).
        #[arg(long = "profile")]
        profiles: Vec<String>,
        /// Allowed action scope, e.g. exec:run, file:*, task:* (repeatable; default: *).
        #[arg(long = "action")]
        actions: Vec<String>,
        /// Deny every action (an explicit empty scope list).
        #[arg(long, conflicts_with = "actions")]
        no_actions: bool,
        /// Role: agent, approver, auditor or admin (repeatable; default agent).
        #[arg(long = "role")]
        roles: Vec<String>,
        /// Task template this token may plan (repeatable; default: *).
        #[arg(long = "task-template")]
        task_templates: Vec<String>,
        /// Instead of a token, issue a client certificate for this identity
        /// from the appliance's CA into DIR (client.pem, client.key, ca.pem)
        /// and print its id. Callers present it over TLS (no token needed);
        /// `token revoke ID` ends it like a token.
        #[arg(long, value_name = "DIR")]
        client_cert: Option<PathBuf>,
        /// Free text kept with the token.
        #[arg(long)]
        description: Option<String>,
    },
    /// List tokens (ids and scopes, never secrets).
    #[command(after_help = EXIT_CODES)]
    List {
        #[command(flatten)]
        common: Common,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Revoke a token by id (or by the token itself).
    ///
    /// Takes effect at once on a running service. Exit 1 when no token has
    /// that id.
    #[command(after_help = EXIT_CODES)]
    Revoke {
        #[command(flatten)]
        common: Common,
        id: String,
    },
}

#[derive(Subcommand)]
enum AuditCommand {
    /// Check the hash chain of the journal. Exit 0 when intact, 1 when not.
    ///
    /// Prints the number of events, the last sequence number, the head hash
    /// and the pending intents. Works while the service runs.
    #[command(after_help = EXIT_CODES)]
    Verify {
        #[command(flatten)]
        common: Common,
    },
    /// Print events as JSON lines.
    ///
    /// Digests, never commands, paths or secrets in clear. Works while the
    /// service runs.
    #[command(after_help = EXIT_CODES)]
    Export {
        #[command(flatten)]
        common: Common,
        /// First sequence number to print.
        #[arg(long, default_value_t = 1)]
        since: u64,
    },
    /// Resolve intents left pending by a crash (service must be stopped).
    ///
    /// Records a `reconciled` outcome for each pending intent, with a digest
    /// of your note (a ticket number, what you checked). It never claims the
    /// operation succeeded and never re-runs it. Exit 3 while the service
    /// runs, 2 without a note.
    #[command(after_help = EXIT_CODES)]
    Reconcile {
        #[command(flatten)]
        common: Common,
        /// Only this operation id (default: all pending).
        #[arg(long)]
        operation: Option<String>,
        /// Why this is resolved (required).
        #[arg(long)]
        note: String,
    },
}

#[derive(Subcommand)]
enum UserCmd {
    /// Add a user (default role approver, with task:approve, task:status,
    /// task:receipt and lease:list).
    Add {
        #[command(flatten)]
        common: Common,
        /// ^[a-z][a-z0-9._-]{0,63}$; the user's subject in the audit journal.
        name: String,
        /// Tenant whose plans the user sees and decides on.
        #[arg(long)]
        tenant: String,
        /// Role: approver, auditor, admin or agent (repeatable).
        #[arg(long = "role")]
        roles: Vec<String>,
        /// Action scope (repeatable; replaces the default scopes).
        #[arg(long = "action")]
        actions: Vec<String>,
        /// Allowed profile (repeatable; default: any).
        #[arg(long = "profile")]
        profiles: Vec<String>,
        /// Task template the user may decide on (repeatable; default: *).
        #[arg(long = "task-template")]
        task_templates: Vec<String>,
        /// Read the password from this file (default: stdin).
        #[arg(long)]
        password_file: Option<PathBuf>,
    },
    /// List users (never their passwords).
    List {
        #[command(flatten)]
        common: Common,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Set a new password.
    Passwd {
        #[command(flatten)]
        common: Common,
        name: String,
        #[arg(long)]
        password_file: Option<PathBuf>,
    },
    /// Refuse a user's sign-ins (at once) until enabled again.
    Disable {
        #[command(flatten)]
        common: Common,
        name: String,
    },
    /// Allow a disabled user again.
    Enable {
        #[command(flatten)]
        common: Common,
        name: String,
    },
    /// Delete a user (what they did stays in the audit journal).
    Remove {
        #[command(flatten)]
        common: Common,
        name: String,
    },
}

#[derive(Subcommand)]
enum ReceiptCommand {
    /// Check a trusted task's signed receipt offline.
    ///
    /// FILE is a receipt, or a response that holds one (…/result,
    /// …/receipt). The Ed25519 signature is checked with --public-key (the
    /// appliance's STATE/receipt-ed25519.pub, or the JSON of GET
    /// /v1/receipts/public-key); the reference-compatible HS256 signature
    /// with --hmac-key-file. --state-dir takes both keys from an
    /// appliance's state directory (and its config). Prints the verdict as
    /// JSON. Exit 0: every signature checked holds; 1: one does not; 2:
    /// nothing could be checked.
    Verify {
        file: PathBuf,
        #[arg(long)]
        public_key: Option<PathBuf>,
        #[arg(long)]
        hmac_key_file: Option<PathBuf>,
        #[arg(long)]
        state_dir: Option<PathBuf>,
        #[arg(long, env = "CUBE_ADAPTER_CONFIG")]
        config: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum Command {
    /// Run the appliance: the /v1 API over HTTPS, the audit journal and,
    /// with no backend configured, the embedded backend.
    ///
    /// Under systemd (Type=notify) it says READY=1 once the store is open
    /// and the listener bound, feeds the watchdog and says STOPPING=1 on
    /// SIGTERM, after which effects in flight get 30 s to record their
    /// outcome. SIGHUP reloads the certificate and `server_names`; other
    /// changed keys need a restart (see `status`). Exit 2 for an invalid
    /// configuration, 3 when another process holds the store, 4 otherwise.
    #[command(after_help = EXIT_CODES)]
    Serve {
        #[command(flatten)]
        common: Common,
        /// Listen address (default 127.0.0.1:18080).
        #[arg(long)]
        listen: Option<SocketAddr>,
        /// Serve plain HTTP (loopback addresses only).
        #[arg(long)]
        insecure_plain_http: bool,
    },
    /// Configuration.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Bearer tokens (through the running service, or the store when stopped).
    #[command(subcommand)]
    Token(TokenCommand),
    /// The audit journal.
    #[command(subcommand)]
    Audit(AuditCommand),
    /// Signed receipts of trusted tasks.
    #[command(subcommand)]
    Receipt(ReceiptCommand),
    /// People (approvers, auditors) who sign in with a password: HTTP Basic
    /// on /v1 and /mcp (`curl -u NAME`), and the console.
    ///
    /// Through the running service, or the store when it is stopped. The
    /// password is read from --password-file (its first line) or from the
    /// first line of stdin, at least 12 characters; it is hashed (argon2id)
    /// here and never stored or sent as it is. Exit 0 done, 1 refused (no
    /// such user, exists already), 2 bad arguments, 3 no state directory.
    #[command(subcommand)]
    User(UserCmd),
    /// Measure performance (prints p50/p90/p99/max; never a pass/fail test).
    #[command(subcommand)]
    Bench(BenchCommand),
    /// The agent tools over MCP on stdin/stdout, as a client of an appliance.
    ///
    /// For hosts that start MCP servers as commands (Codex, Claude Code,
    /// OpenCode, …). Configured by the environment: CUBE_ADAPTER_URL
    /// (default https://127.0.0.1:18080), CUBE_ADAPTER_TOKEN or
    /// CUBE_ADAPTER_TOKEN_FILE, CUBE_ADAPTER_CA_FILE (the appliance's CA),
    /// CUBE_ADAPTER_CLIENT_CERT_FILE + CUBE_ADAPTER_CLIENT_KEY_FILE,
    /// CUBE_ADAPTER_PROFILE (the profile leases are acquired with) and
    /// CUBE_ADAPTER_RUNTIME (the runtime when the model gives none). Plain
    /// HTTP only to loopback; a client certificate only over HTTPS. Exit 2
    /// when the settings are refused (before any connection is tried).
    Mcp,
    /// Run the embedded CubeSandbox-compatible backend on its own.
    ///
    /// Speaks CubeAPI and (by Host, like CubeProxy) envd on one port. Sandboxes
    /// are namespaced process trees on this host: for a single host,
    /// evaluation and tests; production uses CubeSandbox. By default it serves
    /// HTTPS and requires a client certificate issued by its CA (files under
    /// STATE/tls); --plain-http serves plain HTTP on loopback only.
    EmbeddedBackend {
        /// Address to listen on (port 0 picks a free port).
        #[arg(long, default_value = "127.0.0.1:3000")]
        listen: SocketAddr,
        /// Directory for sandboxes, snapshots and certificates.
        #[arg(long)]
        state_dir: PathBuf,
        /// Serve plain HTTP without client certificates (loopback only).
        #[arg(long)]
        plain_http: bool,
        /// How sandboxes are isolated.
        #[arg(long, value_enum, default_value = "namespaces")]
        isolation: IsolationArg,
        /// Extra template: ID=ROOTFS_DIR (the built-in `host` template is the
        /// host's root, read-only). Repeatable.
        #[arg(long = "template", value_name = "ID=DIR")]
        templates: Vec<String>,
        /// Sandbox domain used in data-plane Host names.
        #[arg(long, default_value = "cube.local")]
        domain: String,
        /// File holding an API key that CubeAPI calls must present.
        #[arg(long)]
        api_key_file: Option<PathBuf>,
        /// Extra DNS names or IPs for the server certificate. Repeatable.
        #[arg(long = "server-name")]
        server_names: Vec<String>,
        /// Memory limit per sandbox, MiB.
        #[arg(long, default_value_t = 2048)]
        memory_mb: u64,
        /// Process limit per sandbox.
        #[arg(long, default_value_t = 512)]
        max_processes: u64,
        /// CPUs per sandbox where cgroups allow (0 = no limit).
        #[arg(long, default_value_t = 1.0)]
        cpus: f64,
    },
    /// First run without starting the service: state directory, keys, CA,
    /// server certificate, the first admin token.
    ///
    /// Idempotent: what exists is kept (keys, CA, store, tokens) and never
    /// overwritten; a second run changes nothing. The bootstrap admin token
    /// is issued only while the store has no token, into STATE/admin.token
    /// or --admin-token-file (refused with exit 2 if that file exists).
    /// Run as root on a state directory owned by the service user, the
    /// files it creates are given to that user. Refused (exit 3) while the
    /// service runs: it initialised itself.
    #[command(after_help = EXIT_CODES)]
    Init {
        #[command(flatten)]
        common: Common,
        /// Where to write the bootstrap admin token (default STATE/admin.token).
        #[arg(long)]
        admin_token_file: Option<PathBuf>,
    },
    /// Health, backend, audit journal, leases, tokens, certificate, last reload.
    ///
    /// Asks the running service (STATE/admin.sock); when it is stopped,
    /// reads the store instead. Exit 0 when running and ready, 1 when
    /// running but not ready (audit blocked or unavailable, backend
    /// unreachable or a template not ready), 3 when not running.
    #[command(after_help = EXIT_CODES)]
    Status {
        #[command(flatten)]
        common: Common,
        /// Print JSON (the same document in both cases; `running` tells which).
        #[arg(long)]
        json: bool,
    },
    /// The server certificate.
    #[command(subcommand)]
    Cert(CertCommand),
    /// Write a consistent backup of the state to FILE (a tar archive, 0600).
    ///
    /// While the service runs, it copies its store between two commits
    /// (writes wait for the copy), reopens the copy on its own and verifies
    /// its audit chain; stopped, this command does the same. The archive
    /// holds MANIFEST.json, state.redb, secret.key, hmac.key and tls/: it
    /// is as secret as the state directory. Sandboxes (STATE/embedded) are
    /// not in it. Restore it with `cube-adapter restore FILE`.
    #[command(after_help = EXIT_CODES)]
    Backup {
        #[command(flatten)]
        common: Common,
        /// The archive to write.
        file: PathBuf,
        /// Replace FILE if it exists.
        #[arg(long)]
        force: bool,
    },
    /// Restore a backup into an empty or absent state directory.
    ///
    /// The service must be stopped (exit 3). A state directory with
    /// anything in it is refused (exit 2): move it aside first. The archive
    /// is extracted next to it and checked before it takes its place: the
    /// store's SHA-256 against MANIFEST.json, the keys present, the store
    /// opened on its own and its audit chain verified against the events
    /// and head the manifest records (exit 1 and nothing restored when any
    /// check fails). An existing empty directory's owner (the service user)
    /// is given to what is restored.
    #[command(after_help = EXIT_CODES)]
    Restore {
        #[command(flatten)]
        common: Common,
        /// The archive `backup` wrote.
        file: PathBuf,
    },
}

fn main() -> ExitCode {
    // Internal entry points run single-threaded, before anything else.
    let mut args = std::env::args_os();
    let _ = args.next();
    match args.next().as_deref().and_then(|a| a.to_str()) {
        Some("__sandbox-launch") => {
            let dir = args.next().map(PathBuf::from).unwrap_or_default();
            return exit(cube_adapter::embedded::launch::launcher_main(&dir));
        }
        Some("__probe-namespaces") => return exit(cube_adapter::embedded::launch::probe_main()),
        _ => {}
    }
    cube_adapter::tls::install_default_provider();
    let cli = Cli::parse();
    cube_adapter::telemetry::init();
    match cli.command {
        c @ (Command::Init { .. }
        | Command::Status { .. }
        | Command::Cert(_)
        | Command::Backup { .. }
        | Command::Restore { .. }) => ops_command(c),
        Command::Serve {
            common,
            listen,
            insecure_plain_http,
        } => {
            let flags = cube_adapter::config::Flags {
                state_dir: common.state_dir.clone(),
                listen,
                insecure_plain_http,
            };
            exit(cube_adapter::cli::serve(common.config.as_deref(), &flags))
        }
        Command::Config(ConfigCommand::Check { common, listen }) => {
            let flags = cube_adapter::config::Flags {
                state_dir: common.state_dir.clone(),
                listen,
                insecure_plain_http: false,
            };
            exit(cube_adapter::cli::config_check(
                common.config.as_deref(),
                &flags,
            ))
        }
        Command::Token(t) => exit(match t {
            TokenCommand::Create {
                common,
                tenant,
                subject,
                runtimes,
                profiles,
                actions,
                no_actions,
                roles,
                task_templates,
                description,
                client_cert,
            } => {
                let req = cube_adapter::cli::TokenCreate {
                    tenant,
                    subject,
                    runtimes,
                    profiles,
                    actions,
                    no_actions,
                    roles,
                    task_templates,
                    description,
                    client_cert,
                };
                cube_adapter::cli::token_create(
                    common.config.as_deref(),
                    common.state_dir.as_deref(),
                    req,
                )
            }
            TokenCommand::List { common, json } => cube_adapter::cli::token_list(
                common.config.as_deref(),
                common.state_dir.as_deref(),
                json,
            ),
            TokenCommand::Revoke { common, id } => cube_adapter::cli::token_revoke(
                common.config.as_deref(),
                common.state_dir.as_deref(),
                &id,
            ),
        }),
        Command::Audit(a) => exit(match a {
            AuditCommand::Verify { common } => cube_adapter::cli::audit_verify(
                common.config.as_deref(),
                common.state_dir.as_deref(),
            ),
            AuditCommand::Export { common, since } => cube_adapter::cli::audit_export(
                common.config.as_deref(),
                common.state_dir.as_deref(),
                since,
            ),
            AuditCommand::Reconcile {
                common,
                operation,
                note,
            } => cube_adapter::cli::audit_reconcile(
                common.config.as_deref(),
                common.state_dir.as_deref(),
                operation.as_deref(),
                &note,
            ),
        }),
        Command::User(u) => {
            use cube_adapter::cli::UserCommand as U;
            let (common, cmd) = match u {
                UserCmd::Add {
                    common,
                    name,
                    tenant,
                    roles,
                    actions,
                    profiles,
                    task_templates,
                    password_file,
                } => (
                    common,
                    U::Add {
                        name,
                        tenant,
                        roles,
                        actions,
                        profiles,
                        task_templates,
                        password_file,
                    },
                ),
                UserCmd::List { common, json } => (common, U::List { json }),
                UserCmd::Passwd {
                    common,
                    name,
                    password_file,
                } => (
                    common,
                    U::Passwd {
                        name,
                        password_file,
                    },
                ),
                UserCmd::Disable { common, name } => (common, U::Disable { name }),
                UserCmd::Enable { common, name } => (common, U::Enable { name }),
                UserCmd::Remove { common, name } => (common, U::Remove { name }),
            };
            exit(cube_adapter::cli::user(
                common.config.as_deref(),
                common.state_dir.as_deref(),
                cmd,
            ))
        }
        Command::Receipt(ReceiptCommand::Verify {
            file,
            public_key,
            hmac_key_file,
            state_dir,
            config,
        }) => exit(cube_adapter::broker::receipts::verify_command(
            &file,
            public_key.as_deref(),
            state_dir.as_deref(),
            config.as_deref(),
            hmac_key_file.as_deref(),
        )),
        Command::Bench(b) => {
            let launcher = match std::env::current_exe() {
                Ok(p) => p,
                Err(e) => {
                    eprintln!("error: cannot find this executable: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let rt = match tokio::runtime::Runtime::new() {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("error: cannot start the runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            use cube_adapter::bench::{self, appliance};
            if let BenchCommand::All { json_dir } = &b {
                return match rt.block_on(bench::all(&launcher, json_dir.as_deref())) {
                    Ok(()) => ExitCode::SUCCESS,
                    Err(e) => {
                        eprintln!("error: {e:#}");
                        ExitCode::FAILURE
                    }
                };
            }
            let (result, json) = match b {
                BenchCommand::All { .. } => return ExitCode::FAILURE,
                BenchCommand::Backend {
                    cycles,
                    execs,
                    json,
                } => {
                    let opts = bench::BackendBench {
                        cycles,
                        execs,
                        launcher,
                    };
                    (rt.block_on(bench::backend(&opts)), json)
                }
                BenchCommand::Overhead { iterations, json } => (
                    rt.block_on(appliance::overhead(&launcher, iterations)),
                    json,
                ),
                BenchCommand::Cycle {
                    concurrency,
                    cycles_per_agent,
                    json,
                } => (
                    rt.block_on(appliance::cycle(&launcher, &concurrency, cycles_per_agent)),
                    json,
                ),
                BenchCommand::Hot {
                    agents,
                    ops_per_agent,
                    json,
                } => (
                    rt.block_on(appliance::hot(&launcher, agents, ops_per_agent)),
                    json,
                ),
                BenchCommand::Audit {
                    writers,
                    events_per_writer,
                    json,
                } => (
                    rt.block_on(appliance::audit(&writers, events_per_writer)),
                    json,
                ),
                BenchCommand::Jobs { mib, rounds, json } => (
                    rt.block_on(appliance::job_output(&launcher, mib, rounds)),
                    json,
                ),
                BenchCommand::Memory {
                    leases,
                    starts,
                    json,
                } => (
                    rt.block_on(appliance::memory_and_startup(&launcher, leases, starts)),
                    json,
                ),
            };
            match result {
                Ok(report) => {
                    report.print();
                    if let Some(path) = json {
                        let text = serde_json::to_string_pretty(&report).unwrap_or_default();
                        if let Err(e) = std::fs::write(&path, text) {
                            eprintln!("error: cannot write {}: {e}", path.display());
                            return ExitCode::FAILURE;
                        }
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Mcp => {
            let settings =
                match cube_adapter::mcp::stdio::Settings::from_env(|k| std::env::var(k).ok()) {
                    Ok(s) => s,
                    Err(e) => {
                        eprintln!("cube-adapter mcp: {e}");
                        return ExitCode::from(2);
                    }
                };
            let rt = match tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("cube-adapter mcp: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match rt.block_on(cube_adapter::mcp::stdio::run(settings)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("cube-adapter mcp: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::EmbeddedBackend {
            listen,
            state_dir,
            plain_http,
            isolation,
            templates,
            domain,
            api_key_file,
            server_names,
            memory_mb,
            max_processes,
            cpus,
        } => {
            let mut tpls = vec![];
            for t in templates {
                let Some((id, dir)) = t.split_once('=') else {
                    eprintln!("error: --template takes ID=DIR, got '{t}'");
                    return ExitCode::from(2);
                };
                if !cube_adapter::embedded::sandbox::valid_id(id) {
                    eprintln!("error: template id '{id}' must be letters, digits and '-'");
                    return ExitCode::from(2);
                }
                tpls.push(TemplateConfig {
                    id: id.into(),
                    rootfs: dir.into(),
                });
            }
            let api_key = match api_key_file {
                Some(f) => match std::fs::read_to_string(&f) {
                    Ok(k) => Some(k.trim().to_string()),
                    Err(e) => {
                        eprintln!("error: cannot read {}: {e}", f.display());
                        return ExitCode::from(2);
                    }
                },
                None => None,
            };
            let launcher = match std::env::current_exe() {
                Ok(p) => p,
                Err(e) => {
                    eprintln!("error: cannot find this executable: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let opts = cube_adapter::standalone::Options {
                listen,
                state_dir,
                plain_http,
                isolation: match isolation {
                    IsolationArg::Namespaces => Isolation::Namespaces,
                    IsolationArg::None => Isolation::None,
                },
                templates: tpls,
                domain,
                api_key,
                server_names,
                limits: Limits {
                    memory_mb,
                    max_processes,
                    ..Limits::default()
                },
                cpus,
                launcher,
            };
            let rt = match tokio::runtime::Runtime::new() {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("error: cannot start the runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let result = rt.block_on(cube_adapter::standalone::run(
                opts,
                |s| {
                    println!("cube-adapter embedded backend listening on {}", s.url);
                    if let (Some(ca), Some(c), Some(k)) =
                        (&s.ca_file, &s.client_cert, &s.client_key)
                    {
                        println!("  CA certificate:     {}", ca.display());
                        if let Some(fp) = &s.ca_fingerprint {
                            println!("  CA SHA-256:         {fp}");
                        }
                        println!("  client certificate: {}", c.display());
                        println!("  client key:         {}", k.display());
                    }
                },
                shutdown_signal(),
            ));
            match result {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

/// The commands of `ops` (packaging and operations, #7).
fn ops_command(command: Command) -> ExitCode {
    use cube_adapter::ops::cli as ops;
    exit(match command {
        Command::Init {
            common,
            admin_token_file,
        } => ops::init(
            common.config.as_deref(),
            common.state_dir.as_deref(),
            admin_token_file.as_deref(),
        ),
        Command::Status { common, json } => {
            ops::status(common.config.as_deref(), common.state_dir.as_deref(), json)
        }
        Command::Cert(CertCommand::Show {
            common,
            json,
            warn_days,
        }) => ops::cert_show(
            common.config.as_deref(),
            common.state_dir.as_deref(),
            json,
            warn_days,
        ),
        Command::Cert(CertCommand::Renew { common, json }) => {
            ops::cert_renew(common.config.as_deref(), common.state_dir.as_deref(), json)
        }
        Command::Restore { common, file } => {
            ops::restore(common.config.as_deref(), common.state_dir.as_deref(), &file)
        }
        Command::Backup {
            common,
            file,
            force,
        } => ops::backup(
            common.config.as_deref(),
            common.state_dir.as_deref(),
            &file,
            force,
        ),
        _ => 2,
    })
}

fn exit(code: i32) -> ExitCode {
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
