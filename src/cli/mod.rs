//! The `cube-adapter` command line: the clap grammar ([`Cli`], [`Command`]),
//! the exit codes ([`Exit`]) and the dispatch ([`run`]). `main.rs` calls
//! [`run`] and nothing else.
//!
//! Each subcommand's flags are one `#[derive(Args)]` struct (`ServeArgs`,
//! `TokenCreateArgs`, …; a group of subcommands is a `#[derive(Subcommand)]`
//! enum of them) that `dispatch` hands straight to its handler,
//! `fn(args) -> Exit`, in the submodule of its area:
//!
//! - `common`: what the commands share: `--config`/`--state-dir`, loading
//!   the configuration, the runtime, the shutdown signal, reaching the
//!   store or the running service (STATE/admin.sock).
//! - `serve`: `serve`, `config check`.
//! - `config`: `config import` (the reference adapter's configuration).
//! - `tokens`: `token create|list|revoke` (and client certificates).
//! - `users`: `user add|list|passwd|disable|enable|remove`.
//! - `audit`: `audit verify|export|reconcile`, `receipt verify`.
//! - `ops`: `init`, `status`, `cert show|renew`.
//! - `backup`: `backup`, `restore`.
//! - `bench`: `bench …`.
//! - `mcp`: `mcp` (the agent tools on stdin/stdout).
//! - `connect`: `connect HOST` (an agent host's configuration), and the
//!   snippets' generator the console shares.
//! - `backend`: `embedded-backend`.
//!
//! # Exit codes
//!
//! Scripts, unit files and timers rely on these numbers; `--help` lists
//! them ([`EXIT_CODES`]). Every handler returns an [`Exit`]:
//!
//! - 0 [`Exit::Ok`]: success.
//! - 1 [`Exit::Failed`]: the check or operation failed: a broken audit
//!   chain, a service that is not ready, a certificate about to expire, a
//!   token or user that does not exist, a backup that does not check out, a
//!   receipt whose signature does not hold. `bench`, `mcp` and
//!   `embedded-backend` exit 1 for any failure at run time (the runtime
//!   included) and have no codes 3 and 4.
//! - 2 [`Exit::Usage`]: bad usage or configuration, or a refusal: a file
//!   `init`, `backup` or `token create --client-cert` would overwrite, a
//!   state directory `restore` would overwrite. clap's own parse errors
//!   exit 2 as well.
//! - 3 [`Exit::State`]: the service state does not allow it: running when
//!   it must be stopped, not running, not initialised, its store held by
//!   another process.
//! - 4 [`Exit::Store`]: store or I/O error (a runtime that cannot start
//!   included).

mod audit;
mod backend;
mod backup;
mod bench;
mod common;
mod config;
/// `pub`: the console's "Connect an agent" page shares its generator.
pub(crate) mod connect;
mod lease;
mod mcp;
mod ops;
mod recording;
mod sandboxes;
mod serve;
mod store;
mod tokens;
mod users;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use self::audit::{AuditCommand, ReceiptCommand};
use self::backend::EmbeddedBackendArgs;
use self::backup::{BackupArgs, RestoreArgs};
use self::bench::BenchCommand;
use self::config::ConfigCommand;
use self::ops::{CertCommand, InitArgs, StatusArgs};
use self::sandboxes::{SandboxesCommand, TemplateCommand};
use self::serve::ServeArgs;
use self::tokens::TokenCommand;
use self::users::UserCommand;

/// How a command ends (see the module head for what each code means).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
#[must_use]
pub enum Exit {
    Ok = 0,
    Failed = 1,
    Usage = 2,
    State = 3,
    Store = 4,
}

impl Exit {
    /// The code of a library entry point that still returns a number
    /// (`receipt verify`, the internal sandbox entry points: 0, 1 or 2);
    /// anything unknown is a failure.
    fn from_code(code: i32) -> Exit {
        match code {
            0 => Exit::Ok,
            2 => Exit::Usage,
            3 => Exit::State,
            4 => Exit::Store,
            _ => Exit::Failed,
        }
    }
}

impl From<Exit> for ExitCode {
    fn from(e: Exit) -> ExitCode {
        ExitCode::from(e as u8)
    }
}

/// The exit codes every operator command keeps (scripts may rely on them).
pub const EXIT_CODES: &str = "Exit codes: 0 success; 1 the check or operation failed (a broken audit \
chain, a service that is not ready, a certificate about to expire, a token that does not exist); \
2 bad usage or configuration, or a refusal (a file init or backup would overwrite, a state \
directory restore would overwrite); 3 the service state does not allow it (running when it \
must be stopped, not running, not initialised); 4 store or I/O error. Operator commands need the state directory (root or the cube-adapter \
user); while the service runs they reach it through STATE/admin.sock.";

#[derive(Parser)]
#[command(
    name = "cube-adapter",
    version,
    about = "An appliance between AI coding agents and CubeSandbox sandboxes",
    after_help = EXIT_CODES
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
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
    Serve(ServeArgs),
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
    /// Session recordings of PTYs and jobs.
    #[command(subcommand)]
    Recording(recording::RecordingCommand),
    /// People (approvers, auditors) who sign in with a password: HTTP Basic
    /// on /v1 and /mcp (`curl -u NAME`), and the console.
    ///
    /// Through the running service, or the store when it is stopped. The
    /// password is read from --password-file (its first line) or from the
    /// first line of stdin, at least 12 characters; it is hashed (argon2id)
    /// here and never stored or sent as it is. Exit 0 done, 1 refused (no
    /// such user, exists already), 2 bad arguments, 3 no state directory.
    #[command(subcommand)]
    User(UserCommand),
    /// Measure performance (prints p50/p90/p99/max; never a pass/fail test).
    #[command(subcommand)]
    Bench(BenchCommand),
    /// The agent tools over MCP on stdin/stdout, as a client of an appliance.
    ///
    /// For hosts that start MCP servers as commands (Codex, Claude Code,
    /// OpenCode, OpenClaw, Hermes Agent). Every setting is a flag, or else
    /// an environment variable (the reference facade's names); a flag wins.
    Mcp(mcp::McpArgs),
    /// Configure an agent host (codex, claude-code, opencode, openclaw,
    /// hermes) for this appliance, in the host's own configuration file.
    ///
    /// Writes or merges its `cube` server entry (stdio through `cube-adapter
    /// mcp`, or --http for /mcp), a token file (0600: a new token scoped to
    /// --tenant, the profile and the runtime, through the running service or
    /// the store; or --token-file) and the appliance's CA, and with --tools
    /// the host's own tool filter. Keeps the file's other settings, backs it
    /// up first, writes atomically, never prints the token, then runs the
    /// host's check when it is installed. --dry-run prints the change.
    #[command(after_help = connect::CONNECT_HELP)]
    Connect(connect::ConnectArgs),
    /// Run the embedded CubeSandbox-compatible backend on its own.
    ///
    /// Speaks CubeAPI and (by Host, like CubeProxy) envd on one port. Sandboxes
    /// are namespaced process trees on this host: for a single host,
    /// evaluation and tests; production uses CubeSandbox. By default it serves
    /// HTTPS and requires a client certificate issued by its CA (files under
    /// STATE/tls); --plain-http serves plain HTTP on loopback only.
    EmbeddedBackend(EmbeddedBackendArgs),
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
    Init(InitArgs),
    /// Health, backend, audit journal, leases, tokens, certificate, last reload.
    ///
    /// Asks the running service (STATE/admin.sock); when it is stopped,
    /// reads the store instead. Exit 0 when running and ready, 1 when
    /// running but not ready (audit blocked or unavailable, backend
    /// unreachable or a template not ready), 3 when not running.
    #[command(after_help = EXIT_CODES)]
    Status(StatusArgs),
    /// The embedded backend's sandboxes on this host: list them, or end
    /// those of a stopped service.
    #[command(subcommand)]
    Sandboxes(SandboxesCommand),
    /// Live leases: what their sandboxes may reach through the egress
    /// proxy.
    #[command(subcommand)]
    Lease(lease::LeaseCommand),
    /// The embedded backend's templates: import a root filesystem, list,
    /// remove.
    #[command(subcommand)]
    Template(TemplateCommand),
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
    Backup(BackupArgs),
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
    Restore(RestoreArgs),
    /// The store: move it from the redb file to PostgreSQL, for several
    /// replicas.
    #[command(subcommand)]
    Store(store::StoreCommand),
}

/// The whole program: internal entry points, then the command line.
pub fn run() -> ExitCode {
    // Internal entry points run single-threaded, before anything else:
    // `__sandbox-launch DIR` (the embedded backend's sandbox launcher),
    // `__probe-namespaces`, and the MCP gateway of an embedded sandbox, run
    // as `mcp-gateway` (argv[0]'s file name: the binary bound at
    // `embedded::gateway::GATEWAY_PATH`) or with `__mcp-gateway` first.
    let mut args = std::env::args_os();
    let argv0 = args.next();
    let name = argv0
        .as_deref()
        .map(std::path::Path::new)
        .and_then(|p| p.file_name());
    if name.is_some_and(|n| n == crate::embedded::gateway::PROGRAM) {
        return Exit::from_code(crate::embedded::gateway::gateway_main(args.collect())).into();
    }
    match args.next().as_deref().and_then(|a| a.to_str()) {
        Some(crate::embedded::gateway::HIDDEN_ARG) => {
            return Exit::from_code(crate::embedded::gateway::gateway_main(args.collect())).into();
        }
        Some("__sandbox-launch") => {
            let dir = args.next().map(PathBuf::from).unwrap_or_default();
            return Exit::from_code(crate::embedded::launch::launcher_main(&dir)).into();
        }
        Some("__probe-namespaces") => {
            return Exit::from_code(crate::embedded::launch::probe_main()).into();
        }
        _ => {}
    }
    crate::tls::install_default_provider();
    let cli = Cli::parse();
    crate::telemetry::init();
    dispatch(cli.command).into()
}

/// Every command and its handler.
fn dispatch(command: Command) -> Exit {
    match command {
        Command::Serve(a) => serve::serve(a),
        Command::Config(ConfigCommand::Check(serve::ConfigCommand::Check(a))) => {
            serve::config_check(a)
        }
        Command::Config(ConfigCommand::Import(a)) => config::import(a),
        Command::Token(TokenCommand::Create(a)) => tokens::create(a),
        Command::Token(TokenCommand::List(a)) => tokens::list(a),
        Command::Token(TokenCommand::Revoke(a)) => tokens::revoke(a),
        Command::Audit(AuditCommand::Verify(a)) => audit::verify(a),
        Command::Audit(AuditCommand::Export(a)) => audit::export(a),
        Command::Audit(AuditCommand::Reconcile(a)) => audit::reconcile(a),
        Command::Receipt(ReceiptCommand::Verify(a)) => audit::receipt_verify(a),
        Command::Recording(recording::RecordingCommand::Verify(a)) => recording::verify(a),
        Command::Recording(recording::RecordingCommand::List(a)) => recording::list(a),
        Command::Recording(recording::RecordingCommand::Hold(a)) => recording::hold(a, true),
        Command::Recording(recording::RecordingCommand::Unhold(a)) => recording::hold(a, false),
        Command::User(UserCommand::Add(a)) => users::add(a),
        Command::User(UserCommand::List(a)) => users::list(a),
        Command::User(UserCommand::Passwd(a)) => users::passwd(a),
        Command::User(UserCommand::Disable(a)) => users::disable(a),
        Command::User(UserCommand::Enable(a)) => users::enable(a),
        Command::User(UserCommand::Remove(a)) => users::remove(a),
        Command::Bench(b) => bench::run(b),
        Command::Mcp(a) => mcp::run(a),
        Command::Connect(a) => connect::run(a),
        Command::EmbeddedBackend(a) => backend::run(a),
        Command::Init(a) => ops::init(a),
        Command::Status(a) => ops::status(a),
        Command::Sandboxes(SandboxesCommand::List(a)) => sandboxes::list(a),
        Command::Sandboxes(SandboxesCommand::Kill(a)) => sandboxes::kill(a),
        Command::Sandboxes(SandboxesCommand::Prepare(a)) => sandboxes::prepare(a),
        Command::Lease(lease::LeaseCommand::Egress(a)) => lease::egress(a),
        Command::Template(TemplateCommand::Add(a)) => sandboxes::template_add(a),
        Command::Template(TemplateCommand::List(a)) => sandboxes::template_list(a),
        Command::Template(TemplateCommand::Remove(a)) => sandboxes::template_remove(a),
        Command::Cert(CertCommand::Show(a)) => ops::cert_show(a),
        Command::Cert(CertCommand::Renew(a)) => ops::cert_renew(a),
        Command::Backup(a) => backup::backup(a),
        Command::Restore(a) => backup::restore(a),
        Command::Store(store::StoreCommand::Migrate(a)) => store::migrate(a),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_keep_their_numbers() {
        let codes = [
            Exit::Ok,
            Exit::Failed,
            Exit::Usage,
            Exit::State,
            Exit::Store,
        ];
        assert_eq!(codes.map(|e| e as u8), [0, 1, 2, 3, 4]);
        for e in codes {
            assert_eq!(Exit::from_code(i32::from(e as u8)), e);
        }
        assert_eq!(Exit::from_code(-1), Exit::Failed);
        assert_eq!(Exit::from_code(256), Exit::Failed);
    }

    #[test]
    fn the_grammar_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
