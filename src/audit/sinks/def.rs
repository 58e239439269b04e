//! `[[audit.sinks]]` (re-exported as `config::sinks`): where copies of the journal are delivered
//! (docs/operations.md, "Audit delivery"). The journal in the store stays
//! the authority; each sink reads it from its own cursor.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The most events one delivery carries.
pub const MAX_BATCH: usize = 10_000;

/// One `[[audit.sinks]]` entry, tagged by `kind`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum SinkDef {
    /// JSON lines appended to a file, rotated by size.
    File(FileSink),
    /// JSON lines on the service's standard output (journald under systemd).
    Stdout(StdoutSink),
    /// Batches of JSON lines POSTed to a collector.
    Http(HttpSink),
    /// RFC 5424 messages to a syslog daemon.
    Syslog(SyslogSink),
}

/// Where a sink without a cursor starts: `start` (the whole journal, the
/// default) or `now` (the events after it is added).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum From {
    #[default]
    Start,
    Now,
}

fn default_batch() -> usize {
    256
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileSink {
    pub name: String,
    #[serde(default)]
    pub from: From,
    #[serde(default = "default_batch")]
    pub batch: usize,
    pub path: PathBuf,
    /// Rotate before the file would pass this size (0: never rotate).
    #[serde(default = "default_max_bytes")]
    pub max_bytes: u64,
    /// Rotated files kept (`PATH.1` newest … `PATH.N`).
    #[serde(default = "default_keep")]
    pub keep: u32,
    /// `batch`: fsync each delivery before its cursor moves (the default);
    /// `never`: leave it to the kernel (a power cut can lose the tail,
    /// which is then delivered again only if the cursor did not move).
    #[serde(default)]
    pub fsync: Fsync,
}

fn default_max_bytes() -> u64 {
    100 * 1024 * 1024
}

fn default_keep() -> u32 {
    5
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Fsync {
    #[default]
    Batch,
    Never,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StdoutSink {
    pub name: String,
    #[serde(default)]
    pub from: From,
    #[serde(default = "default_batch")]
    pub batch: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpSink {
    pub name: String,
    #[serde(default)]
    pub from: From,
    #[serde(default = "default_batch")]
    pub batch: usize,
    /// `https://…` (or `http://` to a loopback collector).
    pub url: String,
    /// Trust this CA (PEM) instead of the system's roots.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    #[serde(default)]
    pub client_cert_file: Option<PathBuf>,
    #[serde(default)]
    pub client_key_file: Option<PathBuf>,
    /// A key (at least 32 bytes) for `X-Cube-Adapter-Signature:
    /// sha256=HEX(HMAC-SHA256(key, body))`.
    #[serde(default)]
    pub hmac_key_file: Option<PathBuf>,
    /// Sent as `Authorization: Bearer …` (the reference's
    /// `CUBE_ADAPTER_AUDIT_HTTP_TOKEN`).
    #[serde(default)]
    pub token_file: Option<PathBuf>,
    /// Per request (default 10).
    #[serde(default = "default_timeout")]
    pub timeout_seconds: u64,
    /// The longest wait between retries (default 60; the wait doubles from
    /// half a second, with jitter).
    #[serde(default = "default_max_backoff")]
    pub max_backoff_seconds: u64,
}

fn default_timeout() -> u64 {
    10
}

fn default_max_backoff() -> u64 {
    60
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyslogSink {
    pub name: String,
    #[serde(default)]
    pub from: From,
    #[serde(default = "default_batch")]
    pub batch: usize,
    /// `unix:/dev/log` (a datagram or stream socket) or `tcp:HOST:PORT`
    /// (octet-counted frames, RFC 6587).
    #[serde(default = "default_syslog_address")]
    pub address: String,
    /// `auth`, `authpriv`, `daemon`, `local0` … `local7` (default `authpriv`).
    #[serde(default = "default_facility")]
    pub facility: String,
    /// APP-NAME (default `cube-adapter`).
    #[serde(default = "default_app_name")]
    pub app_name: String,
    #[serde(default = "default_max_backoff")]
    pub max_backoff_seconds: u64,
}

fn default_syslog_address() -> String {
    "unix:/dev/log".into()
}

fn default_facility() -> String {
    "authpriv".into()
}

fn default_app_name() -> String {
    "cube-adapter".into()
}

/// Syslog facility codes (RFC 5424 §6.2.1) by name.
pub fn facility_code(name: &str) -> Option<u8> {
    Some(match name {
        "kern" => 0,
        "user" => 1,
        "daemon" => 3,
        "auth" => 4,
        "syslog" => 5,
        "authpriv" => 10,
        "local0" => 16,
        "local1" => 17,
        "local2" => 18,
        "local3" => 19,
        "local4" => 20,
        "local5" => 21,
        "local6" => 22,
        "local7" => 23,
        _ => return None,
    })
}

/// Where a syslog sink sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SyslogAddress {
    Unix(PathBuf),
    Tcp(String),
}

impl SyslogAddress {
    pub fn parse(s: &str) -> Result<Self, AddressError> {
        if let Some(p) = s.strip_prefix("unix:") {
            if p.is_empty() {
                return Err(AddressError::NoSocketPath);
            }
            return Ok(Self::Unix(PathBuf::from(p)));
        }
        if let Some(hp) = s.strip_prefix("tcp:") {
            let ok = hp
                .rsplit_once(':')
                .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
            if !ok {
                return Err(AddressError::Tcp(hp.to_string()));
            }
            return Ok(Self::Tcp(hp.to_string()));
        }
        Err(AddressError::Unknown(s.to_string()))
    }
}

impl SinkDef {
    pub fn name(&self) -> &str {
        match self {
            Self::File(s) => &s.name,
            Self::Stdout(s) => &s.name,
            Self::Http(s) => &s.name,
            Self::Syslog(s) => &s.name,
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Self::File(_) => "file",
            Self::Stdout(_) => "stdout",
            Self::Http(_) => "http",
            Self::Syslog(_) => "syslog",
        }
    }

    pub fn from(&self) -> From {
        match self {
            Self::File(s) => s.from,
            Self::Stdout(s) => s.from,
            Self::Http(s) => s.from,
            Self::Syslog(s) => s.from,
        }
    }

    pub fn batch(&self) -> usize {
        match self {
            Self::File(s) => s.batch,
            Self::Stdout(s) => s.batch,
            Self::Http(s) => s.batch,
            Self::Syslog(s) => s.batch,
        }
    }

    /// The checks that need no file or network (those come when the sink
    /// is prepared, at start and at each reload).
    pub fn validate(&self) -> Result<(), SinkError> {
        let name = self.name();
        if name.is_empty()
            || name.len() > 32
            || !name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
        {
            return Err(SinkError::Name(name.to_string()));
        }
        self.check().map_err(|problem| SinkError::Invalid {
            sink: name.to_string(),
            problem,
        })
    }

    /// [`Self::validate`]'s checks of the settings, the name aside.
    fn check(&self) -> Result<(), SinkProblem> {
        if !(1..=MAX_BATCH).contains(&self.batch()) {
            return Err(SinkProblem::Batch);
        }
        match self {
            Self::File(f) => {
                if f.path.as_os_str().is_empty() || !f.path.is_absolute() {
                    return Err(SinkProblem::RelativePath);
                }
                if f.max_bytes != 0 && f.max_bytes < 4096 {
                    return Err(SinkProblem::MaxBytes);
                }
                if f.keep > 1000 {
                    return Err(SinkProblem::Keep);
                }
            }
            Self::Stdout(_) => {}
            Self::Http(h) => {
                let u = url::Url::parse(&h.url).map_err(SinkProblem::Url)?;
                match u.scheme() {
                    "https" => {}
                    "http" => {
                        let loopback = match u.host() {
                            Some(url::Host::Ipv4(a)) => a.is_loopback(),
                            Some(url::Host::Ipv6(a)) => a.is_loopback(),
                            Some(url::Host::Domain(d)) => d == "localhost",
                            None => false,
                        };
                        if !loopback {
                            return Err(SinkProblem::PlainHttp);
                        }
                    }
                    s => return Err(SinkProblem::Scheme(s.to_string())),
                }
                if !u.username().is_empty() || u.password().is_some() {
                    return Err(SinkProblem::Credentials);
                }
                if h.client_cert_file.is_some() != h.client_key_file.is_some() {
                    return Err(SinkProblem::HalfClientCert);
                }
                if !(1..=300).contains(&h.timeout_seconds) {
                    return Err(SinkProblem::Timeout);
                }
                if !(1..=3600).contains(&h.max_backoff_seconds) {
                    return Err(SinkProblem::MaxBackoff);
                }
            }
            Self::Syslog(s) => {
                SyslogAddress::parse(&s.address)?;
                if facility_code(&s.facility).is_none() {
                    return Err(SinkProblem::Facility(s.facility.clone()));
                }
                if s.app_name.is_empty()
                    || s.app_name.len() > 48
                    || !s.app_name.bytes().all(|b| (33..=126).contains(&b))
                {
                    return Err(SinkProblem::AppName);
                }
                if !(1..=3600).contains(&s.max_backoff_seconds) {
                    return Err(SinkProblem::MaxBackoff);
                }
            }
        }
        Ok(())
    }
}

/// Every sink's own checks, and names used once.
pub fn validate(sinks: &[SinkDef]) -> Result<(), SinkError> {
    let mut seen = std::collections::BTreeSet::new();
    for s in sinks {
        s.validate()?;
        if !seen.insert(s.name()) {
            return Err(SinkError::Twice(s.name().to_string()));
        }
    }
    Ok(())
}

/// Why `[[audit.sinks]]` are refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SinkError {
    /// A name that is not 1 to 32 of a-z, 0-9, - and _.
    #[error("audit sink name '{0}' must be 1 to 32 of a-z, 0-9, - and _")]
    Name(String),
    /// Two sinks of one name (the name keys each sink's cursor).
    #[error("audit sink name '{0}' is used twice")]
    Twice(String),
    /// A setting of the sink named `sink`.
    #[error("audit sink '{sink}': {problem}")]
    Invalid {
        sink: String,
        #[source]
        problem: SinkProblem,
    },
}

/// What is wrong in one sink's settings.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SinkProblem {
    #[error("batch must be 1 to {max}", max = MAX_BATCH)]
    Batch,
    #[error("path must be an absolute path")]
    RelativePath,
    #[error("max_bytes must be 0 (never rotate) or at least 4096")]
    MaxBytes,
    #[error("keep must be at most 1000")]
    Keep,
    #[error("url: {0}")]
    Url(#[source] url::ParseError),
    /// `http://` to a collector that is not loopback.
    #[error("plain http is only allowed to a loopback collector; use https")]
    PlainHttp,
    #[error("url scheme '{0}' (https or http)")]
    Scheme(String),
    #[error("no credentials in the url (use token_file or a client certificate)")]
    Credentials,
    #[error("client_cert_file and client_key_file go together")]
    HalfClientCert,
    #[error("timeout_seconds must be 1 to 300")]
    Timeout,
    #[error("max_backoff_seconds must be 1 to 3600")]
    MaxBackoff,
    /// A syslog `address` of neither form.
    #[error(transparent)]
    Address(#[from] AddressError),
    #[error("facility '{0}' (kern, user, daemon, auth, syslog, authpriv, local0 … local7)")]
    Facility(String),
    #[error("app_name must be 1 to 48 printable ASCII characters")]
    AppName,
}

/// Why a syslog address is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddressError {
    #[error("unix: needs a socket path")]
    NoSocketPath,
    /// `tcp:` without `HOST:PORT`.
    #[error("tcp:{0}: expected tcp:HOST:PORT")]
    Tcp(String),
    /// Neither `unix:` nor `tcp:`.
    #[error("address '{0}': expected unix:/path/to/socket or tcp:HOST:PORT")]
    Unknown(String),
}
