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
use crate::audit::sinks::SinkError;
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

/// Why a sink could not be prepared (its files, its client) or a
/// delivery failed. Its text goes into `status` (`last_error`), the logs
/// and the console as it is.
#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    /// A file or directory operation (`create`, `open`, `write`, `stat`,
    /// `remove`, `rename`) on `path`.
    #[error("{op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file sink lost its file and could not open it again.
    #[error("the file is not open")]
    NotOpen,
    /// A file the sink's definition names (`ca_file`, `hmac_key_file`, …).
    #[error("cannot read {what} {}: {source}", path.display())]
    Read {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A secret file holds less than it must.
    #[error("{what} {} must hold at least {min} bytes", path.display())]
    ShortSecret {
        what: &'static str,
        path: PathBuf,
        min: usize,
    },
    #[error("token_file is not UTF-8")]
    TokenNotUtf8,
    #[error("url: {0}")]
    Url(#[source] url::ParseError),
    #[error("TLS: {0}")]
    Tls(#[source] crate::tls::TlsError),
    #[error("HTTP client: {0}")]
    Client(#[source] reqwest::Error),
    /// A syslog address that does not parse (`SyslogAddress::parse`).
    #[error(transparent)]
    Address(#[from] crate::audit::sinks::def::AddressError),
    #[error("facility '{0}'")]
    Facility(String),
    /// An event as JSON (never, in practice).
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    /// The blocking write's task ended without an answer.
    #[error(transparent)]
    Join(#[from] tokio::task::JoinError),
    #[error("standard output: {0}")]
    Stdout(#[source] std::io::Error),
    /// An HTTP request that got no answer; says why in a few words, not
    /// reqwest's message, which names the whole URL: the host is enough.
    #[error("POST to {host}: {}", post_failure(.source))]
    Post {
        host: String,
        #[source]
        source: reqwest::Error,
    },
    /// HTTP 413: the receiver refuses the content.
    #[error("{REFUSED}POST to {host}: HTTP 413 (too large)")]
    TooLarge { host: String },
    #[error("POST to {host}: HTTP {status}")]
    Status { host: String, status: u16 },
    /// The syslog socket could not be made.
    #[error("{0}")]
    Socket(#[source] std::io::Error),
    #[error("connect {to}: {source}")]
    Connect {
        to: String,
        #[source]
        source: std::io::Error,
    },
    /// A datagram too long for the socket: the receiver refuses the
    /// content.
    #[error("{REFUSED}send event {seq}: {source}")]
    DatagramTooLong {
        seq: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("send: {0}")]
    Send(#[source] std::io::Error),
    #[error("not connected")]
    NotConnected,
}

impl OutputError {
    /// Whether the receiver refused the content, so that no retry of the
    /// same batch can help.
    fn refused(&self) -> bool {
        matches!(self, Self::TooLarge { .. } | Self::DatagramTooLong { .. })
    }
}

/// A POST that got no answer, in a few words.
fn post_failure(e: &reqwest::Error) -> &'static str {
    if e.is_timeout() {
        "no answer in time"
    } else if e.is_connect() {
        "cannot connect"
    } else {
        "request failed"
    }
}

impl Output {
    /// Read the files a sink names and build its client; an error names
    /// the sink and what is wrong (a start or reload refuses it).
    pub fn prepare(def: &SinkDef) -> Result<Self, SinkError> {
        let named = |source| SinkError::Sink {
            name: def.name().to_string(),
            source,
        };
        Ok(match def {
            SinkDef::File(f) => Self::File(Arc::new(std::sync::Mutex::new(
                FileOut::open(f).map_err(named)?,
            ))),
            SinkDef::Stdout(_) => Self::Stdout,
            SinkDef::Http(h) => Self::Http(HttpOut::new(h).map_err(named)?),
            SinkDef::Syslog(s) => Self::Syslog(SyslogOut::new(s).map_err(named)?),
        })
    }

    /// Deliver `events` (in `seq` order) whole, or fail.
    pub async fn deliver(&mut self, events: &[Event]) -> Result<(), Failure> {
        self.deliver_all(events).await.map_err(|e| {
            if e.refused() {
                Failure::Refused(e)
            } else {
                Failure::Retry(e)
            }
        })
    }

    async fn deliver_all(&mut self, events: &[Event]) -> Result<(), OutputError> {
        match self {
            Self::File(f) => {
                let body = json_lines(events);
                let f = f.clone();
                tokio::task::spawn_blocking(move || {
                    f.lock().unwrap_or_else(|p| p.into_inner()).append(&body)
                })
                .await?
            }
            Self::Stdout => {
                let mut body = Vec::with_capacity(events.len() * 512);
                for ev in events {
                    let mut v = serde_json::to_value(ev)?;
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
                .await?
                .map_err(OutputError::Stdout)
            }
            Self::Http(h) => h.post(events).await,
            Self::Syslog(s) => s.send(events).await,
        }
    }
}

impl Output {
    /// Deliver a sealed recording's file (`path`, whose SHA-256 is
    /// `sha256`): the file sink copies it beside its JSON lines
    /// (`DIR/recordings/REF.cast`, written whole, synced, then renamed into
    /// place), the HTTP sink posts it (`URL/recordings/REF`). The stdout
    /// and syslog sinks cannot carry files: nothing to do.
    pub async fn deliver_recording(
        &mut self,
        recording_ref: &str,
        path: &Path,
        sha256: &str,
    ) -> Result<(), Failure> {
        let r = match self {
            Self::File(f) => {
                let dir = {
                    let g = f.lock().unwrap_or_else(|p| p.into_inner());
                    g.path
                        .parent()
                        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
                        .join("recordings")
                };
                let (from, name) = (path.to_path_buf(), format!("{recording_ref}.cast"));
                tokio::task::spawn_blocking(move || copy_whole(&from, &dir, &name))
                    .await
                    .map_err(OutputError::from)
                    .and_then(|r| r)
            }
            Self::Http(h) => h.post_recording(recording_ref, path, sha256).await,
            Self::Stdout | Self::Syslog(_) => Ok(()),
        };
        r.map_err(|e| {
            if e.refused() {
                Failure::Refused(e)
            } else {
                Failure::Retry(e)
            }
        })
    }
}

/// Copy `from` to `dir/name` whole: into a temporary file, synced, renamed
/// into place, the directory synced. A copy already there of the same
/// length is kept (a delivery again after a crash).
fn copy_whole(from: &Path, dir: &Path, name: &str) -> Result<(), OutputError> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::create_dir_all(dir).map_err(io("create", dir))?;
    let to = dir.join(name);
    let len = std::fs::metadata(from).map_err(io("stat", from))?.len();
    if std::fs::metadata(&to).is_ok_and(|m| m.len() == len) {
        return Ok(());
    }
    let tmp = dir.join(format!(".{name}.tmp"));
    let mut src = std::fs::File::open(from).map_err(io("open", from))?;
    let mut dst = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io("create", &tmp))?;
    std::io::copy(&mut src, &mut dst).map_err(io("write", &tmp))?;
    dst.sync_all().map_err(io("write", &tmp))?;
    std::fs::rename(&tmp, &to).map_err(io("rename", &to))?;
    sync_dir(&to);
    Ok(())
}

/// Why a delivery failed.
#[derive(Debug)]
pub enum Failure {
    /// Try again later: the receiver is down, slow, or the disk full.
    Retry(OutputError),
    /// The receiver will never take this content as it is (a datagram too
    /// long for the socket, HTTP 413): retrying the same batch cannot
    /// help, so the sink splits it, and quarantines an event that fails
    /// alone.
    Refused(OutputError),
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
    fn open(def: &FileSink) -> Result<Self, OutputError> {
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

    fn reopen(&mut self) -> Result<(), OutputError> {
        use std::os::unix::fs::OpenOptionsExt;
        if let Some(dir) = self.path.parent()
            && !dir.as_os_str().is_empty()
            && !dir.exists()
        {
            std::fs::create_dir_all(dir).map_err(io("create", dir))?;
        }
        let created = !self.path.exists();
        let file = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o600)
            .open(&self.path)
            .map_err(io("open", &self.path))?;
        if created {
            sync_dir(&self.path);
        }
        self.file = Some(file);
        Ok(())
    }

    /// Append `body` (whole lines), rotating first when it would pass
    /// `max_bytes`. A failed write is cut back to where the file ended, so
    /// a retry never follows half a line.
    fn append(&mut self, body: &[u8]) -> Result<(), OutputError> {
        if self.file.is_none() {
            self.reopen()?;
        }
        let len = self.current_len()?;
        if self.max_bytes > 0 && len > 0 && len + body.len() as u64 > self.max_bytes {
            self.rotate()?;
        }
        let len = self.current_len()?;
        let Some(file) = self.file.as_mut() else {
            return Err(OutputError::NotOpen);
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
            return Err(io("write", &self.path)(e));
        }
        Ok(())
    }

    fn current_len(&mut self) -> Result<u64, OutputError> {
        let Some(file) = self.file.as_ref() else {
            return Ok(0);
        };
        file.metadata()
            .map(|m| m.len())
            .map_err(io("stat", &self.path))
    }

    /// `PATH` → `PATH.1` → … → `PATH.keep` (the oldest falls off).
    fn rotate(&mut self) -> Result<(), OutputError> {
        self.file = None;
        let name = |n: u32| {
            let mut p = self.path.clone().into_os_string();
            p.push(format!(".{n}"));
            PathBuf::from(p)
        };
        if self.keep == 0 {
            std::fs::remove_file(&self.path).map_err(io("remove", &self.path))?;
        } else {
            let _ = std::fs::remove_file(name(self.keep));
            for n in (1..self.keep).rev() {
                let from = name(n);
                if from.exists() {
                    std::fs::rename(&from, name(n + 1)).map_err(io("rename", &from))?;
                }
            }
            std::fs::rename(&self.path, name(1)).map_err(io("rename", &self.path))?;
        }
        sync_dir(&self.path);
        self.reopen()
    }
}

/// An I/O error of `op` on `path`, for `map_err`.
fn io(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> OutputError {
    let path = path.to_path_buf();
    move |source| OutputError::Io { op, path, source }
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
    fn read(path: &Path, what: &'static str, min: usize) -> Result<Self, OutputError> {
        let raw = std::fs::read(path).map_err(read(what, path))?;
        let s = raw.trim_ascii();
        if s.len() < min {
            return Err(OutputError::ShortSecret {
                what,
                path: path.to_path_buf(),
                min,
            });
        }
        Ok(Self(s.into()))
    }
}

/// A failed read of the file `what` names, for `map_err`.
fn read(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> OutputError {
    let path = path.to_path_buf();
    move |source| OutputError::Read { what, path, source }
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
    fn new(def: &HttpSink) -> Result<Self, OutputError> {
        let url = reqwest::Url::parse(&def.url).map_err(OutputError::Url)?;
        let ca = match &def.ca_file {
            Some(f) => Some(std::fs::read(f).map_err(read("ca_file", f))?),
            None => None,
        };
        let identity = match (&def.client_cert_file, &def.client_key_file) {
            (Some(c), Some(k)) => Some((
                std::fs::read(c).map_err(read("client_cert_file", c))?,
                std::fs::read(k).map_err(read("client_key_file", k))?,
            )),
            _ => None,
        };
        let tls = crate::tls::client_config(
            ca.as_deref(),
            identity.as_ref().map(|(c, k)| (c.as_slice(), k.as_slice())),
        )
        .map_err(OutputError::Tls)?;
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
            .map_err(OutputError::Client)?;
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

    async fn post(&self, events: &[Event]) -> Result<(), OutputError> {
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
            let t = std::str::from_utf8(&t.0).map_err(|_| OutputError::TokenNotUtf8)?;
            req = req.bearer_auth(t);
        }
        self.send(req.body(body)).await
    }

    /// Send a request: a 2xx answer is delivered, 413 refused, anything
    /// else (or no answer) to be retried.
    async fn send(&self, req: reqwest::RequestBuilder) -> Result<(), OutputError> {
        let host = self.url.host_str().unwrap_or_default().to_string();
        let r = req.send().await.map_err(|source| OutputError::Post {
            host: host.clone(),
            source,
        })?;
        let status = r.status();
        if status.is_success() {
            Ok(())
        } else if status == reqwest::StatusCode::PAYLOAD_TOO_LARGE {
            Err(OutputError::TooLarge { host })
        } else {
            Err(OutputError::Status {
                host,
                status: status.as_u16(),
            })
        }
    }
}

impl HttpOut {
    /// POST a recording to `URL/recordings/REF` (`application/x-asciicast`,
    /// the file streamed; its SHA-256 in `X-Cube-Adapter-Recording-Sha256`,
    /// the body's HMAC in the signature header when the sink has a key).
    async fn post_recording(
        &self,
        recording_ref: &str,
        path: &Path,
        sha256: &str,
    ) -> Result<(), OutputError> {
        let mut url = self.url.clone();
        if let Ok(mut segs) = url.path_segments_mut() {
            segs.pop_if_empty().push("recordings").push(recording_ref);
        }
        let mut req = self
            .http
            .post(url)
            .header(reqwest::header::CONTENT_TYPE, "application/x-asciicast")
            .header("X-Cube-Adapter-Sink", &self.name)
            .header("X-Cube-Adapter-Recording", recording_ref)
            .header("X-Cube-Adapter-Recording-Sha256", sha256);
        if let Some(k) = &self.hmac_key {
            // The file is read once for its HMAC, then again as the body.
            let (key, p) = (k.0.clone(), path.to_path_buf());
            let sig = tokio::task::spawn_blocking(move || -> Result<String, OutputError> {
                use hmac::Mac;
                use std::io::Read;
                let mut m = <hmac::Hmac<sha2::Sha256> as Mac>::new_from_slice(&key)
                    .map_err(|_| OutputError::TokenNotUtf8)?;
                let mut f = std::fs::File::open(&p).map_err(io("open", &p))?;
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    let n = f.read(&mut buf).map_err(io("read", &p))?;
                    if n == 0 {
                        break;
                    }
                    m.update(buf.get(..n).unwrap_or_default());
                }
                Ok(format!("sha256={}", hex::encode(m.finalize().into_bytes())))
            })
            .await??;
            req = req.header(SIGNATURE_HEADER, sig);
        }
        if let Some(t) = &self.token {
            let t = std::str::from_utf8(&t.0).map_err(|_| OutputError::TokenNotUtf8)?;
            req = req.bearer_auth(t);
        }
        let f = tokio::fs::File::open(path)
            .await
            .map_err(io("open", path))?;
        let len = f.metadata().await.map_err(io("stat", path))?.len();
        let body = reqwest::Body::wrap_stream(tokio_util::io::ReaderStream::new(f));
        self.send(req.header(reqwest::header::CONTENT_LENGTH, len).body(body))
            .await
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
    fn new(def: &SyslogSink) -> Result<Self, OutputError> {
        let hostname = nix::unistd::gethostname()
            .ok()
            .and_then(|h| h.into_string().ok())
            .filter(|h| {
                !h.is_empty() && h.len() <= 255 && h.bytes().all(|b| (33..=126).contains(&b))
            })
            .unwrap_or_else(|| "-".into());
        Ok(Self {
            address: SyslogAddress::parse(&def.address)?,
            facility: crate::audit::sinks::def::facility_code(&def.facility)
                .ok_or_else(|| OutputError::Facility(def.facility.clone()))?,
            app_name: def.app_name.clone(),
            hostname,
            conn: None,
        })
    }

    async fn connect(&self) -> Result<SyslogConn, OutputError> {
        let connect = |to: String| move |source| OutputError::Connect { to, source };
        match &self.address {
            SyslogAddress::Unix(p) => {
                let d = tokio::net::UnixDatagram::unbound().map_err(OutputError::Socket)?;
                let to = p.display().to_string();
                match d.connect(p) {
                    Ok(()) => Ok(SyslogConn::Datagram(d)),
                    // A stream socket (rsyslog's imuxsock can be either).
                    Err(e) if e.raw_os_error() == Some(libc::EPROTOTYPE) => {
                        tokio::net::UnixStream::connect(p)
                            .await
                            .map(SyslogConn::UnixStream)
                            .map_err(connect(to))
                    }
                    Err(e) => Err(connect(to)(e)),
                }
            }
            SyslogAddress::Tcp(hp) => tokio::net::TcpStream::connect(hp.as_str())
                .await
                .map(SyslogConn::Tcp)
                .map_err(connect(hp.clone())),
        }
    }

    async fn send(&mut self, events: &[Event]) -> Result<(), OutputError> {
        if self.conn.is_none() {
            self.conn = Some(self.connect().await?);
        }
        let r = self.send_on(events).await;
        if r.is_err() {
            self.conn = None;
        }
        r
    }

    async fn send_on(&mut self, events: &[Event]) -> Result<(), OutputError> {
        let pid = std::process::id();
        let mut frames: Vec<u8> = vec![];
        for ev in events {
            let msg = rfc5424(self.facility, &self.hostname, &self.app_name, pid, ev);
            match self.conn.as_mut() {
                Some(SyslogConn::Datagram(d)) => {
                    d.send(msg.as_bytes()).await.map_err(|e| {
                        if e.raw_os_error() == Some(libc::EMSGSIZE) {
                            OutputError::DatagramTooLong {
                                seq: ev.seq,
                                source: e,
                            }
                        } else {
                            OutputError::Send(e)
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
                None => return Err(OutputError::NotConnected),
            }
        }
        match self.conn.as_mut() {
            Some(SyslogConn::UnixStream(s)) => {
                s.write_all(&frames).await.map_err(OutputError::Send)?;
                s.flush().await.map_err(OutputError::Send)
            }
            Some(SyslogConn::Tcp(s)) => {
                s.write_all(&frames).await.map_err(OutputError::Send)?;
                s.flush().await.map_err(OutputError::Send)
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

    /// What `status` shows: the words of before, and "refused: " where the
    /// receiver refuses the content.
    #[test]
    fn output_errors_keep_their_words() {
        let e = OutputError::TooLarge { host: "h".into() };
        assert!(e.refused());
        assert_eq!(e.to_string(), "refused: POST to h: HTTP 413 (too large)");
        let e = OutputError::Status {
            host: "h".into(),
            status: 503,
        };
        assert!(!e.refused());
        assert_eq!(e.to_string(), "POST to h: HTTP 503");
        let e = OutputError::DatagramTooLong {
            seq: 7,
            source: std::io::Error::from_raw_os_error(libc::EMSGSIZE),
        };
        assert!(e.refused());
        assert!(e.to_string().starts_with("refused: send event 7: "), "{e}");
        let e = FileSecret::read(Path::new("/nonexistent/k"), "hmac_key_file", 32)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            e.starts_with("cannot read hmac_key_file /nonexistent/k: "),
            "{e}"
        );
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
