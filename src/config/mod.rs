//! Settings: defaults < `/etc/cube-adapter/config.toml` < `CUBE_ADAPTER_*`
//! environment < command-line flags. Unknown keys in the file are errors;
//! booleans must be booleans.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub(crate) mod egress;
pub(crate) mod import;
pub(crate) mod mcp;
pub(crate) mod paths;
pub(crate) mod presets;
/// `[[audit.sinks]]` (defined with the sinks, below this layer).
pub use crate::audit::sinks::def as sinks;
pub(crate) mod tasks;

pub use self::egress::{Credential, Destination, EgressSection, ProfileEgress};
pub use self::mcp::McpPolicy;
pub use self::presets::Preset;
pub use self::tasks::TaskTemplate;
use crate::audit::AuditMode;
use crate::embedded::{Isolation, TemplateConfig};

pub const DEFAULT_CONFIG: &str = "/etc/cube-adapter/config.toml";
pub const DEFAULT_STATE_DIR: &str = "/var/lib/cube-adapter";
pub const DEFAULT_LISTEN: &str = "127.0.0.1:18080";

/// The runtimes agents identify as (reference set; kept in `auth`, which
/// checks tokens' runtimes below this layer).
pub use crate::auth::RUNTIMES;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Address of the HTTPS listener.
    pub listen: SocketAddr,
    pub state_dir: PathBuf,
    /// Extra DNS names / IPs for the server certificate.
    pub server_names: Vec<String>,
    /// Serve plain HTTP (loopback only).
    pub insecure_plain_http: bool,
    /// Reference-format principals file (JSON).
    pub tokens_file: Option<PathBuf>,
    pub audit: AuditConfig,
    /// A CubeSandbox backend; absent: the embedded backend. The legacy
    /// form of `[backends.default]` (one or the other, not both).
    pub backend: Option<BackendSection>,
    /// The backends by name (`[backends.NAME]`): profiles name theirs
    /// (`backend`), else run on the one named `default`, or the only one.
    /// Empty: `[backend]` if set, else the embedded backend, as `default`.
    pub backends: BTreeMap<String, BackendDef>,
    pub embedded: EmbeddedSection,
    /// Profiles by name; the shipped ones unless the file defines any.
    pub profiles: BTreeMap<String, Profile>,
    /// Old-format (argon2) token checks that may wait for the argon2
    /// thread at once (tokens issued since schema 4 are verified by HMAC
    /// and never wait; see docs/operations.md, "Upgrading to schema 4").
    pub hashing_slots: usize,
    /// How often idle leases are collected (0: only by `POST /v1/admin/gc`).
    pub gc_interval_seconds: u64,
    /// Task templates by name (trusted tasks with approval).
    pub tasks: BTreeMap<String, TaskTemplate>,
    /// Governed MCP servers inside sandboxes, by name (`[mcp_policies.NAME]`);
    /// a profile binds one (`mcp_policy`).
    pub mcp_policies: BTreeMap<String, McpPolicy>,
    /// Template presets by name (`[presets.NAME]`): what a profile's
    /// sandboxes get before an agent does (`template_preset`).
    pub presets: BTreeMap<String, Preset>,
    /// What all profiles' brokered egress shares (`[egress]`).
    pub egress: EgressSection,
    /// Session recordings, all profiles together (`[recordings]`).
    pub recordings: RecordingsSection,
    /// How long GC keeps a plan that never ran (denied or expired) past
    /// its expiry. Plans that ran, and tasks with their receipts, are kept.
    pub plan_retention_seconds: u64,
    pub receipts: ReceiptsSection,
    /// Limits on the HTTPS listener's client connections.
    pub connections: ConnectionsSection,
    /// The web console (`/console`).
    pub console: ConsoleSection,
    /// Identities from elsewhere (`[auth]`): OIDC issuers.
    pub auth: AuthSection,
    /// MCP on the appliance (`/mcp`).
    pub mcp: McpSection,
    /// `/metrics` (`[metrics]`): who may scrape it. A change needs a
    /// restart.
    pub metrics: MetricsSection,
    /// Where leases, jobs, tokens and the audit journal are kept
    /// (`[store]`): the redb file in the state directory, or a PostgreSQL
    /// database several replicas share. A change needs a restart.
    pub store: StoreSection,
    /// Where the appliance's wall-clock time comes from: the system clock;
    /// in-process tests put a manual one here (`crate::clock::ManualClock`).
    /// Not configurable: never read from a file, and kept across reloads
    /// (the components hold the clock `app::serve` gave them).
    #[serde(skip)]
    pub clock: crate::clock::Clock,
}

/// Limits on the client connections of the HTTPS listener (`[connections]`;
/// `src/server.rs` applies them, `docs/security.md` explains them).
/// A change needs a restart.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ConnectionsSection {
    /// Open client connections at most, all addresses together. Connections
    /// over a cap are served `/healthz` and `/readyz` only (a small reserve:
    /// `HEALTH_RESERVE` in `server.rs`). Lowered at start to half the
    /// process's open-file limit when that is smaller.
    pub max_total: usize,
    /// Open connections at most from one source address (an IPv6 client:
    /// its /64). Loopback clients all share 127.0.0.1 and count only
    /// toward `max_total` (which also bounds this one).
    pub max_per_address: usize,
    /// How long a client has to send a complete request head: from the end
    /// of the TLS handshake for the first request, from its first byte for
    /// the next ones.
    pub header_read_timeout_seconds: u64,
    /// How long a keep-alive connection may wait for its next request. A
    /// request being answered (an event stream, a long exec) is never idle.
    pub idle_timeout_seconds: u64,
    /// How long a handler waits for the next piece of a request body before
    /// the request fails (a stall, not a total: large bodies sent steadily
    /// are never cut).
    pub body_read_timeout_seconds: u64,
}

impl Default for ConnectionsSection {
    fn default() -> Self {
        Self {
            max_total: 1024,
            max_per_address: 256,
            header_read_timeout_seconds: 10,
            idle_timeout_seconds: 60,
            body_read_timeout_seconds: 30,
        }
    }
}

impl ConnectionsSection {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.max_total == 0 || self.max_per_address == 0 {
            return Err(ConfigError::invalid(
                "connections",
                "max_total and max_per_address must be at least 1",
            ));
        }
        for (k, v) in [
            (
                "header_read_timeout_seconds",
                self.header_read_timeout_seconds,
            ),
            ("idle_timeout_seconds", self.idle_timeout_seconds),
            ("body_read_timeout_seconds", self.body_read_timeout_seconds),
        ] {
            // A day at most: longer is no timeout, and keeps deadlines in range.
            if !(1..=86_400).contains(&v) {
                return Err(ConfigError::Range {
                    at: "connections",
                    key: k,
                    min: 1,
                    max: 86_400,
                    got: v,
                });
            }
        }
        Ok(())
    }
}

/// MCP on the appliance (`[mcp]`; `src/mcp/http.rs`,
/// `docs/clients/README.md`). A change needs a restart.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct McpSection {
    /// How long an MCP session may go without a request before it ends
    /// (a session with a request or stream in progress is not idle).
    pub session_idle_timeout_seconds: u64,
}

impl Default for McpSection {
    fn default() -> Self {
        Self {
            session_idle_timeout_seconds: 300,
        }
    }
}

impl McpSection {
    fn validate(&self) -> Result<(), ConfigError> {
        // A minute at least (hosts pause between turns), a day at most.
        if !(60..=86_400).contains(&self.session_idle_timeout_seconds) {
            return Err(ConfigError::Range {
                at: "mcp",
                key: "session_idle_timeout_seconds",
                min: 60,
                max: 86_400,
                got: self.session_idle_timeout_seconds,
            });
        }
        Ok(())
    }
}

pub use crate::auth::settings::{
    ClaimNames, ClientCaIdentity, ClientCaSection, ConsoleOidc, OidcIssuer, check_fetch_url,
};

/// Identities from elsewhere (`[auth]`; `src/auth/oidc.rs`,
/// docs/operations.md "OIDC"). A change needs a restart.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct AuthSection {
    /// Identity providers whose JWTs are bearer tokens here
    /// (`[[auth.oidc]]`), each trusted for its own keys only.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub oidc: Vec<OidcIssuer>,
    /// The company's CA for client certificates (`[auth.client_ca]`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_ca: Option<ClientCaSection>,
}

impl AuthSection {
    fn validate(&self) -> Result<(), ConfigError> {
        if let Some(c) = &self.client_ca {
            c.validate()?;
        }
        let mut seen = std::collections::BTreeSet::new();
        for o in &self.oidc {
            o.validate()?;
            if !seen.insert(o.issuer.as_str()) {
                return Err(ConfigError::Conflict {
                    at: format!("auth.oidc {}", o.issuer),
                    why: "configured twice".into(),
                });
            }
        }
        Ok(())
    }
}

/// The web console (`[console]`; `src/console`, `docs/console.md`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct ConsoleSection {
    /// A session unused this long ends (checked to the minute).
    pub idle_timeout_seconds: u64,
    /// A session ends this long after sign-in, however busy.
    pub absolute_timeout_seconds: u64,
    /// Approval notifications (`[console.notify]`): absent, none are sent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub notify: Option<NotifySection>,
    /// Sign-in with the company's identity provider (`[console.oidc]`):
    /// absent, people sign in with local users only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub oidc: Option<ConsoleOidc>,
    /// Whether local users (`cube-adapter user`) may sign in with their
    /// password, to the console and with HTTP Basic. Turning it off needs
    /// `[console.oidc]`.
    pub local_users: bool,
}

impl Default for ConsoleSection {
    fn default() -> Self {
        Self {
            idle_timeout_seconds: 30 * 60,
            absolute_timeout_seconds: 12 * 3600,
            notify: None,
            oidc: None,
            local_users: true,
        }
    }
}

/// A webhook told when a plan needs approval (`[console.notify]`;
/// `console::notify`, docs/console.md "Approval notifications"). A change
/// needs a restart. Its `Debug` shows the URL's scheme and host only.
#[derive(Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct NotifySection {
    /// Where to POST: `https://…`, or `http://` to a loopback address only.
    /// Often a credential itself (a Slack or Teams webhook): never logged,
    /// and `config check` shows its scheme and host only.
    #[serde(serialize_with = "redacted_url")]
    pub url: String,
    /// PEM CA certificates to trust for `url` instead of the public web PKI.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// A file holding the shared secret (at least 16 bytes; surrounding
    /// whitespace ignored) for the `X-Cube-Signature` HMAC header. Absent:
    /// messages are not signed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_file: Option<PathBuf>,
    /// The console's public base URL for the link (`https://host:port`);
    /// default: as the Connect page finds it, on the listener's port (the
    /// first of `server_names`, else the listen address unless it is
    /// unspecified, else a name the certificate covers beyond loopback).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub console_url: Option<String>,
    /// Attempts per message, the first included (1..=10).
    #[serde(default = "notify_attempts")]
    pub max_attempts: u32,
    /// The wait before the first retry, doubled for each next one (with
    /// jitter), in milliseconds (10..=60000).
    #[serde(default = "notify_retry_ms")]
    pub retry_initial_ms: u64,
    /// How long one attempt may take (1..=60 seconds).
    #[serde(default = "notify_timeout")]
    pub timeout_seconds: u64,
    /// Messages waiting at most (1..=10000); more are dropped with a
    /// warning.
    #[serde(default = "notify_queue")]
    pub queue: usize,
}

fn notify_attempts() -> u32 {
    5
}
fn notify_retry_ms() -> u64 {
    1000
}
fn notify_timeout() -> u64 {
    10
}
fn notify_queue() -> usize {
    256
}

/// A webhook URL as shown (`config check`, `Debug`): its scheme, host and
/// port, never its path or query (often the credential).
fn redacted(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(u) => format!(
            "{}://{}{}/…",
            u.scheme(),
            u.host_str().unwrap_or(""),
            u.port().map(|p| format!(":{p}")).unwrap_or_default()
        ),
        Err(_) => "(invalid)".to_string(),
    }
}

fn redacted_url<S: serde::Serializer>(url: &str, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&redacted(url))
}

impl std::fmt::Debug for NotifySection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self {
            url,
            ca_file,
            secret_file,
            console_url,
            max_attempts,
            retry_initial_ms,
            timeout_seconds,
            queue,
        } = self;
        f.debug_struct("NotifySection")
            .field("url", &redacted(url))
            .field("ca_file", ca_file)
            .field("secret_file", secret_file)
            .field("console_url", console_url)
            .field("max_attempts", max_attempts)
            .field("retry_initial_ms", retry_initial_ms)
            .field("timeout_seconds", timeout_seconds)
            .field("queue", queue)
            .finish()
    }
}

impl NotifySection {
    /// The shape (no file is read): the URL, the base URL, the ranges.
    fn validate(&self) -> Result<(), NotifyError> {
        let u = url::Url::parse(&self.url).map_err(NotifyError::Url)?;
        match u.scheme() {
            "https" => {}
            "http" if crate::auth::settings::loopback_host(&u) => {}
            "http" => return Err(NotifyError::PlainHttp),
            other => return Err(NotifyError::Scheme(other.to_string())),
        }
        if u.host().is_none() {
            return Err(NotifyError::NoHost);
        }
        if !u.username().is_empty() || u.password().is_some() {
            return Err(NotifyError::Credentials);
        }
        if let Some(c) = &self.console_url {
            let b = url::Url::parse(c).map_err(NotifyError::ConsoleUrl)?;
            if !matches!(b.scheme(), "https" | "http") || b.host().is_none() {
                return Err(NotifyError::ConsoleUrlShape);
            }
            if b.query().is_some() || b.fragment().is_some() {
                return Err(NotifyError::ConsoleUrlQuery);
            }
        }
        for (key, min, max, got) in [
            ("max_attempts", 1, 10, u64::from(self.max_attempts)),
            ("retry_initial_ms", 10, 60_000, self.retry_initial_ms),
            ("timeout_seconds", 1, 60, self.timeout_seconds),
            ("queue", 1, 10_000, self.queue as u64),
        ] {
            if !(min..=max).contains(&got) {
                return Err(NotifyError::Range { key, min, max, got });
            }
        }
        Ok(())
    }

    /// What the sender needs from the files: the shared secret from
    /// `secret_file` (if configured) and the TLS client configuration for
    /// `url` (trusting `ca_file` if configured, else the public web PKI).
    /// Checked at config load too, so that `config check` and a start say
    /// what is wrong.
    pub fn client(&self) -> Result<(Option<Vec<u8>>, rustls::ClientConfig), NotifyError> {
        let secret = self.read_secret()?;
        let tls = match &self.ca_file {
            Some(f) => {
                let pem = std::fs::read(f).map_err(|source| NotifyError::ReadCa {
                    path: f.clone(),
                    source,
                })?;
                crate::tls::client_config(Some(&pem), None).map_err(|source| NotifyError::Ca {
                    path: f.clone(),
                    source,
                })?
            }
            None => crate::tls::client_config(None, None).map_err(NotifyError::Tls)?,
        };
        Ok((secret, tls))
    }

    /// The shared secret from `secret_file`, if one is configured.
    fn read_secret(&self) -> Result<Option<Vec<u8>>, NotifyError> {
        let Some(f) = &self.secret_file else {
            return Ok(None);
        };
        let raw = std::fs::read(f).map_err(|source| NotifyError::ReadSecret {
            path: f.clone(),
            source,
        })?;
        let s = raw.trim_ascii().to_vec();
        if s.len() < 16 {
            return Err(NotifyError::ShortSecret(f.clone()));
        }
        Ok(Some(s))
    }
}

impl ConsoleSection {
    fn validate(&self) -> Result<(), ConfigError> {
        // At least a minute (the idle clock is kept to the minute), at most
        // a day idle and a week in all.
        if !(60..=86_400).contains(&self.idle_timeout_seconds) {
            return Err(ConfigError::Range {
                at: "console",
                key: "idle_timeout_seconds",
                min: 60,
                max: 86_400,
                got: self.idle_timeout_seconds,
            });
        }
        if !(self.idle_timeout_seconds..=604_800).contains(&self.absolute_timeout_seconds) {
            return Err(ConfigError::invalid(
                "console",
                format!(
                    "absolute_timeout_seconds must be between idle_timeout_seconds ({}) and 604800 (got {})",
                    self.idle_timeout_seconds, self.absolute_timeout_seconds
                ),
            ));
        }
        if let Some(n) = &self.notify {
            n.validate()?;
            // The files too, so that `config check` and a start say so.
            n.client()?;
        }
        if let Some(o) = &self.oidc {
            o.validate()?;
        } else if !self.local_users {
            return Err(ConfigError::Missing {
                at: "console".into(),
                why: "local_users = false leaves no way to sign in without [console.oidc]".into(),
            });
        }
        Ok(())
    }
}

/// Which engine holds the store.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    /// `STATE/state.redb`: one process, no server (the default).
    #[default]
    Redb,
    /// A PostgreSQL database (`url`), shared by every replica.
    Postgres,
}

/// `[store]`. A change needs a restart.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct StoreSection {
    pub kind: StoreKind,
    /// `postgres://USER@HOST:PORT/DB?sslmode=verify-full` (or libpq's
    /// `key=value` form), without a password: that is in `password_file`.
    /// No `sslmode` means `verify-full`; `prefer` and `disable` are refused
    /// unless every host is loopback or a unix socket.
    pub url: Option<String>,
    /// The database password (one line; re-read for each new connection).
    pub password_file: Option<PathBuf>,
    /// The CA that issued the server's certificate (PEM). Without it, a
    /// TLS `sslmode` trusts the system's CA bundle.
    pub ca_file: Option<PathBuf>,
    /// Query connections at most (a replica; advisory locks have their own).
    pub pool_size: usize,
    /// How long opening a connection, or waiting for a free one, may take.
    pub connect_timeout_seconds: u64,
}

impl Default for StoreSection {
    fn default() -> Self {
        Self {
            kind: StoreKind::Redb,
            url: None,
            password_file: None,
            ca_file: None,
            pool_size: 16,
            connect_timeout_seconds: 5,
        }
    }
}

impl StoreSection {
    fn validate(&self) -> Result<(), ConfigError> {
        match self.kind {
            StoreKind::Redb => {
                if self.url.is_some() || self.password_file.is_some() || self.ca_file.is_some() {
                    return Err(ConfigError::Conflict {
                        at: "store".into(),
                        why: "url, password_file and ca_file are for kind = \"postgres\"".into(),
                    });
                }
            }
            StoreKind::Postgres => {
                let Some(url) = &self.url else {
                    return Err(ConfigError::Missing {
                        at: "store".into(),
                        why: "kind = \"postgres\" needs url".into(),
                    });
                };
                if url.trim().is_empty() {
                    return Err(ConfigError::Missing {
                        at: "store".into(),
                        why: "url is empty".into(),
                    });
                }
                // The URL parses, and its `sslmode` is allowed for its
                // hosts (no plain text off this machine).
                crate::store::pg::conn::check_url(url).map_err(ConfigError::StoreUrl)?;
                if self.pool_size == 0 || self.connect_timeout_seconds == 0 {
                    return Err(ConfigError::invalid(
                        "store",
                        "pool_size and connect_timeout_seconds must be at least 1",
                    ));
                }
            }
        }
        Ok(())
    }

    /// The connection settings of a PostgreSQL store.
    pub fn postgres(&self) -> Option<crate::store::pg::Settings> {
        if self.kind != StoreKind::Postgres {
            return None;
        }
        Some(crate::store::pg::Settings {
            url: self.url.clone().unwrap_or_default(),
            password_file: self.password_file.clone(),
            ca_file: self.ca_file.clone(),
            pool_size: self.pool_size,
            connect_timeout: std::time::Duration::from_secs(self.connect_timeout_seconds),
            application_name: "cube-adapter".into(),
        })
    }
}

/// `/metrics` (`[metrics]`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsSection {
    /// A file holding the token scrapers must send (`Authorization:
    /// Bearer …`; at least 16 bytes, surrounding whitespace ignored).
    /// Unset: `/metrics` is open, as the reference's is.
    pub token_file: Option<PathBuf>,
}

impl MetricsSection {
    /// The token, read from `token_file` (never logged: errors name the
    /// file, not its content).
    pub fn token(&self) -> Result<Option<Vec<u8>>, TokenFileError> {
        let Some(f) = &self.token_file else {
            return Ok(None);
        };
        let raw = std::fs::read(f).map_err(|source| TokenFileError::Read {
            path: f.clone(),
            source,
        })?;
        let t = raw.trim_ascii().to_vec();
        if t.len() < 16 {
            return Err(TokenFileError::Short(f.clone()));
        }
        if t.iter().any(|b| !b.is_ascii_graphic()) {
            return Err(TokenFileError::NotToken(f.clone()));
        }
        Ok(Some(t))
    }
}

/// Signed execution receipts.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReceiptsSection {
    /// A key (at least 32 bytes) for the reference-compatible HS256
    /// signature, to share with verifiers that use the reference's tool.
    /// Without it the key is derived from the appliance's own secret.
    /// Receipts are always signed with Ed25519 too (the public key is
    /// `STATE/receipt-ed25519.pub`).
    pub hmac_key_file: Option<PathBuf>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuditConfig {
    pub mode: AuditMode,
    /// What a start does with intents an earlier run left without an
    /// outcome (a crash): `resolve` them, or `block` sandbox effects until
    /// `cube-adapter audit reconcile` (the reference's behaviour).
    pub on_crash: OnCrash,
    /// `[[audit.sinks]]`: copies of the journal delivered elsewhere.
    pub sinks: Vec<sinks::SinkDef>,
}

/// `[audit] on_crash` (docs/operations.md, "After a crash").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnCrash {
    /// Ask the backend what is true where it can know, record `uncertain`
    /// where it cannot, each as an `audit_recover` event; then serve.
    #[default]
    Resolve,
    /// Refuse sandbox effects until an operator reconciles offline.
    Block,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendSection {
    /// CubeAPI (plain HTTP on port 3000 in a stock install).
    pub api_url: String,
    /// CubeProxy: required (CubeAPI serves no data plane). A URL, or
    /// `{ url = "https://<domain>", dial = "host:port" }` to put the sandbox
    /// host in the URL (TLS SNI) and connect to `dial`.
    #[serde(default)]
    pub proxy_url: Option<crate::cube::client::ProxyUrl>,
    #[serde(default = "default_domain")]
    pub domain: String,
    #[serde(default)]
    pub api_key_file: Option<PathBuf>,
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    #[serde(default)]
    pub client_cert_file: Option<PathBuf>,
    #[serde(default)]
    pub client_key_file: Option<PathBuf>,
    #[serde(default)]
    pub insecure_plain_http: bool,
    /// The template of the profiles on this backend that name none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
}

pub use crate::store::leases::DEFAULT_BACKEND;

/// One backend of `[backends.NAME]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum BackendDef {
    /// A CubeSandbox cluster: CubeAPI, CubeProxy, credentials.
    Cubesandbox(BackendSection),
    /// The embedded backend (at most one), with `[embedded]`'s settings but
    /// where this names its own.
    Embedded(EmbeddedBackend),
}

impl BackendDef {
    pub fn is_embedded(&self) -> bool {
        matches!(self, Self::Embedded(_))
    }

    /// The template of the profiles on it that name none.
    pub fn template(&self) -> Option<&str> {
        match self {
            Self::Cubesandbox(b) => b.template.as_deref(),
            Self::Embedded(e) => e.template.as_deref(),
        }
    }

    /// Whether two definitions describe the same backend (a reload that
    /// changes one replaces its client).
    pub fn same_as(&self, other: &Self) -> bool {
        serde_json::to_value(self).ok() == serde_json::to_value(other).ok()
    }
}

/// `[backends.NAME] kind = "embedded"`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EmbeddedBackend {
    /// Where its sandboxes, snapshots and volumes live (default
    /// `[embedded] state_dir`, else `STATE/embedded`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state_dir: Option<PathBuf>,
    /// Its templates, besides the built-in ones (default `[embedded]
    /// templates`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub templates: Vec<TemplateConfig>,
    /// The template of the profiles on it that name none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
}

impl BackendSection {
    fn validate(&self) -> Result<(), BackendSectionError> {
        if self.client_cert_file.is_some() != self.client_key_file.is_some() {
            return Err(BackendSectionError::HalfClientCert);
        }
        let Some(p) = &self.proxy_url else {
            return Err(BackendSectionError::NoProxyUrl {
                domain: self.domain.clone(),
            });
        };
        if p.url().trim_end_matches('/') == self.api_url.trim_end_matches('/') && p.dial().is_none()
        {
            return Err(BackendSectionError::ProxyIsApi {
                api_url: self.api_url.clone(),
            });
        }
        crate::cube::CubeClient::check_urls(
            &self.api_url,
            p,
            &self.domain,
            self.insecure_plain_http,
        )
        .map_err(BackendSectionError::Urls)?;
        Ok(())
    }
}

fn default_domain() -> String {
    "cube.app".into()
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EmbeddedSection {
    /// Where sandboxes and snapshots live (default `STATE/embedded`).
    pub state_dir: Option<PathBuf>,
    pub isolation: Isolation,
    pub templates: Vec<TemplateConfig>,
    pub memory_mb: u64,
    pub max_processes: u64,
    pub cpus: f64,
    /// Behave as a real CubeSandbox deployment does where the embedded
    /// backend is otherwise kinder (500/130404 for an unknown template,
    /// an idle clock that ignores calls in flight, the API key forwarded to
    /// envd, deadline end-streams): for testing clients against production
    /// behaviour. The test suite turns it on.
    pub faithful: bool,
    /// With `faithful`: how long a pause takes (ms).
    pub faithful_pause_ms: u64,
    /// With `faithful`: stand in for this older envd version (e.g. "0.5.1"):
    /// reported as `envdVersion`, and refusing what it refuses.
    pub faithful_envd_version: Option<String>,
    /// A sandbox's own init ends it when no backend has run for its idle
    /// timeout plus this long (s), and its lifecycle kills at the timeout
    /// (docs/security.md, "Orphans").
    pub orphan_grace_seconds: u64,
    /// New sandboxes are refused (503 `storage_low`) while the disk of the
    /// backend's or the appliance's state directory has less than this
    /// free (MiB); they are made again as soon as space returns. 0: no
    /// check.
    pub min_free_mb: u64,
    /// Each sandbox's `/workspace`, `/tmp` and `/root` live on a disk of
    /// its own of this size (MiB), where a profile's `disk_mb` names none:
    /// filling it is "No space left on device" inside, never a full host
    /// disk (docs/security.md, "Disk"). 0: no disk of its own. Needs the
    /// service to run as root.
    pub disk_mb: u64,
}

impl Default for EmbeddedSection {
    fn default() -> Self {
        Self {
            state_dir: None,
            isolation: Isolation::Namespaces,
            templates: vec![],
            memory_mb: 2048,
            max_processes: 512,
            cpus: 1.0,
            faithful: false,
            faithful_pause_ms: 0,
            faithful_envd_version: None,
            orphan_grace_seconds: 60,
            min_free_mb: 512,
            disk_mb: crate::embedded::disk::DEFAULT_MB,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Lifecycle {
    pub on_timeout: String,
    pub auto_resume: bool,
}

/// An operator-owned profile (the reference's fields).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Profile {
    /// The backend that runs it (`[backends.NAME]`); none: `default`, or
    /// the only one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    pub template: String,
    pub sandbox_timeout_seconds: u64,
    pub max_command_seconds: u64,
    pub lease_idle_ttl_seconds: u64,
    pub max_active_leases_per_tenant: u32,
    pub max_jobs_per_lease: u32,
    pub allow_internet_access: bool,
    /// Which destinations sandboxes may reach (`allowOut` beats `denyOut`
    /// beats `allow_internet_access`).
    pub network: ProfileNetwork,
    /// The size of each sandbox's own disk (MiB); 0: the backend's default
    /// (`[embedded] disk_mb`).
    pub disk_mb: u64,
    pub allowed_runtimes: Vec<String>,
    pub checkpoints_enabled: bool,
    pub allow_checkpoint_with_mounts: bool,
    pub lifecycle: Lifecycle,
    /// Keep the sandbox alive while jobs or PTYs run.
    pub keepalive_enabled: bool,
    /// Interactive terminals (PTYs) may be opened on leases of this profile.
    pub ptys_enabled: bool,
    /// An admin may approve a task plan they requested themselves, for task
    /// templates of this profile (off: nobody approves their own plan).
    pub admin_self_approval: bool,
    pub max_keepalive_seconds: u64,
    /// A volume mounted in its sandboxes (the reference's `workspace`).
    /// Not written when it is the default: profile digests made before
    /// workspaces stay the same.
    #[serde(skip_serializing_if = "Workspace::is_default")]
    pub workspace: Workspace,
    /// The governed MCP server its sandboxes run (`[mcp_policies.NAME]`),
    /// called through `cube_mcp_call`. Such a profile has public traffic
    /// off and no checkpoints. Not written when unset: profile digests made
    /// before MCP policies stay the same.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mcp_policy: Option<String>,
    /// The preset its sandboxes get (`[presets.NAME]`). Not written when
    /// unset, as `mcp_policy`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub template_preset: Option<String>,
    /// What its sandboxes reach through the appliance's egress proxy, by
    /// name, and the credentials the proxy adds (`config::egress`). Not
    /// written when unset, as `mcp_policy`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub egress: Option<ProfileEgress>,
    /// How long its sessions' recordings are kept
    /// (`[profiles.NAME.recordings]`). Not written when unset (the
    /// defaults), as `mcp_policy`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recordings: Option<ProfileRecordings>,
}

/// `[profiles.NAME.recordings]`: the retention of a profile's session
/// recordings (`docs/recordings.md`). GC removes a sealed recording older
/// than `retain_days`, and a lease's oldest sealed recordings while its
/// recordings hold more than `max_lease_bytes`; never one under a legal
/// hold, never one still being written.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct ProfileRecordings {
    /// Off: its PTYs and jobs are not recorded (the journal still has
    /// what it always has: digests, sizes, outcomes).
    pub enabled: bool,
    /// Also record every synchronous exec (`POST /v1/leases/{ref}/exec`):
    /// its output, each stream, as it came (off by default).
    pub execs: bool,
    pub retain_days: u64,
    pub max_lease_bytes: u64,
}

impl Default for ProfileRecordings {
    fn default() -> Self {
        Self {
            enabled: true,
            execs: false,
            retain_days: 90,
            max_lease_bytes: 1024 * 1024 * 1024,
        }
    }
}

/// `[recordings]`: what all recordings share. GC removes the oldest
/// sealed recordings (not held) while all of them hold more than
/// `max_total_bytes`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct RecordingsSection {
    pub max_total_bytes: u64,
}

impl Default for RecordingsSection {
    fn default() -> Self {
        Self {
            max_total_bytes: 20 * 1024 * 1024 * 1024,
        }
    }
}

/// How a profile's sandboxes keep their files (`[profiles.NAME.workspace]`,
/// the reference's §3.7).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct Workspace {
    pub mode: WorkspaceMode,
    /// Where the volume is mounted.
    pub mount_path: String,
    /// `existing-volume`: the operator's volume (never destroyed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub volume_id: Option<String>,
    /// `per-session-volume`: a fixed name instead of one per session.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub volume_name: Option<String>,
    /// `per-session-volume`: the backend's volume driver.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub driver: Option<String>,
    pub read_only: bool,
    /// Keep an owned volume when its lease is killed or collected.
    pub retain_on_kill: bool,
    /// `per-session-volume`: the volume's size (MiB); 0: the backend's
    /// default (the embedded backend: a directory, no limit).
    pub size_mb: u64,
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum WorkspaceMode {
    #[default]
    Ephemeral,
    ExistingVolume,
    PerSessionVolume,
}

impl Default for Workspace {
    fn default() -> Self {
        Self {
            mode: WorkspaceMode::Ephemeral,
            mount_path: "/workspace".into(),
            volume_id: None,
            volume_name: None,
            driver: None,
            read_only: false,
            retain_on_kill: true,
            size_mb: 0,
        }
    }
}

impl Workspace {
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }

    /// Whether sandboxes of different leases mount the same volume: the
    /// operator's (`existing-volume`), or one of a fixed name
    /// (`per-session-volume` with `volume_name`). A trusted task may not use
    /// such a workspace (docs/tasks.md, "Workspaces").
    pub fn is_shared(&self) -> bool {
        match self.mode {
            WorkspaceMode::Ephemeral => false,
            WorkspaceMode::ExistingVolume => true,
            WorkspaceMode::PerSessionVolume => self.volume_name.is_some(),
        }
    }

    /// What makes the workspace shared, for messages.
    pub fn sharing(&self) -> String {
        match (&self.volume_id, &self.volume_name) {
            (Some(v), _) if self.mode == WorkspaceMode::ExistingVolume => {
                format!("mode existing-volume (volume_id {v:?})")
            }
            (_, Some(v)) => format!("mode per-session-volume with volume_name {v:?}"),
            _ => "a volume of its own per lease".into(),
        }
    }

    fn validate(&self, profile: &str) -> Result<(), ConfigError> {
        let at = || format!("profile {profile}");
        let e = |m: String| {
            Err(ConfigError::Invalid {
                at: at(),
                why: format!("workspace.{m}"),
            })
        };
        let volume_name_ok = |n: &str| {
            !n.is_empty()
                && n.len() <= 128
                && n.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        };
        if !self.mount_path.starts_with('/')
            || self.mount_path == "/"
            || self.mount_path.split('/').any(|c| c == ".." || c == ".")
        {
            return e(format!(
                "mount_path must be an absolute path below / (got {:?})",
                self.mount_path
            ));
        }
        match self.mode {
            WorkspaceMode::Ephemeral => {}
            WorkspaceMode::ExistingVolume => match &self.volume_id {
                Some(v) if volume_name_ok(v) => {}
                Some(v) => {
                    return e(format!(
                        "volume_id {v:?} must match ^[A-Za-z0-9_-]{{1,128}}$"
                    ));
                }
                None => {
                    return Err(ConfigError::Missing {
                        at: at(),
                        why: "workspace.volume_id is required with mode existing-volume".into(),
                    });
                }
            },
            WorkspaceMode::PerSessionVolume => {
                if let Some(v) = &self.volume_name
                    && !volume_name_ok(v)
                {
                    return e(format!(
                        "volume_name {v:?} must match ^[A-Za-z0-9_-]{{1,128}}$"
                    ));
                }
                if self.volume_id.is_some() {
                    return Err(ConfigError::Conflict {
                        at: at(),
                        why: "workspace.volume_id belongs to mode existing-volume".into(),
                    });
                }
            }
        }
        if self.mode != WorkspaceMode::PerSessionVolume && self.size_mb > 0 {
            return Err(ConfigError::Conflict {
                at: at(),
                why: "workspace.size_mb applies to mode per-session-volume only".into(),
            });
        }
        Ok(())
    }
}

impl Profile {
    /// Whether its sandboxes have network access (the internet, or an
    /// `allow_out` entry): on the embedded backend, they need `pasta` and
    /// `nft` on the host.
    pub fn network_access(&self) -> bool {
        self.allow_internet_access || !self.network.allow_out.is_empty()
    }
}

impl Default for Profile {
    fn default() -> Self {
        Self {
            backend: None,
            // The embedded backend's `minimal` (`embedded::sandbox::MINIMAL_TEMPLATE`).
            template: "minimal".into(),
            sandbox_timeout_seconds: 300,
            max_command_seconds: 120,
            lease_idle_ttl_seconds: 3600,
            max_active_leases_per_tenant: 8,
            max_jobs_per_lease: 8,
            allow_internet_access: false,
            network: ProfileNetwork::default(),
            disk_mb: 0,
            allowed_runtimes: RUNTIMES.iter().map(|s| s.to_string()).collect(),
            checkpoints_enabled: false,
            allow_checkpoint_with_mounts: false,
            lifecycle: Lifecycle {
                on_timeout: "pause".into(),
                auto_resume: true,
            },
            keepalive_enabled: false,
            ptys_enabled: true,
            admin_self_approval: false,
            max_keepalive_seconds: 3600,
            workspace: Workspace::default(),
            mcp_policy: None,
            template_preset: None,
            egress: None,
            recordings: None,
        }
    }
}

/// A profile's egress policy, sent to the backend as CubeSandbox's
/// `network.allowOut` and `network.denyOut` (`cube-protocol.md` §1.16): a
/// destination named in `allow_out` is reachable; else one named in
/// `deny_out` is not; else `allow_internet_access` decides. Entries are
/// IPv4 addresses or CIDRs (a real CubeSandbox also takes domain names in
/// `allow_out`; the embedded backend takes `:PORT` or `:LOW-HIGH` after an
/// address or CIDR instead).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ProfileNetwork {
    pub allow_out: Vec<String>,
    pub deny_out: Vec<String>,
}

/// What internet access does not include unless `allow_out` names it: the
/// private, shared (carrier-grade NAT) and link-local ranges, where a jump
/// host's own networks and cloud metadata services live.
pub const DEFAULT_DENY_OUT: &[&str] = &[
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",
    "169.254.0.0/16",
];

impl Default for ProfileNetwork {
    fn default() -> Self {
        Self {
            allow_out: vec![],
            deny_out: DEFAULT_DENY_OUT.iter().map(|s| s.to_string()).collect(),
        }
    }
}

impl ProfileNetwork {
    fn validate(&self, profile: &str, embedded: bool) -> Result<(), ConfigError> {
        for (key, list) in [("allow_out", &self.allow_out), ("deny_out", &self.deny_out)] {
            for e in list {
                let bad = e.trim().is_empty() || e.chars().any(char::is_whitespace);
                if bad {
                    return Err(ConfigError::Invalid {
                        at: format!("profile {profile}"),
                        why: format!("network.{key} entry {e:?} is empty or has spaces"),
                    });
                }
                if embedded {
                    crate::embedded::egress::Dest::parse(e).map_err(|source| {
                        ConfigError::Egress {
                            profile: profile.to_string(),
                            key,
                            source,
                        }
                    })?;
                }
            }
        }
        Ok(())
    }
}

/// The profiles shipped with the appliance.
pub fn shipped_profiles() -> BTreeMap<String, Profile> {
    let offline = Profile::default();
    let persistent = Profile {
        sandbox_timeout_seconds: 3600,
        lease_idle_ttl_seconds: 8 * 3600,
        keepalive_enabled: true,
        ..Profile::default()
    };
    let checkpoint = Profile {
        checkpoints_enabled: true,
        ..Profile::default()
    };
    BTreeMap::from([
        ("offline-code".to_string(), offline),
        ("persistent-code".to_string(), persistent),
        ("checkpoint-code".to_string(), checkpoint),
    ])
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: DEFAULT_LISTEN
                .parse()
                .unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 18080))),
            state_dir: PathBuf::from(DEFAULT_STATE_DIR),
            server_names: vec![],
            insecure_plain_http: false,
            tokens_file: None,
            audit: AuditConfig::default(),
            backend: None,
            backends: BTreeMap::new(),
            embedded: EmbeddedSection::default(),
            profiles: BTreeMap::new(),
            hashing_slots: 2,
            gc_interval_seconds: 30,
            tasks: BTreeMap::new(),
            mcp_policies: BTreeMap::new(),
            presets: BTreeMap::new(),
            egress: EgressSection::default(),
            recordings: RecordingsSection::default(),
            plan_retention_seconds: 24 * 3600,
            receipts: ReceiptsSection::default(),
            connections: ConnectionsSection::default(),
            console: ConsoleSection::default(),
            auth: AuthSection::default(),
            mcp: McpSection::default(),
            metrics: MetricsSection::default(),
            store: StoreSection::default(),
            clock: crate::clock::Clock::System,
        }
    }
}

/// Command-line overrides (highest precedence).
#[derive(Debug, Clone, Default)]
pub struct Flags {
    pub state_dir: Option<PathBuf>,
    pub listen: Option<SocketAddr>,
    pub insecure_plain_http: bool,
}

pub fn valid_profile_name(n: &str) -> bool {
    let mut c = n.chars();
    n.len() <= 63
        && c.next().is_some_and(|f| f.is_ascii_lowercase())
        && c.all(|x| x.is_ascii_lowercase() || x.is_ascii_digit() || x == '-')
}

impl Config {
    /// Load with the full precedence order. `file`: the config path; a
    /// missing file is fine only when it is the default path.
    pub fn load(
        file: Option<&Path>,
        env: &[(String, String)],
        flags: &Flags,
    ) -> Result<(Self, Vec<String>), ConfigError> {
        let mut warnings = vec![];
        let path = file
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_CONFIG));
        // Profiles the file gives a template: the others take their
        // backend's (`template` of `[backends.NAME]`), if it names one.
        let mut explicit_templates = std::collections::BTreeSet::new();
        let mut file_text: Option<String> = None;
        let mut cfg = match std::fs::read_to_string(&path) {
            Ok(text) => {
                let cfg = toml::from_str::<Config>(&text).map_err(|source| ConfigError::Parse {
                    path: path.clone(),
                    source,
                })?;
                if let Ok(raw) = toml::from_str::<toml::Table>(&text)
                    && let Some(toml::Value::Table(ps)) = raw.get("profiles")
                {
                    for (name, p) in ps {
                        if p.get("template").is_some() {
                            explicit_templates.insert(name.clone());
                        }
                    }
                }
                file_text = Some(text);
                cfg
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && file.is_none() => {
                Config::default()
            }
            Err(source) => return Err(ConfigError::Read { path, source }),
        };
        let mut bind: Option<String> = None;
        let mut port: Option<String> = None;
        let mut oidc: BTreeMap<&str, String> = BTreeMap::new();
        for (k, v) in env {
            let Some(name) = k.strip_prefix("CUBE_ADAPTER_") else {
                continue;
            };
            match name {
                "LISTEN" => {
                    cfg.listen = v.parse().map_err(|source| ConfigError::EnvAddress {
                        var: k.clone(),
                        source,
                    })?
                }
                "BIND" => bind = Some(v.clone()),
                "PORT" => port = Some(v.clone()),
                "STATE_DIR" => cfg.state_dir = PathBuf::from(v),
                "AUDIT_MODE" => {
                    cfg.audit.mode = match v.as_str() {
                        "required" => AuditMode::Required,
                        "best_effort" => AuditMode::BestEffort,
                        other => {
                            return Err(ConfigError::EnvValue {
                                var: k.clone(),
                                value: other.to_string(),
                                expected: "required or best_effort",
                            });
                        }
                    }
                }
                "TOKENS_FILE" => cfg.tokens_file = Some(PathBuf::from(v)),
                // The reference's one OIDC issuer.
                // (and this appliance's ceilings for it, which the
                // reference did not have: OIDC_TENANTS, OIDC_ALLOWED_ROLES)
                "OIDC_JWKS_URL" | "OIDC_ISSUER" | "OIDC_AUDIENCE" | "OIDC_TENANT_CLAIM"
                | "OIDC_ROLES_CLAIM" | "OIDC_TENANTS" | "OIDC_ALLOWED_ROLES" => {
                    oidc.insert(name, v.clone());
                }
                "INSECURE_PLAIN_HTTP" => cfg.insecure_plain_http = parse_bool(k, v)?,
                // Read elsewhere (secrets, clients of the appliance).
                "TOKEN" | "TOKEN_FILE" | "URL" | "CA_FILE" | "CLIENT_CERT_FILE"
                | "CLIENT_KEY_FILE" | "PROFILE" | "RUNTIME" => {}
                "FAILPOINT" if cfg!(any(feature = "failpoints", debug_assertions)) => {}
                "FAILPOINT" => warnings.push(format!(
                    "{k} ignored: this build has no failpoints (the `failpoints` feature)"
                )),
                _ => warnings.push(format!("unknown environment variable {k} ignored")),
            }
        }
        if !oidc.is_empty() {
            let (Some(issuer), Some(audience)) =
                (oidc.get("OIDC_ISSUER"), oidc.get("OIDC_AUDIENCE"))
            else {
                return Err(ConfigError::Missing {
                    at: "CUBE_ADAPTER_OIDC_*".into(),
                    why:
                        "both CUBE_ADAPTER_OIDC_ISSUER and CUBE_ADAPTER_OIDC_AUDIENCE are required"
                            .into(),
                });
            };
            let mut claims = ClaimNames::default();
            if let Some(t) = oidc.get("OIDC_TENANT_CLAIM") {
                claims.tenant = t.clone();
            }
            if let Some(r) = oidc.get("OIDC_ROLES_CLAIM") {
                claims.roles = r.clone();
            }
            // The ceilings: from the variables, else from the file's entry
            // for the same issuer (which the variables replace).
            let split = |v: &String| -> Vec<String> {
                v.split([',', ' '])
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(String::from)
                    .collect()
            };
            let same = cfg.auth.oidc.iter().find(|o| &o.issuer == issuer);
            let (tenant, tenants) = match oidc.get("OIDC_TENANTS") {
                Some(v) => (None, split(v)),
                None => same
                    .map(|o| (o.tenant.clone(), o.tenants.clone()))
                    .unwrap_or_default(),
            };
            let allowed_roles = match (oidc.get("OIDC_ALLOWED_ROLES"), same) {
                (Some(v), _) => split(v),
                (None, Some(o)) => o.allowed_roles.clone(),
                (None, None) => vec!["agent".into()],
            };
            cfg.auth.oidc.retain(|o| &o.issuer != issuer);
            cfg.auth.oidc.push(OidcIssuer {
                issuer: issuer.clone(),
                audience: audience.clone(),
                // The reference's.
                algorithms: ["RS256", "RS384", "RS512", "ES256", "ES384"]
                    .map(String::from)
                    .to_vec(),
                jwks_url: oidc.get("OIDC_JWKS_URL").cloned(),
                ca_file: None,
                leeway_seconds: crate::auth::settings::oidc_leeway(),
                claims,
                tenant,
                tenants,
                allowed_roles,
            });
        }
        if bind.is_some() || port.is_some() {
            let host = bind.unwrap_or_else(|| cfg.listen.ip().to_string());
            let port = port.unwrap_or_else(|| cfg.listen.port().to_string());
            cfg.listen =
                format!("{host}:{port}")
                    .parse()
                    .map_err(|source| ConfigError::EnvAddress {
                        var: "CUBE_ADAPTER_BIND/PORT".into(),
                        source,
                    })?;
        }
        if let Some(d) = &flags.state_dir {
            cfg.state_dir = d.clone();
        }
        if let Some(l) = flags.listen {
            cfg.listen = l;
        }
        if flags.insecure_plain_http {
            cfg.insecure_plain_http = true;
        }
        if cfg.profiles.is_empty() {
            cfg.profiles = shipped_profiles();
        }
        let defs = cfg.backend_defs();
        let fills: Vec<(String, String)> = cfg
            .profiles
            .iter()
            .filter(|(name, _)| !explicit_templates.contains(*name))
            .filter_map(|(name, p)| {
                let t = defs.get(cfg.profile_backend(p)?)?.template()?;
                Some((name.clone(), t.to_string()))
            })
            .collect();
        for (name, t) in fills {
            if let Some(p) = cfg.profiles.get_mut(&name) {
                p.template = t;
            }
        }
        for (name, p) in &cfg.profiles {
            let creds = p.egress.iter().flat_map(|e| e.credentials.iter());
            for (dest, c) in creds {
                if let Err(e) = std::fs::metadata(&c.secret_file) {
                    warnings.push(format!(
                        "profile {name}: egress.credentials.{dest:?}: secret_file {}: {e}: requests to it will fail until it can be read",
                        c.secret_file.display()
                    ));
                }
            }
        }
        for (name, pr) in &cfg.presets {
            if let Err(e) = pr.validate(name, true) {
                warnings.push(format!(
                    "{e}: acquires with this preset will fail until it can"
                ));
            }
        }
        if let Err(e) = cfg.validate() {
            // Where in the file, for what a person has to find there.
            let table = match &e {
                ConfigError::Preset(p) => Some(format!("presets.{}", p.preset())),
                _ => None,
            };
            let line = table
                .zip(file_text.as_deref())
                .and_then(|(t, text)| table_line(text, &t));
            return Err(match line {
                Some(line) => ConfigError::At {
                    path,
                    line,
                    source: Box::new(e),
                },
                None => e,
            });
        }
        Ok((cfg, warnings))
    }

    /// The backends by name: `[backends]`, else `[backend]` or the
    /// embedded backend as `default`.
    pub fn backend_defs(&self) -> BTreeMap<String, BackendDef> {
        if !self.backends.is_empty() {
            return self.backends.clone();
        }
        let def = match &self.backend {
            Some(b) => BackendDef::Cubesandbox(b.clone()),
            None => BackendDef::Embedded(EmbeddedBackend::default()),
        };
        BTreeMap::from([(DEFAULT_BACKEND.to_string(), def)])
    }

    /// The name of the backend a profile runs on: its own, else `default`,
    /// else the only one (`None`: it names none and there is no telling).
    pub fn profile_backend<'a>(&'a self, p: &'a Profile) -> Option<&'a str> {
        if let Some(b) = &p.backend {
            return Some(b);
        }
        if self.backends.is_empty() || self.backends.contains_key(DEFAULT_BACKEND) {
            return Some(DEFAULT_BACKEND);
        }
        match self.backends.len() {
            1 => self.backends.keys().next().map(String::as_str),
            _ => None,
        }
    }

    /// The embedded backend's name and definition, if one is configured.
    pub fn embedded_backend(&self) -> Option<(String, EmbeddedBackend)> {
        self.backend_defs().into_iter().find_map(|(n, d)| match d {
            BackendDef::Embedded(e) => Some((n, e)),
            BackendDef::Cubesandbox(_) => None,
        })
    }

    fn validate_backends(&self) -> Result<(), ConfigError> {
        if self.backend.is_some() && !self.backends.is_empty() {
            return Err(ConfigError::BothBackendForms);
        }
        let mut embedded = vec![];
        for (name, d) in &self.backends {
            if !valid_profile_name(name) {
                return Err(ConfigError::Name {
                    what: "backend",
                    name: name.clone(),
                });
            }
            match d {
                BackendDef::Cubesandbox(b) => {
                    b.validate().map_err(|source| ConfigError::Backends {
                        name: name.clone(),
                        source,
                    })?
                }
                BackendDef::Embedded(_) => embedded.push(name.as_str()),
            }
        }
        if embedded.len() > 1 {
            return Err(ConfigError::Conflict {
                at: "backends".into(),
                why: format!(
                    "at most one embedded backend (found {})",
                    embedded.join(", ")
                ),
            });
        }
        let defs = self.backend_defs();
        for (name, p) in &self.profiles {
            match self.profile_backend(p) {
                Some(b) if defs.contains_key(b) => {}
                Some(b) => {
                    return Err(ConfigError::Invalid {
                        at: format!("profile {name}"),
                        why: format!(
                            "backend '{b}' is not configured (backends: {})",
                            defs.keys().cloned().collect::<Vec<_>>().join(", ")
                        ),
                    });
                }
                None => {
                    return Err(ConfigError::Missing {
                        at: format!("profile {name}"),
                        why: format!(
                            "name its backend (one of {}); with several backends and none named default, every profile names one",
                            defs.keys().cloned().collect::<Vec<_>>().join(", ")
                        ),
                    });
                }
            }
        }
        Ok(())
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.insecure_plain_http && !self.listen.ip().is_loopback() {
            return Err(ConfigError::PlainHttp {
                listen: self.listen,
            });
        }
        sinks::validate(&self.audit.sinks)?;
        for (name, p) in &self.profiles {
            if !valid_profile_name(name) {
                return Err(ConfigError::Name {
                    what: "profile",
                    name: name.clone(),
                });
            }
            let at = || format!("profile {name}");
            if p.template.is_empty() {
                return Err(ConfigError::Missing {
                    at: at(),
                    why: "template is required".into(),
                });
            }
            for r in &p.allowed_runtimes {
                if !RUNTIMES.contains(&r.as_str()) {
                    return Err(ConfigError::Invalid {
                        at: at(),
                        why: format!("unknown runtime '{r}' (one of {})", RUNTIMES.join(", ")),
                    });
                }
            }
            if !["pause", "kill"].contains(&p.lifecycle.on_timeout.as_str()) {
                return Err(ConfigError::invalid(
                    at(),
                    "lifecycle.on_timeout must be pause or kill",
                ));
            }
            p.workspace.validate(name)?;
            let embedded = self
                .profile_backend(p)
                .and_then(|b| self.backend_defs().remove(b))
                .is_some_and(|d| d.is_embedded());
            p.network.validate(name, embedded)?;
            if p.disk_mb > 0 && p.disk_mb < crate::embedded::disk::MIN_MB {
                return Err(ConfigError::Invalid {
                    at: at(),
                    why: format!(
                        "disk_mb must be 0 (the backend's default) or at least {}",
                        crate::embedded::disk::MIN_MB
                    ),
                });
            }
            if p.sandbox_timeout_seconds == 0 || p.max_command_seconds == 0 {
                return Err(ConfigError::invalid(
                    at(),
                    "timeouts must be at least 1 second",
                ));
            }
            if let Some(m) = &p.mcp_policy {
                if !self.mcp_policies.contains_key(m) {
                    return Err(ConfigError::Missing {
                        at: at(),
                        why: format!("mcp_policy '{m}' is not defined ([mcp_policies.{m}])"),
                    });
                }
                // The gateway's port must not be reachable from outside,
                // nor the server reach out.
                if p.network_access() || p.egress.is_some() {
                    return Err(ConfigError::Conflict {
                        at: at(),
                        why: "mcp_policy needs public traffic off (allow_internet_access = false, no network.allow_out, no egress)".into(),
                    });
                }
                // A snapshot would carry the gateway and its token into
                // every sandbox made from it.
                if p.checkpoints_enabled {
                    return Err(ConfigError::Conflict {
                        at: at(),
                        why: "mcp_policy and checkpoints_enabled do not go together (a checkpoint would reuse the gateway's token)".into(),
                    });
                }
            }
        }
        if self.recordings.max_total_bytes == 0 {
            return Err(ConfigError::Invalid {
                at: "recordings.max_total_bytes".into(),
                why: "must be at least 1 (bytes)".into(),
            });
        }
        for (name, p) in &self.profiles {
            let Some(r) = &p.recordings else { continue };
            if r.retain_days == 0 || r.max_lease_bytes == 0 {
                return Err(ConfigError::Invalid {
                    at: format!("profiles.{name}.recordings"),
                    why: "retain_days and max_lease_bytes must be at least 1".into(),
                });
            }
        }
        self.egress.validate()?;
        for (name, p) in &self.profiles {
            let Some(e) = &p.egress else { continue };
            e.validate(name)?;
            let embedded = self
                .profile_backend(p)
                .and_then(|b| self.backend_defs().remove(b))
                .is_some_and(|d| d.is_embedded());
            if !embedded && self.egress.listen.is_none() {
                return Err(ConfigError::Conflict {
                    at: format!("profile {name}"),
                    why: "egress on a CubeSandbox backend needs [egress] listen (an address its sandboxes reach the appliance at)".into(),
                });
            }
            if embedded && self.embedded.isolation != Isolation::Namespaces {
                return Err(ConfigError::Conflict {
                    at: format!("profile {name}"),
                    why: "egress needs [embedded] isolation = \"namespaces\" (the proxy is reached inside the sandbox's own network)".into(),
                });
            }
        }
        for (name, m) in &self.mcp_policies {
            m.validate(name)?;
        }
        // The secret files are read when a sandbox is made: one missing
        // now fails those acquires (`preset_failed`), not the service.
        for (name, pr) in &self.presets {
            pr.validate(name, false)?;
        }
        for (name, p) in &self.profiles {
            let Some(pn) = &p.template_preset else {
                continue;
            };
            let Some(pr) = self.presets.get(pn) else {
                return Err(ConfigError::Missing {
                    at: format!("profile {name}"),
                    why: format!("template_preset '{pn}' is not defined ([presets.{pn}])"),
                });
            };
            if let Some(t) = &pr.template
                && *t != p.template
            {
                return Err(ConfigError::Conflict {
                    at: format!("profile {name}"),
                    why: format!(
                        "template_preset '{pn}' is made for template '{t}'; the profile's is '{}'",
                        p.template
                    ),
                });
            }
        }
        self.validate_backends()?;
        self.connections.validate()?;
        self.console.validate()?;
        self.auth.validate()?;
        self.mcp.validate()?;
        self.metrics.token()?;
        self.store.validate()?;
        let profiles: Vec<&str> = self.profiles.keys().map(String::as_str).collect();
        for (name, t) in &self.tasks {
            t.validate(name, &profiles)?;
            // A volume other leases mount would let an agent plant the
            // inputs the approved command reads, or swap its outputs.
            if let Some(p) = self.profiles.get(&t.profile)
                && p.workspace.is_shared()
            {
                return Err(ConfigError::SharedWorkspace {
                    task: name.clone(),
                    profile: t.profile.clone(),
                    sharing: p.workspace.sharing(),
                });
            }
        }
        if let Some(b) = &self.backend {
            b.validate()?;
        }
        if self.embedded.disk_mb > 0 && self.embedded.disk_mb < crate::embedded::disk::MIN_MB {
            return Err(ConfigError::EmbeddedDisk {
                min: crate::embedded::disk::MIN_MB,
            });
        }
        for t in &self.embedded.templates {
            // The built-in ones would win silently.
            if ["minimal", "host"].contains(&t.id.as_str()) {
                return Err(ConfigError::Conflict {
                    at: "embedded.templates".into(),
                    why: format!("'{}' is a built-in template; give yours another name", t.id),
                });
            }
        }
        if self.embedded.faithful_pause_ms > 600_000 {
            return Err(ConfigError::FaithfulPause);
        }
        Ok(())
    }
}

/// The 1-based line of `[TABLE]` (or `[TABLE.…]`, `[[TABLE.…]]`) in a TOML
/// text: where a person finds it.
fn table_line(text: &str, table: &str) -> Option<usize> {
    text.lines()
        .position(|l| {
            let l = l.trim().trim_start_matches('[').trim_end_matches(']');
            l == table || l.starts_with(&format!("{table}."))
        })
        .map(|i| i + 1)
}

fn parse_bool(k: &str, v: &str) -> Result<bool, ConfigError> {
    match v {
        "1" | "true" => Ok(true),
        "0" | "false" => Ok(false),
        other => Err(ConfigError::EnvValue {
            var: k.to_string(),
            value: other.to_string(),
            expected: "a boolean (true/false/1/0)",
        }),
    }
}

/// Why a configuration is refused, by [`Config::load`] (the file, the
/// environment) or [`Config::validate`] (the values). `Display` is what
/// `config check`, a start and a reload say.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("cannot read {}: {source}", .path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The file is not TOML, or not these settings (an unknown key, a
    /// string for a boolean).
    #[error("{}: {source}", .path.display())]
    Parse {
        path: PathBuf,
        source: toml::de::Error,
    },
    /// A `CUBE_ADAPTER_*` variable that makes the listen address.
    #[error("{var}: {source}")]
    EnvAddress {
        var: String,
        source: std::net::AddrParseError,
    },
    /// A `CUBE_ADAPTER_*` variable whose value is none of those expected.
    #[error("{var}: '{value}' is not {expected}")]
    EnvValue {
        var: String,
        value: String,
        expected: &'static str,
    },
    /// A setting whose value is wrong: `at` says where as the message
    /// names it (`connections`, `profile dev`), `why` what is wrong.
    #[error("{at}: {why}")]
    Invalid { at: String, why: String },
    /// A number out of its range.
    #[error("{at}: {key} must be between {min} and {max} (got {got})")]
    Range {
        at: &'static str,
        key: &'static str,
        min: u64,
        max: u64,
        got: u64,
    },
    /// Something the settings at `at` need is not there.
    #[error("{at}: {why}")]
    Missing { at: String, why: String },
    /// Settings that do not go together.
    #[error("{at}: {why}")]
    Conflict { at: String, why: String },
    /// A profile's or backend's name (`what`) that is not a name.
    #[error("{what} name '{name}' must match ^[a-z][a-z0-9-]{{0,62}}$")]
    Name { what: &'static str, name: String },
    /// Plain HTTP off loopback.
    #[error("insecure_plain_http is only allowed on a loopback address (listen = {listen})")]
    PlainHttp { listen: SocketAddr },
    #[error(
        "[backend] and [backends.*] together: move [backend] to [backends.default] (kind = \"cubesandbox\")"
    )]
    BothBackendForms,
    /// `[backend]`.
    #[error(transparent)]
    Backend(#[from] BackendSectionError),
    /// `[backends.NAME]`, a CubeSandbox one.
    #[error("backends.{name}: {source}")]
    Backends {
        name: String,
        source: BackendSectionError,
    },
    /// A profile's `network` entry the embedded backend cannot apply.
    #[error("profile {profile}: network.{key}: {source}")]
    Egress {
        profile: String,
        key: &'static str,
        source: crate::embedded::egress::BadDest,
    },
    /// A trusted task on a profile whose workspace other leases mount.
    #[error(
        "task {task}: profile {profile}: its workspace ({sharing}) is shared with other sandboxes; \
         trusted tasks need a workspace of their own: use mode ephemeral, or \
         per-session-volume without volume_name (docs/tasks.md, \"Workspaces\")"
    )]
    SharedWorkspace {
        task: String,
        profile: String,
        sharing: String,
    },
    #[error("[embedded] disk_mb must be 0 (no disk of their own) or at least {min}")]
    EmbeddedDisk { min: u64 },
    #[error("embedded.faithful_pause_ms must be at most 600000 (10 minutes)")]
    FaithfulPause,
    /// `[store] url` (the store's own check).
    #[error("store: url: {0}")]
    StoreUrl(#[source] crate::store::StoreError),
    /// `[[audit.sinks]]`.
    #[error(transparent)]
    Sinks(#[from] sinks::SinkError),
    /// `[auth]`, `[console.oidc]`.
    #[error(transparent)]
    Auth(#[from] crate::auth::settings::SettingsError),
    /// `[console.notify]`.
    #[error(transparent)]
    Notify(#[from] NotifyError),
    /// `[metrics] token_file`.
    #[error(transparent)]
    Metrics(#[from] TokenFileError),
    /// `[tasks.NAME]`.
    #[error(transparent)]
    Task(#[from] tasks::TemplateError),
    /// `[mcp_policies.NAME]`.
    #[error(transparent)]
    McpPolicy(#[from] mcp::McpPolicyError),
    /// `[presets.NAME]`.
    #[error(transparent)]
    Preset(#[from] presets::PresetError),
    /// An error the file's line says where (`config check`).
    #[error("{}:{line}: {source}", .path.display())]
    At {
        path: PathBuf,
        line: usize,
        source: Box<ConfigError>,
    },
}

impl ConfigError {
    /// [`ConfigError::Invalid`].
    fn invalid(at: impl Into<String>, why: impl Into<String>) -> Self {
        Self::Invalid {
            at: at.into(),
            why: why.into(),
        }
    }
}

/// What is wrong in a CubeSandbox backend's settings (`[backend]`,
/// `[backends.NAME]`).
#[derive(Debug, Clone, thiserror::Error)]
pub enum BackendSectionError {
    #[error("backend: client_cert_file and client_key_file go together")]
    HalfClientCert,
    /// No CubeProxy address (`domain`: for the example).
    #[error(
        "backend: proxy_url is required: CubeProxy's address, not CubeAPI's (CubeAPI serves no data plane), e.g. proxy_url = \"https://{domain}\" or proxy_url = {{ url = \"https://{domain}\", dial = \"10.0.0.5:443\" }}"
    )]
    NoProxyUrl { domain: String },
    #[error("backend: proxy_url is the CubeAPI URL ({api_url}); CubeProxy is a separate address")]
    ProxyIsApi { api_url: String },
    /// CubeAPI's or CubeProxy's URL, as the client checks them.
    #[error("backend: {}", .0.message)]
    Urls(#[source] crate::cube::CubeError),
}

/// What is wrong in `[console.notify]`: its shape, or the files it names.
#[derive(Debug, thiserror::Error)]
pub enum NotifyError {
    #[error("console.notify: url is not a URL ({0})")]
    Url(#[source] url::ParseError),
    /// `http://` to a host that is not loopback.
    #[error("console.notify: url must be https:// (plain http:// only to a loopback address)")]
    PlainHttp,
    #[error("console.notify: url must be https:// (got {0}://)")]
    Scheme(String),
    #[error("console.notify: url has no host")]
    NoHost,
    #[error("console.notify: url must not carry a user or password")]
    Credentials,
    #[error("console.notify: console_url is not a URL ({0})")]
    ConsoleUrl(#[source] url::ParseError),
    #[error(
        "console.notify: console_url must be an http(s) URL with a host, e.g. https://adapter.example:18080"
    )]
    ConsoleUrlShape,
    #[error("console.notify: console_url must not have a query or fragment")]
    ConsoleUrlQuery,
    /// A number out of its range.
    #[error("console.notify: {key} must be between {min} and {max} (got {got})")]
    Range {
        key: &'static str,
        min: u64,
        max: u64,
        got: u64,
    },
    #[error("console.notify: cannot read ca_file {}: {source}", .path.display())]
    ReadCa {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("console.notify: ca_file {} holds no usable CA certificate: {source}", .path.display())]
    Ca {
        path: PathBuf,
        source: crate::tls::TlsError,
    },
    /// The TLS client (the public web PKI).
    #[error("console.notify: TLS: {0}")]
    Tls(#[source] crate::tls::TlsError),
    #[error("console.notify: cannot read secret_file {}: {source}", .path.display())]
    ReadSecret {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("console.notify: secret_file {} must hold at least 16 bytes", .0.display())]
    ShortSecret(PathBuf),
}

/// Why `[metrics] token_file` gives no token (never its content).
#[derive(Debug, thiserror::Error)]
pub enum TokenFileError {
    #[error("metrics: token_file {}: {source}", .path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("metrics: token_file {} must hold at least 16 bytes", .0.display())]
    Short(PathBuf),
    /// Spaces or control characters inside.
    #[error(
        "metrics: token_file {} must hold one token of printable characters, no spaces",
        .0.display()
    )]
    NotToken(PathBuf),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `[store] url`: no plain text (`prefer`, `disable`) to a database
    /// on another host, said when the config is loaded (#34, L5).
    #[test]
    fn store_url_refuses_plain_text_off_loopback() {
        let store = |url: &str| StoreSection {
            kind: StoreKind::Postgres,
            url: Some(url.into()),
            ..StoreSection::default()
        };
        for url in [
            "postgres://cube@db.example/cube?sslmode=disable",
            "postgres://cube@10.1.2.3:5432/cube?sslmode=prefer",
        ] {
            let e = store(url).validate().unwrap_err().to_string();
            assert!(e.starts_with("store: url:") && e.contains("refused"), "{e}");
        }
        for url in [
            "postgres://cube@db.example/cube",
            "postgres://cube@db.example/cube?sslmode=verify-ca",
            "postgres://cube@127.0.0.1/cube?sslmode=disable",
            "host=/run/postgresql user=cube sslmode=prefer",
        ] {
            store(url)
                .validate()
                .unwrap_or_else(|e| panic!("{url}: {e}"));
        }
    }

    /// `config check` names the file and the line of a bad preset: a
    /// trailing space in a provider, a fallback no model matches; a profile
    /// names a preset that exists and is made for its template.
    #[test]
    fn a_bad_preset_is_named_with_its_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("api-key");
        std::fs::write(&key, "sk-test\n").unwrap();
        let f = dir.path().join("c.toml");
        let good = format!(
            "[profiles.claw]\ntemplate = \"openclaw\"\ntemplate_preset = \"claw\"\n\n\
             [presets.claw]\nversion = \"1\"\ntemplate = \"openclaw\"\n\
             [[presets.claw.files]]\npath = \"/root/.openclaw/openclaw.json\"\n\
             content = '{{\"apiKey\": \"${{FILE:{}}}\"}}'\n\
             [presets.claw.models]\nprovider = \"deepseek\"\n\
             available = [\"deepseek-chat\", \"deepseek-reasoner\"]\n\
             default = \"deepseek/deepseek-chat\"\nfallbacks = [\"deepseek/deepseek-reasoner\"]\n",
            key.display()
        );
        let load = |text: &str| {
            std::fs::write(&f, text).unwrap();
            Config::load(Some(&f), &[], &Flags::default())
        };
        let (c, w) = load(&good).unwrap();
        assert_eq!(c.profiles["claw"].template_preset.as_deref(), Some("claw"));
        assert!(w.is_empty(), "{w:?}");
        // A secret file missing now fails the acquires, not the service.
        std::fs::remove_file(&key).unwrap();
        let (_, w) = load(&good).unwrap();
        assert!(
            w.iter()
                .any(|w| w.contains("secret file") && w.contains("acquires")),
            "{w:?}"
        );
        std::fs::write(&key, "sk-test\n").unwrap();
        for (bad, want) in [
            (
                good.replace("provider = \"deepseek\"", "provider = \"deepseek \""),
                ":5: presets.claw: models: provider \"deepseek \" has a trailing space",
            ),
            (
                good.replace("deepseek/deepseek-reasoner", "deepseek/deepseek-coder"),
                ":5: presets.claw: models: fallback \"deepseek/deepseek-coder\" names a model the provider does not serve",
            ),
        ] {
            let e = load(&bad).unwrap_err().to_string();
            assert!(e.starts_with(&f.display().to_string()), "{e}");
            assert!(e.contains(want), "{e:?} lacks {want:?}");
        }
        let e = load(&good.replace("template_preset = \"claw\"", "template_preset = \"other\""))
            .unwrap_err()
            .to_string();
        assert!(e.contains("template_preset 'other' is not defined"), "{e}");
        let e = load(&good.replacen("template = \"openclaw\"", "template = \"minimal\"", 1))
            .unwrap_err()
            .to_string();
        assert!(e.contains("made for template 'openclaw'"), "{e}");
    }

    /// `[profiles.NAME.egress]` at load: served on the embedded backend
    /// only, with namespaces, never with a governed MCP server; a
    /// credential names one of the destinations; its secret file missing
    /// is a warning (requests to it fail), not a refusal.
    #[test]
    fn egress_is_checked_at_load_and_a_missing_secret_only_warns() {
        let dir = tempfile::tempdir().unwrap();
        let token = dir.path().join("api-token");
        std::fs::write(&token, "sk-test\n").unwrap();
        let f = dir.path().join("c.toml");
        let load = |text: &str| {
            std::fs::write(&f, text).unwrap();
            Config::load(Some(&f), &[], &Flags::default())
        };
        let good = format!(
            "[profiles.build]\n\n\
             [profiles.build.egress]\n\
             destinations = [\"api.test.invalid\", \"*.mirror.test.invalid:8080\"]\n\
             [profiles.build.egress.credentials.\"api.test.invalid\"]\n\
             secret_file = \"{}\"\n",
            token.display()
        );
        let (c, w) = load(&good).unwrap();
        assert!(w.is_empty(), "{w:?}");
        let eg = c.profiles["build"].egress.as_ref().unwrap();
        assert_eq!(
            eg.destinations,
            ["api.test.invalid", "*.mirror.test.invalid:8080"]
        );
        assert!(eg.credentials.contains_key("api.test.invalid"));

        // The secret file missing: loaded, with a warning naming it.
        std::fs::remove_file(&token).unwrap();
        let (_, w) = load(&good).unwrap();
        assert!(
            w.iter().any(|w| w.contains("profile build")
                && w.contains(&token.display().to_string())
                && w.contains("requests to it will fail")),
            "{w:?}"
        );

        let cube = "[backends.cube]\nkind = \"cubesandbox\"\n\
                    api_url = \"https://cube.example:3000\"\n\
                    proxy_url = \"https://cube.app.example\"\ntemplate = \"tpl-cube\"\n\n";
        let policy = "[mcp_policies.echo]\ncommand = \"echo-mcp --stdio\"\n\
                      [mcp_policies.echo.tools.echo]\n\
                      input_schema = { type = \"object\", additionalProperties = false }\n\n";
        for (bad, want) in [
            (
                format!(
                    "{cube}{}",
                    good.replace(
                        "[profiles.build]\n",
                        "[profiles.build]\nbackend = \"cube\"\n"
                    )
                ),
                "egress on a CubeSandbox backend needs [egress] listen",
            ),
            (
                format!("[embedded]\nisolation = \"none\"\n\n{good}"),
                "egress needs [embedded] isolation = \"namespaces\"",
            ),
            (
                format!(
                    "{policy}{}",
                    good.replace(
                        "[profiles.build]\n",
                        "[profiles.build]\nmcp_policy = \"echo\"\n"
                    )
                ),
                "mcp_policy needs public traffic off",
            ),
            (
                good.replace(
                    "credentials.\"api.test.invalid\"",
                    "credentials.\"other.test.invalid\"",
                ),
                "not one of destinations",
            ),
        ] {
            let e = load(&bad).unwrap_err().to_string();
            assert!(e.contains(want), "{e:?} lacks {want:?}\n{bad}");
            assert!(e.contains("profile build"), "{e}");
        }
    }

    #[test]
    fn oidc_issuers_are_checked_and_the_reference_variables_make_one() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        let load = |text: &str, env: &[(&str, &str)]| {
            std::fs::write(&f, text).unwrap();
            let env: Vec<(String, String)> = env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            Config::load(Some(&f), &env, &Flags::default())
        };
        let ok = "[[auth.oidc]]\nissuer = \"https://idp.example.test/realms/x\"\naudience = \"cube\"\nalgorithms = [\"RS256\", \"EdDSA\"]\ntenants = [\"acme\"]\n[auth.oidc.claims]\nroles = \"groups\"\n";
        let (c, _) = load(ok, &[]).unwrap();
        assert_eq!(c.auth.oidc[0].claims.roles, "groups");
        assert_eq!(c.auth.oidc[0].claims.tenant, "tenant_id");
        for (bad, why) in [
            (ok.replace("RS256", "HS256"), "not allowed"),
            (ok.replace("https://idp", "http://idp"), "https"),
            (ok.replace("\"cube\"", "\" \""), "audience"),
            // No ceiling on the tenant: refused, naming the issuer.
            (
                ok.replace("tenants = [\"acme\"]\n", ""),
                "auth.oidc https://idp.example.test/realms/x: name the tenants",
            ),
            (ok.replace("[\"acme\"]", "[\"a b\"]"), "tenant \"a b\""),
            (
                ok.replace("tenants =", "allowed_roles = [\"root\"]\ntenants ="),
                "allowed_roles: unknown role",
            ),
            (
                ok.replace("tenants =", "allowed_roles = []\ntenants ="),
                "allowed_roles must name",
            ),
            (
                format!(
                    "{ok}{}",
                    ok.replace("[auth.oidc.claims]\nroles = \"groups\"\n", "")
                ),
                "twice",
            ),
        ] {
            let e = load(&bad, &[]).unwrap_err().to_string();
            assert!(e.contains(why), "{why}: {e}");
        }
        // http on loopback is fine (a provider on the same host).
        assert!(
            load(
                &ok.replace("https://idp.example.test", "http://127.0.0.1:9"),
                &[]
            )
            .is_ok()
        );
        let reference = [
            ("CUBE_ADAPTER_OIDC_ISSUER", "https://idp.example.test"),
            ("CUBE_ADAPTER_OIDC_AUDIENCE", "cube"),
            ("CUBE_ADAPTER_OIDC_ROLES_CLAIM", "groups"),
        ];
        // The reference's variables alone name no tenants: refused.
        let e = load("", &reference).unwrap_err().to_string();
        assert!(e.contains("name the tenants"), "{e}");
        let mut with = reference.to_vec();
        with.push(("CUBE_ADAPTER_OIDC_TENANTS", "acme, globex"));
        let (c, _) = load("", &with).unwrap();
        assert_eq!(c.auth.oidc.len(), 1);
        assert_eq!(c.auth.oidc[0].claims.roles, "groups");
        assert_eq!(c.auth.oidc[0].tenants, ["acme", "globex"]);
        assert_eq!(c.auth.oidc[0].allowed_roles, ["agent"]);
        // Or the file's entry for the same issuer gives them.
        let (c, _) = load(
            "[[auth.oidc]]\nissuer = \"https://idp.example.test\"\naudience = \"x\"\ntenant = \"acme\"\nallowed_roles = [\"agent\", \"approver\"]\n",
            &reference,
        )
        .unwrap();
        assert_eq!(c.auth.oidc.len(), 1);
        assert_eq!(c.auth.oidc[0].audience, "cube");
        assert_eq!(c.auth.oidc[0].tenant.as_deref(), Some("acme"));
        assert_eq!(c.auth.oidc[0].allowed_roles, ["agent", "approver"]);
        let e = load(
            "",
            &[("CUBE_ADAPTER_OIDC_ISSUER", "https://idp.example.test")],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("AUDIENCE"), "{e}");
    }

    #[test]
    fn precedence_and_strictness() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(
            &f,
            "listen = \"127.0.0.1:1000\"\nstate_dir = \"/a\"\n[audit]\nmode = \"best_effort\"\n",
        )
        .unwrap();
        let env = vec![
            ("CUBE_ADAPTER_STATE_DIR".to_string(), "/b".to_string()),
            ("CUBE_ADAPTER_NOPE".to_string(), "x".to_string()),
        ];
        let flags = Flags {
            listen: Some("127.0.0.1:2000".parse().unwrap()),
            ..Default::default()
        };
        let (c, w) = Config::load(Some(&f), &env, &flags).unwrap();
        assert_eq!(c.listen.port(), 2000);
        assert_eq!(c.state_dir, PathBuf::from("/b"));
        assert_eq!(c.audit.mode, AuditMode::BestEffort);
        assert_eq!(w.len(), 1);
        assert!(c.profiles.contains_key("offline-code"));

        std::fs::write(&f, "bogus = 1\n").unwrap();
        assert!(
            Config::load(Some(&f), &[], &Flags::default())
                .unwrap_err()
                .to_string()
                .contains("bogus")
        );
        std::fs::write(&f, "[profiles.x]\ncheckpoints_enabled = \"false\"\n").unwrap();
        assert!(Config::load(Some(&f), &[], &Flags::default()).is_err());
        std::fs::write(&f, "listen = \"0.0.0.0:1\"\ninsecure_plain_http = true\n").unwrap();
        assert!(
            Config::load(Some(&f), &[], &Flags::default())
                .unwrap_err()
                .to_string()
                .contains("loopback")
        );
        std::fs::write(
            &f,
            "[connections]\nmax_total = 10\nheader_read_timeout_seconds = 2\n",
        )
        .unwrap();
        let (c, _) = Config::load(Some(&f), &[], &Flags::default()).unwrap();
        assert_eq!(c.connections.max_total, 10);
        assert_eq!(c.connections.header_read_timeout_seconds, 2);
        assert_eq!(
            c.connections.idle_timeout_seconds,
            ConnectionsSection::default().idle_timeout_seconds
        );
        for (bad, why) in [
            ("max_total = 0", "at least 1"),
            ("max_per_address = 0", "at least 1"),
            ("idle_timeout_seconds = 0", "idle_timeout_seconds"),
            (
                "body_read_timeout_seconds = 86401",
                "body_read_timeout_seconds",
            ),
            ("max_idle = 1", "max_idle"),
        ] {
            std::fs::write(&f, format!("[connections]\n{bad}\n")).unwrap();
            let e = Config::load(Some(&f), &[], &Flags::default())
                .unwrap_err()
                .to_string();
            assert!(e.contains(why), "{bad}: {e}");
        }
        // A configured template may not take a built-in one's name.
        for name in ["minimal", "host"] {
            std::fs::write(
                &f,
                format!("[[embedded.templates]]\nid = \"{name}\"\nrootfs = \"/srv/x\"\n"),
            )
            .unwrap();
            let e = Config::load(Some(&f), &[], &Flags::default())
                .unwrap_err()
                .to_string();
            assert!(e.contains("built-in template"), "{name}: {e}");
        }
        assert!(
            Config::load(
                Some(&dir.path().join("missing.toml")),
                &[],
                &Flags::default()
            )
            .is_err()
        );
    }

    #[test]
    fn console_notify() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        let secret = dir.path().join("notify.secret");
        std::fs::write(&secret, "0123456789abcdef0123\n").unwrap();
        let short = dir.path().join("short.secret");
        std::fs::write(&short, "too short\n").unwrap();
        let junk = dir.path().join("junk.pem");
        std::fs::write(&junk, "not a certificate").unwrap();
        let head = |url: &str| {
            format!(
                "[console.notify]\nurl = \"{url}\"\nsecret_file = \"{}\"\n",
                secret.display()
            )
        };
        std::fs::write(&f, head("https://hooks.example/services/T0/B0/SECRETPART")).unwrap();
        let (c, _) = Config::load(Some(&f), &[], &Flags::default()).unwrap();
        let n = c.console.notify.clone().unwrap();
        assert_eq!(
            (
                n.max_attempts,
                n.retry_initial_ms,
                n.timeout_seconds,
                n.queue
            ),
            (5, 1000, 10, 256)
        );
        assert_eq!(n.read_secret().unwrap().unwrap(), b"0123456789abcdef0123");
        // `config check` shows the webhook's host, not its (secret) path.
        let shown = toml::to_string_pretty(&c).unwrap();
        assert!(shown.contains("https://hooks.example/"), "{shown}");
        assert!(!shown.contains("SECRETPART"), "{shown}");
        let debug = format!("{c:?}");
        assert!(debug.contains("https://hooks.example/"), "{debug}");
        assert!(!debug.contains("SECRETPART"), "{debug}");
        // Plain HTTP to loopback is fine (tests, a local relay).
        std::fs::write(&f, head("http://127.0.0.1:9/hook")).unwrap();
        assert!(Config::load(Some(&f), &[], &Flags::default()).is_ok());
        for (body, why) in [
            (head("http://hooks.example/x"), "loopback"),
            (head("ftp://hooks.example/x"), "https://"),
            (head("not a url"), "not a URL"),
            (head("https://u:p@hooks.example/x"), "user or password"),
            (
                head("https://h.example/x") + "max_attempts = 0\n",
                "max_attempts",
            ),
            (
                head("https://h.example/x") + "retry_initial_ms = 5\n",
                "retry_initial_ms",
            ),
            (
                head("https://h.example/x") + "timeout_seconds = 61\n",
                "timeout_seconds",
            ),
            (head("https://h.example/x") + "queue = 0\n", "queue"),
            (
                head("https://h.example/x") + "console_url = \"adapter\"\n",
                "console_url",
            ),
            (head("https://h.example/x") + "nope = 1\n", "nope"),
            (
                format!(
                    "[console.notify]\nurl = \"https://h.example/x\"\nsecret_file = \"{}\"\n",
                    dir.path().join("missing").display()
                ),
                "cannot read secret_file",
            ),
            (
                format!(
                    "[console.notify]\nurl = \"https://h.example/x\"\nsecret_file = \"{}\"\n",
                    short.display()
                ),
                "at least 16 bytes",
            ),
            (
                head("https://h.example/x") + &format!("ca_file = \"{}\"\n", junk.display()),
                "ca_file",
            ),
        ] {
            std::fs::write(&f, &body).unwrap();
            let e = Config::load(Some(&f), &[], &Flags::default())
                .unwrap_err()
                .to_string();
            assert!(e.contains(why), "{body}: {e}");
        }
    }

    #[test]
    fn console_lifetimes() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(&f, "").unwrap();
        let (c, _) = Config::load(Some(&f), &[], &Flags::default()).unwrap();
        assert_eq!(c.console.idle_timeout_seconds, 1800);
        assert_eq!(c.console.absolute_timeout_seconds, 43_200);
        std::fs::write(
            &f,
            "[console]\nidle_timeout_seconds = 600\nabsolute_timeout_seconds = 3600\n",
        )
        .unwrap();
        let (c, _) = Config::load(Some(&f), &[], &Flags::default()).unwrap();
        assert_eq!(c.console.idle_timeout_seconds, 600);
        assert_eq!(c.console.absolute_timeout_seconds, 3600);
        for (bad, why) in [
            ("idle_timeout_seconds = 59", "idle_timeout_seconds"),
            ("idle_timeout_seconds = 86401", "idle_timeout_seconds"),
            (
                "idle_timeout_seconds = 7200\nabsolute_timeout_seconds = 3600",
                "absolute_timeout_seconds",
            ),
            (
                "absolute_timeout_seconds = 604801",
                "absolute_timeout_seconds",
            ),
            ("idle = 1", "idle"),
        ] {
            std::fs::write(&f, format!("[console]\n{bad}\n")).unwrap();
            let e = Config::load(Some(&f), &[], &Flags::default())
                .unwrap_err()
                .to_string();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn mcp_session_idle_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(&f, "").unwrap();
        let (c, _) = Config::load(Some(&f), &[], &Flags::default()).unwrap();
        assert_eq!(c.mcp.session_idle_timeout_seconds, 300);
        std::fs::write(&f, "[mcp]\nsession_idle_timeout_seconds = 900\n").unwrap();
        let (c, _) = Config::load(Some(&f), &[], &Flags::default()).unwrap();
        assert_eq!(c.mcp.session_idle_timeout_seconds, 900);
        for bad in [
            "session_idle_timeout_seconds = 59",
            "session_idle_timeout_seconds = 86401",
            "idle = 1",
        ] {
            std::fs::write(&f, format!("[mcp]\n{bad}\n")).unwrap();
            let e = Config::load(Some(&f), &[], &Flags::default())
                .unwrap_err()
                .to_string();
            assert!(e.contains(bad.split(' ').next().unwrap()), "{bad}: {e}");
        }
    }

    #[test]
    fn backends_are_named_and_each_profile_runs_on_one() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        let load = |body: &str| {
            std::fs::write(&f, body).unwrap();
            Config::load(Some(&f), &[], &Flags::default())
        };
        // No backend at all: the embedded one, as `default`.
        let (c, _) = load("").unwrap();
        let defs = c.backend_defs();
        assert_eq!(defs.keys().collect::<Vec<_>>(), ["default"]);
        assert!(defs["default"].is_embedded());
        let p = &c.profiles["offline-code"];
        assert_eq!(c.profile_backend(p), Some("default"));
        let two = r#"
[backends.staging]
kind = "cubesandbox"
api_url = "https://staging.example:3000"
proxy_url = "https://cube.staging.example"
template = "tpl-staging"

[backends.production]
kind = "cubesandbox"
api_url = "https://prod.example:3000"
proxy_url = { url = "https://cube.app", dial = "10.0.0.5:443" }
"#;
        // Several, none named default: a profile must name its own.
        let e = load(two).unwrap_err().to_string();
        assert!(e.contains("name its backend"), "{e}");
        let (c, _) = load(&format!(
            "{two}
[profiles.stage]
backend = \"staging\"

[profiles.prod]
backend = \"production\"
template = \"tpl-prod\"
"
        ))
        .unwrap();
        // A profile without a template takes its backend's.
        assert_eq!(c.profiles["stage"].template, "tpl-staging");
        assert_eq!(c.profiles["prod"].template, "tpl-prod");
        assert_eq!(c.profile_backend(&c.profiles["prod"]), Some("production"));
        // An unknown backend, an unknown key, two embedded, both forms.
        let e = load(&format!(
            "{two}
[profiles.x]
backend = \"nowhere\"
"
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("backend 'nowhere' is not configured"), "{e}");
        let e = load(
            "[backends.a]
kind = \"cubesandbox\"
api_url = \"https://a.example\"
proxy_url = \"https://p.example\"
bogus = 1
",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("bogus"), "{e}");
        let e = load(
            "[backends.a]
kind = \"embedded\"
[backends.b]
kind = \"embedded\"
",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("at most one embedded"), "{e}");
        let e = load(
            "[backends.a]
kind = \"kvm\"
",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("kvm"), "{e}");
        let e = load(
            "[backend]
api_url = \"https://a.example\"
proxy_url = \"https://p.example\"
[backends.default]
kind = \"embedded\"
",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("[backend] and [backends.*] together"), "{e}");
        // One backend of any name serves profiles that name none.
        let (c, _) = load(
            "[backends.local]
kind = \"embedded\"
",
        )
        .unwrap();
        assert_eq!(
            c.profile_backend(&c.profiles["offline-code"]),
            Some("local")
        );
        // Workspaces are checked.
        let e = load(
            "[profiles.w.workspace]
mode = \"existing-volume\"
",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("volume_id is required"), "{e}");
        let e = load(
            "[profiles.w.workspace]
mode = \"per-session-volume\"
mount_path = \"work\"
",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("mount_path must be an absolute path"), "{e}");
        let (c, _) = load(
            "[profiles.w.workspace]
mode = \"per-session-volume\"
size_mb = 64
",
        )
        .unwrap();
        let w = &c.profiles["w"].workspace;
        assert_eq!(
            (w.mount_path.as_str(), w.retain_on_kill, w.size_mb),
            ("/workspace", true, 64)
        );
        // The default workspace is not part of a profile's serialised form
        // (digests of plans made before workspaces stay the same).
        let v = serde_json::to_value(Profile::default()).unwrap();
        assert!(v.get("workspace").is_none() && v.get("backend").is_none());
    }

    /// A trusted task's profile never shares its workspace volume with
    /// other leases (issue #34, M2): refused at load, naming task and
    /// profile; a volume of its own per lease is fine.
    #[test]
    fn task_profiles_have_workspaces_of_their_own() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        let load = |workspace: &str| {
            let body = format!(
                "[profiles.tp]\nallowed_runtimes = [\"mcp\"]\n{workspace}\n\
                 [tasks.job]\ndescription = \"d\"\nprofile = \"tp\"\n\
                 [tasks.job.command]\nargv = [\"true\"]\n\
                 [tasks.job.parameters]\ntype = \"object\"\nadditionalProperties = false\n"
            );
            std::fs::write(&f, body).unwrap();
            Config::load(Some(&f), &[], &Flags::default())
        };
        for ok in [
            "",
            "[profiles.tp.workspace]\nmode = \"per-session-volume\"\n",
        ] {
            let r = load(ok);
            assert!(r.is_ok(), "{ok}: {:?}", r.err());
        }
        for (bad, why) in [
            (
                "[profiles.tp.workspace]\nmode = \"existing-volume\"\nvolume_id = \"team\"\n",
                "existing-volume",
            ),
            (
                "[profiles.tp.workspace]\nmode = \"existing-volume\"\nvolume_id = \"team\"\nread_only = true\n",
                "existing-volume",
            ),
            (
                "[profiles.tp.workspace]\nmode = \"per-session-volume\"\nvolume_name = \"shared\"\n",
                "volume_name \"shared\"",
            ),
        ] {
            let e = load(bad).unwrap_err().to_string();
            assert!(
                e.contains("task job: profile tp") && e.contains(why) && e.contains("shared"),
                "{e}"
            );
        }
    }

    #[test]
    fn backend_needs_a_proxy_url_of_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        let load = |body: &str| {
            std::fs::write(&f, body).unwrap();
            Config::load(Some(&f), &[], &Flags::default())
        };
        let e = load("[backend]\napi_url = \"https://cubeapi.example:3000\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("proxy_url is required"), "{e}");
        let e = load(
            "[backend]\napi_url = \"https://cubeapi.example:3000\"\nproxy_url = \"https://cubeapi.example:3000/\"\n",
        )
        .unwrap_err().to_string();
        assert!(e.contains("is the CubeAPI URL"), "{e}");
        // Plain http to CubeAPI needs the opt-in.
        let e = load(
            "[backend]\napi_url = \"http://10.0.0.5:3000\"\nproxy_url = \"https://cube.app\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("insecure_plain_http"), "{e}");
        // The dial form must name the sandbox domain and a host:port.
        let e = load(
            "[backend]\napi_url = \"https://a.example\"\nproxy_url = { url = \"https://other.example\", dial = \"10.0.0.5:443\" }\n",
        )
        .unwrap_err().to_string();
        assert!(e.contains("must name the sandbox domain"), "{e}");
        let e = load(
            "[backend]\napi_url = \"https://a.example\"\nproxy_url = { url = \"https://cube.app\", dial = \"10.0.0.5:x\" }\n",
        )
        .unwrap_err().to_string();
        assert!(e.contains("host:port"), "{e}");
        let (c, _) = load(
            "[backend]\napi_url = \"http://10.0.0.5:3000\"\ninsecure_plain_http = true\nproxy_url = { url = \"https://cube.app\", dial = \"10.0.0.5:443\" }\n",
        )
        .unwrap();
        let p = c.backend.unwrap().proxy_url.unwrap();
        assert_eq!(p.dial(), Some("10.0.0.5:443"));
        let (c, _) = load(
            "[backend]\napi_url = \"https://a.example\"\nproxy_url = \"https://proxy.example\"\n",
        )
        .unwrap();
        assert_eq!(
            c.backend.unwrap().proxy_url.unwrap().url(),
            "https://proxy.example"
        );
    }
}
