//! `mcp`: the agent tools over MCP on stdin/stdout, as a client of an
//! appliance's /v1 (configured by flags, else the environment; see
//! `--help`). Exit 2 when the settings are refused, 1 when it fails at run
//! time.

use std::path::PathBuf;

use super::Exit;
use crate::mcp::stdio;

/// How `cube-adapter mcp --help` ends: where each setting comes from.
pub const PRECEDENCE: &str = "Precedence: a flag wins over its environment variable, and the \
environment over the default. An identity flag (--token-file, or --client-cert with --client-key) \
replaces the whole identity of the environment: CUBE_ADAPTER_TOKEN, CUBE_ADAPTER_TOKEN_FILE, \
CUBE_ADAPTER_CLIENT_CERT_FILE and CUBE_ADAPTER_CLIENT_KEY_FILE are then not read, so a token \
exported in the shell that starts the agent host cannot conflict with the configured one. \
Without flags the variables work as before; two that conflict (CUBE_ADAPTER_TOKEN and \
CUBE_ADAPTER_TOKEN_FILE) are refused with a message naming both. When a runtime is given (flag \
or variable), cube_acquire takes no runtime argument and always uses it; when none is, the \
identity's only allowed runtime is used. Plain HTTP only to loopback; a client certificate only \
over HTTPS. Stdout carries nothing but MCP. Exit 2 when the settings are refused (one line on \
stderr, before any connection is tried), 1 when it fails at run time.";

/// The agent tools over MCP on stdin/stdout, as a client of an appliance.
///
/// For hosts that start MCP servers as commands (Codex, Claude Code,
/// OpenCode, OpenClaw, Hermes Agent). Every setting is a flag, or else an
/// environment variable (the reference facade's names).
#[derive(clap::Args, Debug, Default)]
#[command(after_help = PRECEDENCE)]
pub struct McpArgs {
    /// The appliance, https://HOST:PORT (http:// only to a loopback address).
    /// Else CUBE_ADAPTER_URL; default https://127.0.0.1:18080.
    #[arg(long, value_name = "URL")]
    pub url: Option<String>,
    /// A file holding the bearer token (its first line; keep it 0600).
    /// Else CUBE_ADAPTER_TOKEN_FILE or CUBE_ADAPTER_TOKEN. Given, no
    /// identity variable is read.
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// The CA that signed the appliance's certificate (its STATE/tls/ca.pem).
    /// Else CUBE_ADAPTER_CA_FILE; default the public web PKI.
    #[arg(long, value_name = "FILE")]
    pub ca_file: Option<PathBuf>,
    /// A client certificate (PEM), with --client-key: one the appliance
    /// issued (`token create --client-cert DIR`), or one for an mTLS proxy
    /// in front of it. HTTPS only. Else CUBE_ADAPTER_CLIENT_CERT_FILE.
    /// Given, no identity variable is read.
    #[arg(long, value_name = "FILE")]
    pub client_cert: Option<PathBuf>,
    /// The client certificate's key (PEM), with --client-cert. Else
    /// CUBE_ADAPTER_CLIENT_KEY_FILE.
    #[arg(long, value_name = "FILE")]
    pub client_key: Option<PathBuf>,
    /// The profile leases are acquired with (the model cannot change it).
    /// Else CUBE_ADAPTER_PROFILE; default offline-code.
    #[arg(long, value_name = "NAME")]
    pub profile: Option<String>,
    /// The runtime this host runs agents as (openclaw, dsh, hermes, mcp):
    /// cube_acquire then has no runtime argument and always uses it. Else
    /// CUBE_ADAPTER_RUNTIME; without either, the identity's only allowed
    /// runtime, or the one the model names.
    #[arg(long, value_name = "RUNTIME")]
    pub runtime: Option<String>,
}

impl From<McpArgs> for stdio::Flags {
    fn from(a: McpArgs) -> Self {
        Self {
            url: a.url,
            token_file: a.token_file,
            ca_file: a.ca_file,
            client_cert: a.client_cert,
            client_key: a.client_key,
            profile: a.profile,
            runtime: a.runtime,
        }
    }
}

/// `cube-adapter mcp` with its flags.
pub fn run(args: McpArgs) -> Exit {
    let flags = stdio::Flags::from(args);
    let settings = match stdio::Settings::resolve(&flags, |k| std::env::var(k).ok()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("cube-adapter mcp: {e}");
            return Exit::Usage;
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cube-adapter mcp: {e}");
            return Exit::Failed;
        }
    };
    match rt.block_on(stdio::run(settings)) {
        Ok(()) => Exit::Ok,
        Err(e) => {
            eprintln!("cube-adapter mcp: {e}");
            Exit::Failed
        }
    }
}
