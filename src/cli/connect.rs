//! `connect HOST`: an agent host's configuration for this appliance,
//! written into the host's own file: the server entry of its snippet
//! (`docs/clients/snippets/`, the same text the documentation and the
//! console's "Connect an agent" page show), a token file (0600, with a new
//! token scoped to a tenant, the profile and the runtime; or `--token-file`),
//! the appliance's CA, with `--tools` the host's own tool filter, and with
//! `--hardened` the host's own settings that turn off its shell, file and
//! web tools (`crate::clients::HARDENINGS`).
//!
//! The snippets' generator is `crate::clients`, shared with the console's
//! page (`console::connect`). A changed file is parsed, merged (the user's
//! other settings kept; TOML comments too, JSON and YAML comments are not),
//! backed up as `FILE.bak-<UTC time>` (mode kept) and replaced atomically.
//! The token is never printed and never written anywhere but its file.

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use serde_norway::{Mapping, Value};

use super::Exit;
use super::common::{Access, Common, access, ask, runtime as tokio_runtime, unexpected};
use crate::admin::{Request, Response};
use crate::auth;

pub use crate::clients::*;

// --------------------------------------------------------------------- the command

/// The agent hosts `connect` configures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Host {
    Codex,
    ClaudeCode,
    Opencode,
    Openclaw,
    Hermes,
}

impl Host {
    /// `codex`, `claude-code`, … (as in the snippets).
    pub fn id(self) -> &'static str {
        match self {
            Host::Codex => "codex",
            Host::ClaudeCode => "claude-code",
            Host::Opencode => "opencode",
            Host::Openclaw => "openclaw",
            Host::Hermes => "hermes",
        }
    }

    /// Its configuration file under `home`.
    fn default_file(self, home: &Path) -> PathBuf {
        match self {
            Host::Codex => home.join(".codex/config.toml"),
            Host::ClaudeCode => home.join(".claude.json"),
            Host::Opencode => home.join(".config/opencode/opencode.json"),
            Host::Openclaw => home.join(".openclaw/openclaw.json"),
            Host::Hermes => home.join(".hermes/config.yaml"),
        }
    }

    /// The host's own check, run when its binary is on PATH.
    fn check(self) -> (&'static str, &'static [&'static str]) {
        match self {
            Host::Codex => ("codex", &["mcp", "list"]),
            Host::ClaudeCode => ("claude", &["mcp", "list"]),
            Host::Opencode => ("opencode", &["mcp", "list"]),
            Host::Openclaw => ("openclaw", &["mcp", "probe", "cube"]),
            Host::Hermes => ("hermes", &["mcp", "test", "cube"]),
        }
    }
}

/// What `connect --help` ends with.
pub const CONNECT_HELP: &str = "Files: the host's configuration (codex ~/.codex/config.toml, \
claude-code ~/.claude.json (user scope) and, with --tools, ~/.claude/settings.json, opencode \
~/.config/opencode/opencode.json, openclaw ~/.openclaw/openclaw.json, hermes \
~/.hermes/config.yaml), the token file ~/.config/cube-adapter/HOST.token (0600; a second run \
replaces it with a new token and names the old one to revoke) and ~/.config/cube-adapter/ca.pem. \
The server entry is named cube: an existing one is replaced, everything else is kept (TOML \
comments too; JSON and YAML comments are not kept). Each changed file is first copied to \
FILE.bak-<UTC time>. The token is never printed. --tools: codex enabled_tools, claude-code \
permissions (allow and deny) in settings.json, opencode permission, hermes tools.include; \
openclaw has no filter in its file and refuses --tools. --hardened (the default when the token \
is made here, on the appliance's own machine; --no-hardened to keep them) turns off the host's own \
shell, file and web tools, so that the model acts only through the appliance: claude-code \
permissions.deny in ~/.claude/settings.json (Bash, PowerShell, Monitor, Read, Glob, Grep, LSP, \
Edit, Write, NotebookEdit, WebFetch, WebSearch, EnterWorktree, ExitWorktree, Workflow); codex \
sandbox_mode = \"read-only\", approval_policy = \"never\", web_search = \"disabled\" and \
[features] shell_tool, view_image, browser_use, computer_use = false; opencode permission \
bash, edit, read, glob, grep, list, lsp, webfetch, websearch, external_directory = \"deny\"; \
openclaw tools.deny (group:runtime, group:fs, group:web, group:ui, group:nodes, \
group:automation, ls, view_image, pdf); hermes agent.disabled_toolsets (terminal, file, \
code_execution, web, browser, computer_use, vision, video). Entries are added, nothing of the \
user's is removed. Exit codes: 0 done; 1 the host's \
check failed or a file could not be written; 2 bad usage, or a configuration file that does \
not parse (nothing is changed); 3 no state directory or service to make a token; 4 store or \
I/O error.";

#[derive(Args)]
pub struct ConnectArgs {
    /// The agent host to configure.
    #[arg(value_enum)]
    pub host: Host,
    #[command(flatten)]
    pub common: Common,
    /// Remote HTTP (the appliance's /mcp) instead of stdio (`cube-adapter
    /// mcp`). The host then sends the token from CUBE_ADAPTER_TOKEN in its
    /// environment (Hermes: also from ~/.hermes/.env).
    #[arg(long)]
    pub http: bool,
    /// The appliance, https://HOST:PORT; default its public URL as the
    /// configuration gives it (server_names, listen).
    #[arg(long, value_name = "URL")]
    pub url: Option<String>,
    /// The profile the host acquires leases with.
    #[arg(long, value_name = "NAME", default_value = "offline-code")]
    pub profile: String,
    /// The runtime the host names (default: the host's, as in its
    /// snippet: mcp, or openclaw, hermes).
    #[arg(long, value_name = "RUNTIME")]
    pub runtime: Option<String>,
    /// Tenant of the new token (required unless --token-file).
    #[arg(long)]
    pub tenant: Option<String>,
    /// Subject of the new token (default: the tenant).
    #[arg(long)]
    pub subject: Option<String>,
    /// Use this existing token file instead of creating a token (its first
    /// line is the token; keep it 0600).
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// The appliance's CA on this machine (default: a copy of
    /// STATE/tls/ca.pem in ~/.config/cube-adapter/ca.pem).
    #[arg(long, value_name = "FILE")]
    pub ca_file: Option<PathBuf>,
    /// The host's configuration file (default: its usual one under $HOME).
    #[arg(long, value_name = "FILE")]
    pub config_file: Option<PathBuf>,
    /// Only these tools (comma-separated names, a trailing * matches a
    /// prefix: cube_task_*), with the host's own tool filter.
    #[arg(long, value_name = "TOOLS", value_delimiter = ',')]
    pub tools: Vec<String>,
    /// Also turn off the host's own shell, file and web tools (in its own
    /// settings), so that the model can act only through the appliance.
    /// The default when the token is made here (the host runs on the
    /// appliance's own machine, the jump host); with --token-file, give it.
    #[arg(long)]
    pub hardened: bool,
    /// Leave the host's own tools as they are, even on the appliance's
    /// machine.
    #[arg(long, conflicts_with = "hardened")]
    pub no_hardened: bool,
    /// Print the changes and write nothing (no token is created).
    #[arg(long)]
    pub dry_run: bool,
}

/// A refusal: its message, and the exit code.
struct Refusal(Exit, String);

fn usage(m: impl Into<String>) -> Refusal {
    Refusal(Exit::Usage, m.into())
}

/// A file `connect` changes: where, what it held (None: absent) and what
/// it will hold.
struct Change {
    path: PathBuf,
    old: Option<String>,
    new: String,
}

pub fn run(args: ConnectArgs) -> Exit {
    match connect(args) {
        Ok(e) => e,
        Err(Refusal(code, m)) => {
            eprintln!("error: {m}");
            code
        }
    }
}

fn connect(a: ConnectArgs) -> Result<Exit, Refusal> {
    let host = a.host;
    let home = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(PathBuf::from)
        .ok_or_else(|| usage("HOME is not set: cannot find the host's files"))?;
    // Everything is checked before anything is written or a token made.
    let tools = tool_list(&a.tools)?;
    if !tools.is_empty() && host == Host::Openclaw {
        return Err(usage(
            "OpenClaw has no tool filter in its server entry: --tools cannot restrict it here. \
             Connect without --tools, then run `openclaw mcp tools cube --include 'cube_task_*'` \
             (or your list), or limit the token's actions (token create --action)",
        ));
    }
    if !plain(&a.profile) {
        return Err(usage(
            "--profile: letters, digits, '.', '_' and '-' only (at most 64)",
        ));
    }
    if let Some(r) = &a.runtime
        && !plain(r)
    {
        return Err(usage("--runtime: letters, digits, '.', '_' and '-' only"));
    }
    let needs_state = a.url.is_none() || a.token_file.is_none() || a.ca_file.is_none();
    let cfg = if needs_state {
        Some(
            a.common
                .load()
                .map_err(|e| Refusal(e, "the configuration is invalid".into()))?,
        )
    } else {
        None
    };
    let url = match (&a.url, &cfg) {
        (Some(u), _) => check_url(u)?,
        (None, Some(c)) => public_url(c, c.listen, None),
        (None, None) => return Err(usage("--url is required")),
    };
    let plain_http = url.starts_with("http://");
    let mine = home.join(".config/cube-adapter");
    // The token file: given (it must hold a token), or ours (made below).
    let (token_file, make_token) = match &a.token_file {
        Some(f) => {
            let f = absolute(f)?;
            let t = std::fs::read_to_string(&f)
                .map_err(|e| usage(format!("--token-file {}: {e}", f.display())))?;
            if !t
                .lines()
                .next()
                .unwrap_or("")
                .trim()
                .starts_with(auth::TOKEN_PREFIX)
            {
                return Err(usage(format!(
                    "--token-file {}: its first line is not a token (cat_…)",
                    f.display()
                )));
            }
            (f, false)
        }
        None => {
            if a.tenant.as_deref().unwrap_or("").trim().is_empty() {
                return Err(usage(
                    "--tenant is required to create a token (or give --token-file FILE)",
                ));
            }
            (mine.join(format!("{}.token", host.id())), true)
        }
    };
    // The CA: given, none for plain HTTP, else a copy of the appliance's.
    let (ca_file, ca_copy) = match (&a.ca_file, plain_http) {
        (Some(f), _) => {
            let f = absolute(f)?;
            if !f.is_file() {
                return Err(usage(format!("--ca-file {}: no such file", f.display())));
            }
            (Some(f), None)
        }
        (None, true) => (None, None),
        (None, false) => {
            let state = cfg
                .as_ref()
                .map(|c| c.state_dir.clone())
                .unwrap_or_default();
            let pem = std::fs::read(state.join("tls/ca.pem")).map_err(|e| {
                Refusal(
                    Exit::State,
                    format!(
                        "cannot read the appliance's CA {} ({e}): give --ca-file FILE",
                        state.join("tls/ca.pem").display()
                    ),
                )
            })?;
            (Some(mine.join("ca.pem")), Some(pem))
        }
    };
    let command = mcp_command();
    let runtime = a.runtime.clone();
    let token_text = text_path(&token_file)?;
    let ca_text = ca_file.as_deref().map(text_path).transpose()?;
    let target = Target {
        url: &url,
        profile: &a.profile,
        runtime: runtime.as_deref(),
        token_file: &token_text,
        ca_file: ca_text.as_deref(),
        command: &command,
    };
    let transport = if a.http { "http" } else { "stdio" };
    let entry = server_entry(host.id(), transport, &target).map_err(usage)?;
    let config_file = match &a.config_file {
        Some(f) => absolute(f)?,
        None => host.default_file(&home),
    };
    // The host's own settings that --hardened writes: in the file of its
    // entry, or (Claude Code) in its settings.
    // On the appliance's own machine (the token is made here) the host's
    // own tools would reach around the appliance: off unless refused.
    let hardened = a.hardened || (!a.no_hardened && a.token_file.is_none());
    // Said when it was not asked for: how to keep the host's tools.
    let why = if a.hardened {
        ""
    } else {
        " (the default on the appliance's machine; --no-hardened keeps them)"
    };
    let hardening = if hardened {
        Some(hardening(host.id()).ok_or_else(|| usage("no hardened mode for this host"))?)
    } else {
        None
    };
    let settings = home.join(".claude/settings.json");
    let mut changes = vec![merge(
        host,
        &config_file,
        entry,
        &tools,
        hardening.filter(|_| host != Host::ClaudeCode),
    )?];
    if host == Host::ClaudeCode && (!tools.is_empty() || hardening.is_some()) {
        changes.push(claude_settings(&settings, &tools, hardening)?);
    }
    let hardened_file = if host == Host::ClaudeCode {
        &settings
    } else {
        &config_file
    };
    let changes: Vec<Change> = changes
        .into_iter()
        .filter(|c| c.old.as_deref() != Some(c.new.as_str()))
        .collect();

    if a.dry_run {
        for c in &changes {
            print!("{}", diff(c));
        }
        if changes.is_empty() {
            println!("{}: nothing to change", config_file.display());
        }
        if make_token {
            println!(
                "# would create a token for tenant {} (profile {}) into {}",
                a.tenant.as_deref().unwrap_or_default().trim(),
                a.profile,
                token_file.display()
            );
        }
        if let Some(ca) = ca_copy.as_ref().and(ca_file.as_ref()) {
            println!("# would copy the appliance's CA to {}", ca.display());
        }
        if let Some(h) = hardening {
            println!(
                "# would turn off the host's own tools in {}{why}:",
                hardened_file.display()
            );
            for l in h.summary() {
                println!("#   {l}");
            }
        }
        return Ok(Exit::Ok);
    }

    // The token first: a configuration never names a file that is not there.
    if make_token {
        let spec = auth::TokenSpec {
            tenant: a.tenant.clone().unwrap_or_default().trim().to_string(),
            subject: a.subject.clone(),
            runtimes: vec![
                runtime
                    .clone()
                    .unwrap_or_else(|| default_runtime(host, transport)),
            ],
            profiles: vec![a.profile.clone()],
            ..auth::TokenSpec::default()
        };
        let state = cfg
            .as_ref()
            .map(|c| c.state_dir.clone())
            .unwrap_or_default();
        let description = format!("{} over {transport} (cube-adapter connect)", host.id());
        let token = new_token(&state, spec, description)?;
        let previous = std::fs::read_to_string(&token_file)
            .ok()
            .map(|t| admin_token_id(t.trim()));
        write_file(&token_file, token.as_bytes(), Some(0o600))
            .map_err(|e| Refusal(Exit::Failed, format!("{}: {e}", token_file.display())))?;
        eprintln!(
            "wrote a new token ({}) to {} (0600)",
            admin_token_id(&token),
            token_file.display()
        );
        if let Some(id) = previous.filter(|i| !i.is_empty()) {
            eprintln!(
                "the token it held before ({id}) still works: revoke it with `cube-adapter token revoke {id}` once unused"
            );
        }
    }
    if let (Some(pem), Some(ca)) = (&ca_copy, &ca_file)
        && std::fs::read(ca).ok().as_ref() != Some(pem)
    {
        write_file(ca, pem, Some(0o644))
            .map_err(|e| Refusal(Exit::Failed, format!("{}: {e}", ca.display())))?;
        eprintln!("wrote the appliance's CA to {}", ca.display());
    }
    for c in &changes {
        if c.old.is_some() {
            let b = backup(&c.path).map_err(|e| {
                Refusal(Exit::Failed, format!("backup of {}: {e}", c.path.display()))
            })?;
            eprintln!("kept {} as {}", c.path.display(), b.display());
        }
        write_file(&c.path, c.new.as_bytes(), None)
            .map_err(|e| Refusal(Exit::Failed, format!("{}: {e}", c.path.display())))?;
        eprintln!("wrote {}", c.path.display());
    }
    if changes.is_empty() {
        eprintln!(
            "{} already says this: nothing changed",
            config_file.display()
        );
    }
    if let Some(h) = hardening {
        eprintln!(
            "hardened: the host's own shell, file and web tools are off in {}{why}:",
            hardened_file.display()
        );
        for l in h.summary() {
            eprintln!("  {l}");
        }
    }
    if a.http {
        eprintln!(
            "the host sends the token from CUBE_ADAPTER_TOKEN: export CUBE_ADAPTER_TOKEN=\"$(cat {})\" before starting it",
            token_file.display()
        );
        if let Some(hint) = ca_hint(host)
            && let Some(ca) = &ca_file
        {
            eprintln!("and trust the appliance's CA: {hint}={}", ca.display());
        }
    }
    Ok(host_check(host, a.config_file.is_some()))
}

/// The runtime of the host's snippet.
fn default_runtime(host: Host, transport: &str) -> String {
    let probe = Target {
        url: EXAMPLE_URL,
        profile: EXAMPLE_PROFILE,
        runtime: None,
        token_file: "t",
        ca_file: None,
        command: "cube-adapter",
    };
    let entry = server_entry(host.id(), transport, &probe).unwrap_or_default();
    named_runtime(&entry).unwrap_or_else(|| "mcp".into())
}

/// The runtime an entry names: `--runtime X` in its arguments, or
/// `runtime=X` in its URL.
fn named_runtime(v: &Value) -> Option<String> {
    match v {
        Value::String(s) if s.starts_with("http") => url::Url::parse(s)
            .ok()?
            .query_pairs()
            .find(|(k, _)| k == "runtime")
            .map(|(_, r)| r.into_owned()),
        Value::Sequence(items) => items
            .iter()
            .position(|x| x.as_str() == Some("--runtime"))
            .and_then(|i| items.get(i + 1))
            .and_then(Value::as_str)
            .map(str::to_string)
            .or_else(|| items.iter().find_map(named_runtime)),
        Value::Mapping(m) => m.values().find_map(named_runtime),
        _ => None,
    }
}

/// How the host's HTTP client trusts the appliance's CA, when it is an
/// environment variable.
fn ca_hint(host: Host) -> Option<&'static str> {
    match host {
        Host::Codex => Some("CODEX_CA_CERTIFICATE"),
        Host::Hermes => None,
        _ => Some("NODE_EXTRA_CA_CERTS"),
    }
}

/// `cube-adapter` when that is on PATH (as the snippets say), else this
/// binary's absolute path.
fn mcp_command() -> String {
    let me = std::env::current_exe().ok();
    let on_path = find_on_path("cube-adapter");
    match (on_path, me) {
        (Some(p), Some(m)) if same_file(&p, &m) => "cube-adapter".into(),
        (_, Some(m)) => m.display().to_string(),
        (Some(_), None) => "cube-adapter".into(),
        (None, None) => "cube-adapter".into(),
    }
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    }
}

fn find_on_path(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(name))
        .find(|p| {
            std::fs::metadata(p)
                .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
                .unwrap_or(false)
        })
}

/// A path that goes into a configuration as it is: absolute, UTF-8, no
/// control characters.
fn text_path(p: &Path) -> Result<String, Refusal> {
    let s = p
        .to_str()
        .ok_or_else(|| usage(format!("{}: not UTF-8", p.display())))?;
    if s.chars().any(char::is_control) {
        return Err(usage(format!("{s:?}: control characters in a path")));
    }
    Ok(s.to_string())
}

fn absolute(p: &Path) -> Result<PathBuf, Refusal> {
    std::path::absolute(p).map_err(|e| usage(format!("{}: {e}", p.display())))
}

/// A name that may go into a URL and any configuration as it is.
fn plain(p: &str) -> bool {
    !p.is_empty()
        && p.len() <= 64
        && p.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// `https://HOST[:PORT]` (or `http://` to loopback), nothing after it.
fn check_url(u: &str) -> Result<String, Refusal> {
    let bad = || {
        usage(format!(
            "--url {u:?}: give https://HOST:PORT (http:// only to a loopback address), with no path, query or credentials"
        ))
    };
    let p = url::Url::parse(u.trim()).map_err(|_| bad())?;
    let host = p.host_str().ok_or_else(bad)?;
    let loopback = host == "localhost"
        || host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    let scheme_ok = p.scheme() == "https" || (p.scheme() == "http" && loopback);
    if !scheme_ok
        || !p.username().is_empty()
        || p.password().is_some()
        || p.query().is_some()
        || p.fragment().is_some()
        || !matches!(p.path(), "" | "/")
    {
        return Err(bad());
    }
    let text = p.as_str().trim_end_matches('/').to_string();
    if !text
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b".-:[]/".contains(&b))
    {
        return Err(bad());
    }
    Ok(text)
}

/// `--tools`: known tool names; `PREFIX*` stands for every tool it
/// begins. Empty: no filter.
fn tool_list(given: &[String]) -> Result<Vec<String>, Refusal> {
    let known: Vec<&str> = crate::mcp::tools::TOOLS.iter().map(|t| t.name).collect();
    let mut out: Vec<String> = Vec::new();
    for t in given.iter().map(|t| t.trim()).filter(|t| !t.is_empty()) {
        let matched: Vec<&str> = match t.strip_suffix('*') {
            Some(prefix) => known
                .iter()
                .copied()
                .filter(|k| k.starts_with(prefix))
                .collect(),
            None => known.iter().copied().filter(|k| *k == t).collect(),
        };
        if matched.is_empty() {
            return Err(usage(format!(
                "--tools: no tool {t:?} (the tools: {})",
                known.join(", ")
            )));
        }
        for m in matched {
            if !out.iter().any(|o| o == m) {
                out.push(m.to_string());
            }
        }
    }
    if !given.is_empty() && out.is_empty() {
        return Err(usage("--tools: name at least one tool"));
    }
    Ok(out)
}

// ------------------------------------------------------------- merging the files

fn read_existing(path: &Path) -> Result<Option<String>, Refusal> {
    match std::fs::read_to_string(path) {
        Ok(t) => Ok(Some(t)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Refusal(Exit::Store, format!("{}: {e}", path.display()))),
    }
}

fn unparsable(path: &Path, what: &str, e: impl std::fmt::Display) -> Refusal {
    usage(format!(
        "{} is not valid {what} ({e}); nothing was changed",
        path.display()
    ))
}

/// The host's file with `entry` as its `cube` server (for OpenCode, its
/// permissions for `tools`), and `hardening` applied.
fn merge(
    host: Host,
    path: &Path,
    entry: Value,
    tools: &[String],
    hardening: Option<&Hardening>,
) -> Result<Change, Refusal> {
    let old = read_existing(path)?;
    let (keys, format) = entry_path(host.id()).ok_or_else(|| usage("unknown host"))?;
    let mut entry = entry;
    if !tools.is_empty() {
        let list = Value::Sequence(tools.iter().map(|t| Value::String(t.clone())).collect());
        if let Value::Mapping(m) = &mut entry {
            match host {
                Host::Codex => {
                    m.insert("enabled_tools".into(), list);
                }
                Host::Hermes => {
                    let mut f = Mapping::new();
                    f.insert("include".into(), list);
                    m.insert("tools".into(), Value::Mapping(f));
                }
                _ => {}
            }
        }
    }
    let new = match format {
        "toml" => merge_toml(path, old.as_deref().unwrap_or(""), keys, &entry, hardening)?,
        "json" | "yaml" => {
            let text = old.as_deref().unwrap_or("");
            let mut doc: Value = if text.trim().is_empty() {
                Value::Mapping(Mapping::new())
            } else if format == "json" {
                serde_json::from_str(text).map_err(|e| unparsable(path, "JSON", e))?
            } else {
                serde_norway::from_str(text).map_err(|e| unparsable(path, "YAML", e))?
            };
            if doc.is_null() {
                doc = Value::Mapping(Mapping::new());
            }
            if host == Host::Opencode
                && doc.get("$schema").is_none()
                && let Value::Mapping(m) = &mut doc
            {
                m.insert("$schema".into(), "https://opencode.ai/config.json".into());
            }
            set_at(&mut doc, keys, entry).map_err(|k| not_a_mapping(path, &k))?;
            if host == Host::Opencode && !tools.is_empty() {
                opencode_permission(&mut doc, tools)
                    .map_err(|e| usage(format!("{}: {e}; nothing was changed", path.display())))?;
            }
            if let Some(h) = hardening {
                harden(&mut doc, h).map_err(|k| not_a_mapping(path, &k))?;
            }
            if format == "json" {
                let mut s = serde_json::to_string_pretty(&doc)
                    .map_err(|e| Refusal(Exit::Failed, e.to_string()))?;
                s.push('\n');
                s
            } else {
                serde_norway::to_string(&doc).map_err(|e| Refusal(Exit::Failed, e.to_string()))?
            }
        }
        _ => return Err(usage("unknown format")),
    };
    Ok(Change {
        path: path.to_path_buf(),
        old,
        new,
    })
}

fn not_a_mapping(path: &Path, key: &str) -> Refusal {
    usage(format!(
        "{}: `{key}` is not an object/mapping; nothing was changed",
        path.display()
    ))
}

/// `h` in a parsed JSON or YAML file: each list gains the entries it lacks
/// (made if absent), each key takes its value. The key in the way when a
/// mapping or a list is something else.
fn harden(doc: &mut Value, h: &Hardening) -> Result<(), String> {
    for (keys, names) in h.lists {
        let mut list = match keys.split_last() {
            Some((last, parents)) => {
                let m = mapping_at(doc, parents)?;
                m.entry(Value::String((*last).to_string()))
                    .or_insert(Value::Null)
            }
            None => continue,
        };
        if list.is_null() {
            *list = Value::Sequence(Vec::new());
        }
        let Value::Sequence(items) = &mut list else {
            return Err(keys.join("."));
        };
        for n in *names {
            if !items.iter().any(|v| v.as_str() == Some(*n)) {
                items.push(Value::String((*n).to_string()));
            }
        }
    }
    for (keys, v) in h.values {
        let v = match v {
            Setting::Text(t) => Value::String((*t).to_string()),
            Setting::Flag(b) => Value::Bool(*b),
        };
        set_at(doc, keys, v)?;
    }
    Ok(())
}

/// The mapping at `keys` (made on the way, a null replaced); the key that
/// is something else.
fn mapping_at<'a>(doc: &'a mut Value, keys: &[&str]) -> Result<&'a mut Mapping, String> {
    let mut cur = doc;
    let mut seen = String::new();
    for k in keys {
        seen = if seen.is_empty() {
            (*k).to_string()
        } else {
            format!("{seen}.{k}")
        };
        if cur.is_null() {
            *cur = Value::Mapping(Mapping::new());
        }
        let Value::Mapping(m) = cur else {
            return Err(seen);
        };
        cur = m
            .entry(Value::String((*k).to_string()))
            .or_insert(Value::Null);
    }
    if cur.is_null() {
        *cur = Value::Mapping(Mapping::new());
    }
    match cur {
        Value::Mapping(m) => Ok(m),
        _ => Err(if seen.is_empty() {
            "(top level)".into()
        } else {
            seen
        }),
    }
}

/// Put `v` at `keys` (making the mappings on the way); the key that is not
/// a mapping when one is in the way.
fn set_at(doc: &mut Value, keys: &[&str], v: Value) -> Result<(), String> {
    let Some((last, parents)) = keys.split_last() else {
        return Ok(());
    };
    let mut cur = doc;
    let mut seen = String::new();
    for k in parents {
        seen = if seen.is_empty() {
            (*k).to_string()
        } else {
            format!("{seen}.{k}")
        };
        let Value::Mapping(m) = cur else {
            return Err(seen);
        };
        cur = m
            .entry(Value::String((*k).to_string()))
            .or_insert_with(|| Value::Mapping(Mapping::new()));
        if cur.is_null() {
            *cur = Value::Mapping(Mapping::new());
        }
    }
    let Value::Mapping(m) = cur else {
        return Err(seen);
    };
    m.insert(Value::String((*last).to_string()), v);
    Ok(())
}

/// OpenCode: `permission` denies the server's tools (`cube_*`) and then
/// allows those named (the last matching rule wins). Earlier `cube_…`
/// rules are replaced.
fn opencode_permission(doc: &mut Value, tools: &[String]) -> Result<(), String> {
    let Value::Mapping(root) = doc else {
        return Err("the file is not an object".into());
    };
    let p = root
        .entry("permission".into())
        .or_insert_with(|| Value::Mapping(Mapping::new()));
    let Value::Mapping(p) = p else {
        return Err("`permission` is not an object (set per tool to use --tools)".into());
    };
    p.retain(|k, _| !k.as_str().is_some_and(|k| k.starts_with("cube_")));
    p.insert("cube_*".into(), "deny".into());
    for t in tools {
        p.insert(format!("cube_{t}").into(), "allow".into());
    }
    Ok(())
}

/// Claude Code's `~/.claude/settings.json`. With `tools`, `permissions.allow`
/// and `.deny` name this server's tools (`mcp__cube__NAME`): the ones given
/// allowed, every other one denied; earlier `mcp__cube__` rules are
/// replaced. With `hardening`, `permissions.deny` also names the host's own
/// tools it turns off.
fn claude_settings(
    path: &Path,
    tools: &[String],
    hardening: Option<&Hardening>,
) -> Result<Change, Refusal> {
    let old = read_existing(path)?;
    let text = old.as_deref().unwrap_or("");
    let mut doc: Value = if text.trim().is_empty() {
        Value::Mapping(Mapping::new())
    } else {
        serde_json::from_str(text).map_err(|e| unparsable(path, "JSON", e))?
    };
    let not_object = |k: &str| {
        usage(format!(
            "{}: `{k}` is not an object; nothing was changed",
            path.display()
        ))
    };
    if !tools.is_empty() {
        let Value::Mapping(root) = &mut doc else {
            return Err(not_object("(top level)"));
        };
        let perms = root
            .entry("permissions".into())
            .or_insert_with(|| Value::Mapping(Mapping::new()));
        let Value::Mapping(perms) = perms else {
            return Err(not_object("permissions"));
        };
        let all = crate::mcp::tools::TOOLS.iter().map(|t| t.name);
        for (key, names) in [
            ("allow", tools.to_vec()),
            (
                "deny",
                all.filter(|n| !tools.iter().any(|t| t == n))
                    .map(str::to_string)
                    .collect(),
            ),
        ] {
            let list = perms
                .entry(key.into())
                .or_insert_with(|| Value::Sequence(Vec::new()));
            let Value::Sequence(list) = list else {
                return Err(not_object(&format!("permissions.{key}")));
            };
            list.retain(|v| {
                !v.as_str()
                    .is_some_and(|s| s.starts_with("mcp__cube__") || s == "mcp__cube")
            });
            list.extend(
                names
                    .into_iter()
                    .map(|n| Value::String(format!("mcp__cube__{n}"))),
            );
        }
    }
    if let Some(h) = hardening {
        harden(&mut doc, h).map_err(|k| not_object(&k))?;
    }
    let mut new =
        serde_json::to_string_pretty(&doc).map_err(|e| Refusal(Exit::Failed, e.to_string()))?;
    new.push('\n');
    Ok(Change {
        path: path.to_path_buf(),
        old,
        new,
    })
}

/// Codex's TOML, edited in place: comments and every other table kept.
fn merge_toml(
    path: &Path,
    text: &str,
    keys: &[&str],
    entry: &Value,
    hardening: Option<&Hardening>,
) -> Result<String, Refusal> {
    use toml_edit::{DocumentMut, Item, Table};
    let mut doc: DocumentMut = text.parse().map_err(|e| unparsable(path, "TOML", e))?;
    let Some((last, parents)) = keys.split_last() else {
        return Err(usage("no entry path"));
    };
    let mut cur: &mut Table = doc.as_table_mut();
    for k in parents {
        if !cur.contains_key(k) {
            let mut t = Table::new();
            t.set_implicit(true);
            cur.insert(k, Item::Table(t));
        }
        cur = cur.get_mut(k).and_then(Item::as_table_mut).ok_or_else(|| {
            usage(format!(
                "{}: `{k}` is not a table; nothing was changed",
                path.display()
            ))
        })?;
    }
    let Value::Mapping(m) = entry else {
        return Err(usage("the entry is not a table"));
    };
    let mut t = Table::new();
    for (k, v) in m {
        let (Some(k), Some(v)) = (k.as_str(), toml_value(v)) else {
            continue;
        };
        t.insert(k, Item::Value(v));
    }
    // Replaced where it was (its comments above it kept), or appended.
    match cur.get_mut(last).and_then(Item::as_table_mut) {
        Some(old) => {
            let decor = old.decor().clone();
            *old = t;
            *old.decor_mut() = decor;
        }
        None => {
            cur.insert(last, Item::Table(t));
        }
    }
    if let Some(h) = hardening {
        harden_toml(&mut doc, h).map_err(|k| {
            usage(format!(
                "{}: `{k}` is not a table (or array); nothing was changed",
                path.display()
            ))
        })?;
    }
    Ok(doc.to_string())
}

/// `h` in Codex's TOML: each key takes its value (a value already there
/// keeps its comments), each array gains the entries it lacks; tables are
/// made on the way. The key in the way when one is not a table.
fn harden_toml(doc: &mut toml_edit::DocumentMut, h: &Hardening) -> Result<(), String> {
    use toml_edit::{Item, Table, TableLike};
    fn table_at<'a>(
        doc: &'a mut toml_edit::DocumentMut,
        keys: &[&str],
    ) -> Result<&'a mut dyn TableLike, String> {
        let mut cur: &mut dyn TableLike = doc.as_table_mut();
        for (i, k) in keys.iter().enumerate() {
            if !cur.contains_key(k) {
                cur.insert(k, Item::Table(Table::new()));
            }
            cur = cur
                .get_mut(k)
                .and_then(Item::as_table_like_mut)
                .ok_or_else(|| keys.get(..=i).unwrap_or_default().join("."))?;
        }
        Ok(cur)
    }
    for (keys, v) in h.values {
        let Some((last, parents)) = keys.split_last() else {
            continue;
        };
        let new: toml_edit::Value = match v {
            Setting::Text(t) => (*t).into(),
            Setting::Flag(b) => (*b).into(),
        };
        let t = table_at(doc, parents)?;
        match t.get_mut(last).and_then(Item::as_value_mut) {
            Some(old) if old.to_string().trim() == new.to_string().trim() => {}
            Some(old) => {
                let decor = old.decor().clone();
                *old = new;
                *old.decor_mut() = decor;
            }
            None => {
                t.insert(last, Item::Value(new));
            }
        }
    }
    for (keys, names) in h.lists {
        let Some((last, parents)) = keys.split_last() else {
            continue;
        };
        let t = table_at(doc, parents)?;
        if !t.contains_key(last) {
            t.insert(last, Item::Value(toml_edit::Array::new().into()));
        }
        let a = t
            .get_mut(last)
            .and_then(Item::as_array_mut)
            .ok_or_else(|| keys.join("."))?;
        for n in *names {
            if !a.iter().any(|x| x.as_str() == Some(*n)) {
                a.push(*n);
            }
        }
    }
    Ok(())
}

fn toml_value(v: &Value) -> Option<toml_edit::Value> {
    Some(match v {
        Value::String(s) => s.as_str().into(),
        Value::Bool(b) => (*b).into(),
        Value::Number(n) => match n.as_i64() {
            Some(i) => i.into(),
            None => n.as_f64()?.into(),
        },
        Value::Sequence(items) => {
            let mut a = toml_edit::Array::new();
            for x in items {
                a.push(toml_value(x)?);
            }
            // Long lists one item a line, as the snippets write them.
            if a.len() > 3 {
                for x in a.iter_mut() {
                    x.decor_mut().set_prefix("\n  ");
                }
                a.set_trailing("\n");
                a.set_trailing_comma(true);
            }
            toml_edit::Value::Array(a)
        }
        Value::Mapping(m) => {
            let mut t = toml_edit::InlineTable::new();
            for (k, x) in m {
                t.insert(k.as_str()?, toml_value(x)?);
            }
            toml_edit::Value::InlineTable(t)
        }
        _ => return None,
    })
}

// ------------------------------------------------------------- writing the files

/// `a` → `b` as removed and added lines around their common head and tail.
fn diff(c: &Change) -> String {
    let old: Vec<&str> = c.old.as_deref().unwrap_or("").lines().collect();
    let new: Vec<&str> = c.new.lines().collect();
    let head = old.iter().zip(&new).take_while(|(a, b)| a == b).count();
    let tail = old
        .iter()
        .rev()
        .zip(new.iter().rev())
        .take_while(|(a, b)| a == b)
        .count()
        .min(old.len().min(new.len()) - head);
    let mut out = format!(
        "--- {}{}\n+++ {}\n@@ -{},{} +{},{} @@\n",
        c.path.display(),
        if c.old.is_none() { " (absent)" } else { "" },
        c.path.display(),
        head + 1,
        old.len() - head - tail,
        head + 1,
        new.len() - head - tail
    );
    for l in old.get(head..old.len() - tail).unwrap_or_default() {
        out.push_str(&format!("-{l}\n"));
    }
    for l in new.get(head..new.len() - tail).unwrap_or_default() {
        out.push_str(&format!("+{l}\n"));
    }
    out
}

/// `FILE.bak-<UTC time>` (a new name, the file's mode kept).
fn backup(path: &Path) -> std::io::Result<PathBuf> {
    let stamp = crate::clock::system_now()
        .format(time::macros::format_description!(
            "[year][month][day]T[hour][minute][second]Z"
        ))
        .unwrap_or_default();
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    for n in 0..100 {
        let suffix = if n == 0 {
            String::new()
        } else {
            format!("-{n}")
        };
        let b = path.with_file_name(format!("{name}.bak-{stamp}{suffix}"));
        if b.exists() {
            continue;
        }
        std::fs::copy(path, &b)?;
        return Ok(b);
    }
    Err(std::io::Error::other("too many backups this second"))
}

/// Replace `path` atomically (a new file beside it, renamed over it): the
/// old file's mode, else `mode`, else 0600. A symlink's target is written.
fn write_file(path: &Path, data: &[u8], mode: Option<u32>) -> std::io::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let path = match std::fs::canonicalize(path) {
        Ok(p) => p,
        Err(_) => path.to_path_buf(),
    };
    let mode = match (mode, std::fs::metadata(&path)) {
        (Some(m), _) => m,
        (None, Ok(m)) => m.permissions().mode() & 0o7777,
        (None, Err(_)) => 0o600,
    };
    let dir = path
        .parent()
        .ok_or_else(|| std::io::Error::other("no parent directory"))?;
    std::fs::create_dir_all(dir)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.connect-{}", std::process::id()));
    let r = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))?;
        std::fs::rename(&tmp, &path)
    })();
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

/// `cat_<id>_…` → `<id>`.
fn admin_token_id(token: &str) -> String {
    token
        .strip_prefix(auth::TOKEN_PREFIX)
        .and_then(|r| r.split('_').next())
        .unwrap_or_default()
        .to_string()
}

/// A new token as `token create` makes it: through the running service's
/// admin socket, or the store when it is stopped.
fn new_token(state: &Path, spec: auth::TokenSpec, description: String) -> Result<String, Refusal> {
    let principal = spec.principal().map_err(|e| usage(e.to_string()))?;
    let token = match access(state) {
        Err(c) => return Err(Refusal(c, "no token was made".into())),
        Ok(Access::Socket(p)) => match ask(
            &p,
            &Request::TokenCreate {
                principal,
                description: Some(description),
            },
        ) {
            Ok(Response::Token { token }) => token,
            Ok(r) => return Err(Refusal(unexpected(r), "no token was made".into())),
            Err(c) => return Err(Refusal(c, "no token was made".into())),
        },
        Ok(Access::Store(store)) => {
            let rt = tokio_runtime().map_err(|c| Refusal(c, "no token was made".into()))?;
            rt.block_on(async {
                let (token, rec) =
                    auth::new_token(principal, Some(description), &crate::clock::Clock::System);
                auth::store_token(&store, rec)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok::<_, String>(token)
            })
            .map_err(|e| Refusal(Exit::Store, e))?
        }
    };
    if token.is_empty() {
        return Err(Refusal(Exit::Failed, "no token was issued".into()));
    }
    Ok(token)
}

/// The host's own check, when its binary is on PATH and the file is the
/// one it reads: its output, and exit 1 when it fails.
fn host_check(host: Host, other_file: bool) -> Exit {
    let (bin, args) = host.check();
    let Some(path) = find_on_path(bin) else {
        eprintln!(
            "{bin} is not on PATH: its check (`{bin} {}`) was not run",
            args.join(" ")
        );
        return Exit::Ok;
    };
    if other_file {
        eprintln!(
            "--config-file given: `{bin} {}` reads its usual file, so it was not run",
            args.join(" ")
        );
        return Exit::Ok;
    }
    eprintln!("running `{bin} {}`:", args.join(" "));
    // Its output goes where ours goes, as it comes (nothing is buffered).
    let child = std::process::Command::new(&path)
        .args(args)
        .stdin(std::process::Stdio::null())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: cannot run {}: {e}", path.display());
            return Exit::Failed;
        }
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break Ok(st),
            Ok(None) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                break Err("it did not finish within 60 s".to_string());
            }
            Err(e) => break Err(e.to_string()),
        }
    };
    match status {
        Ok(st) if st.success() => Exit::Ok,
        Ok(st) => {
            eprintln!("error: `{bin} {}` failed ({st})", args.join(" "));
            Exit::Failed
        }
        Err(e) => {
            eprintln!("error: `{bin} {}`: {e}", args.join(" "));
            Exit::Failed
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target<'a>(ca: Option<&'a str>, runtime: Option<&'a str>) -> Target<'a> {
        Target {
            url: "https://10.0.0.5:9443",
            profile: "dev",
            runtime,
            token_file: "/home/bob/t",
            ca_file: ca,
            command: "/opt/bin/cube-adapter",
        }
    }

    /// Every snippet becomes an entry with nothing of the examples left.
    #[test]
    fn every_host_and_transport_has_an_entry_filled_in() {
        for (host, ..) in HOSTS {
            for transport in ["stdio", "http"] {
                for (ca, runtime) in [(Some("/home/bob/ca.pem"), Some("dsh")), (None, None)] {
                    let e = server_entry(host, transport, &target(ca, runtime)).unwrap();
                    let text = serde_json::to_string(&e).unwrap();
                    for gone in ["example.internal", "alice", "offline-code", "${HOME}"] {
                        assert!(!text.contains(gone), "{host} {transport}: {text}");
                    }
                    assert!(text.contains("https://10.0.0.5:9443"), "{host} {transport}");
                    // Over HTTP only Hermes names the CA in its entry.
                    if transport == "stdio" || *host == "hermes" {
                        assert_eq!(text.contains("/home/bob/ca.pem"), ca.is_some(), "{text}");
                    }
                    if runtime.is_some() {
                        assert!(
                            text.contains("\"dsh\"") || text.contains("runtime=dsh"),
                            "{host} {transport}: {text}"
                        );
                    }
                    if transport == "stdio" {
                        assert!(text.contains("/opt/bin/cube-adapter"), "{text}");
                        assert!(text.contains("/home/bob/t"), "{text}");
                        assert!(text.contains("\"dev\""), "{text}");
                    } else {
                        assert!(text.contains("/mcp?profile=dev&runtime="), "{text}");
                    }
                }
            }
        }
    }

    #[test]
    fn each_host_has_its_runtime() {
        for (h, r) in [
            (Host::Codex, "mcp"),
            (Host::ClaudeCode, "mcp"),
            (Host::Opencode, "mcp"),
            (Host::Openclaw, "openclaw"),
            (Host::Hermes, "hermes"),
        ] {
            assert_eq!(default_runtime(h, "stdio"), r, "{h:?}");
            assert_eq!(default_runtime(h, "http"), r, "{h:?}");
        }
    }

    #[test]
    fn urls_tools_and_diffs() {
        assert_eq!(
            check_url("https://a.b:1/").ok().as_deref(),
            Some("https://a.b:1")
        );
        assert!(check_url("http://127.0.0.1:8080").is_ok());
        for bad in [
            "http://a.b:80",
            "https://a.b/x",
            "https://u:p@a.b",
            "https://a.b?q",
            "ftp://a.b",
            "nope",
        ] {
            assert!(check_url(bad).is_err(), "{bad}");
        }
        let t = tool_list(&["cube_exec".into(), "cube_task_*".into(), "cube_exec".into()])
            .ok()
            .unwrap_or_default();
        assert_eq!(t.first().map(String::as_str), Some("cube_exec"));
        assert!(t.len() > 2 && t.iter().skip(1).all(|x| x.starts_with("cube_task_")));
        assert!(tool_list(&["nope".into()]).is_err());
        let c = Change {
            path: "f".into(),
            old: Some("a\nb\nc\n".into()),
            new: "a\nx\nc\n".into(),
        };
        assert_eq!(diff(&c), "--- f\n+++ f\n@@ -2,1 +2,1 @@\n-b\n+x\n");
    }
}
