//! `cube-adapter config import`: the reference adapter's configuration as ours.
//!
//! The reference (docs: reference-adapter.md, Appendix A, §3.7, §3.9, §3.10,
//! §4.2) is configured by environment variables, usually kept in a `.env`
//! file, plus a profiles YAML, a task-templates YAML and a principals JSON.
//! [`plan`] reads those files (the `.env` *file* only, never this process's
//! environment, so that the result is reproducible) and decides the files of
//! a configuration directory:
//!
//! - `config.toml`, commented: where it came from and when, and where each
//!   translated value came from;
//! - `principals.json`, the principals copied as they are (`tokens_file`);
//! - the secrets, each in a 0600 file of its own: `cube-api-key`
//!   (`api_key_file`), `receipt-hmac.key` (`[receipts] hmac_key_file`) and
//!   `env` (`CUBE_ADAPTER_TOKEN`, which stays an environment variable of the
//!   service).
//!
//! No secret value is ever put in `config.toml` or in the [`Report`].
//! [`write`] writes the files (refusing to replace any without `force`) and
//! [`check`] runs the loader `config check` uses on the result.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::{Config, Flags, TaskTemplate};

pub const CONFIG_FILE: &str = "config.toml";
pub const PRINCIPALS_FILE: &str = "principals.json";
pub const CUBE_API_KEY_FILE: &str = "cube-api-key";
pub const RECEIPT_KEY_FILE: &str = "receipt-hmac.key";
pub const ENV_FILE: &str = "env";
pub const AUDIT_HTTP_TOKEN_FILE: &str = "audit-http-token";
/// Where an imported file sink writes (the packaged unit's LogsDirectory).
const DEFAULT_AUDIT_LOG: &str = "/var/log/cube-adapter/audit.jsonl";

/// Where the reference's files are (each optional; the env file may name
/// the others).
#[derive(Debug, Clone, Default)]
pub struct Sources {
    pub env: Option<PathBuf>,
    pub profiles: Option<PathBuf>,
    pub task_templates: Option<PathBuf>,
    pub principals: Option<PathBuf>,
    /// The reference's `mcp-policies.yaml` (governed MCP in the sandbox).
    pub mcp_policies: Option<PathBuf>,
    /// The reference's template presets file.
    pub presets: Option<PathBuf>,
}

/// One line of the report: a variable or key, and where it went or why it
/// did not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub what: String,
    pub detail: String,
}

/// What the import did and did not carry over. Holds no secret value.
#[derive(Debug, Default)]
pub struct Report {
    /// What was read: (kind, path).
    pub sources: Vec<(String, PathBuf)>,
    pub carried: Vec<Entry>,
    pub not_carried: Vec<Entry>,
    /// Differences worth knowing that are not a single variable's.
    pub notes: Vec<String>,
}

impl Report {
    fn carried(&mut self, what: impl Into<String>, detail: impl Into<String>) {
        self.carried.push(Entry {
            what: what.into(),
            detail: detail.into(),
        });
    }

    fn not_carried(&mut self, what: impl Into<String>, detail: impl Into<String>) {
        self.not_carried.push(Entry {
            what: what.into(),
            detail: detail.into(),
        });
    }
}

/// A file to write into the output directory.
pub struct OutFile {
    pub name: &'static str,
    pub data: Vec<u8>,
    pub mode: u32,
    /// Holds a secret (never shown).
    pub secret: bool,
}

impl std::fmt::Debug for OutFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutFile")
            .field("name", &self.name)
            .field("bytes", &self.data.len())
            .field("mode", &format_args!("{:o}", self.mode))
            .field("secret", &self.secret)
            .finish()
    }
}

/// Everything the import would write, and its report.
#[derive(Debug)]
pub struct Plan {
    pub files: Vec<OutFile>,
    pub report: Report,
}

// ------------------------------------------------------------------ .env

/// One `KEY=VALUE` of an env file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvVar {
    pub key: String,
    pub value: String,
    /// 1-based line of the key.
    pub line: usize,
}

/// Parse an env file as docker compose and python-dotenv read one: `KEY=VALUE`
/// lines, blank lines and `#` comments, an optional `export ` prefix,
/// values in single quotes (literal) or double quotes (`\n`, `\t`, `\r`,
/// `\"`, `\\`, `\$` escapes; both may span lines), unquoted values trimmed
/// and ended by ` #` (a comment). Nothing is expanded.
pub fn parse_env(text: &str) -> Result<Vec<EnvVar>, EnvFileError> {
    let mut out = vec![];
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut lines = text.lines().enumerate();
    while let Some((i, raw)) = lines.next() {
        let n = i + 1;
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let line = match line.strip_prefix("export") {
            Some(rest) if rest.starts_with([' ', '\t']) => rest.trim_start(),
            _ => line,
        };
        let Some((k, v)) = line.split_once('=') else {
            return Err(EnvFileError::NotKeyValue { line: n });
        };
        let key = k.trim();
        if !valid_env_key(key) {
            return Err(EnvFileError::BadName {
                line: n,
                key: key.to_string(),
            });
        }
        let start = v.trim_start();
        let value = match start.chars().next() {
            Some(q @ ('"' | '\'')) => {
                let mut buf = start.get(1..).unwrap_or_default().to_string();
                loop {
                    if let Some((val, rest)) = close_quote(&buf, q) {
                        let rest = rest.trim();
                        if !rest.is_empty() && !rest.starts_with('#') {
                            return Err(EnvFileError::AfterQuote {
                                line: n,
                                key: key.to_string(),
                            });
                        }
                        break val;
                    }
                    match lines.next() {
                        Some((_, more)) => {
                            buf.push('\n');
                            buf.push_str(more);
                        }
                        None => {
                            return Err(EnvFileError::Unclosed {
                                line: n,
                                key: key.to_string(),
                            });
                        }
                    }
                }
            }
            _ => unquoted(v),
        };
        out.push(EnvVar {
            key: key.to_string(),
            value,
            line: n,
        });
    }
    Ok(out)
}

fn valid_env_key(k: &str) -> bool {
    let mut c = k.chars();
    c.next()
        .is_some_and(|f| f.is_ascii_alphabetic() || f == '_')
        && c.all(|x| x.is_ascii_alphanumeric() || x == '_')
}

/// The value of a quoted string whose opening quote `q` is gone, and what
/// follows the closing one; `None` when it is not closed in `s`.
fn close_quote(s: &str, q: char) -> Option<(String, &str)> {
    let mut val = String::new();
    let mut chars = s.char_indices();
    while let Some((i, c)) = chars.next() {
        if c == q {
            return Some((val, s.get(i + 1..).unwrap_or_default()));
        }
        if c == '\\' && q == '"' {
            match chars.next() {
                Some((_, 'n')) => val.push('\n'),
                Some((_, 't')) => val.push('\t'),
                Some((_, 'r')) => val.push('\r'),
                Some((_, e @ ('"' | '\\' | '$'))) => val.push(e),
                Some((_, other)) => {
                    val.push('\\');
                    val.push(other);
                }
                None => val.push('\\'),
            }
            continue;
        }
        val.push(c);
    }
    None
}

/// An unquoted value: up to a `#` that follows white space, trimmed.
fn unquoted(v: &str) -> String {
    let mut prev_space = false;
    let mut end = v.len();
    for (i, c) in v.char_indices() {
        if c == '#' && prev_space {
            end = i;
            break;
        }
        prev_space = c.is_whitespace();
    }
    v.get(..end).unwrap_or(v).trim().to_string()
}

/// The variables of the env file, taken one by one as they are mapped;
/// what is left at the end is reported as not carried.
#[derive(Default)]
struct Env {
    vars: BTreeMap<String, (String, usize)>,
    /// The env file's directory: relative paths in it start there.
    dir: PathBuf,
    /// The env file, as shown.
    shown: String,
}

impl Env {
    fn take(&mut self, k: &str) -> Option<String> {
        self.vars.remove(k).map(|(v, _)| v)
    }

    fn peek(&self, k: &str) -> Option<&str> {
        self.vars.get(k).map(|(v, _)| v.as_str())
    }

    fn line(&self, k: &str) -> usize {
        self.vars.get(k).map(|(_, l)| *l).unwrap_or_default()
    }

    fn resolve(&self, p: &str) -> PathBuf {
        let p = Path::new(p);
        if p.is_absolute() {
            p.to_path_buf()
        } else {
            self.dir.join(p)
        }
    }

    fn at(&self, k: &str) -> String {
        format!("{} (line {} of {})", k, self.line(k), self.shown)
    }
}

/// Variables whose values are secrets: never shown.
const SECRET_VARS: &[&str] = &[
    "CUBE_API_KEY",
    "CUBE_ADAPTER_TOKEN",
    "CUBE_ADAPTER_HMAC_KEY",
    "CUBE_ADAPTER_RECEIPT_HMAC_KEY",
    "CUBE_ADAPTER_STATE_ENCRYPTION_KEY",
    "CUBE_ADAPTER_AUDIT_HTTP_TOKEN",
];

/// A value as the report may show it: nothing of a secret or of a
/// variable we do not know; a URL's scheme, host and port only (a Redis
/// URL may carry a password).
fn shown_value(k: &str, v: &str) -> Option<String> {
    let known = k.starts_with("CUBE_");
    let secretish = ["KEY", "TOKEN", "SECRET", "PASSWORD"]
        .iter()
        .any(|s| k.contains(s));
    if SECRET_VARS.contains(&k) || secretish || !known {
        return None;
    }
    if v.contains("://") {
        return Some(match url::Url::parse(v) {
            Ok(u) => format!(
                "{}://{}{}…",
                u.scheme(),
                u.host_str().unwrap_or(""),
                u.port().map(|p| format!(":{p}")).unwrap_or_default()
            ),
            Err(_) => "(a URL)".into(),
        });
    }
    Some(v.chars().take(80).collect())
}

/// Why a variable left over is not carried.
fn why_not(k: &str, v: &str) -> String {
    match k {
        "CUBE_ADAPTER_HMAC_KEY" => "the appliance makes its own secret key at first start (STATE/hmac.key): session and identity pseudonyms (requester and approver hashes, audit digests) differ from the reference's, so its sessions, plans and leases do not carry over".into(),
        "CUBE_ADAPTER_STATE_BACKEND_URL" if v == "memory" => "state lives in the appliance's own durable store (redb under state_dir); the reference's memory state ends with it".into(),
        "CUBE_ADAPTER_STATE_BACKEND_URL" => "we keep state in our own store (redb under state_dir), not Redis; the reference's leases, jobs, plans and tasks are not moved: finish or release them before switching".into(),
        "CUBE_ADAPTER_STATE_ENCRYPTION_KEY" => "the Fernet key of the reference's Redis state; our store seals its secrets under its own key (STATE/secret.key)".into(),
        "CUBE_ADAPTER_STATE_PREFIX" => "a Redis key prefix; there is no Redis here".into(),
        "CUBE_ADAPTER_LOCK_TTL" => "the lifetime of the reference's Redis locks; the appliance has one writer and no distributed locks".into(),
        "CUBE_ADAPTER_READINESS_CACHE_SECONDS" => "/readyz answers from the appliance's own watch of its backends; there is no cache to size".into(),
        "CUBE_ADAPTER_TLS_CERT_FILE" | "CUBE_ADAPTER_TLS_KEY_FILE" => "the appliance serves HTTPS with a certificate of its own CA (STATE/tls, made at first start; the names of this certificate are carried as server_names when it can be read): give clients that CA (`cube-adapter cert show`; `cube-adapter connect` sets agent hosts up)".into(),
        "CUBE_ADAPTER_TLS_CLIENT_CA_FILE" | "CUBE_ADAPTER_TRUST_CLIENT_CERT_SUBJECT" => "the reference made any certificate of this CA an unscoped identity; here a client CA's certificates stand for listed identities only: add [auth.client_ca] ca_file = \"…\" with one [[auth.client_ca.identities]] per subject, or issue client certificates from the appliance's CA (`cube-adapter token create --client-cert`)".into(),
        "CUBE_ADAPTER_AUDIT_UI" => "the audit view is part of the console (/console), for auditors and admins".into(),
        "CUBE_ADAPTER_ADMIN_ENABLED" => "there is no switch: admin endpoints answer admin identities only".into(),
        "CUBE_MCP_TEMPLATE_ID" => "the SDK's MCP template; the appliance does not use it".into(),
        "CUBE_ADAPTER_OIDC_ISSUER" | "CUBE_ADAPTER_OIDC_AUDIENCE" | "CUBE_ADAPTER_OIDC_TENANT_CLAIM" | "CUBE_ADAPTER_OIDC_ROLES_CLAIM" => "OIDC is off in the reference without CUBE_ADAPTER_OIDC_JWKS_URL".into(),
        "CUBE_PROXY_PORT_HTTP" => "used with CUBE_PROXY_NODE_IP only".into(),
        k if k.starts_with("CUBE_ADAPTER_") || k.starts_with("CUBE_") => "not a variable of the reference adapter or its SDK; ignored".into(),
        _ => "not a reference adapter variable; ignored".into(),
    }
}

// ------------------------------------------------------------------ YAML

fn read_text(p: &Path) -> Result<String, ImportError> {
    std::fs::read_to_string(p).map_err(|source| ImportError::Read {
        path: p.to_path_buf(),
        source,
    })
}

/// A YAML file as JSON values; an error names the file and the line.
fn read_yaml(p: &Path) -> Result<Value, ImportError> {
    let text = read_text(p)?;
    serde_norway::from_str::<Value>(&text).map_err(|source| ImportError::Yaml {
        path: p.to_path_buf(),
        source,
    })
}

/// A YAML error as [`ImportError::Yaml`] says it: the file, and the line
/// and column where the parser's own words do not name them.
fn yaml_message(p: &Path, e: &serde_norway::Error) -> String {
    let msg = e.to_string();
    match e.location() {
        Some(l) if !msg.contains("line") => {
            format!("{}:{}:{}: {msg}", p.display(), l.line(), l.column())
        }
        _ => format!("{}: {msg}", p.display()),
    }
}

/// Where the keys of a YAML document are: each key's path (its parents'
/// keys and its own) and its 1-based line. Block mappings only: keys in
/// flow collections (`{…}`) or in sequence items are not indexed (an error
/// there names no line, or its parent's).
#[derive(Debug, Default)]
struct KeyLines(BTreeMap<Vec<String>, usize>);

impl KeyLines {
    fn of(text: &str) -> Self {
        let mut stack: Vec<(usize, String)> = vec![];
        let mut out = BTreeMap::new();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.trim_start();
            if line.is_empty() || line.starts_with('#') || line.starts_with('-') {
                continue;
            }
            let Some(key) = yaml_key(line) else {
                continue;
            };
            let indent = raw.len() - line.len();
            while stack.last().is_some_and(|(d, _)| *d >= indent) {
                stack.pop();
            }
            stack.push((indent, key));
            out.entry(stack.iter().map(|(_, k)| k.clone()).collect())
                .or_insert(i + 1);
        }
        Self(out)
    }

    /// The line of the first of `paths` that is in the document.
    fn line(&self, paths: &[&[&str]]) -> Option<usize> {
        paths.iter().find_map(|p| {
            let key: Vec<String> = p.iter().map(|s| s.to_string()).collect();
            self.0.get(&key).copied()
        })
    }
}

/// The key of a `key: value` (or `key:`) line, unquoted.
fn yaml_key(line: &str) -> Option<String> {
    let (key, rest) = match line.chars().next()? {
        q @ ('"' | '\'') => {
            let end = line[1..].find(q)? + 1;
            (line[1..end].to_string(), &line[end + 1..])
        }
        _ => {
            let at = line
                .find(": ")
                .or_else(|| line.ends_with(':').then(|| line.len() - 1))?;
            (line[..at].trim_end().to_string(), &line[at..])
        }
    };
    let rest = rest.strip_prefix(':')?;
    (rest.is_empty() || rest.starts_with([' ', '\t'])).then_some(key)
}

/// `FILE:LINE` where the line is known, else `FILE`.
fn file_line(shown: &str, line: Option<usize>) -> String {
    match line {
        Some(l) => format!("{shown}:{l}"),
        None => shown.to_string(),
    }
}

fn object<'a>(v: &'a Value, at: &str) -> Result<&'a Map<String, Value>, ImportError> {
    v.as_object()
        .ok_or_else(|| ImportError::value(at, ValueProblem::Mapping))
}

/// The reference's `_positive_int`: an integer (or a string of one) of at
/// least `min`.
fn int(v: &Value, at: &str, min: i64) -> Result<i64, ImportError> {
    let n = match v {
        Value::Number(n) => n
            .as_i64()
            .or_else(|| n.as_f64().filter(|f| f.fract() == 0.0).map(|f| f as i64)),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    };
    match n {
        Some(n) if n >= min => Ok(n),
        Some(_) => Err(ImportError::value(at, ValueProblem::AtLeast(min))),
        None => Err(ImportError::value(at, ValueProblem::Integer)),
    }
}

/// A real boolean (the reference refuses the string "false" too).
fn boolean(v: &Value, at: &str) -> Result<bool, ImportError> {
    v.as_bool()
        .ok_or_else(|| ImportError::value(at, ValueProblem::Boolean(v.clone())))
}

/// A list of non-empty strings, or a comma-separated string.
fn strings(v: &Value, at: &str) -> Result<Vec<String>, ImportError> {
    match v {
        Value::Null => Ok(vec![]),
        Value::String(s) => Ok(s
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect()),
        Value::Array(a) => a
            .iter()
            .map(|x| match x.as_str() {
                Some(s) if !s.is_empty() => Ok(s.to_string()),
                _ => Err(ImportError::value(at, ValueProblem::NonEmptyStrings)),
            })
            .collect(),
        _ => Err(ImportError::value(at, ValueProblem::Strings)),
    }
}

fn string(v: &Value, at: &str) -> Result<String, ImportError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Number(n) => Ok(n.to_string()),
        _ => Err(ImportError::value(at, ValueProblem::String)),
    }
}

/// `${ENV:NAME}` leaves (profile `network`, the key `at`): resolved from
/// the env file.
fn env_ref(s: &str, env: &Env, at: &str) -> Result<String, ImportError> {
    match s.strip_prefix("${ENV:").and_then(|r| r.strip_suffix('}')) {
        Some(name) if valid_env_key(name) => {
            env.peek(name)
                .map(str::to_string)
                .ok_or_else(|| ImportError::EnvRef {
                    at: at.to_string(),
                    name: name.to_string(),
                })
        }
        _ => Ok(s.to_string()),
    }
}

// ------------------------------------------------------------------ TOML

/// `config.toml` as it is written: comments, then TOML each piece of which
/// is serialised on its own.
#[derive(Default)]
struct Doc {
    text: String,
}

impl Doc {
    fn comment(&mut self, text: &str) {
        for para in text.split('\n') {
            let mut line = String::new();
            for w in para.split(' ') {
                if !line.is_empty() && line.len() + w.len() > 76 {
                    self.text.push_str(&format!("# {}\n", line.trim_end()));
                    line.clear();
                }
                line.push_str(w);
                line.push(' ');
            }
            self.text
                .push_str(&format!("# {}\n", line.trim_end()).replace("# \n", "#\n"));
        }
    }

    /// `value` at `path` (`["profiles", "x"]` gives `[profiles.x]`).
    fn put(&mut self, path: &[&str], value: toml::Value) -> Result<(), ImportError> {
        let mut v = value;
        for seg in path.iter().rev() {
            let mut t = toml::Table::new();
            t.insert((*seg).to_string(), v);
            v = toml::Value::Table(t);
        }
        let toml::Value::Table(t) = v else {
            return Err(ImportError::NothingToWrite);
        };
        let text = toml::to_string_pretty(&t).map_err(|source| ImportError::Toml {
            at: path.join("."),
            source,
        })?;
        self.text.push_str(&text);
        Ok(())
    }

    fn blank(&mut self) {
        if !self.text.ends_with("\n\n") {
            self.text.push('\n');
        }
    }
}

fn tstr(s: impl Into<String>) -> toml::Value {
    toml::Value::String(s.into())
}

fn tint(n: i64) -> toml::Value {
    toml::Value::Integer(n)
}

fn tlist(v: &[String]) -> toml::Value {
    toml::Value::Array(v.iter().map(|s| tstr(s.clone())).collect())
}

/// A piece of `config.toml`: comment lines, then `value` at `path`.
struct Piece {
    comment: Vec<String>,
    path: Vec<String>,
    value: toml::Value,
}

// ------------------------------------------------------------------ plan

const PROFILE_INTS: &[(&str, i64)] = &[
    ("sandbox_timeout_seconds", 1),
    ("max_command_seconds", 1),
    ("lease_idle_ttl_seconds", 1),
    ("max_active_leases_per_tenant", 1),
    ("max_jobs_per_lease", 1),
    // v0.6.
    ("max_keepalive_seconds", 1),
];
const PROFILE_BOOLS: &[&str] = &[
    "allow_internet_access",
    "checkpoints_enabled",
    "allow_checkpoint_with_mounts",
    // v0.6.
    "keepalive_enabled",
];
const TASK_FIELDS: &[&str] = &[
    "description",
    "profile",
    "parameters",
    "command",
    "approval_required",
    "plan_ttl_seconds",
    "outputs",
];

/// Decide everything the import writes into `out_dir` (absolute: the
/// config names its files there), stamped `now`. Nothing is written.
/// An error: a file that cannot be read, or that the reference itself would
/// refuse (bad YAML, a bad value), with the file and where.
pub fn plan(src: &Sources, out_dir: &Path, now: &str) -> Result<Plan, ImportError> {
    let mut b = Build {
        env: Env::default(),
        out_dir,
        top: vec![],
        sections: vec![],
        files: vec![],
        rep: Report::default(),
        tenants: Default::default(),
    };
    if let Some(p) = &src.env {
        b.read_env(p)?;
    }
    b.listen()?;
    b.gc()?;
    b.server_names();
    b.principals(&src.principals)?;
    b.audit()?;
    b.receipts()?;
    b.oidc()?;
    b.shared_token()?;
    let template = b.env.take("CUBE_TEMPLATE_ID");
    let backend = backend(
        &mut b.env,
        template.as_deref(),
        out_dir,
        &mut b.rep,
        &mut b.files,
    )?;
    let has_backend = backend.is_some();
    b.sections.extend(backend);
    b.sections_file(
        &src.mcp_policies,
        "CUBE_ADAPTER_MCP_POLICIES_FILE",
        "--mcp-policies",
        "MCP policies",
        mcp_policies,
    )?;
    b.sections_file(
        &src.presets,
        "CUBE_ADAPTER_TEMPLATE_PRESETS_FILE",
        "--presets",
        "template presets",
        presets,
    )?;
    let profiles = b.profiles(&src.profiles, template.as_deref(), has_backend)?;
    b.task_templates(&src.task_templates, &profiles)?;
    b.leftovers();
    b.finish(now)
}

/// What [`plan`] builds up: the env file's variables not mapped yet, the
/// pieces of `config.toml` (top-level keys, then sections), the other
/// files, the report.
struct Build<'a> {
    env: Env,
    out_dir: &'a Path,
    top: Vec<Piece>,
    sections: Vec<Piece>,
    files: Vec<OutFile>,
    rep: Report,
    /// The tenants the principals file names (the OIDC issuer's ceiling).
    tenants: std::collections::BTreeSet<String>,
}

impl Build<'_> {
    fn out(&self, name: &str) -> String {
        self.out_dir.join(name).display().to_string()
    }

    fn read_env(&mut self, p: &Path) -> Result<(), ImportError> {
        let text = read_text(p)?;
        let vars = parse_env(&text).map_err(|source| ImportError::EnvFile {
            path: p.to_path_buf(),
            source,
        })?;
        for v in vars {
            if let Some((_, old)) = self.env.vars.insert(v.key.clone(), (v.value, v.line)) {
                self.rep.notes.push(format!(
                    "{}: {} is set twice (lines {old} and {}); the last one counts",
                    p.display(),
                    v.key,
                    v.line
                ));
            }
        }
        // Empty is unset, for the reference too.
        self.env.vars.retain(|_, (v, _)| !v.is_empty());
        self.env.dir = p.parent().map(Path::to_path_buf).unwrap_or_default();
        self.env.shown = p.display().to_string();
        self.rep
            .sources
            .push(("environment".into(), p.to_path_buf()));
        Ok(())
    }

    /// `listen`: `CUBE_ADAPTER_BIND` and `CUBE_ADAPTER_PORT`.
    fn listen(&mut self) -> Result<(), ImportError> {
        let bind = self.env.take("CUBE_ADAPTER_BIND");
        let port = self.env.take("CUBE_ADAPTER_PORT");
        let host = match bind.as_deref() {
            None | Some("localhost") => "127.0.0.1",
            Some(h) => h,
        };
        let port_s = port.as_deref().unwrap_or("18080");
        let port_n: u16 = port_s.parse().map_err(|_| ImportError::NotA {
            var: "CUBE_ADAPTER_PORT",
            value: port_s.to_string(),
            what: "a port number",
        })?;
        let ip: IpAddr = host
            .trim_matches(['[', ']'])
            .parse()
            .map_err(|_| ImportError::NotA {
                var: "CUBE_ADAPTER_BIND",
                value: host.to_string(),
                what: "an IP address",
            })?;
        let listen = SocketAddr::new(ip, port_n);
        let from = match (&bind, &port) {
            (None, None) => "the reference's default (127.0.0.1:18080)",
            _ => "CUBE_ADAPTER_BIND and CUBE_ADAPTER_PORT",
        };
        self.top.push(Piece {
            comment: vec![format!(
                "listen: {from}. The reference served plain HTTP here (unless it had a TLS certificate); this listener serves HTTPS with the appliance's own CA."
            )],
            path: vec!["listen".into()],
            value: tstr(listen.to_string()),
        });
        if bind.is_some() || port.is_some() {
            self.rep.carried(
                "CUBE_ADAPTER_BIND, CUBE_ADAPTER_PORT",
                format!("listen = \"{listen}\""),
            );
        }
        self.rep.notes.push(format!(
            "agents now reach https://{listen}/ (HTTPS, the appliance's own CA), not http://: give them the CA (`cube-adapter cert show`) or use `cube-adapter connect`"
        ));
        Ok(())
    }

    /// `gc_interval_seconds`: `CUBE_ADAPTER_GC_INTERVAL`.
    fn gc(&mut self) -> Result<(), ImportError> {
        if let Some(v) = self.env.take("CUBE_ADAPTER_GC_INTERVAL") {
            let n = int(&Value::String(v), "CUBE_ADAPTER_GC_INTERVAL", 0)?;
            self.top.push(Piece {
                comment: vec!["gc_interval_seconds: CUBE_ADAPTER_GC_INTERVAL.".into()],
                path: vec!["gc_interval_seconds".into()],
                value: tint(n),
            });
            self.rep.carried(
                "CUBE_ADAPTER_GC_INTERVAL",
                format!("gc_interval_seconds = {n}"),
            );
        }
        Ok(())
    }

    /// `server_names`: the names of the reference's certificate (the
    /// variable itself is reported as not carried: our own CA serves).
    fn server_names(&mut self) {
        let Some(cert) = self.env.peek("CUBE_ADAPTER_TLS_CERT_FILE") else {
            return;
        };
        let path = self.env.resolve(cert);
        let info = match std::fs::read(&path)
            .map_err(|e| e.to_string())
            .and_then(|pem| crate::tls::cert_info(&pem).map_err(|e| e.to_string()))
        {
            Ok(i) => i,
            Err(e) => {
                self.rep.notes.push(format!(
                    "CUBE_ADAPTER_TLS_CERT_FILE: cannot read its names from {} ({e}); put the names agents use in server_names",
                    path.display()
                ));
                return;
            }
        };
        let mut names = vec![];
        let mut wild = vec![];
        for n in info.names {
            let loopback = n == "localhost" || n.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
            if n.starts_with("*.") {
                wild.push(n);
            } else if !loopback && !names.contains(&n) {
                names.push(n);
            }
        }
        if !names.is_empty() {
            self.rep.carried(
                "CUBE_ADAPTER_TLS_CERT_FILE (its names)",
                format!("server_names = {names:?}"),
            );
            self.top.push(Piece {
                comment: vec![format!(
                    "server_names: the names of the reference's certificate ({}), for the appliance's own certificate.",
                    path.display()
                )],
                path: vec!["server_names".into()],
                value: tlist(&names),
            });
        }
        if !wild.is_empty() {
            self.rep.notes.push(format!(
                "the reference's certificate also names {}: wildcards are not put in server_names; list the host names agents use",
                wild.join(", ")
            ));
        }
    }

    /// `tokens_file`: the principals, checked and copied as they are.
    fn principals(&mut self, flag: &Option<PathBuf>) -> Result<(), ImportError> {
        let Some((p, named)) = source(
            flag,
            &mut self.env,
            "CUBE_ADAPTER_TOKENS_FILE",
            "--principals",
            &mut self.rep,
        )?
        else {
            return Ok(());
        };
        let bytes = std::fs::read(&p).map_err(|source| ImportError::Read {
            path: p.clone(),
            source,
        })?;
        let text = std::str::from_utf8(&bytes).map_err(|_| ImportError::NotUtf8(p.clone()))?;
        let loaded =
            crate::auth::load_tokens_file(text).map_err(|source| ImportError::Principals {
                path: p.clone(),
                source,
            })?;
        let n = loaded.len();
        self.tenants
            .extend(loaded.into_iter().map(|(_, principal)| principal.tenant));
        self.files.push(OutFile {
            name: PRINCIPALS_FILE,
            data: bytes,
            mode: 0o600,
            secret: true,
        });
        let dest = self.out(PRINCIPALS_FILE);
        self.top.push(Piece {
            comment: vec![format!(
                "tokens_file: CUBE_ADAPTER_TOKENS_FILE, copied as it is ({}); re-read at every reload.",
                p.display()
            )],
            path: vec!["tokens_file".into()],
            value: tstr(dest.clone()),
        });
        self.rep.carried(
            named,
            format!("{dest} ({n} principals, copied as is, 0600) = tokens_file"),
        );
        self.rep.sources.push(("principals".into(), p));
        Ok(())
    }

    /// `[audit] mode`: `CUBE_ADAPTER_AUDIT_MODE`; `[[audit.sinks]]`:
    /// `CUBE_ADAPTER_AUDIT_SINKS` with `CUBE_ADAPTER_AUDIT_LOG` (file) and
    /// `CUBE_ADAPTER_AUDIT_HTTP_URL`/`_TOKEN` (http).
    fn audit(&mut self) -> Result<(), ImportError> {
        let mut t = toml::Table::new();
        let mut comment = vec![];
        if let Some(m) = self.env.take("CUBE_ADAPTER_AUDIT_MODE") {
            if !["required", "best_effort"].contains(&m.as_str()) {
                return Err(ImportError::Invalid {
                    at: format!("CUBE_ADAPTER_AUDIT_MODE={m}"),
                    why: "must be required or best_effort".into(),
                });
            }
            t.insert("mode".into(), tstr(m.clone()));
            comment.push("[audit] mode: CUBE_ADAPTER_AUDIT_MODE.".to_string());
            self.rep
                .carried("CUBE_ADAPTER_AUDIT_MODE", format!("[audit] mode = \"{m}\""));
        }
        let sinks = self.audit_sinks()?;
        if !sinks.is_empty() {
            comment.push(
                "[[audit.sinks]]: CUBE_ADAPTER_AUDIT_SINKS. Delivered at least once, in order, from a cursor of each sink's own (docs/operations.md, \"Audit delivery\"); the journal itself is the appliance's store.".to_string(),
            );
            t.insert("sinks".into(), toml::Value::Array(sinks));
        }
        if !t.is_empty() {
            self.sections.push(Piece {
                comment,
                path: vec!["audit".into()],
                value: toml::Value::Table(t),
            });
        }
        Ok(())
    }

    /// The reference's sinks (`file`, `stdout`, `http`; `file` when
    /// `CUBE_ADAPTER_AUDIT_SINKS` is unset, as there).
    fn audit_sinks(&mut self) -> Result<Vec<toml::Value>, ImportError> {
        let named = self.env.take("CUBE_ADAPTER_AUDIT_SINKS");
        let log = self.env.take("CUBE_ADAPTER_AUDIT_LOG");
        let url = self.env.take("CUBE_ADAPTER_AUDIT_HTTP_URL");
        let token = self.env.take("CUBE_ADAPTER_AUDIT_HTTP_TOKEN");
        let list: Vec<String> = match &named {
            Some(v) => v
                .split(',')
                .map(|s| s.trim().to_ascii_lowercase())
                .filter(|s| !s.is_empty())
                .collect(),
            // Unset, the reference wrote a file; carried only where the
            // env file says where (its default is relative to wherever it
            // ran).
            None if log.is_some() => vec!["file".into()],
            None => {
                self.rep.notes.push("the reference's default audit sink (a file, ./cube-adapter-audit.jsonl) is not carried: add a [[audit.sinks]] kind = \"file\" with a path of your choice (docs/operations.md, \"Audit delivery\")".into());
                vec![]
            }
        };
        let mut out = vec![];
        let mut seen = BTreeSet::new();
        for kind in &list {
            if !seen.insert(kind.clone()) {
                continue;
            }
            let mut t = toml::Table::new();
            t.insert("kind".into(), tstr(kind.clone()));
            t.insert("name".into(), tstr(kind.clone()));
            match kind.as_str() {
                "file" => {
                    let path = match &log {
                        Some(l) if Path::new(l).is_absolute() => PathBuf::from(l),
                        Some(l) => {
                            self.rep.notes.push(format!("CUBE_ADAPTER_AUDIT_LOG={l} is relative to where the reference ran: the file sink writes {DEFAULT_AUDIT_LOG} instead (the directory the packaged service may write)"));
                            PathBuf::from(DEFAULT_AUDIT_LOG)
                        }
                        None => PathBuf::from(DEFAULT_AUDIT_LOG),
                    };
                    let path = path.display().to_string();
                    t.insert("path".into(), tstr(path.clone()));
                    self.rep.carried(
                        if log.is_some() {
                            "CUBE_ADAPTER_AUDIT_LOG"
                        } else {
                            "CUBE_ADAPTER_AUDIT_SINKS=file"
                        },
                        format!("[[audit.sinks]] kind = \"file\", path = \"{path}\" (JSON lines, sorted keys, as the reference's; rotated at 100 MiB, 5 kept: max_bytes = 0 turns that off)"),
                    );
                }
                "stdout" => {}
                "http" => {
                    let Some(u) = &url else {
                        return Err(ImportError::HttpSinkWithoutUrl);
                    };
                    let parsed = reqwest::Url::parse(u).map_err(|source| ImportError::Url {
                        at: "CUBE_ADAPTER_AUDIT_HTTP_URL".into(),
                        source,
                    })?;
                    let loopback = parsed.host_str().is_some_and(|h| {
                        h == "localhost"
                            || h.trim_matches(['[', ']'])
                                .parse::<IpAddr>()
                                .is_ok_and(|ip| ip.is_loopback())
                    });
                    if parsed.scheme() != "https" && !loopback {
                        return Err(ImportError::Invalid {
                            at: format!(
                                "CUBE_ADAPTER_AUDIT_HTTP_URL ({})",
                                shown_value("CUBE_ADAPTER_AUDIT_HTTP_URL", u).unwrap_or_default()
                            ),
                            why: "audit events leave the host over https only (http is allowed to a loopback collector)".into(),
                        });
                    }
                    t.insert("url".into(), tstr(u.clone()));
                    // The reference POSTed each event on its own.
                    t.insert("batch".into(), tint(1));
                    t.insert("timeout_seconds".into(), tint(3));
                    if let Some(tok) = &token {
                        self.files.push(OutFile {
                            name: AUDIT_HTTP_TOKEN_FILE,
                            data: format!("{}\n", tok.trim()).into_bytes(),
                            mode: 0o600,
                            secret: true,
                        });
                        let dest = self.out(AUDIT_HTTP_TOKEN_FILE);
                        t.insert("token_file".into(), tstr(dest.clone()));
                        self.rep.carried(
                            "CUBE_ADAPTER_AUDIT_HTTP_TOKEN",
                            format!("{dest} (0600) = token_file of the http sink"),
                        );
                    }
                    self.rep.carried(
                        "CUBE_ADAPTER_AUDIT_HTTP_URL",
                        "[[audit.sinks]] kind = \"http\", url (one event per POST as the reference's, batch = 1, now as a JSON line with X-Cube-Adapter-Seq; retried with backoff until taken; raise batch for throughput)",
                    );
                }
                other => {
                    return Err(ImportError::Invalid {
                        at: "CUBE_ADAPTER_AUDIT_SINKS".into(),
                        why: format!(
                            "unknown sink {other:?} (the reference knows file, stdout and http)"
                        ),
                    });
                }
            }
            out.push(toml::Value::Table(t));
        }
        if let Some(v) = named {
            self.rep.carried(
                "CUBE_ADAPTER_AUDIT_SINKS",
                format!("{v} = [[audit.sinks]] named {}", list.join(", ")),
            );
        }
        if url.is_some() && !seen.contains("http") {
            self.rep.not_carried(
                "CUBE_ADAPTER_AUDIT_HTTP_URL",
                "CUBE_ADAPTER_AUDIT_SINKS does not name http: the reference did not use it either",
            );
        }
        if token.is_some() && !seen.contains("http") {
            self.rep.not_carried(
                "CUBE_ADAPTER_AUDIT_HTTP_TOKEN",
                "CUBE_ADAPTER_AUDIT_SINKS does not name http: the reference did not use it either",
            );
        }
        if log.is_some() && !seen.contains("file") {
            self.rep.not_carried(
                "CUBE_ADAPTER_AUDIT_LOG",
                "CUBE_ADAPTER_AUDIT_SINKS does not name file; the journal is the appliance's own store (`cube-adapter audit export`)",
            );
        }
        Ok(out)
    }

    /// `[receipts] hmac_key_file`: the receipt key, else the key the
    /// reference fell back to for receipts.
    fn receipts(&mut self) -> Result<(), ImportError> {
        let key = match self.env.take("CUBE_ADAPTER_RECEIPT_HMAC_KEY") {
            Some(k) => Some(("CUBE_ADAPTER_RECEIPT_HMAC_KEY", k)),
            None => self
                .env
                .peek("CUBE_ADAPTER_HMAC_KEY")
                .map(|k| ("CUBE_ADAPTER_HMAC_KEY", k.to_string())),
        };
        let Some((var, k)) = key else {
            return Ok(());
        };
        if k.trim().len() < 32 {
            return Err(ImportError::Invalid {
                at: var.into(),
                why: "a receipt key must be at least 32 characters".into(),
            });
        }
        self.files.push(OutFile {
            name: RECEIPT_KEY_FILE,
            data: format!("{}\n", k.trim()).into_bytes(),
            mode: 0o600,
            secret: true,
        });
        let why = if var == "CUBE_ADAPTER_HMAC_KEY" {
            " (the reference signed receipts with CUBE_ADAPTER_HMAC_KEY when CUBE_ADAPTER_RECEIPT_HMAC_KEY was unset: kept, so that verifiers holding it still verify)"
        } else {
            ""
        };
        let dest = self.out(RECEIPT_KEY_FILE);
        let mut t = toml::Table::new();
        t.insert("hmac_key_file".into(), tstr(dest.clone()));
        self.sections.push(Piece {
            comment: vec![format!(
                "[receipts] hmac_key_file: {var}{why}. Receipts are signed with Ed25519 too."
            )],
            path: vec!["receipts".into()],
            value: toml::Value::Table(t),
        });
        self.rep.carried(
            format!("{var} (receipt signing)"),
            format!("{dest} (0600) = [receipts] hmac_key_file{why}"),
        );
        Ok(())
    }

    /// `[[auth.oidc]]`: on in the reference with a JWKS URL only.
    fn oidc(&mut self) -> Result<(), ImportError> {
        let Some(jwks) = self.env.take("CUBE_ADAPTER_OIDC_JWKS_URL") else {
            return Ok(());
        };
        let (Some(issuer), Some(audience)) = (
            self.env.take("CUBE_ADAPTER_OIDC_ISSUER"),
            self.env.take("CUBE_ADAPTER_OIDC_AUDIENCE"),
        ) else {
            return Err(ImportError::OidcIncomplete);
        };
        let mut t = toml::Table::new();
        t.insert("issuer".into(), tstr(issuer));
        t.insert("audience".into(), tstr(audience));
        t.insert(
            "algorithms".into(),
            tlist(&["RS256", "RS384", "RS512", "ES256", "ES384"].map(String::from)),
        );
        t.insert("jwks_url".into(), tstr(jwks));
        let mut claims = toml::Table::new();
        if let Some(c) = self.env.take("CUBE_ADAPTER_OIDC_TENANT_CLAIM") {
            claims.insert("tenant".into(), tstr(c));
        }
        if let Some(c) = self.env.take("CUBE_ADAPTER_OIDC_ROLES_CLAIM") {
            claims.insert("roles".into(), tstr(c));
        }
        if !claims.is_empty() {
            t.insert("claims".into(), toml::Value::Table(claims));
        }
        // The reference took any tenant and role a token named; here an
        // issuer has a ceiling. The principals' tenants are a start.
        let mut comment = vec!["[[auth.oidc]]: CUBE_ADAPTER_OIDC_JWKS_URL, _ISSUER, _AUDIENCE, _TENANT_CLAIM, _ROLES_CLAIM, with the reference's algorithms; the other claims (cube_profiles, cube_runtimes, cube_actions, cube_task_templates) keep their names.".into()];
        if self.tenants.is_empty() {
            self.rep.not_carried(
                "CUBE_ADAPTER_OIDC_* tenants",
                "the reference took any tenant a token named; name the issuer's tenants (`tenants` or `tenant` in [[auth.oidc]]) before `config check` accepts it",
            );
        } else {
            let list: Vec<String> = self.tenants.iter().cloned().collect();
            t.insert("tenants".into(), tlist(&list));
            comment.push("tenants: the principals file's, the only ones its tokens may name (the reference took any); allowed_roles: agent only by default (the reference took any role a token named, admin too): widen it deliberately.".into());
        }
        self.sections.push(Piece {
            comment,
            path: vec!["auth".into(), "oidc".into()],
            value: toml::Value::Array(vec![toml::Value::Table(t)]),
        });
        self.rep.carried("CUBE_ADAPTER_OIDC_*", "[[auth.oidc]]");
        Ok(())
    }

    /// The shared token: an environment variable of the service, in `env`.
    fn shared_token(&mut self) -> Result<(), ImportError> {
        let Some(tok) = self.env.take("CUBE_ADAPTER_TOKEN") else {
            return Ok(());
        };
        if tok.len() < 24 {
            return Err(ImportError::ShortToken);
        }
        self.files.push(OutFile {
            name: ENV_FILE,
            data: format!("CUBE_ADAPTER_TOKEN={}\n", env_quote(&tok)).into_bytes(),
            mode: 0o600,
            secret: true,
        });
        self.rep.carried(
            "CUBE_ADAPTER_TOKEN",
            format!(
                "{} (0600), not config.toml: it stays the environment variable CUBE_ADAPTER_TOKEN of the service; install it as /etc/cube-adapter/env and load it with a drop-in (`systemctl edit cube-adapter`: [Service] EnvironmentFile=/etc/cube-adapter/env). Here it is an agent (tenant default, subject shared-bearer, every action), not an admin as in the reference: give admins their own tokens (`cube-adapter token create --role admin`)",
                self.out(ENV_FILE)
            ),
        );
        Ok(())
    }

    /// `[profiles.NAME]`: the file's (its `defaults` and the environment's
    /// timeouts merged under each), else the reference's built-in
    /// `offline-code`. Returns the profiles' names.
    fn profiles(
        &mut self,
        flag: &Option<PathBuf>,
        template: Option<&str>,
        has_backend: bool,
    ) -> Result<Vec<String>, ImportError> {
        const FROM_ENV: [(&str, &str); 2] = [
            ("CUBE_ADAPTER_SANDBOX_TIMEOUT", "sandbox_timeout_seconds"),
            ("CUBE_ADAPTER_MAX_COMMAND_SECONDS", "max_command_seconds"),
        ];
        let mut env_defaults = Map::new();
        for (var, key) in FROM_ENV {
            if let Some(v) = self.env.take(var) {
                let n = int(&Value::String(v), var, 1)?;
                env_defaults.insert(key.into(), Value::from(n));
            }
        }
        let path = source(
            flag,
            &mut self.env,
            "CUBE_ADAPTER_PROFILES_FILE",
            "--profiles",
            &mut self.rep,
        )?;
        let (file_defaults, raw, shown, lines) = match &path {
            Some((p, _)) => {
                let (d, ps, lines) = read_profiles(p)?;
                self.rep.sources.push(("profiles".into(), p.clone()));
                (d, ps, p.display().to_string(), lines)
            }
            None => {
                self.rep.notes.push(
                    "no profiles file: the reference had its one built-in profile, offline-code; it is written as [profiles.offline-code]"
                        .into(),
                );
                (
                    Map::new(),
                    Map::from_iter([("offline-code".to_string(), Value::Null)]),
                    "the built-in profile".to_string(),
                    ProfileLines::default(),
                )
            }
        };
        let mut from_env: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        let mut untemplated = vec![];
        let mut names = vec![];
        for (name, value) in &raw {
            let own = match value {
                Value::Null => Map::new(),
                v => object(
                    v,
                    &format!(
                        "{}: profile {name}",
                        file_line(&shown, lines.line(name, ""))
                    ),
                )?
                .clone(),
            };
            let mut merged = env_defaults.clone();
            for (k, v) in file_defaults.iter().chain(own.iter()) {
                merged.insert(k.clone(), v.clone());
            }
            for k in env_defaults.keys() {
                if !file_defaults.contains_key(k) && !own.contains_key(k) {
                    from_env.entry(k.as_str()).or_default().push(name.clone());
                }
            }
            let line = |k: &str| lines.line(name, k);
            let (piece, named_template) = profile(
                name,
                &merged,
                &shown,
                &line,
                &self.env,
                has_backend,
                &mut self.rep,
            )?;
            if !named_template {
                untemplated.push(name.clone());
            }
            self.sections.push(piece);
            names.push(name.clone());
        }
        if let Some((p, named)) = path {
            self.rep.carried(
                named,
                format!("{}: {} profiles as [profiles.*]", p.display(), names.len()),
            );
        }
        for (var, key) in FROM_ENV {
            if env_defaults.contains_key(key) {
                let ps = from_env.get(key).cloned().unwrap_or_default();
                self.rep.carried(
                    var,
                    if ps.is_empty() {
                        format!("{key}: every profile sets its own; not used")
                    } else {
                        format!("{key} of the profiles that set none: {}", ps.join(", "))
                    },
                );
            }
        }
        let none = untemplated.join(", ");
        match (template, has_backend, untemplated.is_empty()) {
            (Some(t), true, false) => self.rep.carried(
                "CUBE_TEMPLATE_ID",
                format!(
                    "[backends.default] template = \"{t}\": the template of the profiles that name none ({none})"
                ),
            ),
            (Some(t), true, true) => self.rep.carried(
                "CUBE_TEMPLATE_ID",
                format!("[backends.default] template = \"{t}\" (every profile names its own)"),
            ),
            (Some(_), false, _) => self.rep.not_carried(
                "CUBE_TEMPLATE_ID",
                format!(
                    "it names a CubeSandbox template and no backend is written; the profiles that name none ({none}) take the embedded backend's `minimal`"
                ),
            ),
            (None, _, false) => self.rep.notes.push(format!(
                "CUBE_TEMPLATE_ID is not set (the reference requires it): the profiles that name no template ({none}) get `minimal`, the embedded backend's"
            )),
            (None, _, true) => {}
        }
        Ok(names)
    }

    /// `[tasks.NAME]`: the task templates file.
    fn task_templates(
        &mut self,
        flag: &Option<PathBuf>,
        profiles: &[String],
    ) -> Result<(), ImportError> {
        let Some((p, named)) = source(
            flag,
            &mut self.env,
            "CUBE_ADAPTER_TASK_TEMPLATES_FILE",
            "--task-templates",
            &mut self.rep,
        )?
        else {
            return Ok(());
        };
        let n = tasks(&p, profiles, &mut self.sections, &mut self.rep)?;
        self.rep.carried(
            named,
            format!("{}: {n} task templates as [tasks.*]", p.display()),
        );
        self.rep.sources.push(("task templates".into(), p));
        self.rep.notes.push(format!(
            "{n} task templates carried; their digests (template_sha256) are the reference's. An admin may not approve their own plans here unless the profile says admin_self_approval = true (the reference let admins)"
        ));
        Ok(())
    }

    /// A file of named sections (`[mcp_policies.NAME]`, `[presets.NAME]`):
    /// the flag's, else the env file's `var`, read by `read`.
    fn sections_file(
        &mut self,
        flag: &Option<PathBuf>,
        var: &str,
        flag_name: &str,
        kind: &str,
        read: fn(&Path, &mut Vec<Piece>, &mut Report) -> Result<usize, ImportError>,
    ) -> Result<(), ImportError> {
        let Some((p, named)) = source(flag, &mut self.env, var, flag_name, &mut self.rep)? else {
            return Ok(());
        };
        let n = read(&p, &mut self.sections, &mut self.rep)?;
        self.rep
            .carried(named, format!("{}: {n} {kind}", p.display()));
        self.rep.sources.push((kind.to_string(), p));
        Ok(())
    }

    /// What is left of the env file: not carried, each with its reason.
    fn leftovers(&mut self) {
        for (k, (v, _)) in std::mem::take(&mut self.env.vars) {
            let what = match shown_value(&k, &v) {
                Some(s) => format!("{k}={s}"),
                None => k.clone(),
            };
            self.rep.not_carried(what, why_not(&k, &v));
        }
    }

    /// `config.toml` first, then the other files.
    fn finish(self, now: &str) -> Result<Plan, ImportError> {
        let Build {
            top,
            sections,
            mut files,
            rep,
            ..
        } = self;
        let mut doc = Doc::default();
        doc.comment(&format!(
            "Imported from the reference adapter (cubesandbox-agent-adapter) by `cube-adapter config import` at {now}."
        ));
        for (kind, p) in &rep.sources {
            doc.comment(&format!("  {kind}: {}", p.display()));
        }
        doc.comment(
            "Secrets are not in this file: they are in the 0600 files beside it. What was not carried over, and why, is in the report the command printed. Check: cube-adapter config check --config THIS_FILE",
        );
        doc.blank();
        let n_top = top.len();
        for (i, p) in top.into_iter().chain(sections).enumerate() {
            if i >= n_top {
                doc.blank();
            }
            for c in &p.comment {
                doc.comment(c);
            }
            let path: Vec<&str> = p.path.iter().map(String::as_str).collect();
            doc.put(&path, p.value)?;
        }
        files.insert(
            0,
            OutFile {
                name: CONFIG_FILE,
                data: doc.text.into_bytes(),
                mode: 0o640,
                secret: false,
            },
        );
        Ok(Plan { files, report: rep })
    }
}

/// A YAML mapping.
type Mapping = Map<String, Value>;

/// A profiles file: `{defaults, profiles}` or a bare map of profiles; and
/// where a profile's key is (`profiles.NAME.KEY`, else `defaults.KEY`, else
/// the profile's own line).
fn read_profiles(p: &Path) -> Result<(Mapping, Mapping, ProfileLines), ImportError> {
    let doc = read_yaml(p)?;
    let lines = KeyLines::of(&read_text(p)?);
    let shown = p.display().to_string();
    let top = object(&doc, &shown)?;
    let (defaults, profiles, wrapped) = if top.contains_key("profiles") {
        if let Some(k) = top
            .keys()
            .find(|k| !["defaults", "profiles"].contains(&k.as_str()))
        {
            return Err(ImportError::UnknownKey {
                file: shown,
                key: k.clone(),
                known: "defaults and profiles",
            });
        }
        let d = match top.get("defaults") {
            None | Some(Value::Null) => Map::new(),
            Some(d) => object(d, &format!("{shown}: defaults"))?.clone(),
        };
        let ps = object(
            top.get("profiles").unwrap_or(&Value::Null),
            &format!("{shown}: profiles"),
        )?
        .clone();
        (d, ps, true)
    } else {
        (Map::new(), top.clone(), false)
    };
    if profiles.is_empty() {
        return Err(ImportError::NoProfile(shown));
    }
    Ok((defaults, profiles, ProfileLines { lines, wrapped }))
}

/// Where the keys of a profiles file are.
#[derive(Debug, Default)]
struct ProfileLines {
    lines: KeyLines,
    /// Under `profiles:` (with `defaults:`), not a bare map of profiles.
    wrapped: bool,
}

impl ProfileLines {
    /// The line of profile `name`'s `key` (its own, else the defaults'),
    /// else of the profile.
    fn line(&self, name: &str, key: &str) -> Option<usize> {
        if self.wrapped {
            self.lines.line(&[
                &["profiles", name, key],
                &["defaults", key],
                &["profiles", name],
            ])
        } else {
            self.lines.line(&[&[name, key], &[name]])
        }
    }
}

/// A file of the reference: the flag's, else the env file's variable
/// (relative to the env file's directory); with what named it.
fn source(
    flag: &Option<PathBuf>,
    env: &mut Env,
    var: &str,
    flag_name: &str,
    rep: &mut Report,
) -> Result<Option<(PathBuf, String)>, ImportError> {
    let at = env.at(var);
    let from_env = env.take(var);
    if let Some(f) = flag {
        if from_env.is_some() {
            rep.notes.push(format!(
                "{flag_name} {} is read instead of {at}",
                f.display()
            ));
        }
        return Ok(Some((f.clone(), flag_name.to_string())));
    }
    let Some(v) = from_env else {
        return Ok(None);
    };
    let p = env.resolve(&v);
    if !p.exists() {
        return Err(ImportError::NoSuchFile {
            at,
            path: p,
            flag: flag_name.to_string(),
        });
    }
    Ok(Some((p, var.to_string())))
}

/// A value for an `EnvironmentFile=` line: as it is when it has nothing
/// systemd would read specially, else in double quotes.
fn env_quote(v: &str) -> String {
    if v.chars()
        .all(|c| c.is_ascii_alphanumeric() || "._~+/=:,@%-".contains(c))
    {
        v.to_string()
    } else {
        format!("\"{}\"", v.replace('\\', "\\\\").replace('"', "\\\""))
    }
}

/// `[backends.default]` from `CUBE_API_URL` and the SDK's variables; `None`
/// (the embedded backend) without `CUBE_API_URL`.
fn backend(
    env: &mut Env,
    template: Option<&str>,
    out_dir: &Path,
    rep: &mut Report,
    files: &mut Vec<OutFile>,
) -> Result<Option<Piece>, ImportError> {
    let Some(api) = env.take("CUBE_API_URL") else {
        rep.notes.push(
            "no CUBE_API_URL: no backend is written; the appliance runs its embedded backend (sandboxes on this host)"
                .into(),
        );
        for k in [
            "CUBE_PROXY_NODE_IP",
            "CUBE_PROXY_PORT_HTTP",
            "CUBE_SANDBOX_DOMAIN",
            "CUBE_API_KEY",
        ] {
            if env.take(k).is_some() {
                rep.not_carried(k, "no CUBE_API_URL, so no CubeSandbox backend is written");
            }
        }
        return Ok(None);
    };
    let u = url::Url::parse(&api).map_err(|source| ImportError::Url {
        at: format!("CUBE_API_URL={api}"),
        source,
    })?;
    let loopback = |u: &url::Url| match u.host() {
        Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
        Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
        Some(url::Host::Domain(d)) => d.eq_ignore_ascii_case("localhost"),
        None => false,
    };
    let mut comment = vec![
        "[backends.default]: CUBE_API_URL (api_url) and the SDK's CUBE_PROXY_NODE_IP, CUBE_PROXY_PORT_HTTP, CUBE_SANDBOX_DOMAIN, CUBE_API_KEY, CUBE_TEMPLATE_ID.".to_string(),
    ];
    let mut insecure = u.scheme() == "http" && !loopback(&u);
    if insecure {
        comment.push(
            "insecure_plain_http: CubeAPI is plain HTTP here (as for the reference); keep it on a private network or put TLS in front."
                .into(),
        );
    }
    let domain = env
        .take("CUBE_SANDBOX_DOMAIN")
        .unwrap_or_else(|| "cube.app".into());
    let node_ip = env.take("CUBE_PROXY_NODE_IP");
    let proxy = match node_ip {
        Some(ip) => {
            let port = env
                .take("CUBE_PROXY_PORT_HTTP")
                .unwrap_or_else(|| "80".into());
            port.parse::<u16>().map_err(|_| ImportError::NotA {
                var: "CUBE_PROXY_PORT_HTTP",
                value: port.clone(),
                what: "a port number",
            })?;
            let dial = if ip.contains(':') && !ip.starts_with('[') {
                format!("[{ip}]:{port}")
            } else {
                format!("{ip}:{port}")
            };
            comment.push(format!(
                "proxy_url: the SDK sent data-plane requests for <port>-<id>.{domain} over plain HTTP to CUBE_PROXY_NODE_IP:CUBE_PROXY_PORT_HTTP; so does this. For TLS instead: proxy_url = {{ url = \"https://{domain}\", dial = \"{ip}:443\" }} and ca_file = CubeProxy's CA (docs/operations.md, \"Connecting to CubeSandbox\")."
            ));
            rep.carried(
                "CUBE_PROXY_NODE_IP, CUBE_PROXY_PORT_HTTP",
                format!("proxy_url = {{ url = \"http://{domain}\", dial = \"{dial}\" }}"),
            );
            let mut t = toml::Table::new();
            t.insert("url".into(), tstr(format!("http://{domain}")));
            t.insert("dial".into(), tstr(dial));
            toml::Value::Table(t)
        }
        None => {
            comment.push(format!(
                "proxy_url: the SDK resolved <port>-<id>.{domain} through DNS; here requests go to {domain} itself with the sandbox in the Host header: {domain} must resolve to CubeProxy, or use the dial form, proxy_url = {{ url = \"http://{domain}\", dial = \"NODE:80\" }}."
            ));
            rep.notes.push(format!(
                "no CUBE_PROXY_NODE_IP: proxy_url = \"http://{domain}\"; check that {domain} resolves to CubeProxy, or set the dial form (see config.toml)"
            ));
            tstr(format!("http://{domain}"))
        }
    };
    if !domain.eq_ignore_ascii_case("localhost") {
        insecure = true;
    }
    let mut t = toml::Table::new();
    t.insert("kind".into(), tstr("cubesandbox"));
    t.insert("api_url".into(), tstr(api.clone()));
    t.insert("proxy_url".into(), proxy);
    t.insert("domain".into(), tstr(domain.clone()));
    t.insert("insecure_plain_http".into(), toml::Value::Boolean(insecure));
    rep.carried(
        "CUBE_API_URL",
        format!("[backends.default] api_url = \"{api}\""),
    );
    rep.carried(
        "CUBE_SANDBOX_DOMAIN (or cube.app)",
        format!("domain = \"{domain}\""),
    );
    if let Some(k) = env.take("CUBE_API_KEY") {
        files.push(OutFile {
            name: CUBE_API_KEY_FILE,
            data: format!("{}\n", k.trim()).into_bytes(),
            mode: 0o600,
            secret: true,
        });
        let f = out_dir.join(CUBE_API_KEY_FILE).display().to_string();
        t.insert("api_key_file".into(), tstr(f.clone()));
        rep.carried("CUBE_API_KEY", format!("{f} (0600) = api_key_file"));
    }
    if let Some(tpl) = template {
        t.insert("template".into(), tstr(tpl));
    }
    let v = toml::Value::Table(t);
    // What the loader will say, said here with the variables' names.
    v.clone()
        .try_into::<super::BackendDef>()
        .map_err(ImportError::Backend)?;
    Ok(Some(Piece {
        comment,
        path: vec!["backends".into(), "default".into()],
        value: v,
    }))
}

/// `[profiles.NAME]` from the reference's profile (its `defaults` and the
/// environment's merged under it), and whether it names a template.
fn profile(
    name: &str,
    merged: &Map<String, Value>,
    shown: &str,
    line: &dyn Fn(&str) -> Option<usize>,
    env: &Env,
    has_backend: bool,
    rep: &mut Report,
) -> Result<(Piece, bool), ImportError> {
    let at = |k: &str| format!("{}: profile {name}: {k}", file_line(shown, line(k)));
    let mut t = toml::Table::new();
    let mut comment = vec![format!("[profiles.{name}]: from {shown}.")];
    let mut named_template = false;
    for (k, v) in merged {
        let k = k.as_str();
        if let Some((_, min)) = PROFILE_INTS.iter().find(|(f, _)| *f == k) {
            t.insert(k.into(), tint(int(v, &at(k), *min)?));
            continue;
        }
        if PROFILE_BOOLS.contains(&k) {
            t.insert(k.into(), toml::Value::Boolean(boolean(v, &at(k))?));
            continue;
        }
        match k {
            "template" => {
                let s = if v.is_null() {
                    String::new()
                } else {
                    string(v, &at(k))?
                };
                if !s.is_empty() {
                    t.insert("template".into(), tstr(s));
                    named_template = true;
                }
            }
            "allowed_runtimes" => {
                let rs = strings(v, &at(k))?;
                if let Some(r) = rs.iter().find(|r| !super::RUNTIMES.contains(&r.as_str())) {
                    return Err(ImportError::Invalid {
                        at: at(k),
                        why: format!("unknown runtime '{r}'"),
                    });
                }
                // Empty: the reference's default, all of them.
                if !rs.is_empty() {
                    t.insert(k.into(), tlist(&rs));
                }
            }
            "lifecycle" => {
                let m = match v {
                    Value::Null => Map::new(),
                    v => object(v, &at(k))?.clone(),
                };
                let mut l = toml::Table::new();
                let on = match m.get("on_timeout") {
                    None => "pause".to_string(),
                    Some(x) => string(x, &at("lifecycle.on_timeout"))?,
                };
                if !["pause", "kill"].contains(&on.as_str()) {
                    return Err(ImportError::Invalid {
                        at: at("lifecycle.on_timeout"),
                        why: "must be pause or kill".into(),
                    });
                }
                let resume = match m.get("auto_resume") {
                    None => true,
                    Some(x) => boolean(x, &at("lifecycle.auto_resume"))?,
                };
                l.insert("on_timeout".into(), tstr(on));
                l.insert("auto_resume".into(), toml::Value::Boolean(resume));
                for other in m
                    .keys()
                    .filter(|x| !["on_timeout", "auto_resume"].contains(&x.as_str()))
                {
                    rep.not_carried(
                        format!("{shown}: {name}.lifecycle.{other}"),
                        "passed to the SDK by the reference; no such setting here",
                    );
                }
                t.insert(k.into(), toml::Value::Table(l));
            }
            "network" => {
                let m = match v {
                    Value::Null => Map::new(),
                    v => object(v, &at(k))?.clone(),
                };
                let mut n = toml::Table::new();
                for (nk, nv) in &m {
                    match nk.as_str() {
                        "allow_public_traffic" | "allowPublicTraffic" => {
                            if boolean(nv, &at(&format!("network.{nk}")))? {
                                rep.not_carried(
                                    format!("{shown}: {name}.network.{nk}=true"),
                                    "sandboxes are always created with public traffic off here (the data plane carries each sandbox's traffic token)",
                                );
                            }
                        }
                        "allow_out" | "allowOut" | "deny_out" | "denyOut" => {
                            let key = if nk.starts_with("allow") { "allow_out" } else { "deny_out" };
                            let nat = at(&format!("network.{nk}"));
                            let list = strings(nv, &nat)?
                                .iter()
                                .map(|s| env_ref(s, env, &nat))
                                .collect::<Result<Vec<_>, _>>()?;
                            n.insert(key.into(), tlist(&list));
                        }
                        other => rep.not_carried(
                            format!("{shown}: {name}.network.{other}"),
                            "passed to the SDK by the reference; only allow_out and deny_out exist here",
                        ),
                    }
                }
                if !n.is_empty() {
                    if !n.contains_key("deny_out") {
                        comment.push("network.deny_out: not set in the reference; here it defaults to the private, shared and link-local ranges (reachable only where allow_out names them).".into());
                    }
                    t.insert(k.into(), toml::Value::Table(n));
                }
            }
            "workspace" => {
                if let Some(w) = workspace(v, &at(k), name, shown, rep)? {
                    t.insert(k.into(), toml::Value::Table(w));
                }
            }
            "mcp_policy" | "template_preset" => {
                if !v.is_null() {
                    t.insert(k.into(), tstr(string(v, &at(k))?));
                }
            }
            "distribution_scope" => {
                let s = strings(v, &at(k))?;
                if !s.is_empty() {
                    rep.not_carried(
                        format!("{shown}: {name}.distribution_scope"),
                        "there is no scheduling scope here: CubeSandbox places sandboxes itself",
                    );
                }
            }
            "backend_id" => {
                let b = string(v, &at(k))?;
                if has_backend && b == super::DEFAULT_BACKEND {
                    t.insert("backend".into(), tstr(b));
                    comment.push("backend: backend_id.".into());
                } else {
                    rep.not_carried(
                        format!("{shown}: {name}.backend_id={b}"),
                        "the reference's backends file is not imported: the profile runs on the one backend written (default); add [backends.NAME] and set backend = \"NAME\" in the profile",
                    );
                }
            }
            other => rep.not_carried(
                format!("{shown}: {name}.{other}"),
                "not a field of the reference's profile schema (it refuses it too)",
            ),
        }
    }
    if t.get("allow_internet_access")
        .and_then(toml::Value::as_bool)
        == Some(true)
        && t.get("network").and_then(|n| n.get("deny_out")).is_none()
    {
        rep.notes.push(format!(
            "profile {name}: with internet access, the private, shared and link-local ranges stay unreachable here unless network.allow_out names them (the reference did not deny them)"
        ));
    }
    // What the loader will say, said here with the file's name.
    toml::Value::Table(t.clone())
        .try_into::<super::Profile>()
        .map_err(|source| ImportError::Profile {
            at: format!("{}: profile {name}", file_line(shown, line(""))),
            source,
        })?;
    rep.carried(
        format!("{shown}: profile {name}"),
        format!("[profiles.{name}]"),
    );
    Ok((
        Piece {
            comment,
            path: vec!["profiles".into(), name.into()],
            value: toml::Value::Table(t),
        },
        named_template,
    ))
}

/// The reference's `mcp-policies.yaml`: `policies:` (or the top level) maps
/// each policy's name to its server (`server: {name, command, env}`, or
/// `command`/`env` beside the rest), its `tools` (a map of name to
/// `{description, input_schema}`, or a list of such with `name`), its
/// timeout (`timeout_seconds` or `call_timeout_seconds`) and limits
/// (`max_input_bytes`, `max_output_bytes`). A list `command` is joined
/// as shell words. Each policy is checked as `config check` would.
fn mcp_policies(
    p: &Path,
    sections: &mut Vec<Piece>,
    rep: &mut Report,
) -> Result<usize, ImportError> {
    let shown = p.display().to_string();
    let doc = read_yaml(p)?;
    let lines = KeyLines::of(&read_text(p)?);
    let top = object(&doc, &shown)?;
    let (all, wrapped) = match top.get("policies") {
        Some(v) => (object(v, &format!("{shown}: policies"))?.clone(), true),
        None => (top.clone(), false),
    };
    if all.is_empty() {
        return Err(ImportError::NoPolicy(shown));
    }
    for (name, v) in &all {
        let line = |k: &str| {
            if wrapped {
                lines.line(&[&["policies", name, k], &["policies", name]])
            } else {
                lines.line(&[&[name, k], &[name]])
            }
        };
        let at = |k: &str| format!("{}: policy {name}: {k}", file_line(&shown, line(k)));
        let m = object(v, &at(""))?;
        let mut t = toml::Table::new();
        let server = match m.get("server") {
            Some(Value::Object(s)) => s.clone(),
            Some(Value::String(s)) => Map::from_iter([("name".into(), Value::String(s.clone()))]),
            _ => Map::new(),
        };
        let get = |k: &str| server.get(k).or_else(|| m.get(k));
        if let Some(n) = server.get("name") {
            t.insert("server".into(), tstr(string(n, &at("server.name"))?));
        }
        let command = match get("command")
            .or_else(|| get("run_cmd"))
            .or_else(|| get("runCmd"))
        {
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| string(x, &at("command")).map(|s| super::tasks::shell_quote(&s)))
                .collect::<Result<Vec<_>, _>>()?
                .join(" "),
            Some(x) => string(x, &at("command"))?,
            None => String::new(),
        };
        t.insert("command".into(), tstr(command));
        if let Some(e) = get("env").or_else(|| get("envs")) {
            let mut env = toml::Table::new();
            for (k, x) in object(e, &at("env"))? {
                env.insert(k.clone(), tstr(string(x, &at(&format!("env.{k}")))?));
            }
            t.insert("env".into(), toml::Value::Table(env));
        }
        if let Some(d) = m.get("description") {
            t.insert("description".into(), tstr(string(d, &at("description"))?));
        }
        for (keys, to) in [
            (
                &["call_timeout_seconds", "timeout_seconds"][..],
                "call_timeout_seconds",
            ),
            (&["max_input_bytes"][..], "max_input_bytes"),
            (&["max_output_bytes"][..], "max_output_bytes"),
        ] {
            if let Some((k, x)) = keys.iter().find_map(|k| m.get(*k).map(|x| (*k, x))) {
                t.insert(to.into(), tint(int(x, &at(k), 1)?));
            }
        }
        let mut tools = toml::Table::new();
        let listed: Vec<(String, Map<String, Value>)> =
            match m.get("tools").or_else(|| m.get("allowed_tools")) {
                Some(Value::Object(o)) => o
                    .iter()
                    .map(|(k, x)| Ok((k.clone(), object(x, &at(&format!("tools.{k}")))?.clone())))
                    .collect::<Result<_, ImportError>>()?,
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|x| {
                        let o = object(x, &at("tools"))?;
                        let n = string(o.get("name").unwrap_or(&Value::Null), &at("tools.name"))?;
                        Ok((n, o.clone()))
                    })
                    .collect::<Result<_, ImportError>>()?,
                _ => vec![],
            };
        for (tool, o) in listed {
            let mut tt = toml::Table::new();
            if let Some(d) = o.get("description") {
                tt.insert(
                    "description".into(),
                    tstr(string(d, &at(&format!("tools.{tool}.description")))?),
                );
            }
            let schema = o
                .get("input_schema")
                .or_else(|| o.get("inputSchema"))
                .or_else(|| o.get("parameters"))
                .or_else(|| o.get("schema"))
                .cloned()
                .unwrap_or(Value::Null);
            let schema: toml::Value =
                toml::Value::try_from(&schema).map_err(|source| ImportError::Toml {
                    at: at(&format!("tools.{tool}.input_schema")),
                    source,
                })?;
            tt.insert("input_schema".into(), schema);
            for other in o.keys().filter(|k| {
                ![
                    "name",
                    "description",
                    "input_schema",
                    "inputSchema",
                    "parameters",
                    "schema",
                ]
                .contains(&k.as_str())
            }) {
                rep.not_carried(
                    format!("{shown}: {name}.tools.{tool}.{other}"),
                    "no such setting of a tool here",
                );
            }
            tools.insert(tool, toml::Value::Table(tt));
        }
        t.insert("tools".into(), toml::Value::Table(tools));
        for other in m.keys().filter(|k| {
            ![
                "server",
                "command",
                "run_cmd",
                "runCmd",
                "env",
                "envs",
                "description",
                "call_timeout_seconds",
                "timeout_seconds",
                "max_input_bytes",
                "max_output_bytes",
                "tools",
                "allowed_tools",
            ]
            .contains(&k.as_str())
        }) {
            rep.not_carried(
                format!("{shown}: {name}.{other}"),
                "no such setting of an MCP policy here",
            );
        }
        // What the loader will say, said here with the file's name.
        let policy: super::McpPolicy =
            toml::Value::Table(t.clone())
                .try_into()
                .map_err(|source| ImportError::Profile {
                    at: format!("{}: policy {name}", file_line(&shown, line(""))),
                    source,
                })?;
        policy.validate(name).map_err(|e| ImportError::Invalid {
            at: format!("{}: policy {name}", file_line(&shown, line(""))),
            why: e.to_string(),
        })?;
        rep.carried(
            format!("{shown}: policy {name}"),
            format!("[mcp_policies.{name}]"),
        );
        sections.push(Piece {
            comment: vec![format!("[mcp_policies.{name}]: from {shown}.")],
            path: vec!["mcp_policies".into(), name.clone()],
            value: toml::Value::Table(t),
        });
    }
    Ok(all.len())
}

/// The reference's template presets file: `presets:` (or the top level)
/// maps each name to `version`, `template` (or `template_id`), `bootstrap`,
/// `files` (a list of `{path, content, mode}`), `after` (or `restart`),
/// `prechecks` (or `pre_checks`), `step_timeout_seconds` and `models`
/// (`provider`, `available`, `default`, `fallbacks`, `aliases`). Each is
/// checked as `config check` would (its secret files are not read here).
fn presets(p: &Path, sections: &mut Vec<Piece>, rep: &mut Report) -> Result<usize, ImportError> {
    let shown = p.display().to_string();
    let doc = read_yaml(p)?;
    let lines = KeyLines::of(&read_text(p)?);
    let top = object(&doc, &shown)?;
    let (all, wrapped) = match top.get("presets") {
        Some(v) => (object(v, &format!("{shown}: presets"))?.clone(), true),
        None => (top.clone(), false),
    };
    if all.is_empty() {
        return Err(ImportError::NoPreset(shown));
    }
    const ALIASES: &[(&str, &str)] = &[
        ("template_id", "template"),
        ("restart", "after"),
        ("pre_checks", "prechecks"),
    ];
    const KNOWN: &[&str] = &[
        "version",
        "description",
        "template",
        "bootstrap",
        "files",
        "after",
        "prechecks",
        "step_timeout_seconds",
        "models",
    ];
    for (name, v) in &all {
        let line = || {
            if wrapped {
                lines.line(&[&["presets", name]])
            } else {
                lines.line(&[&[name]])
            }
        };
        let at = format!("{}: preset {name}", file_line(&shown, line()));
        let mut m = object(v, &at)?.clone();
        for (from, to) in ALIASES {
            if let Some(x) = m.remove(*from) {
                m.entry(to.to_string()).or_insert(x);
            }
        }
        for other in m
            .keys()
            .filter(|k| !KNOWN.contains(&k.as_str()))
            .cloned()
            .collect::<Vec<_>>()
        {
            rep.not_carried(
                format!("{shown}: {name}.{other}"),
                "no such setting of a preset here",
            );
            m.remove(&other);
        }
        let value =
            toml::Value::try_from(Value::Object(m)).map_err(|source| ImportError::Toml {
                at: at.clone(),
                source,
            })?;
        let preset: super::Preset =
            value
                .clone()
                .try_into()
                .map_err(|source| ImportError::Profile {
                    at: at.clone(),
                    source,
                })?;
        preset
            .validate(name, false)
            .map_err(|e| ImportError::Invalid {
                at: at.clone(),
                why: e.to_string(),
            })?;
        rep.carried(
            format!("{shown}: preset {name}"),
            format!("[presets.{name}]"),
        );
        sections.push(Piece {
            comment: vec![format!("[presets.{name}]: from {shown}.")],
            path: vec!["presets".into(), name.clone()],
            value,
        });
    }
    Ok(all.len())
}

fn workspace(
    v: &Value,
    at: &str,
    name: &str,
    shown: &str,
    rep: &mut Report,
) -> Result<Option<toml::Table>, ImportError> {
    let m = match v {
        Value::Null => return Ok(None),
        v => object(v, at)?,
    };
    let mut w = toml::Table::new();
    for (k, x) in m {
        let a = format!("{at}.{k}");
        match k.as_str() {
            "mode" => {
                let s = string(x, &a)?;
                if !["ephemeral", "existing-volume", "per-session-volume"].contains(&s.as_str()) {
                    return Err(ImportError::Invalid {
                        at: a,
                        why: "must be ephemeral, existing-volume or per-session-volume".into(),
                    });
                }
                if s == "per-session-volume" {
                    rep.notes.push(format!(
                        "profile {name}: per-session volumes the reference made (cwa-…) are not attached again: names here also carry the runtime and derive from the appliance's own key; retained ones stay on the backend (attach one with mode existing-volume)"
                    ));
                }
                w.insert(k.clone(), tstr(s));
            }
            "mount_path" | "volume_id" | "volume_name" | "driver" => {
                if !x.is_null() {
                    let s = string(x, &a)?;
                    if !s.is_empty() {
                        w.insert(k.clone(), tstr(s));
                    }
                }
            }
            "read_only" | "retain_on_kill" => {
                w.insert(k.clone(), toml::Value::Boolean(boolean(x, &a)?));
            }
            "size_mb" => {
                w.insert(k.clone(), tint(int(x, &a, 0)?));
            }
            other => rep.not_carried(
                format!("{shown}: {name}.workspace.{other}"),
                "not a workspace field (the reference refuses it too)",
            ),
        }
    }
    Ok(Some(w))
}

/// The task templates file: `defaults` merged into each task, then
/// `[tasks.NAME]`. Returns how many were carried.
fn tasks(
    p: &Path,
    profiles: &[String],
    sections: &mut Vec<Piece>,
    rep: &mut Report,
) -> Result<usize, ImportError> {
    let shown = p.display().to_string();
    let doc = read_yaml(p)?;
    let lines = KeyLines::of(&read_text(p)?);
    let top = object(&doc, &shown)?;
    if let Some(k) = top
        .keys()
        .find(|k| !["defaults", "tasks"].contains(&k.as_str()))
    {
        return Err(ImportError::UnknownKey {
            file: shown,
            key: k.clone(),
            known: "defaults and tasks",
        });
    }
    let defaults = match top.get("defaults") {
        None | Some(Value::Null) => Map::new(),
        Some(d) => object(d, &format!("{shown}: defaults"))?.clone(),
    };
    let list = match top.get("tasks") {
        Some(t @ Value::Object(m)) if !m.is_empty() => object(t, &shown)?,
        _ => return Err(ImportError::NoTask(shown)),
    };
    let known: BTreeSet<&str> = profiles.iter().map(String::as_str).collect();
    let mut n = 0;
    for (name, v) in list {
        // A task's key: its own line, else the defaults', else the task's.
        let line = |k: &str| lines.line(&[&["tasks", name, k], &["defaults", k], &["tasks", name]]);
        let at = format!("{}: task {name}", file_line(&shown, line("")));
        let mut merged = defaults.clone();
        for (k, x) in object(v, &at)? {
            merged.insert(k.clone(), x.clone());
        }
        let unknown: Vec<String> = merged
            .keys()
            .filter(|k| !TASK_FIELDS.contains(&k.as_str()))
            .cloned()
            .collect();
        for k in unknown {
            merged.remove(&k);
            rep.not_carried(
                format!("{shown}: {name}.{k}"),
                "not a field of the reference's task template schema (it refuses it too)",
            );
        }
        // The reference strips the description.
        if let Some(Value::String(d)) = merged.get_mut("description") {
            *d = d.trim().to_string();
        }
        let t: TaskTemplate = serde_json::from_value(Value::Object(merged))
            .map_err(|source| ImportError::Task { at, source })?;
        if !known.contains(t.profile.as_str()) {
            return Err(ImportError::Invalid {
                at: format!("{}: task {name}", file_line(&shown, line("profile"))),
                why: format!(
                    "profile '{}' is not defined (the reference refuses it too)",
                    t.profile
                ),
            });
        }
        let value = match toml::Value::try_from(&t) {
            Ok(v) => v,
            Err(e) => {
                rep.not_carried(
                    format!("{shown}: task {name}"),
                    format!("cannot be written as TOML ({e}): TOML has no null, for instance; rewrite the schema without it and add [tasks.{name}] by hand"),
                );
                continue;
            }
        };
        sections.push(Piece {
            comment: vec![format!(
                "[tasks.{name}]: from {shown}, its defaults merged in. template_sha256 {}",
                t.digest(name)
            )],
            path: vec!["tasks".into(), name.clone()],
            value,
        });
        rep.carried(format!("{shown}: task {name}"), format!("[tasks.{name}]"));
        n += 1;
    }
    Ok(n)
}

// ------------------------------------------------------------------ errors

/// Why [`plan`] refuses: a file that cannot be read, or a value the
/// reference itself would refuse (or this appliance does), with the file
/// and where. Nothing is written then.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("cannot read {}: {source}", .path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The principals file.
    #[error("{}: not UTF-8 text", .0.display())]
    NotUtf8(PathBuf),
    /// A YAML file that does not parse.
    #[error("{}", yaml_message(.path, .source))]
    Yaml {
        path: PathBuf,
        source: serde_norway::Error,
    },
    /// The env file.
    #[error("{}: {source}", .path.display())]
    EnvFile { path: PathBuf, source: EnvFileError },
    /// The principals file does not load.
    #[error("{}: {source}", .path.display())]
    Principals {
        path: PathBuf,
        source: crate::auth::TokensFileError,
    },
    /// A file the env file names (`at`: the variable and its line) that
    /// is not here; `flag` gives another.
    #[error("{at}: {} does not exist here; give {flag} FILE", .path.display())]
    NoSuchFile {
        at: String,
        path: PathBuf,
        flag: String,
    },
    /// A variable that is not what it must be (a port, an address).
    #[error("{var}={value} is not {what}")]
    NotA {
        var: &'static str,
        value: String,
        what: &'static str,
    },
    /// A URL that does not parse (`at`: the variable).
    #[error("{at}: {source}")]
    Url { at: String, source: url::ParseError },
    /// A value of the wrong kind: `at` is the variable, or the file, line
    /// and key.
    #[error("{at} {problem}")]
    Value {
        at: String,
        #[source]
        problem: ValueProblem,
    },
    /// A value the reference would refuse too, or this appliance does.
    #[error("{at}: {why}")]
    Invalid { at: String, why: String },
    /// `${ENV:NAME}` in a profile (`at`), the env file not setting NAME.
    #[error("{at}: ${{ENV:{name}}}: the env file does not set {name}")]
    EnvRef { at: String, name: String },
    /// A top-level key other than `known` in a YAML file.
    #[error("{file}: unknown top-level key '{key}' ({known} only; the reference refuses it too)")]
    UnknownKey {
        file: String,
        key: String,
        known: &'static str,
    },
    #[error("{0}: defines no profile")]
    NoProfile(String),
    #[error("{0}: defines no task (tasks: {{name: {{…}}}})")]
    NoTask(String),
    #[error("{0}: defines no MCP policy (policies: {{name: {{…}}}})")]
    NoPolicy(String),
    #[error("{0}: defines no template preset (presets: {{name: {{…}}}})")]
    NoPreset(String),
    #[error("CUBE_ADAPTER_AUDIT_SINKS names http but CUBE_ADAPTER_AUDIT_HTTP_URL is unset")]
    HttpSinkWithoutUrl,
    #[error(
        "CUBE_ADAPTER_OIDC_JWKS_URL needs CUBE_ADAPTER_OIDC_ISSUER and CUBE_ADAPTER_OIDC_AUDIENCE (the reference refuses it too)"
    )]
    OidcIncomplete,
    #[error(
        "CUBE_ADAPTER_TOKEN must be at least 24 characters (the reference and the appliance both refuse a shorter one)"
    )]
    ShortToken,
    /// What the loader would say of the `[backends.default]` written.
    #[error("CUBE_API_URL and the SDK's variables: {0}")]
    Backend(#[source] toml::de::Error),
    /// What the loader would say of a profile written (`at`: where).
    #[error("{at}: {source}")]
    Profile { at: String, source: toml::de::Error },
    /// A task template that is not one (`at`: where).
    #[error("{at}: {source}")]
    Task {
        at: String,
        source: serde_json::Error,
    },
    /// A piece of `config.toml` TOML cannot hold (`at`: its key).
    #[error("{at}: cannot be written as TOML: {source}")]
    Toml {
        at: String,
        source: toml::ser::Error,
    },
    /// A piece with no key (a bug).
    #[error("nothing to write")]
    NothingToWrite,
}

impl ImportError {
    /// [`ImportError::Value`].
    fn value(at: &str, problem: ValueProblem) -> Self {
        Self::Value {
            at: at.to_string(),
            problem,
        }
    }
}

/// What a value of the reference's files or variables must be and is not.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ValueProblem {
    #[error("must be a mapping")]
    Mapping,
    #[error("must be an integer")]
    Integer,
    #[error("must be at least {0}")]
    AtLeast(i64),
    /// Anything but `true` or `false` (the string "false" too).
    #[error("must be a boolean (true or false), not {0}")]
    Boolean(Value),
    #[error("must hold non-empty strings")]
    NonEmptyStrings,
    #[error("must be a list of strings")]
    Strings,
    #[error("must be a string")]
    String,
}

/// Why an env file is refused, by its line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvFileError {
    #[error("line {line}: not KEY=VALUE")]
    NotKeyValue { line: usize },
    #[error("line {line}: {key:?} is not a variable name")]
    BadName { line: usize, key: String },
    #[error("line {line}: {key}: text after the closing quote")]
    AfterQuote { line: usize, key: String },
    #[error("line {line}: {key}: the quote is never closed")]
    Unclosed { line: usize, key: String },
}

// ------------------------------------------------------------------ write, check

/// Why [`write`] wrote nothing or not everything.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// These exist and `force` was not given: nothing was written.
    #[error("files already exist: nothing was written")]
    Exists(Vec<PathBuf>),
    /// The directory (`what`: `create`) or a file (`write`).
    #[error("cannot {what} {}: {source}", .path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Write the plan's files into `dir` (made if missing), each whole or not
/// at all, with its mode. Without `force`, nothing is written when any of
/// them exists.
pub fn write(plan: &Plan, dir: &Path, force: bool) -> Result<Vec<PathBuf>, WriteError> {
    let targets: Vec<PathBuf> = plan.files.iter().map(|f| dir.join(f.name)).collect();
    if !force {
        let existing: Vec<PathBuf> = targets
            .iter()
            .filter(|p| p.symlink_metadata().is_ok())
            .cloned()
            .collect();
        if !existing.is_empty() {
            return Err(WriteError::Exists(existing));
        }
    }
    std::fs::create_dir_all(dir).map_err(|source| WriteError::Io {
        what: "create",
        path: dir.to_path_buf(),
        source,
    })?;
    for (f, p) in plan.files.iter().zip(&targets) {
        crate::secrets::write_private(p, &f.data, f.mode).map_err(|source| WriteError::Io {
            what: "write",
            path: p.clone(),
            source,
        })?;
    }
    Ok(targets)
}

/// The loader `config check` uses, on the written file, with no
/// environment and no flags: the configuration, and its warnings.
pub fn check(config: &Path) -> Result<(Config, Vec<String>), super::ConfigError> {
    Config::load(Some(config), &[], &Flags::default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_lines_follow_block_mappings() {
        let text = "# a comment\ndefaults:\n  profile: a\ntasks:\n  build:\n    \
                    description: |\n      not: a key of ours\n    \"profile\": b\n    \
                    command: {argv: [x]}\n    parameters:\n      - item: 1\n  deploy:\n";
        let l = KeyLines::of(text);
        assert_eq!(l.line(&[&["defaults", "profile"]]), Some(3));
        assert_eq!(l.line(&[&["tasks", "build"]]), Some(5));
        assert_eq!(l.line(&[&["tasks", "build", "profile"]]), Some(8));
        assert_eq!(l.line(&[&["tasks", "build", "command"]]), Some(9));
        assert_eq!(l.line(&[&["tasks", "deploy"]]), Some(12));
        assert_eq!(
            l.line(&[&["tasks", "deploy", "profile"], &["defaults", "profile"]]),
            Some(3)
        );
        assert_eq!(l.line(&[&["tasks", "build", "item"]]), None);
        assert_eq!(yaml_key("url: http://x"), Some("url".into()));
        assert_eq!(yaml_key("a:b"), None);
        assert_eq!(yaml_key("'k: 1': v"), Some("k: 1".into()));
    }

    fn kv(text: &str) -> Vec<(String, String)> {
        parse_env(text)
            .unwrap()
            .into_iter()
            .map(|v| (v.key, v.value))
            .collect()
    }

    #[test]
    fn env_lines_comments_quotes_and_export() {
        let got = kv("# a comment\n\
             \n\
             A=1\n\
             export B = two words  \n\
             C='single # not a comment'\n\
             D=\"double \\\"q\\\" \\n \\$HOME\" # trailing comment\n\
             E=plain # comment\n\
             F=a#b\n\
             G=\n\
             H= #only a comment\n\
             exported=x\n\
             I=\"multi\n\
             line\"\n\
             J=${NOT_EXPANDED}\n");
        assert_eq!(
            got,
            [
                ("A", "1"),
                ("B", "two words"),
                ("C", "single # not a comment"),
                ("D", "double \"q\" \n $HOME"),
                ("E", "plain"),
                ("F", "a#b"),
                ("G", ""),
                ("H", ""),
                ("exported", "x"),
                ("I", "multi\nline"),
                ("J", "${NOT_EXPANDED}"),
            ]
            .map(|(k, v)| (k.to_string(), v.to_string()))
        );
    }

    #[test]
    fn env_lines_are_numbered_and_errors_say_where() {
        let vars = parse_env("\n# x\nA=1\n\nB=2\n").unwrap();
        assert_eq!(vars.iter().map(|v| v.line).collect::<Vec<_>>(), [3, 5]);
        assert!(
            parse_env("A=1\nnot a line\n")
                .unwrap_err()
                .to_string()
                .starts_with("line 2:")
        );
        assert!(
            parse_env("1A=x\n")
                .unwrap_err()
                .to_string()
                .contains("not a variable name")
        );
        assert!(
            parse_env("A=\"open\n")
                .unwrap_err()
                .to_string()
                .contains("never closed")
        );
        assert!(
            parse_env("A='x' y\n")
                .unwrap_err()
                .to_string()
                .contains("after the closing quote")
        );
        // A BOM, CRLF line ends, a tab after export.
        assert_eq!(
            kv("\u{feff}A=1\r\nexport\tB=2\r\n"),
            [
                ("A".to_string(), "1".to_string()),
                ("B".to_string(), "2".to_string())
            ]
        );
    }

    #[test]
    fn secret_values_are_never_shown() {
        assert_eq!(shown_value("CUBE_API_KEY", "k"), None);
        assert_eq!(shown_value("CUBE_ADAPTER_AUDIT_HTTP_TOKEN", "t"), None);
        assert_eq!(shown_value("SOMETHING_ELSE", "v"), None);
        assert_eq!(shown_value("CUBE_ADAPTER_MY_SECRET", "v"), None);
        assert_eq!(
            shown_value(
                "CUBE_ADAPTER_STATE_BACKEND_URL",
                "rediss://:pw@redis.internal:6380/0"
            )
            .unwrap(),
            "rediss://redis.internal:6380…"
        );
        assert_eq!(shown_value("CUBE_ADAPTER_LOCK_TTL", "180").unwrap(), "180");
    }

    #[test]
    fn toml_pieces_render_as_sections() {
        let mut d = Doc::default();
        d.put(&["listen"], tstr("127.0.0.1:1")).unwrap();
        d.put(
            &["profiles", "offline-code"],
            toml::Value::Table(toml::Table::new()),
        )
        .unwrap();
        d.comment("a comment");
        let mut t = toml::Table::new();
        t.insert("issuer".into(), tstr("https://i"));
        d.put(
            &["auth", "oidc"],
            toml::Value::Array(vec![toml::Value::Table(t)]),
        )
        .unwrap();
        let back: toml::Table = toml::from_str(&d.text).unwrap();
        assert!(
            back["profiles"]["offline-code"]
                .as_table()
                .unwrap()
                .is_empty()
        );
        assert_eq!(
            back["auth"]["oidc"][0]["issuer"].as_str(),
            Some("https://i")
        );
        assert!(d.text.contains("# a comment\n"), "{}", d.text);
    }
}
