//! The four kinds of audit sink: how one batch of events is delivered.
//! Each `deliver` either takes the whole batch (then the cursor may move)
//! or fails and leaves nothing half-done that a retry would corrupt.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hmac::{Hmac, Mac};
use tokio::io::AsyncWriteExt;

use crate::audit::event::{Event, Outcome};
use crate::audit::sinks::def::{FileSink, Fsync, HttpSink, SinkDef, SyslogAddress, SyslogSink};

/// A prepared sink: files read, clients built, nothing sent yet.
pub enum Output {
    File(Arc<std::sync::Mutex<FileOut>>),
    Stdout,
    Http(HttpOut),
    Syslog(SyslogOut),
}

impl std::fmt::Debug for Output {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::File(_) => "Output::File",
            Self::Stdout => "Output::Stdout",
            Self::Http(_) => "Output::Http",
            Self::Syslog(_) => "Output::Syslog",
        })
    }
}

impl Output {
    /// Read the files a sink names and build its client; an error names
    /// the sink and what is wrong (a start or reload refuses it).
    pub fn prepare(def: &SinkDef) -> Result<Self, String> {
        let what = format!("audit sink '{}'", def.name());
        Ok(match def {
            SinkDef::File(f) => Self::File(Arc::new(std::sync::Mutex::new(
                FileOut::open(f).map_err(|e| format!("{what}: {e}"))?,
            ))),
            SinkDef::Stdout(_) => Self::Stdout,
            SinkDef::Http(h) => Self::Http(HttpOut::new(h).map_err(|e| format!("{what}: {e}"))?),
            SinkDef::Syslog(s) => {
                Self::Syslog(SyslogOut::new(s).map_err(|e| format!("{what}: {e}"))?)
            }
        })
    }

    /// Deliver `events` (in `seq` order) whole, or fail.
    pub async fn deliver(&mut self, events: &[Event]) -> Result<(), Failure> {
        self.deliver_all(events).await.map_err(|e| {
            if e.starts_with(REFUSED) {
                Failure::Refused(e)
            } else {
                Failure::Retry(e)
            }
        })
    }

    async fn deliver_all(&mut self, events: &[Event]) -> Result<(), String> {
        match self {
            Self::File(f) => {
                let body = json_lines(events);
                let f = f.clone();
                tokio::task::spawn_blocking(move || {
                    f.lock().unwrap_or_else(|p| p.into_inner()).append(&body)
                })
                .await
                .map_err(|e| e.to_string())?
            }
            Self::Stdout => {
                let mut body = Vec::with_capacity(events.len() * 512);
                for ev in events {
                    let mut v = serde_json::to_value(ev).map_err(|e| e.to_string())?;
                    if let Some(o) = v.as_object_mut() {
                        o.insert("stream".into(), "cube-adapter-audit".into());
                    }
                    body.extend_from_slice(v.to_string().as_bytes());
                    body.push(b'\n');
                }
                tokio::task::spawn_blocking(move || {
                    let mut out = std::io::stdout().lock();
                    out.write_all(&body).and_then(|()| out.flush())
                })
                .await
                .map_err(|e| e.to_string())?
                .map_err(|e| format!("standard output: {e}"))
            }
            Self::Http(h) => h.post(events).await,
            Self::Syslog(s) => s.send(events).await,
        }
    }
}

/// Why a delivery failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// Try again later: the receiver is down, slow, or the disk full.
    Retry(String),
    /// The receiver will never take this content as it is (a datagram too
    /// long for the socket, HTTP 413): retrying the same batch cannot
    /// help, so the sink splits it, and quarantines an event that fails
    /// alone.
    Refused(String),
}

/// How a failure message starts when the receiver refused the content.
const REFUSED: &str = "refused: ";

/// `events` as `audit export` prints them, a line each.
fn json_lines(events: &[Event]) -> Vec<u8> {
    let mut body = Vec::with_capacity(events.len() * 512);
    for ev in events {
        body.extend_from_slice(crate::audit::export_line(ev).as_bytes());
        body.push(b'\n');
    }
    body
}

/// The file sink's open file.
pub struct FileOut {
    path: PathBuf,
    file: Option<std::fs::File>,
    max_bytes: u64,
    keep: u32,
    fsync: Fsync,
}

impl FileOut {
    fn open(def: &FileSink) -> Result<Self, String> {
        let mut f = Self {
            path: def.path.clone(),
            file: None,
            max_bytes: def.max_bytes,
            keep: def.keep,
            fsync: def.fsync,
        };
        f.reopen()?;
        Ok(f)
    }

    fn reopen(&mut self) -> Result<(), String> {
        use std::os::unix::fs::OpenOptionsExt;
        if let Some(dir) = self.path.parent()
            && !dir.as_os_str().is_empty()
            && !dir.exists()
        {
            std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
        }
        let created = !self.path.exists();
        let file = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o600)
            .open(&self.path)
            .map_err(|e| format!("open {}: {e}", self.path.display()))?;
        if created {
            sync_dir(&self.path);
        }
        self.file = Some(file);
        Ok(())
    }

    /// Append `body` (whole lines), rotating first when it would pass
    /// `max_bytes`. A failed write is cut back to where the file ended, so
    /// a retry never follows half a line.
    fn append(&mut self, body: &[u8]) -> Result<(), String> {
        if self.file.is_none() {
            self.reopen()?;
        }
        let len = self.current_len()?;
        if self.max_bytes > 0 && len > 0 && len + body.len() as u64 > self.max_bytes {
            self.rotate()?;
        }
        let len = self.current_len()?;
        let Some(file) = self.file.as_mut() else {
            return Err("the file is not open".into());
        };
        let r = file.write_all(body).and_then(|()| match self.fsync {
            Fsync::Batch => file.sync_data(),
            Fsync::Never => Ok(()),
        });
        if let Err(e) = r {
            // Cut back what part of the batch got in (a full disk).
            let cut = file.set_len(len);
            if cut.is_err() {
                // Whatever is there, a fresh open finds it at the next try.
                self.file = None;
            }
            return Err(format!("write {}: {e}", self.path.display()));
        }
        Ok(())
    }

    fn current_len(&mut self) -> Result<u64, String> {
        let Some(file) = self.file.as_ref() else {
            return Ok(0);
        };
        file.metadata()
            .map(|m| m.len())
            .map_err(|e| format!("stat {}: {e}", self.path.display()))
    }

    /// `PATH` → `PATH.1` → … → `PATH.keep` (the oldest falls off).
    fn rotate(&mut self) -> Result<(), String> {
        self.file = None;
        let name = |n: u32| {
            let mut p = self.path.clone().into_os_string();
            p.push(format!(".{n}"));
            PathBuf::from(p)
        };
        if self.keep == 0 {
            std::fs::remove_file(&self.path)
                .map_err(|e| format!("remove {}: {e}", self.path.display()))?;
        } else {
            let _ = std::fs::remove_file(name(self.keep));
            for n in (1..self.keep).rev() {
                let from = name(n);
                if from.exists() {
                    std::fs::rename(&from, name(n + 1))
                        .map_err(|e| format!("rename {}: {e}", from.display()))?;
                }
            }
            std::fs::rename(&self.path, name(1))
                .map_err(|e| format!("rename {}: {e}", self.path.display()))?;
        }
        sync_dir(&self.path);
        self.reopen()
    }
}

fn sync_dir(p: &Path) {
    if let Some(d) = p.parent()
        && let Ok(f) = std::fs::File::open(if d.as_os_str().is_empty() {
            Path::new(".")
        } else {
            d
        })
    {
        let _ = f.sync_all();
    }
}

/// A secret read from a file (trimmed), never printed.
#[derive(Clone)]
struct FileSecret(Arc<[u8]>);

impl FileSecret {
    fn read(path: &Path, what: &str, min: usize) -> Result<Self, String> {
        let raw = std::fs::read(path)
            .map_err(|e| format!("cannot read {what} {}: {e}", path.display()))?;
        let s = raw.trim_ascii();
        if s.len() < min {
            return Err(format!(
                "{what} {} must hold at least {min} bytes",
                path.display()
            ));
        }
        Ok(Self(s.into()))
    }
}

/// The HTTP sink's client.
pub struct HttpOut {
    http: reqwest::Client,
    url: reqwest::Url,
    name: String,
    hmac_key: Option<FileSecret>,
    token: Option<FileSecret>,
}

/// The header carrying the body's HMAC-SHA256 under the sink's key.
pub const SIGNATURE_HEADER: &str = "X-Cube-Adapter-Signature";

impl HttpOut {
    fn new(def: &HttpSink) -> Result<Self, String> {
        let url = reqwest::Url::parse(&def.url).map_err(|e| format!("url: {e}"))?;
        let ca = match &def.ca_file {
            Some(f) => Some(
                std::fs::read(f)
                    .map_err(|e| format!("cannot read ca_file {}: {e}", f.display()))?,
            ),
            None => None,
        };
        let identity = match (&def.client_cert_file, &def.client_key_file) {
            (Some(c), Some(k)) => Some((
                std::fs::read(c)
                    .map_err(|e| format!("cannot read client_cert_file {}: {e}", c.display()))?,
                std::fs::read(k)
                    .map_err(|e| format!("cannot read client_key_file {}: {e}", k.display()))?,
            )),
            _ => None,
        };
        let tls = crate::tls::client_config(
            ca.as_deref(),
            identity.as_ref().map(|(c, k)| (c.as_slice(), k.as_slice())),
        )
        .map_err(|e| format!("TLS: {e}"))?;
        let timeout = Duration::from_secs(def.timeout_seconds);
        let http = reqwest::Client::builder()
            .tls_backend_preconfigured(tls)
            .http1_only()
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(timeout)
            .timeout(timeout)
            .user_agent(concat!("cube-adapter/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| format!("HTTP client: {e}"))?;
        Ok(Self {
            http,
            url,
            name: def.name.clone(),
            hmac_key: def
                .hmac_key_file
                .as_deref()
                .map(|f| FileSecret::read(f, "hmac_key_file", 32))
                .transpose()?,
            token: def
                .token_file
                .as_deref()
                .map(|f| FileSecret::read(f, "token_file", 1))
                .transpose()?,
        })
    }

    async fn post(&self, events: &[Event]) -> Result<(), String> {
        let body = json_lines(events);
        let (first, last) = match (events.first(), events.last()) {
            (Some(a), Some(b)) => (a.seq, b.seq),
            _ => return Ok(()),
        };
        let mut req = self
            .http
            .post(self.url.clone())
            .header(reqwest::header::CONTENT_TYPE, "application/x-ndjson")
            .header("X-Cube-Adapter-Sink", &self.name)
            .header("X-Cube-Adapter-Seq", format!("{first}-{last}"));
        if let Some(k) = &self.hmac_key {
            req = req.header(SIGNATURE_HEADER, signature(&k.0, &body));
        }
        if let Some(t) = &self.token {
            let t = std::str::from_utf8(&t.0).map_err(|_| "token_file is not UTF-8".to_string())?;
            req = req.bearer_auth(t);
        }
        let host = self.url.host_str().unwrap_or_default().to_string();
        let r = req.body(body).send().await.map_err(|e| {
            // reqwest's message names the URL; the host is enough.
            let why = if e.is_timeout() {
                "no answer in time"
            } else if e.is_connect() {
                "cannot connect"
            } else {
                "request failed"
            };
            format!("POST to {host}: {why}")
        })?;
        let status = r.status();
        if status.is_success() {
            Ok(())
        } else if status == reqwest::StatusCode::PAYLOAD_TOO_LARGE {
            Err(format!("{REFUSED}POST to {host}: HTTP 413 (too large)"))
        } else {
            Err(format!("POST to {host}: HTTP {}", status.as_u16()))
        }
    }
}

/// `sha256=HEX(HMAC-SHA256(key, body))`.
pub fn signature(key: &[u8], body: &[u8]) -> String {
    match <Hmac<sha2::Sha256> as Mac>::new_from_slice(key) {
        Ok(mut m) => {
            m.update(body);
            format!("sha256={}", hex::encode(m.finalize().into_bytes()))
        }
        Err(_) => String::new(),
    }
}

/// The syslog sink's connection (opened at the first delivery, again
/// after a failure).
pub struct SyslogOut {
    address: SyslogAddress,
    facility: u8,
    app_name: String,
    hostname: String,
    conn: Option<SyslogConn>,
}

enum SyslogConn {
    Datagram(tokio::net::UnixDatagram),
    UnixStream(tokio::net::UnixStream),
    Tcp(tokio::net::TcpStream),
}

impl SyslogOut {
    fn new(def: &SyslogSink) -> Result<Self, String> {
        let hostname = nix::unistd::gethostname()
            .ok()
            .and_then(|h| h.into_string().ok())
            .filter(|h| {
                !h.is_empty() && h.len() <= 255 && h.bytes().all(|b| (33..=126).contains(&b))
            })
            .unwrap_or_else(|| "-".into());
        Ok(Self {
            address: SyslogAddress::parse(&def.address).map_err(|e| e.to_string())?,
            facility: crate::audit::sinks::def::facility_code(&def.facility)
                .ok_or_else(|| format!("facility '{}'", def.facility))?,
            app_name: def.app_name.clone(),
            hostname,
            conn: None,
        })
    }

    async fn connect(&self) -> Result<SyslogConn, String> {
        match &self.address {
            SyslogAddress::Unix(p) => {
                let d = tokio::net::UnixDatagram::unbound().map_err(|e| e.to_string())?;
                match d.connect(p) {
                    Ok(()) => Ok(SyslogConn::Datagram(d)),
                    // A stream socket (rsyslog's imuxsock can be either).
                    Err(e) if e.raw_os_error() == Some(libc::EPROTOTYPE) => {
                        tokio::net::UnixStream::connect(p)
                            .await
                            .map(SyslogConn::UnixStream)
                            .map_err(|e| format!("connect {}: {e}", p.display()))
                    }
                    Err(e) => Err(format!("connect {}: {e}", p.display())),
                }
            }
            SyslogAddress::Tcp(hp) => tokio::net::TcpStream::connect(hp.as_str())
                .await
                .map(SyslogConn::Tcp)
                .map_err(|e| format!("connect {hp}: {e}")),
        }
    }

    async fn send(&mut self, events: &[Event]) -> Result<(), String> {
        if self.conn.is_none() {
            self.conn = Some(self.connect().await?);
        }
        let r = self.send_on(events).await;
        if r.is_err() {
            self.conn = None;
        }
        r
    }

    async fn send_on(&mut self, events: &[Event]) -> Result<(), String> {
        let pid = std::process::id();
        let mut frames: Vec<u8> = vec![];
        for ev in events {
            let msg = rfc5424(self.facility, &self.hostname, &self.app_name, pid, ev);
            match self.conn.as_mut() {
                Some(SyslogConn::Datagram(d)) => {
                    d.send(msg.as_bytes()).await.map_err(|e| {
                        if e.raw_os_error() == Some(libc::EMSGSIZE) {
                            format!("{REFUSED}send event {}: {e}", ev.seq)
                        } else {
                            format!("send: {e}")
                        }
                    })?;
                }
                Some(SyslogConn::UnixStream(_)) => {
                    frames.extend_from_slice(msg.as_bytes());
                    frames.push(b'\n');
                }
                Some(SyslogConn::Tcp(_)) => {
                    // Octet counting (RFC 6587 §3.4.1).
                    frames.extend_from_slice(format!("{} ", msg.len()).as_bytes());
                    frames.extend_from_slice(msg.as_bytes());
                }
                None => return Err("not connected".into()),
            }
        }
        match self.conn.as_mut() {
            Some(SyslogConn::UnixStream(s)) => {
                s.write_all(&frames)
                    .await
                    .map_err(|e| format!("send: {e}"))?;
                s.flush().await.map_err(|e| format!("send: {e}"))
            }
            Some(SyslogConn::Tcp(s)) => {
                s.write_all(&frames)
                    .await
                    .map_err(|e| format!("send: {e}"))?;
                s.flush().await.map_err(|e| format!("send: {e}"))
            }
            _ => Ok(()),
        }
    }
}

/// One event as an RFC 5424 message: `<PRI>1 TIMESTAMP HOSTNAME APP-NAME
/// PROCID MSGID - MSG`, MSGID the action, MSG the event's JSON line.
/// Severity: warning for `error` and `uncertain`, notice for `rejected`,
/// informational otherwise.
pub fn rfc5424(facility: u8, hostname: &str, app: &str, pid: u32, ev: &Event) -> String {
    let severity = match ev.outcome {
        Outcome::Error | Outcome::Uncertain => 4,
        Outcome::Rejected => 5,
        _ => 6,
    };
    let pri = u16::from(facility) * 8 + severity;
    let msgid: String = ev
        .action
        .as_str()
        .chars()
        .filter(|c| c.is_ascii_graphic())
        .take(32)
        .collect();
    let msgid = if msgid.is_empty() { "-".into() } else { msgid };
    let ts = if ev.ts.is_empty() {
        "-"
    } else {
        ev.ts.as_str()
    };
    format!(
        "<{pri}>1 {ts} {hostname} {app} {pid} {msgid} - {}",
        crate::audit::export_line(ev)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::event::Action;

    #[test]
    fn a_syslog_message_is_rfc_5424() {
        let ev = Event {
            seq: 7,
            ts: "2026-12-03T10:00:00Z".into(),
            action: Action::Exec,
            outcome: Outcome::Uncertain,
            ..Default::default()
        };
        let m = rfc5424(10, "host", "cube-adapter", 42, &ev);
        // authpriv (10) * 8 + warning (4)
        assert!(
            m.starts_with("<84>1 2026-12-03T10:00:00Z host cube-adapter 42 exec - {"),
            "{m}"
        );
        assert!(m.ends_with('}'));
    }

    #[test]
    fn a_failed_write_leaves_no_half_line_and_rotation_keeps_count() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let def = FileSink {
            name: "f".into(),
            from: Default::default(),
            batch: 10,
            path: path.clone(),
            max_bytes: 4096,
            keep: 2,
            fsync: Fsync::Batch,
        };
        let mut f = FileOut::open(&def).unwrap();
        let line = vec![b'x'; 1000];
        for _ in 0..20 {
            let mut l = line.clone();
            l.push(b'\n');
            f.append(&l).unwrap();
        }
        let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).ok();
        assert!(size(&path).unwrap() <= 4096);
        let mut one = path.clone().into_os_string();
        one.push(".1");
        let mut three = path.clone().into_os_string();
        three.push(".3");
        assert!(size(Path::new(&one)).unwrap() <= 4096);
        assert_eq!(size(Path::new(&three)), None, "keep = 2");
    }
}
