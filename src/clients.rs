//! The agent hosts' configurations for this appliance, from one source:
//! the snippets of `docs/clients/snippets/` (the very blocks of
//! `docs/clients/*.md`), rendered for an appliance, a profile and a home by
//! the console's "Connect an agent" page, and turned into server entries by
//! `cube-adapter connect`. A module of its own so that both use it without
//! the console depending on the command line.

use serde_norway::Value;

/// The documentation's example appliance, profile and home, which the
/// page replaces.
pub const EXAMPLE_URL: &str = "https://cube.example.internal:18080";
pub const EXAMPLE_PROFILE: &str = "offline-code";
pub const EXAMPLE_HOME: &str = "/home/alice";

/// One host's configuration for one transport.
pub struct Snippet {
    /// `codex`, `claude-code`, … (as in `<!-- check: HOST … -->`).
    pub host: &'static str,
    /// `stdio` or `http`.
    pub transport: &'static str,
    /// Where it goes (`~/.codex/config.toml`, `run` for a command).
    pub dest: &'static str,
    /// The fence's language in the documentation.
    pub lang: &'static str,
    pub text: &'static str,
}

/// The hosts: id, name, documentation page, how its HTTP client trusts the
/// appliance's CA.
pub const HOSTS: &[(&str, &str, &str, &str)] = &[
    (
        "codex",
        "Codex",
        "codex.md",
        "CODEX_CA_CERTIFICATE=/path/to/ca.pem in Codex's environment",
    ),
    (
        "claude-code",
        "Claude Code",
        "claude-code.md",
        "NODE_EXTRA_CA_CERTS=/path/to/ca.pem in Claude Code's environment",
    ),
    (
        "opencode",
        "OpenCode",
        "opencode.md",
        "NODE_EXTRA_CA_CERTS=/path/to/ca.pem in OpenCode's environment",
    ),
    (
        "openclaw",
        "OpenClaw",
        "openclaw.md",
        "NODE_EXTRA_CA_CERTS=/path/to/ca.pem in the Gateway's environment",
    ),
    (
        "hermes",
        "Hermes Agent",
        "hermes.md",
        "ssl_verify names the CA file in the server's entry (above)",
    ),
];

macro_rules! snippet {
    ($host:literal, $transport:literal, $dest:literal, $lang:literal, $file:literal) => {
        Snippet {
            host: $host,
            transport: $transport,
            dest: $dest,
            lang: $lang,
            text: include_str!(concat!("../docs/clients/snippets/", $file)),
        }
    };
}

/// Every snippet: one per host and transport.
pub const SNIPPETS: &[Snippet] = &[
    snippet!(
        "codex",
        "stdio",
        "~/.codex/config.toml",
        "toml",
        "codex-stdio.toml"
    ),
    snippet!(
        "codex",
        "http",
        "~/.codex/config.toml",
        "toml",
        "codex-http.toml"
    ),
    snippet!("claude-code", "stdio", "run", "sh", "claude-code-stdio.sh"),
    snippet!("claude-code", "http", "run", "sh", "claude-code-http.sh"),
    snippet!(
        "opencode",
        "stdio",
        "opencode.json",
        "json",
        "opencode-stdio.json"
    ),
    snippet!(
        "opencode",
        "http",
        "opencode.json",
        "json",
        "opencode-http.json"
    ),
    snippet!(
        "openclaw",
        "stdio",
        "~/.openclaw/openclaw.json",
        "json",
        "openclaw-stdio.json"
    ),
    snippet!(
        "openclaw",
        "http",
        "~/.openclaw/openclaw.json",
        "json",
        "openclaw-http.json"
    ),
    snippet!(
        "hermes",
        "stdio",
        "~/.hermes/config.yaml",
        "yaml",
        "hermes-stdio.yaml"
    ),
    snippet!(
        "hermes",
        "http",
        "~/.hermes/config.yaml",
        "yaml",
        "hermes-http.yaml"
    ),
];

/// A snippet for this appliance: its URL, the profile and home in place of
/// the examples'.
pub fn render(s: &Snippet, url: &str, profile: &str, home: &str) -> String {
    s.text
        .replace(EXAMPLE_URL, url)
        .replace(EXAMPLE_PROFILE, profile)
        .replace(EXAMPLE_HOME, home)
}

// ------------------------------------------- the same snippets as entries (`connect`)

/// The documentation's example token and CA files (under [`EXAMPLE_HOME`];
/// Claude Code's `.mcp.json` blocks name them under `${HOME}`).
pub const EXAMPLE_TOKEN_FILE: &str = "/home/alice/.config/cube-adapter/token";
pub const EXAMPLE_CA_FILE: &str = "/home/alice/.config/cube-adapter/ca.pem";
const EXAMPLE_TOKEN_FILE_VAR: &str = "${HOME}/.config/cube-adapter/token";
const EXAMPLE_CA_FILE_VAR: &str = "${HOME}/.config/cube-adapter/ca.pem";

/// Claude Code's page: its `.mcp.json` blocks are the entries `connect`
/// writes (its snippets are `claude mcp add` lines).
const CLAUDE_CODE_PAGE: &str = include_str!("../docs/clients/claude-code.md");

/// What an entry is filled in with: this appliance, the host's profile and
/// runtime, the files on the agent's machine, the command that runs
/// `cube-adapter mcp`.
pub struct Target<'a> {
    /// `https://HOST:PORT` (no path).
    pub url: &'a str,
    pub profile: &'a str,
    /// `None`: the snippet's (the host's usual runtime).
    pub runtime: Option<&'a str>,
    pub token_file: &'a str,
    /// `None`: no CA argument (the public web PKI, or plain HTTP).
    pub ca_file: Option<&'a str>,
    /// `cube-adapter`, or its absolute path.
    pub command: &'a str,
}

/// Where a host keeps its server entries in its configuration file (the
/// entry itself is the last key, `cube`), and the file's format.
pub fn entry_path(host: &str) -> Option<(&'static [&'static str], &'static str)> {
    Some(match host {
        "codex" => (&["mcp_servers", "cube"], "toml"),
        "claude-code" => (&["mcpServers", "cube"], "json"),
        "opencode" => (&["mcp", "cube"], "json"),
        "openclaw" => (&["mcp", "servers", "cube"], "json"),
        "hermes" => (&["mcp_servers", "cube"], "yaml"),
        _ => return None,
    })
}

/// The source of a host's entry: its snippet (Claude Code: the page's
/// `.mcp.json` block), as the documentation shows it.
fn entry_source(host: &str, transport: &str) -> Option<&'static str> {
    if host == "claude-code" {
        let marker = format!("<!-- check: claude-code {transport} .mcp.json -->\n```json\n");
        let start = CLAUDE_CODE_PAGE.find(&marker)? + marker.len();
        let len = CLAUDE_CODE_PAGE.get(start..)?.find("```")?;
        return CLAUDE_CODE_PAGE.get(start..start + len);
    }
    SNIPPETS
        .iter()
        .find(|s| s.host == host && s.transport == transport)
        .map(|s| s.text)
}

/// The host's server entry (`cube`) for `transport` (`stdio` or `http`),
/// as the documentation and the console show it, filled in for `t`: the
/// one generator of `cube-adapter connect`. Keys keep the snippet's order.
pub fn server_entry(
    host: &str,
    transport: &str,
    t: &Target,
) -> Result<serde_norway::Value, String> {
    let (path, format) = entry_path(host).ok_or_else(|| format!("unknown host {host}"))?;
    let text =
        entry_source(host, transport).ok_or_else(|| format!("no {transport} entry for {host}"))?;
    let doc: serde_norway::Value = match format {
        "toml" => {
            let d: toml_edit::DocumentMut = text.parse().map_err(|e| format!("{e}"))?;
            from_toml(d.as_item())
        }
        "json" => serde_json::from_str(text).map_err(|e| e.to_string())?,
        _ => serde_norway::from_str(text).map_err(|e| e.to_string())?,
    };
    let mut entry = path
        .iter()
        .try_fold(&doc, |v, k| v.get(*k))
        .cloned()
        .ok_or_else(|| format!("the {host} {transport} snippet has no server entry"))?;
    fill(&mut entry, t);
    Ok(entry)
}

/// Replace the examples in every string of `v` with `t`'s values; drop the
/// CA argument (`--ca-file X`, `ssl_verify`) when `t` has none.
fn fill(v: &mut serde_norway::Value, t: &Target) {
    use serde_norway::Value;
    match v {
        Value::String(s) => *s = fill_text(s, t),
        Value::Sequence(items) => {
            let mut out = Vec::with_capacity(items.len());
            let mut it = std::mem::take(items).into_iter();
            while let Some(mut x) = it.next() {
                match x.as_str() {
                    Some("--ca-file") if t.ca_file.is_none() => {
                        let _ = it.next();
                        continue;
                    }
                    Some("--runtime") if t.runtime.is_some() => {
                        let _ = it.next();
                        out.push(x);
                        out.push(Value::String(t.runtime.unwrap_or_default().to_string()));
                        continue;
                    }
                    _ => {}
                }
                fill(&mut x, t);
                out.push(x);
            }
            *items = out;
        }
        Value::Mapping(m) => {
            if t.ca_file.is_none() {
                let _ = m.shift_remove("ssl_verify");
            }
            for (_, x) in m.iter_mut() {
                fill(x, t);
            }
        }
        _ => {}
    }
}

fn fill_text(s: &str, t: &Target) -> String {
    if s == "cube-adapter" {
        return t.command.to_string();
    }
    let ca = t.ca_file.unwrap_or_default();
    let mut s = s
        .replace(EXAMPLE_TOKEN_FILE, t.token_file)
        .replace(EXAMPLE_TOKEN_FILE_VAR, t.token_file)
        .replace(EXAMPLE_CA_FILE, ca)
        .replace(EXAMPLE_CA_FILE_VAR, ca);
    if s.starts_with(EXAMPLE_URL) {
        s = s.replacen(EXAMPLE_URL, t.url, 1).replace(
            &format!("profile={EXAMPLE_PROFILE}"),
            &format!("profile={}", t.profile),
        );
        if let (Some(r), Some(i)) = (t.runtime, s.find("runtime=")) {
            let end = s
                .get(i..)
                .and_then(|x| x.find('&'))
                .map_or(s.len(), |e| i + e);
            s.replace_range(i..end, &format!("runtime={r}"));
        }
        return s;
    }
    if s == EXAMPLE_PROFILE {
        return t.profile.to_string();
    }
    s
}

// -------------------------------------------- hardened mode (`connect --hardened`)

/// A value hardened mode sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Setting {
    Text(&'static str),
    Flag(bool),
}

/// What `connect HOST --hardened` writes into a host's own settings (the file
/// of its server entry; Claude Code's `~/.claude/settings.json`) so that
/// its model cannot run anything on the host, read or change the host's
/// files, or reach the web from it: the host's shell, file and web tools
/// removed or denied, the appliance's tools left as the only way to act.
/// The same table is the documentation's (`docs/clients/HOST.md`, "Hardened
/// mode") and the tests' (`tests/it/connect.rs`).
pub struct Hardening {
    pub host: &'static str,
    /// Lists (by their keys from the top) that gain these entries; an entry
    /// already there is not added again, nothing is removed.
    pub lists: &'static [(&'static [&'static str], &'static [&'static str])],
    /// Keys (from the top) set to these values, replacing what was there.
    pub values: &'static [(&'static [&'static str], Setting)],
}

/// Per host. Each name was seen to take effect with the pinned host
/// (tests/hosts/run.sh): the tool is gone from what the model is offered,
/// or its call is refused.
pub const HARDENINGS: &[Hardening] = &[
    Hardening {
        host: "claude-code",
        lists: &[(
            &["permissions", "deny"],
            &[
                "Bash",
                "PowerShell",
                "Monitor",
                "Read",
                "Glob",
                "Grep",
                "LSP",
                "Edit",
                "Write",
                "NotebookEdit",
                "WebFetch",
                "WebSearch",
                "EnterWorktree",
                "ExitWorktree",
                "Workflow",
            ],
        )],
        values: &[],
    },
    Hardening {
        host: "codex",
        lists: &[],
        values: &[
            (&["sandbox_mode"], Setting::Text("read-only")),
            (&["approval_policy"], Setting::Text("never")),
            (&["web_search"], Setting::Text("disabled")),
            (&["features", "shell_tool"], Setting::Flag(false)),
            (&["features", "view_image"], Setting::Flag(false)),
            (&["features", "browser_use"], Setting::Flag(false)),
            (&["features", "computer_use"], Setting::Flag(false)),
        ],
    },
    Hardening {
        host: "opencode",
        lists: &[],
        values: &[
            (&["permission", "bash"], Setting::Text("deny")),
            (&["permission", "edit"], Setting::Text("deny")),
            (&["permission", "read"], Setting::Text("deny")),
            (&["permission", "glob"], Setting::Text("deny")),
            (&["permission", "grep"], Setting::Text("deny")),
            (&["permission", "list"], Setting::Text("deny")),
            (&["permission", "lsp"], Setting::Text("deny")),
            (&["permission", "webfetch"], Setting::Text("deny")),
            (&["permission", "websearch"], Setting::Text("deny")),
            (&["permission", "external_directory"], Setting::Text("deny")),
        ],
    },
    Hardening {
        host: "openclaw",
        lists: &[(
            &["tools", "deny"],
            &[
                "group:runtime",
                "group:fs",
                "group:web",
                "group:ui",
                "group:nodes",
                "group:automation",
                "ls",
                "view_image",
                "pdf",
            ],
        )],
        values: &[],
    },
    Hardening {
        host: "hermes",
        lists: &[(
            &["agent", "disabled_toolsets"],
            &[
                "terminal",
                "file",
                "code_execution",
                "web",
                "browser",
                "computer_use",
                "vision",
                "video",
            ],
        )],
        values: &[],
    },
];

/// The host's hardening.
pub fn hardening(host: &str) -> Option<&'static Hardening> {
    HARDENINGS.iter().find(|h| h.host == host)
}

impl Hardening {
    /// One line a key: `permissions.deny += Bash, Read, …`,
    /// `sandbox_mode = "read-only"`.
    pub fn summary(&self) -> Vec<String> {
        let lists = self
            .lists
            .iter()
            .map(|(k, names)| format!("{} += {}", k.join("."), names.join(", ")));
        let values = self.values.iter().map(|(k, v)| match v {
            Setting::Text(t) => format!("{} = \"{t}\"", k.join(".")),
            Setting::Flag(b) => format!("{} = {b}", k.join(".")),
        });
        lists.chain(values).collect()
    }
}

/// The appliance's public URL, for links and agents: `asked` (the name
/// and port a browser used) when the server certificate covers the name;
/// else the first configured `server_names` entry, the listen address
/// unless unspecified (`0.0.0.0`, `::`), a name the certificate covers
/// beyond loopback (the host name, its addresses), or `localhost`; on the
/// port asked or `listen`'s. Without a request (notifications) `asked` is
/// `None`.
pub fn public_url(
    cfg: &crate::config::Config,
    listen: std::net::SocketAddr,
    asked: Option<(String, Option<u16>)>,
) -> String {
    let scheme = if cfg.insecure_plain_http {
        "http"
    } else {
        "https"
    };
    let covered = crate::tls::server_names(&cfg.server_names, listen);
    let port = asked
        .as_ref()
        .and_then(|(_, p)| *p)
        .unwrap_or(listen.port());
    let name = match asked {
        Some((n, _)) if covered.iter().any(|c| c.eq_ignore_ascii_case(&n)) => n,
        _ => cfg
            .server_names
            .first()
            .cloned()
            .or_else(|| (!listen.ip().is_unspecified()).then(|| listen.ip().to_string()))
            .or_else(|| {
                covered
                    .iter()
                    .find(|n| !matches!(n.as_str(), "localhost" | "127.0.0.1" | "::1"))
                    .cloned()
            })
            .unwrap_or_else(|| "localhost".into()),
    };
    let name = if name.contains(':') {
        format!("[{name}]")
    } else {
        name
    };
    format!("{scheme}://{name}:{port}")
}

/// A TOML item as a value, its keys in the file's order.
pub(crate) fn from_toml(item: &toml_edit::Item) -> Value {
    use toml_edit::Item;
    fn table<'a>(it: impl Iterator<Item = (&'a str, Value)>) -> Value {
        Value::Mapping(it.map(|(k, v)| (Value::String(k.to_string()), v)).collect())
    }
    fn value(v: &toml_edit::Value) -> Value {
        use toml_edit::Value as T;
        match v {
            T::String(s) => Value::String(s.value().clone()),
            T::Integer(i) => Value::Number((*i.value()).into()),
            T::Float(f) => Value::Number((*f.value()).into()),
            T::Boolean(b) => Value::Bool(*b.value()),
            T::Datetime(d) => Value::String(d.value().to_string()),
            T::Array(a) => Value::Sequence(a.iter().map(value).collect()),
            T::InlineTable(t) => table(t.iter().map(|(k, v)| (k, value(v)))),
        }
    }
    match item {
        Item::None => Value::Null,
        Item::Value(v) => value(v),
        Item::Table(t) => table(t.iter().map(|(k, v)| (k, from_toml(v)))),
        Item::ArrayOfTables(a) => Value::Sequence(
            a.iter()
                .map(|t| table(t.iter().map(|(k, v)| (k, from_toml(v)))))
                .collect(),
        ),
    }
}
