//! Session recordings: what a PTY or a job showed, kept by the appliance
//! (never in the sandbox), sealed into the audit chain as it is written.
//!
//! A recording is an asciicast v2 file, `STATE/recordings/<ref>.cast`: a
//! header line, then one `[seconds, code, data]` line per event (`o` a
//! PTY's or job's output, `e` a job's standard error, `i` what was typed,
//! `r` a resize, `m` a marker; `ob`, `eb`, `ib`: bytes that are not UTF-8,
//! in base64). Each recording has one writer task, fed through a bounded
//! queue (a producer waits when the disk does: memory stays flat), which
//! appends each event as it comes.
//!
//! The file is cut into chunks: one closes when it holds
//! [`CHUNK_BYTES`], [`SEAL_EVERY`] after its first byte, and at the end.
//! Closing a chunk syncs the file and commits a `recording_chunk` event
//! (its index, offset, length and SHA-256) with the recording's record, in
//! one transaction; the end commits `recording_sealed` with the SHA-256 of
//! the whole file. `cube-adapter recording verify` checks a file against
//! those events, offline.
//!
//! Secrets the appliance knows (brokered credentials, preset secrets, the
//! lease's own tokens) are masked (`[REDACTED***]`, as long as the secret)
//! before anything is written, across event boundaries (`Redactor`).
//!
//! After a restart an open recording is reopened: its sealed chunks are
//! checked against the record (a changed one is `recording_damaged`), the
//! bytes written after the last seal are sealed, and it goes on (a PTY the
//! appliance re-attached to, a job still running) or is sealed.

use std::collections::HashMap;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, oneshot};

use super::Broker;
use super::leases::Lease;
use crate::audit::event::{Action, Event, Outcome};
pub use crate::store::recordings::{Chunk, Hold, Recording, RecordingKind, RecordingState};

pub use crate::store::recordings::DIR;
/// A chunk closes when it holds this many bytes.
pub const CHUNK_BYTES: u64 = 4 * 1024 * 1024;
/// … or this long after its first byte.
pub const SEAL_EVERY: Duration = Duration::from_secs(5);
/// Events a recording's queue holds before its producer waits.
const QUEUE: usize = 64;
/// What a known secret becomes: `[REDACTED***]`, as long as the secret
/// (so that a recording's byte counts stay those of the stream it
/// records); a secret shorter than 11 bytes becomes `[***…]`.
pub fn mask(len: usize) -> Vec<u8> {
    const WORD: &[u8] = b"[REDACTED";
    let mut m = Vec::with_capacity(len);
    if len >= WORD.len() + 2 {
        m.extend_from_slice(WORD);
    } else {
        m.push(b'[');
    }
    m.resize(len.saturating_sub(1), b'*');
    m.push(b']');
    m
}
/// Secrets shorter than this are not redacted (they would hit ordinary
/// text).
pub const MIN_SECRET: usize = 8;
/// The header's format version (ours, under `cube_adapter`).
pub const FORMAT: u32 = 1;

/// Which stream an event's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// A PTY's output, a job's standard output.
    Output,
    /// A job's standard error.
    Error,
    /// What was typed into a PTY.
    Input,
}

impl Stream {
    const ALL: [Stream; 3] = [Stream::Output, Stream::Error, Stream::Input];

    fn index(self) -> usize {
        match self {
            Self::Output => 0,
            Self::Error => 1,
            Self::Input => 2,
        }
    }

    /// The event code of its text, and of bytes that are not UTF-8.
    pub fn codes(self) -> (&'static str, &'static str) {
        match self {
            Self::Output => ("o", "ob"),
            Self::Error => ("e", "eb"),
            Self::Input => ("i", "ib"),
        }
    }
}

enum Msg {
    Data(Stream, Vec<u8>, f64),
    Resize(u32, u32, f64),
    Marker(String, f64),
    Finish(oneshot::Sender<Option<String>>),
}

/// Now, as Unix seconds with a fraction (recordings' own times are the
/// real clock's).
fn unix_now() -> f64 {
    let t = crate::clock::system_now();
    t.unix_timestamp_nanos() as f64 / 1e9
}

/// The handle of a live recording: cheap to clone; what is sent through it
/// is written in order.
#[derive(Clone)]
pub struct Recorder {
    tx: mpsc::Sender<Msg>,
    pub recording_ref: Arc<str>,
    pub lease_ref: Arc<str>,
}

impl Recorder {
    /// Bytes of a stream, as they happened (waits while the queue is full).
    pub async fn data(&self, stream: Stream, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        let _ = self
            .tx
            .send(Msg::Data(stream, bytes.to_vec(), unix_now()))
            .await;
    }

    pub async fn resize(&self, cols: u32, rows: u32) {
        let _ = self.tx.send(Msg::Resize(cols, rows, unix_now())).await;
    }

    pub async fn marker(&self, text: &str) {
        let _ = self.tx.send(Msg::Marker(text.into(), unix_now())).await;
    }

    /// Seal the recording: its last chunk and the whole file's digest. The
    /// digest, once in the journal.
    pub async fn finish(&self) -> Option<String> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Msg::Finish(tx)).await.ok()?;
        rx.await.ok().flatten()
    }
}

/// The live recordings of this process, by what they record (a PTY's or
/// job's ref), and where their files go.
#[derive(Default)]
pub struct Recordings {
    dir: OnceLock<PathBuf>,
    live: Mutex<HashMap<String, Recorder>>,
}

impl Recordings {
    /// Where recordings are written (`STATE/recordings`); set once at start.
    pub fn set_dir(&self, dir: PathBuf) {
        let _ = self.dir.set(dir);
    }

    pub fn dir(&self) -> Option<&Path> {
        self.dir.get().map(PathBuf::as_path)
    }

    /// Where a recording's file is.
    pub fn path(&self, rec: &Recording) -> Option<PathBuf> {
        self.dir().map(|d| d.join(rec.file_name()))
    }

    pub fn get(&self, subject: &str) -> Option<Recorder> {
        self.live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(subject)
            .cloned()
    }

    /// The live recordings of a lease.
    pub fn of_lease(&self, lease_ref: &str) -> Vec<Recorder> {
        self.live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter(|r| &*r.lease_ref == lease_ref)
            .cloned()
            .collect()
    }

    fn insert(&self, subject: &str, r: Recorder) {
        self.live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(subject.to_string(), r);
    }

    fn remove(&self, subject: &str) {
        self.live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(subject);
    }
}

/// Replaces known secrets in one stream, across the pieces it comes in:
/// the end of a piece that could be the start of a secret is held back
/// until the next piece (or the end) shows whether it is.
#[derive(Debug, Default)]
pub struct Redactor {
    secrets: Arc<Vec<Vec<u8>>>,
    held: Vec<u8>,
    /// How many secrets it replaced.
    pub redacted: u64,
}

impl Redactor {
    pub fn new(secrets: Arc<Vec<Vec<u8>>>) -> Self {
        Self {
            secrets,
            held: vec![],
            redacted: 0,
        }
    }

    /// Bytes held back (not yet written).
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// What of `bytes` (after what was held) can be written now.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<u8> {
        if self.secrets.is_empty() {
            return bytes.to_vec();
        }
        let mut buf = std::mem::take(&mut self.held);
        buf.extend_from_slice(bytes);
        let (mut out, tail_from) = self.replace(&buf);
        // Hold back the longest end of the input that starts a secret.
        let longest = self.secrets.iter().map(Vec::len).max().unwrap_or(0);
        let mut hold = 0;
        for n in (1..longest.min(buf.len() - tail_from + 1)).rev() {
            let end = buf.get(buf.len() - n..).unwrap_or_default();
            if self
                .secrets
                .iter()
                .any(|s| s.len() > n && s.starts_with(end))
            {
                hold = n;
                break;
            }
        }
        if hold > 0 {
            out.truncate(out.len() - hold);
            self.held = buf.get(buf.len() - hold..).unwrap_or_default().to_vec();
        }
        out
    }

    /// What is still held (at the end: it was not a secret).
    pub fn flush(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.held)
    }

    /// `buf` with every secret replaced, and where the unreplaced end of
    /// `buf` starts (nothing before it can be held back).
    fn replace(&mut self, buf: &[u8]) -> (Vec<u8>, usize) {
        let mut hits: Vec<(usize, usize)> = vec![];
        for s in self.secrets.iter() {
            let mut from = 0;
            while let Some(i) = find(buf.get(from..).unwrap_or_default(), s) {
                hits.push((from + i, from + i + s.len()));
                from += i + 1;
            }
        }
        if hits.is_empty() {
            return (buf.to_vec(), 0);
        }
        hits.sort_unstable();
        // Overlapping or touching hits are one span, masked once.
        let mut spans: Vec<(usize, usize)> = vec![];
        for (a, b) in hits {
            match spans.last_mut() {
                Some(last) if a <= last.1 => last.1 = last.1.max(b),
                _ => spans.push((a, b)),
            }
        }
        let mut out = Vec::with_capacity(buf.len());
        let mut at = 0;
        for (a, b) in spans {
            out.extend_from_slice(buf.get(at..a).unwrap_or_default());
            out.extend(mask(b - a));
            self.redacted += 1;
            at = b;
        }
        // The unreplaced end: bytes after the last replacement, as the
        // output's same last bytes.
        out.extend_from_slice(buf.get(at..).unwrap_or_default());
        (out, at)
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    memchr::memmem::find(hay, needle)
}

/// One event line: `[t, code, data]` and a newline.
fn line(t: f64, code: &str, data: &str) -> Vec<u8> {
    let mut s = Vec::with_capacity(data.len() + 40);
    line_into(&mut s, t, code, data);
    s
}

/// [`line`], appended to `out` (one pass over `data`, its JSON escapes
/// written as it goes).
fn line_into(out: &mut Vec<u8>, t: f64, code: &str, data: &str) {
    use std::io::Write;
    let _ = write!(out, "[{:.6}, ", t.max(0.0));
    let _ = serde_json::to_writer(&mut *out, code);
    out.extend_from_slice(b", ");
    let _ = serde_json::to_writer(&mut *out, data);
    out.extend_from_slice(b"]\n");
}

/// A `*b` line: `bytes` in base64, which needs no JSON escape.
fn bytes_line_into(out: &mut Vec<u8>, t: f64, code: &str, bytes: &[u8]) {
    use std::io::Write;
    let _ = write!(out, "[{:.6}, \"{code}\", \"", t.max(0.0));
    let at = out.len();
    out.resize(at + bytes.len().div_ceil(3) * 4, 0);
    let n = B64
        .encode_slice(bytes, out.get_mut(at..).unwrap_or_default())
        .unwrap_or(0);
    out.truncate(at + n);
    out.extend_from_slice(b"\"]\n");
}

/// `bytes` (after `carry`, the end of the last piece that was an
/// incomplete character) as event lines: text as `code`, bytes that are
/// not UTF-8 in base64 as `bcode`; the new carry.
fn encode(t: f64, (code, bcode): (&str, &str), carry: &mut Vec<u8>, bytes: &[u8]) -> Vec<u8> {
    let joined;
    let buf: &[u8] = if carry.is_empty() {
        bytes
    } else {
        let mut b = std::mem::take(carry);
        b.extend_from_slice(bytes);
        joined = b;
        &joined
    };
    let mut out = Vec::with_capacity(buf.len() + buf.len() / 3 + 64);
    // Mostly not text (a binary's bytes): one base64 event for all of it,
    // not an event per stray byte.
    let mut bad = 0;
    let mut at: &[u8] = buf;
    while let Err(e) = std::str::from_utf8(at) {
        match e.error_len() {
            Some(n) => {
                bad += 1;
                at = at.get(e.valid_up_to() + n..).unwrap_or_default();
            }
            None => break,
        }
        if bad > 4 {
            bytes_line_into(&mut out, t, bcode, buf);
            return out;
        }
    }
    let mut rest: &[u8] = buf;
    while !rest.is_empty() {
        match std::str::from_utf8(rest) {
            Ok(s) => {
                line_into(&mut out, t, code, s);
                break;
            }
            Err(e) => {
                let (ok, bad) = rest.split_at(e.valid_up_to());
                if !ok.is_empty() {
                    line_into(&mut out, t, code, &String::from_utf8_lossy(ok));
                }
                match e.error_len() {
                    // An incomplete character at the end: the next piece
                    // may complete it.
                    None => {
                        *carry = bad.to_vec();
                        break;
                    }
                    Some(n) => {
                        let (b, after) = bad.split_at(n.min(bad.len()));
                        bytes_line_into(&mut out, t, bcode, b);
                        rest = after;
                    }
                }
            }
        }
    }
    out
}

/// The first line of a recording.
fn header(r: &Recording, cols: u32, rows: u32, start: f64) -> Vec<u8> {
    let title = format!("{} {} on {}", r.kind.as_str(), r.subject, r.lease_ref);
    let v = serde_json::json!({
        "version": 2,
        "width": cols,
        "height": rows,
        "timestamp": start.floor() as i64,
        "title": title,
        "env": {"TERM": "xterm-256color"},
        "cube_adapter": {
            "format": FORMAT,
            "recording_ref": r.recording_ref,
            "kind": r.kind.as_str(),
            "subject": r.subject,
            "lease_ref": r.lease_ref,
            "sandbox_ref": r.sandbox_ref,
            "profile": r.profile,
            "start": start,
        },
    });
    let mut b = v.to_string().into_bytes();
    b.push(b'\n');
    b
}

/// The recording a file's header names, and its start.
pub fn read_header(first_line: &str) -> Option<(String, f64)> {
    let v: serde_json::Value = serde_json::from_str(first_line).ok()?;
    let c = v.get("cube_adapter")?;
    Some((
        c.get("recording_ref")?.as_str()?.to_string(),
        c.get("start")?.as_f64()?,
    ))
}

/// The bytes of each stream a recording holds: (output, error, input).
pub fn stream_bytes(file: &[u8]) -> [u64; 3] {
    let mut n = [0u64; 3];
    for l in file.split(|c| *c == b'\n').skip(1) {
        let Ok((_, code, data)) = serde_json::from_slice::<(f64, String, String)>(l) else {
            continue;
        };
        let len = match code.as_str() {
            "o" | "e" | "i" => data.len() as u64,
            "ob" | "eb" | "ib" => B64.decode(data.as_bytes()).map_or(0, |b| b.len() as u64),
            _ => continue,
        };
        let i = match code.as_bytes().first() {
            Some(b'o') => 0,
            Some(b'e') => 1,
            _ => 2,
        };
        if let Some(x) = n.get_mut(i) {
            *x += len;
        }
    }
    n
}

/// What a recording's writer holds.
struct Writer {
    broker: Broker,
    rec: Recording,
    file: std::fs::File,
    /// The file's length (what was written).
    len: u64,
    chunk_hash: Sha256,
    file_hash: Sha256,
    /// When the open chunk got its first byte.
    chunk_since: Option<Instant>,
    start: f64,
    redactors: [Redactor; 3],
    carries: [Vec<u8>; 3],
}

impl Writer {
    /// A writer at the start of `file` (nothing written yet).
    fn new(
        broker: Broker,
        rec: Recording,
        file: std::fs::File,
        start: f64,
        secrets: Arc<Vec<Vec<u8>>>,
    ) -> Self {
        Self {
            broker,
            rec,
            file,
            len: 0,
            chunk_hash: Sha256::new(),
            file_hash: Sha256::new(),
            chunk_since: None,
            start,
            redactors: [
                Redactor::new(secrets.clone()),
                Redactor::new(secrets.clone()),
                Redactor::new(secrets),
            ],
            carries: Default::default(),
        }
    }

    fn write(&mut self, b: &[u8]) -> std::io::Result<()> {
        if b.is_empty() {
            return Ok(());
        }
        self.file.write_all(b)?;
        self.chunk_hash.update(b);
        self.file_hash.update(b);
        self.len += b.len() as u64;
        if self.chunk_since.is_none() {
            self.chunk_since = Some(Instant::now());
        }
        Ok(())
    }

    fn t(&self, at: f64) -> f64 {
        at - self.start
    }

    fn data(&mut self, s: Stream, bytes: &[u8], at: f64) -> std::io::Result<()> {
        let i = s.index();
        // No secret to look for: the bytes as they are, not a copy.
        let clean = match self.redactors.get_mut(i) {
            Some(r) if r.secrets.is_empty() => std::borrow::Cow::Borrowed(bytes),
            Some(r) => std::borrow::Cow::Owned(r.push(bytes)),
            None => return Ok(()),
        };
        let t = self.t(at);
        let lines = match self.carries.get_mut(i) {
            Some(c) => encode(t, s.codes(), c, &clean),
            None => return Ok(()),
        };
        self.write(&lines)
    }

    /// Write what each stream still holds (at the end).
    fn drain(&mut self) -> std::io::Result<()> {
        let t = self.t(unix_now());
        for s in Stream::ALL {
            let i = s.index();
            let rest = self
                .redactors
                .get_mut(i)
                .map(Redactor::flush)
                .unwrap_or_default();
            let mut out = match self.carries.get_mut(i) {
                Some(c) => encode(t, s.codes(), c, &rest),
                None => vec![],
            };
            if let Some(c) = self.carries.get_mut(i)
                && !c.is_empty()
            {
                out.extend(line(t, s.codes().1, &B64.encode(&*c)));
                c.clear();
            }
            self.write(&out)?;
        }
        Ok(())
    }

    fn event(&self, action: Action) -> Event {
        let j = self.broker.journal();
        let mut ev = j.event(action);
        ev.tenant_digest = Some(j.digest("tenant", self.rec.tenant.as_bytes()));
        ev.lease_ref = Some(self.rec.lease_ref.clone());
        ev.sandbox_ref = Some(self.rec.sandbox_ref.clone());
        ev.profile = Some(self.rec.profile.clone());
        ev.recording_ref = Some(self.rec.recording_ref.clone());
        match self.rec.kind {
            RecordingKind::Pty => ev.pty_ref = Some(self.rec.subject.clone()),
            RecordingKind::Job => ev.job_ref = Some(self.rec.subject.clone()),
            // An exec's recording is named by its own ref.
            RecordingKind::Exec => {}
        }
        ev.outcome = Outcome::Ok;
        ev.phase = crate::audit::event::Phase::Event;
        ev
    }

    /// Close the open chunk, if it holds anything: sync the file, then
    /// commit its digest with the record.
    async fn seal(&mut self) -> bool {
        let from = self.rec.sealed_bytes();
        if self.len <= from {
            self.chunk_since = None;
            return true;
        }
        // The sync waits on the disk: off the runtime's threads.
        let synced = match self.file.try_clone() {
            Ok(f) => tokio::task::spawn_blocking(move || f.sync_data())
                .await
                .unwrap_or_else(|e| Err(std::io::Error::other(e))),
            Err(e) => Err(e),
        };
        if let Err(e) = synced {
            tracing::error!(recording = %self.rec.recording_ref, error = %e, "cannot sync a recording");
            return false;
        }
        let sha = hex::encode(self.chunk_hash.clone().finalize());
        let c = Chunk {
            offset: from,
            len: self.len - from,
            sha256: sha.clone(),
        };
        let mut ev = self.event(Action::RecordingChunk);
        ev.chunk = Some(self.rec.chunks.len() as u64);
        ev.offset = Some(c.offset);
        ev.bytes = Some(c.len);
        ev.content_sha256 = Some(sha);
        let mut rec = self.rec.clone();
        rec.chunks.push(c);
        match self.commit(ev, rec).await {
            Ok(()) => {
                self.chunk_hash = Sha256::new();
                self.chunk_since = None;
                true
            }
            Err(e) => {
                // The bytes stay on disk, unsealed: the next seal (or the
                // next start) takes them.
                tracing::error!(recording = %self.rec.recording_ref, error = %e, "cannot seal a recording's chunk");
                false
            }
        }
    }

    /// Commit `ev` with the record as it becomes (`rec`, stamped now),
    /// which the writer then holds.
    async fn commit(
        &mut self,
        ev: Event,
        mut rec: Recording,
    ) -> Result<(), crate::store::StoreError> {
        rec.updated_at = self.broker.now().0;
        let r2 = rec.clone();
        self.broker
            .inner
            .store
            .write(move |txn, chain| {
                chain.append(txn, ev)?;
                crate::store::recordings::put(txn, &r2)
            })
            .await?;
        self.rec = rec;
        Ok(())
    }

    /// Seal the last chunk and the whole file.
    async fn finish(&mut self) -> Option<String> {
        if let Err(e) = self.drain() {
            tracing::error!(recording = %self.rec.recording_ref, error = %e, "cannot write a recording");
        }
        if !self.seal().await {
            return None;
        }
        let digest = hex::encode(self.file_hash.clone().finalize());
        let mut ev = self.event(Action::RecordingSealed);
        ev.chunk = Some(self.rec.chunks.len() as u64);
        ev.bytes = Some(self.len);
        ev.content_sha256 = Some(digest.clone());
        let redacted: u64 = self.redactors.iter().map(|r| r.redacted).sum();
        if redacted > 0 {
            ev.error_code = Some(format!("redacted:{redacted}"));
        }
        let mut rec = self.rec.clone();
        rec.state = RecordingState::Sealed;
        rec.digest = Some(digest.clone());
        rec.bytes = self.len;
        match self.commit(ev, rec).await {
            Ok(()) => Some(digest),
            Err(e) => {
                tracing::error!(recording = %self.rec.recording_ref, error = %e, "cannot seal a recording");
                None
            }
        }
    }

    async fn run(mut self, mut rx: mpsc::Receiver<Msg>) {
        let subject = self.rec.subject.clone();
        loop {
            let wait = match self.chunk_since {
                Some(since) => SEAL_EVERY.saturating_sub(since.elapsed()),
                None => Duration::from_secs(3600),
            };
            let msg = tokio::select! {
                m = rx.recv() => m,
                _ = tokio::time::sleep(wait) => {
                    self.seal().await;
                    continue;
                }
            };
            let r = match msg {
                // Every sender is gone without a finish (this process is
                // stopping): what was written is sealed at the next start.
                None => {
                    self.seal().await;
                    break;
                }
                Some(Msg::Data(s, b, at)) => self.data(s, &b, at),
                Some(Msg::Resize(c, r, at)) => {
                    let l = line(self.t(at), "r", &format!("{c}x{r}"));
                    self.write(&l)
                }
                Some(Msg::Marker(text, at)) => {
                    let l = line(self.t(at), "m", &text);
                    self.write(&l)
                }
                Some(Msg::Finish(done)) => {
                    let d = self.finish().await;
                    self.broker.inner.recordings.remove(&subject);
                    let _ = done.send(d);
                    return;
                }
            };
            if let Err(e) = r {
                tracing::error!(recording = %self.rec.recording_ref, error = %e, "cannot write a recording");
            }
            if self.len - self.rec.sealed_bytes() >= CHUNK_BYTES {
                self.seal().await;
            }
        }
        self.broker.inner.recordings.remove(&subject);
    }
}

/// Why a recording could not be started or reopened.
#[derive(Debug, thiserror::Error)]
pub enum RecordingError {
    #[error("recordings have no directory (the appliance did not set one)")]
    NoDir,
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn open_append(path: &Path, create: bool) -> Result<std::fs::File, RecordingError> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .append(true)
        .create_new(create)
        .mode(0o600)
        .open(path)
        .map_err(|source| RecordingError::Io {
            path: path.to_path_buf(),
            source,
        })
}

impl Broker {
    /// The secrets a lease's recordings must not hold: its profile's
    /// brokered credentials, its preset's `${FILE:…}` secrets and the
    /// lease's own tokens, each as read now.
    pub(crate) fn recording_secrets(&self, l: &Lease) -> Arc<Vec<Vec<u8>>> {
        let cfg = self.config();
        let mut files: Vec<PathBuf> = vec![];
        if let Some(pr) = cfg.profiles.get(&l.profile)
            && let Some(e) = &pr.egress
        {
            files.extend(e.credentials.values().map(|c| c.secret_file.clone()));
        }
        if let Some(name) = l.preset.as_deref().and_then(|p| p.split('@').next())
            && let Some(pre) = cfg.presets.get(name)
        {
            for f in &pre.files {
                if let Ok(paths) = crate::config::presets::secret_files(&f.content) {
                    files.extend(paths.into_iter().map(PathBuf::from));
                }
            }
        }
        let mut out: Vec<Vec<u8>> = vec![];
        for f in files {
            if let Ok(mut b) = std::fs::read(&f) {
                while b.last().is_some_and(|c| *c == b'\n' || *c == b'\r') {
                    b.pop();
                }
                out.push(b);
            }
        }
        for sealed in [&l.egress_token, &l.traffic_token].into_iter().flatten() {
            if let Ok(b) = self.inner.store.sealer.open(sealed) {
                out.push(b);
            }
        }
        out.retain(|s| s.len() >= MIN_SECRET);
        out.sort();
        out.dedup();
        Arc::new(out)
    }

    /// Whether a profile's synchronous execs are recorded (`execs`).
    pub(crate) fn records_execs(&self, profile: &str) -> bool {
        self.config()
            .profiles
            .get(profile)
            .and_then(|p| p.recordings.as_ref())
            .is_some_and(|r| r.enabled && r.execs)
    }

    /// Whether a profile's PTYs and jobs are recorded (the default).
    pub(crate) fn records(&self, profile: &str) -> bool {
        self.config()
            .profiles
            .get(profile)
            .and_then(|p| p.recordings.as_ref())
            .is_none_or(|r| r.enabled)
    }

    /// Start recording `subject` (a PTY's or job's ref) of a lease: its
    /// file is made with its header; the record to store with what it
    /// records comes back with the handle, whose writer runs from now.
    pub(crate) fn begin_recording(
        &self,
        kind: RecordingKind,
        l: &Lease,
        subject: &str,
        (cols, rows): (u32, u32),
    ) -> Result<(Recorder, Recording), RecordingError> {
        let dir = self
            .inner
            .recordings
            .dir()
            .ok_or(RecordingError::NoDir)?
            .to_path_buf();
        std::fs::create_dir_all(&dir).map_err(|source| RecordingError::Io {
            path: dir.clone(),
            source,
        })?;
        let now = self.now().0;
        let rec = Recording {
            recording_ref: super::leases::new_ref("rec"),
            tenant: l.tenant.clone(),
            lease_ref: l.lease_ref.clone(),
            sandbox_ref: l.sandbox_ref.clone(),
            profile: l.profile.clone(),
            kind,
            subject: subject.to_string(),
            state: RecordingState::Open,
            created_at: now.clone(),
            updated_at: now,
            chunks: vec![],
            digest: None,
            bytes: 0,
            damaged: vec![],
            replica: self.inner.store.replica().map(str::to_string),
            hold: None,
        };
        let path = dir.join(rec.file_name());
        let file = open_append(&path, true)?;
        let start = unix_now();
        let secrets = self.recording_secrets(l);
        let mut w = Writer::new(self.clone(), rec.clone(), file, start, secrets);
        w.write(&header(&rec, cols, rows, start))
            .map_err(|source| RecordingError::Io { path, source })?;
        Ok((self.spawn_writer(w), rec))
    }

    fn spawn_writer(&self, w: Writer) -> Recorder {
        let (tx, rx) = mpsc::channel(QUEUE);
        let r = Recorder {
            tx,
            recording_ref: w.rec.recording_ref.as_str().into(),
            lease_ref: w.rec.lease_ref.as_str().into(),
        };
        self.inner.recordings.insert(&w.rec.subject, r.clone());
        tokio::spawn(w.run(rx));
        r
    }

    /// Reopen a recording left open by an earlier run: check its sealed
    /// chunks (one that changed is recorded `recording_damaged`), drop a
    /// last line cut short by the crash, and go on writing after it.
    pub(crate) async fn reopen_recording(
        &self,
        rec: Recording,
        l: Option<&Lease>,
    ) -> Result<Recorder, RecordingError> {
        let dir = self
            .inner
            .recordings
            .dir()
            .ok_or(RecordingError::NoDir)?
            .to_path_buf();
        let path = dir.join(rec.file_name());
        let io = |source| RecordingError::Io {
            path: path.clone(),
            source,
        };
        let mut file = open_append(&path, false)?;
        let mut all = vec![];
        file.read_to_end(&mut all).map_err(io)?;
        // Only whole lines: a crash can cut the last one.
        let keep = all
            .iter()
            .rposition(|c| *c == b'\n')
            .map_or(0, |i| i + 1)
            .max(usize::try_from(rec.sealed_bytes()).unwrap_or(usize::MAX))
            .min(all.len());
        if keep < all.len() {
            all.truncate(keep);
            file.set_len(keep as u64).map_err(io)?;
            file.seek(std::io::SeekFrom::End(0)).map_err(io)?;
        }
        let mut damaged = vec![];
        for (i, c) in rec.chunks.iter().enumerate() {
            let (a, b) = (
                usize::try_from(c.offset).unwrap_or(usize::MAX),
                usize::try_from(c.offset + c.len).unwrap_or(usize::MAX),
            );
            let ok = all
                .get(a..b)
                .is_some_and(|s| hex::encode(Sha256::digest(s)) == c.sha256);
            if !ok {
                damaged.push(i as u64);
            }
        }
        let start = all
            .split(|c| *c == b'\n')
            .next()
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(read_header)
            .map_or_else(unix_now, |(_, s)| s);
        let sealed = usize::try_from(rec.sealed_bytes())
            .unwrap_or(usize::MAX)
            .min(all.len());
        let mut chunk_hash = Sha256::new();
        chunk_hash.update(all.get(sealed..).unwrap_or_default());
        let mut file_hash = Sha256::new();
        file_hash.update(&all);
        let secrets = match l {
            Some(l) => self.recording_secrets(l),
            None => Arc::default(),
        };
        let mut w = Writer::new(self.clone(), rec, file, start, secrets);
        w.len = all.len() as u64;
        w.chunk_hash = chunk_hash;
        w.file_hash = file_hash;
        w.chunk_since = (all.len() > sealed).then(Instant::now);
        if !damaged.is_empty() {
            tracing::error!(recording = %w.rec.recording_ref, chunks = ?damaged, "a recording's sealed chunks changed while the appliance was down");
            let mut ev = w.event(Action::RecordingDamaged);
            ev.outcome = Outcome::Error;
            ev.chunk = damaged.first().copied();
            ev.error_code = Some("recording_damaged".into());
            let mut rec = w.rec.clone();
            rec.damaged = damaged;
            if let Err(e) = w.commit(ev, rec).await {
                tracing::error!(recording = %w.rec.recording_ref, error = %e, "cannot record a damaged recording");
            }
        }
        // What the crash left unsealed is sealed now, as its own chunk.
        w.seal().await;
        Ok(self.spawn_writer(w))
    }

    /// At start: the open recordings this process answers for (its own,
    /// and with a shared database those of replicas that are not running).
    pub(crate) fn open_recordings(&self) -> Vec<Recording> {
        let store = &self.inner.store;
        let all = store
            .read_now(crate::store::recordings::all)
            .unwrap_or_default();
        all.into_iter()
            .filter(|r| r.state == RecordingState::Open)
            .filter(|r| match &r.replica {
                Some(x) => {
                    store.replica() == Some(x.as_str()) || !store.replica_running(x).unwrap_or(true)
                }
                None => true,
            })
            .collect()
    }

    /// At start, in the background: re-attach to the PTYs the previous run
    /// left running, then seal the recordings nothing goes on with.
    pub fn spawn_resume(&self) {
        let b = self.clone();
        tokio::spawn(async move {
            match b.resume_ptys().await {
                Ok((0, 0)) => {}
                Ok((back, lost)) => tracing::info!(
                    reattached = back,
                    lost,
                    "PTYs of the previous run: re-attached, or lost"
                ),
                Err(e) => tracing::error!(error = %e, "cannot resume the previous run's PTYs"),
            }
            b.resume_job_recordings().await;
            b.seal_left_recordings().await;
        });
    }

    /// At start: seal the open recordings nothing goes on with (those of
    /// PTYs and jobs that did not outlive the restart).
    pub(crate) async fn seal_left_recordings(&self) {
        for rec in self.open_recordings() {
            if self.inner.recordings.get(&rec.subject).is_some() {
                continue;
            }
            let id = rec.recording_ref.clone();
            match self.reopen_recording(rec, None).await {
                Ok(r) => {
                    r.marker("the appliance restarted; what this recorded has ended")
                        .await;
                    r.finish().await;
                }
                Err(e) => {
                    tracing::error!(recording = %id, error = %e, "cannot reopen a recording to seal it");
                }
            }
        }
    }

    /// A lease whose sandbox is gone: seal its live recordings (nothing
    /// more will come; each gets up to 10 s) and name its sealed ones,
    /// `(ref, SHA-256, bytes)` in ref order.
    pub(crate) async fn seal_lease_recordings(
        &self,
        lease_ref: &str,
    ) -> Vec<(String, String, u64)> {
        for r in self.inner.recordings.of_lease(lease_ref) {
            let _ = tokio::time::timeout(Duration::from_secs(10), r.finish()).await;
        }
        let mut v: Vec<(String, String, u64)> = self
            .inner
            .store
            .read_now(|txn| crate::store::recordings::of_lease(txn, lease_ref))
            .unwrap_or_default()
            .into_iter()
            .filter_map(|r| Some((r.recording_ref, r.digest?, r.bytes)))
            .collect();
        v.sort();
        v
    }

    /// The recording of a lease's PTY or job, if it has one.
    pub(crate) fn recording_of(&self, lease_ref: &str, subject: &str) -> Option<Recording> {
        self.inner
            .store
            .read_now(|txn| crate::store::recordings::of_lease(txn, lease_ref))
            .ok()?
            .into_iter()
            .rev()
            .find(|r| r.subject == subject)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn red(secrets: &[&str]) -> Redactor {
        Redactor::new(Arc::new(
            secrets.iter().map(|s| s.as_bytes().to_vec()).collect(),
        ))
    }

    #[test]
    fn a_secret_is_redacted_across_pieces() {
        let mut r = red(&["s3cr3t-value"]);
        let mut out = r.push(b"token=s3cr");
        out.extend(r.push(b"3t-val"));
        out.extend(r.push(b"ue and more s3cr3t-value!"));
        out.extend(r.flush());
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "token=[REDACTED**] and more [REDACTED**]!"
        );
        assert_eq!(r.redacted, 2);
    }

    #[test]
    fn a_prefix_that_is_not_a_secret_comes_out_whole() {
        let mut r = red(&["s3cr3t-value"]);
        let mut out = r.push(b"abc s3c");
        assert_eq!(out, b"abc ");
        out.extend(r.push(b"ond"));
        out.extend(r.flush());
        assert_eq!(out, b"abc s3cond");
        assert_eq!(r.redacted, 0);
        let mut none = red(&[]);
        assert_eq!(none.push(b"s3cr3t-value"), b"s3cr3t-value");
    }

    #[test]
    fn overlapping_secrets_are_one_redaction() {
        let mut r = red(&["abcdefgh12", "defgh12345"]);
        let mut out = r.push(b"xxabcdefgh12345yy");
        out.extend(r.flush());
        assert_eq!(out, b"xx[REDACTED***]yy".as_slice());
        assert_eq!(mask(8), b"[******]");
        assert_eq!(mask(11), b"[REDACTED*]");
    }

    fn rec(id: &str, lease: &str, created: &str, bytes: u64, sealed: bool) -> Recording {
        Recording {
            recording_ref: id.into(),
            tenant: "t".into(),
            lease_ref: lease.into(),
            sandbox_ref: "abcd1234".into(),
            profile: "p".into(),
            kind: RecordingKind::Pty,
            subject: format!("pty_{id}"),
            state: if sealed {
                RecordingState::Sealed
            } else {
                RecordingState::Open
            },
            created_at: created.into(),
            updated_at: created.into(),
            chunks: vec![Chunk {
                offset: 0,
                len: bytes,
                sha256: String::new(),
            }],
            digest: None,
            bytes: if sealed { bytes } else { 0 },
            damaged: vec![],
            replica: None,
            hold: None,
        }
    }

    #[test]
    fn retention_by_age_lease_and_total_never_a_hold_or_an_open_one() {
        let mut cfg = crate::config::Config::default();
        cfg.profiles.insert(
            "p".into(),
            crate::config::Profile {
                recordings: Some(crate::config::ProfileRecordings {
                    enabled: true,
                    execs: false,
                    retain_days: 10,
                    max_lease_bytes: 250,
                }),
                ..Default::default()
            },
        );
        cfg.recordings.max_total_bytes = 1000;
        let now = crate::clock::parse_unix("2026-02-01T00:00:00Z").unwrap();
        let mut held = rec("a", "l1", "2026-01-01T00:00:00Z", 100, true);
        held.hold = Some(Hold {
            at: String::new(),
            note_digest: String::new(),
        });
        let all = vec![
            held,
            rec("b", "l1", "2026-01-02T00:00:00Z", 100, true),
            rec("c", "l2", "2026-01-30T00:00:00Z", 100, true),
            rec("d", "l2", "2026-01-30T01:00:00Z", 100, true),
            rec("e", "l2", "2026-01-30T02:00:00Z", 100, true),
            rec("f", "l3", "2026-01-31T00:00:00Z", 600, false),
            rec("g", "l4", "2026-01-31T01:00:00Z", 200, true),
        ];
        let gone: Vec<(String, &str)> = expired(&all, &cfg, now)
            .into_iter()
            .map(|(r, why)| (r.recording_ref, why.as_str()))
            .collect();
        // b by age (a is held); c over l2's cap (300 > 250); then over the
        // total (a 100 + d 100 + e 100 + f 600 + g 200 = 1100 > 1000): d,
        // the oldest removable left. f is still being written.
        assert_eq!(
            gone,
            vec![
                ("b".to_string(), "age"),
                ("c".to_string(), "lease_cap"),
                ("d".to_string(), "total_cap"),
            ]
        );
    }

    #[test]
    fn binary_bytes_are_one_event() {
        let mut carry = vec![];
        let bytes: Vec<u8> = (0..=255u8).collect();
        let out = encode(0.0, ("o", "ob"), &mut carry, &bytes);
        let s = String::from_utf8(out).unwrap();
        assert_eq!(s.lines().count(), 1, "{s}");
        assert_eq!(stream_bytes(format!("{{}}\n{s}").as_bytes()), [256, 0, 0]);
        assert!(carry.is_empty());
    }

    #[test]
    fn a_files_streams_are_counted_as_bytes() {
        let f = b"{}\n[0.1, \"o\", \"caf\\u00e9\"]\n[0.2, \"ob\", \"/w==\"]\n[0.3, \"e\", \"x\"]\n[0.4, \"m\", \"note\"]\n[0.5, \"i\", \"ls\\n\"]\n";
        assert_eq!(stream_bytes(f), [6, 1, 3]);
    }

    #[test]
    fn text_and_bytes_are_encoded_exactly() {
        let mut carry = vec![];
        // "é" split over two pieces, then a byte that is never UTF-8.
        let a = encode(1.0, ("o", "ob"), &mut carry, b"caf\xc3");
        assert_eq!(
            String::from_utf8(a).unwrap(),
            "[1.000000, \"o\", \"caf\"]\n"
        );
        assert_eq!(carry, b"\xc3");
        let b = encode(2.5, ("o", "ob"), &mut carry, b"\xa9\xff\n");
        assert_eq!(
            String::from_utf8(b).unwrap(),
            "[2.500000, \"o\", \"é\"]\n[2.500000, \"ob\", \"/w==\"]\n[2.500000, \"o\", \"\\n\"]\n"
        );
        assert!(carry.is_empty());
    }

    #[test]
    fn a_header_names_its_recording() {
        let r = Recording {
            recording_ref: "rec_abc".into(),
            tenant: "t".into(),
            lease_ref: "lease_x".into(),
            sandbox_ref: "abcd1234".into(),
            profile: "p".into(),
            kind: RecordingKind::Job,
            subject: "job_x".into(),
            state: RecordingState::Open,
            created_at: String::new(),
            updated_at: String::new(),
            chunks: vec![],
            digest: None,
            bytes: 0,
            damaged: vec![],
            replica: None,
            hold: None,
        };
        let h = header(&r, 80, 24, 1_700_000_000.25);
        let s = String::from_utf8(h).unwrap();
        assert!(s.ends_with('\n') && s.matches('\n').count() == 1);
        assert_eq!(
            read_header(s.trim_end()),
            Some(("rec_abc".to_string(), 1_700_000_000.25))
        );
        assert!(!s.contains("\"t\""), "the tenant stays out of the file");
    }
}

impl Broker {
    /// A recording an auditor of its tenant or an admin reads (`action`:
    /// `recording_view` or `recording_download`, recorded either way): the
    /// record and its file's path. Anyone else is refused
    /// (`auditor_required`); another tenant's is `recording_not_found`, as a
    /// missing one is.
    pub async fn recording_for(
        &self,
        p: &crate::auth::Principal,
        ctx: &super::Ctx,
        action: Action,
        recording_ref: &str,
    ) -> super::Result<(Recording, PathBuf)> {
        use super::{Code, Error};
        let ev = self.event(p, action, ctx);
        if !p.may_audit() {
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        Code::AuditorRequired,
                        "recordings are for auditors and admins",
                    ),
                )
                .await);
        }
        let missing = || Error::new(Code::RecordingNotFound, "no such recording");
        let rec = if super::leases::valid_ref(recording_ref, "rec") {
            self.inner
                .store
                .read_now(|txn| crate::store::recordings::get(txn, recording_ref))?
        } else {
            None
        };
        let Some(rec) = rec.filter(|r| p.is_admin() || r.tenant == p.tenant) else {
            return Err(self.reject(ev, missing()).await);
        };
        let Some(path) = self.inner.recordings.path(&rec).filter(|f| f.exists()) else {
            return Err(self.reject(ev, missing()).await);
        };
        let mut ev = ev;
        ev.recording_ref = Some(rec.recording_ref.clone());
        ev.lease_ref = Some(rec.lease_ref.clone());
        ev.sandbox_ref = Some(rec.sandbox_ref.clone());
        ev.outcome = Outcome::Ok;
        self.inner.journal.record(ev).await?;
        Ok((rec, path))
    }

    /// The recordings a principal may replay (auditors: their tenant's;
    /// admins: all), newest first, at most `limit`; of one lease with
    /// `lease`.
    pub fn recordings_for(
        &self,
        p: &crate::auth::Principal,
        lease: Option<&str>,
        limit: usize,
    ) -> super::Result<Vec<Recording>> {
        if !p.may_audit() {
            return Ok(vec![]);
        }
        let mut all = self.inner.store.read_now(|txn| match lease {
            Some(l) => crate::store::recordings::of_lease(txn, l),
            None => crate::store::recordings::all(txn),
        })?;
        all.retain(|r| p.is_admin() || r.tenant == p.tenant);
        all.sort_by(|a, b| b.created_at.cmp(&a.created_at));
        all.truncate(limit);
        Ok(all)
    }
}

/// Why retention removes a recording (`recording_deleted`'s `cleanup`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expiry {
    /// Older than its profile's `retain_days`.
    Age,
    /// Its lease's recordings hold more than `max_lease_bytes`.
    LeaseCap,
    /// All recordings hold more than `[recordings] max_total_bytes`.
    TotalCap,
}

impl Expiry {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Age => "age",
            Self::LeaseCap => "lease_cap",
            Self::TotalCap => "total_cap",
        }
    }
}

/// A recording's size as retention counts it.
fn size(r: &Recording) -> u64 {
    match r.state {
        RecordingState::Sealed => r.bytes,
        RecordingState::Open => r.sealed_bytes(),
    }
}

/// What retention removes from `all` (every recording this process keeps
/// files of), and why, oldest first: sealed recordings past their
/// profile's age, then the oldest of a lease over its cap, then the oldest
/// of all while all are over the total. One under a hold, or still being
/// written, is never removed, but counts toward the caps.
pub fn expired(
    all: &[Recording],
    cfg: &crate::config::Config,
    now: i64,
) -> Vec<(Recording, Expiry)> {
    let policy = |r: &Recording| {
        cfg.profiles
            .get(&r.profile)
            .and_then(|p| p.recordings.clone())
            .unwrap_or_default()
    };
    let removable = |r: &Recording| r.state == RecordingState::Sealed && r.hold.is_none();
    let mut by_age: Vec<&Recording> = all.iter().collect();
    by_age.sort_by(|a, b| a.created_at.cmp(&b.created_at));
    let mut gone: Vec<(Recording, Expiry)> = vec![];
    let is_gone = |g: &[(Recording, Expiry)], r: &Recording| {
        g.iter().any(|(x, _)| x.recording_ref == r.recording_ref)
    };
    for r in &by_age {
        let days = i64::try_from(policy(r).retain_days).unwrap_or(i64::MAX);
        let sealed_at = crate::clock::parse_unix(&r.updated_at).unwrap_or(now);
        if removable(r) && now.saturating_sub(sealed_at) > days.saturating_mul(86_400) {
            gone.push(((*r).clone(), Expiry::Age));
        }
    }
    let mut leases: Vec<&str> = all.iter().map(|r| r.lease_ref.as_str()).collect();
    leases.sort_unstable();
    leases.dedup();
    for lease in leases {
        let mine: Vec<&&Recording> = by_age.iter().filter(|r| r.lease_ref == lease).collect();
        let cap = mine.first().map_or(u64::MAX, |r| policy(r).max_lease_bytes);
        let mut total: u64 = mine
            .iter()
            .filter(|r| !is_gone(&gone, r))
            .map(|r| size(r))
            .sum();
        for r in &mine {
            if total <= cap {
                break;
            }
            if removable(r) && !is_gone(&gone, r) {
                total = total.saturating_sub(size(r));
                gone.push(((**r).clone(), Expiry::LeaseCap));
            }
        }
    }
    let mut total: u64 = all.iter().filter(|r| !is_gone(&gone, r)).map(size).sum();
    for r in &by_age {
        if total <= cfg.recordings.max_total_bytes {
            break;
        }
        if removable(r) && !is_gone(&gone, r) {
            total = total.saturating_sub(size(r));
            gone.push(((*r).clone(), Expiry::TotalCap));
        }
    }
    gone
}

impl Broker {
    /// Retention (each upkeep pass, on every replica for the files on its
    /// disk): remove what [`expired`] names, each with a
    /// `recording_deleted` event committed with the record's removal,
    /// before its file goes. Returns how many.
    pub async fn recordings_gc(&self) -> super::Result<u64> {
        let store = &self.inner.store;
        let ours = store.replica().map(str::to_string);
        let all: Vec<Recording> = store
            .read(crate::store::recordings::all)
            .await?
            .into_iter()
            .filter(|r| r.replica == ours || r.replica.is_none())
            .collect();
        let cfg = self.config();
        let mut n = 0;
        for (r, why) in expired(&all, &cfg, self.now().1) {
            let j = self.journal();
            let mut ev = j.event(Action::RecordingDeleted);
            ev.tenant_digest = Some(j.digest("tenant", r.tenant.as_bytes()));
            ev.lease_ref = Some(r.lease_ref.clone());
            ev.sandbox_ref = Some(r.sandbox_ref.clone());
            ev.profile = Some(r.profile.clone());
            ev.recording_ref = Some(r.recording_ref.clone());
            ev.bytes = Some(size(&r));
            ev.content_sha256 = r.digest.clone();
            ev.cleanup = Some(why.as_str().into());
            ev.outcome = Outcome::Ok;
            ev.phase = crate::audit::event::Phase::Event;
            let r2 = r.clone();
            store
                .write(move |txn, chain| {
                    // Still as it was read: a hold set since keeps it.
                    if crate::store::recordings::get(txn, &r2.recording_ref)?
                        .is_none_or(|c| c.hold.is_some())
                    {
                        return Ok(false);
                    }
                    chain.append(txn, ev)?;
                    crate::store::recordings::remove(txn, &r2)?;
                    Ok(true)
                })
                .await
                .map(|done| {
                    if done {
                        n += 1;
                    }
                })?;
            if let Some(p) = self.inner.recordings.path(&r)
                && let Err(e) = std::fs::remove_file(&p)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::error!(recording = %r.recording_ref, error = %e, "cannot remove a recording's file");
            }
            self.inner.gc.actions.inc(["recording_deleted"]);
        }
        Ok(n)
    }

    /// Set or lift a legal hold (`recording hold|unhold`): recorded as
    /// `recording_hold` with a keyed digest of the operator's note.
    pub async fn recording_hold(
        &self,
        recording_ref: &str,
        hold: bool,
        note: &str,
    ) -> super::Result<Recording> {
        use super::{Code, Error};
        let j = self.journal();
        let note_digest = j.digest("note", note.as_bytes());
        let mut ev = j.event(Action::RecordingHold);
        ev.recording_ref = Some(recording_ref.to_string());
        ev.note_digest = Some(note_digest.clone());
        ev.decision = Some(if hold { "hold" } else { "unhold" }.into());
        ev.outcome = Outcome::Ok;
        ev.phase = crate::audit::event::Phase::Event;
        let at = self.now().0;
        let id = recording_ref.to_string();
        let r = self
            .inner
            .store
            .write(move |txn, chain| {
                let Some(mut r) = crate::store::recordings::get(txn, &id)? else {
                    return Ok(None);
                };
                r.hold = hold.then_some(Hold { at, note_digest });
                ev.lease_ref = Some(r.lease_ref.clone());
                ev.sandbox_ref = Some(r.sandbox_ref.clone());
                chain.append(txn, ev)?;
                crate::store::recordings::put(txn, &r)?;
                Ok(Some(r))
            })
            .await?;
        r.ok_or_else(|| Error::new(Code::RecordingNotFound, "no such recording"))
    }

    /// Every recording (the operator's `recording list`), oldest first.
    pub async fn all_recordings(&self, lease: Option<&str>) -> super::Result<Vec<Recording>> {
        let mut v = self.inner.store.read(crate::store::recordings::all).await?;
        if let Some(l) = lease {
            v.retain(|r| r.lease_ref == l);
        }
        v.sort_by(|a, b| a.created_at.cmp(&b.created_at));
        Ok(v)
    }
}

/// `recordings_digest` of a killed lease's sealed recordings: SHA-256 over
/// `RECORDING_REF SHA256\n` lines, in ref order (none: no recording).
pub fn recordings_digest(sealed: &[(String, String, u64)]) -> Option<String> {
    if sealed.is_empty() {
        return None;
    }
    let mut h = Sha256::new();
    for (r, d, _) in sealed {
        h.update(format!("{r} {d}\n").as_bytes());
    }
    Some(hex::encode(h.finalize()))
}

/// What `recording verify` found.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Verdict {
    pub recording_ref: String,
    /// Every sealed chunk matches, nothing follows the seal, and the
    /// journal's events hold together.
    pub ok: bool,
    /// The journal has the recording's `recording_sealed`.
    pub sealed: bool,
    pub chunks: u64,
    /// The file's length.
    pub bytes: u64,
    /// Bytes after the last sealed chunk of a recording still open (they
    /// cannot be checked yet).
    pub unsealed_bytes: u64,
    /// SHA-256 of the whole file, as the journal names it (sealed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    pub problems: Vec<String>,
}

/// Check a recording's bytes against its journal events (those with its
/// `recording_ref`, in journal order).
pub fn verify_file(file: &[u8], events: &[Event]) -> Verdict {
    let rec_ref = file
        .split(|c| *c == b'\n')
        .next()
        .and_then(|h| std::str::from_utf8(h).ok())
        .and_then(read_header)
        .map(|(r, _)| r)
        .unwrap_or_default();
    let mut v = Verdict {
        recording_ref: rec_ref.clone(),
        bytes: file.len() as u64,
        ..Verdict::default()
    };
    let mine = || {
        events
            .iter()
            .filter(|e| e.recording_ref.as_deref() == Some(rec_ref.as_str()))
    };
    let mut at = 0u64;
    let mut next = 0u64;
    for e in mine().filter(|e| e.action == Action::RecordingChunk) {
        let (Some(i), Some(off), Some(len), Some(sha)) =
            (e.chunk, e.offset, e.bytes, e.content_sha256.as_deref())
        else {
            v.problems
                .push(format!("event {} is a chunk without its fields", e.seq));
            continue;
        };
        if i != next || off != at {
            v.problems.push(format!(
                "chunk {i} (event {}) starts at byte {off}; chunk {next} was expected at byte {at}",
                e.seq
            ));
        }
        let slice = usize::try_from(off)
            .ok()
            .zip(usize::try_from(off + len).ok())
            .and_then(|(a, b)| file.get(a..b));
        match slice {
            None => v.problems.push(format!(
                "chunk {i} (bytes {off}..{}) is missing: the file ends at byte {}",
                off + len,
                file.len()
            )),
            Some(s) if hex::encode(Sha256::digest(s)) != sha => v.problems.push(format!(
                "chunk {i} (bytes {off}..{}) does not match the journal (event {})",
                off + len,
                e.seq
            )),
            Some(_) => {}
        }
        v.chunks += 1;
        next = i + 1;
        at = off + len;
    }
    for e in mine().filter(|e| e.action == Action::RecordingDamaged) {
        v.problems.push(format!(
            "the appliance found chunk {} changed at a restart (event {})",
            e.chunk.unwrap_or_default(),
            e.seq
        ));
    }
    match mine().find(|e| e.action == Action::RecordingSealed) {
        Some(e) => {
            v.sealed = true;
            v.digest = e.content_sha256.clone();
            if e.chunk != Some(v.chunks) {
                v.problems.push(format!(
                    "the seal (event {}) counts {} chunks; the journal has {}",
                    e.seq,
                    e.chunk.unwrap_or_default(),
                    v.chunks
                ));
            }
            if e.bytes != Some(v.bytes) {
                v.problems.push(format!(
                    "the file has {} bytes; the seal (event {}) says {}",
                    v.bytes,
                    e.seq,
                    e.bytes.unwrap_or_default()
                ));
            }
            if e.content_sha256.as_deref() != Some(hex::encode(Sha256::digest(file)).as_str()) {
                v.problems.push(format!(
                    "the file's SHA-256 is not the one sealed (event {})",
                    e.seq
                ));
            }
        }
        None => v.unsealed_bytes = v.bytes.saturating_sub(at),
    }
    if rec_ref.is_empty() {
        v.problems
            .push("the file has no cube-adapter recording header".into());
    } else if v.chunks == 0 && !v.sealed {
        v.problems
            .push(format!("the journal has no chunk of {rec_ref}"));
    }
    v.ok = v.problems.is_empty();
    v
}

/// Whether journal event `e`, read from an export, holds together with the
/// one before it (`prev`): its hash is its content's, and it links to
/// `prev` when that is the event just before it. An export that does not
/// start at the first event, or skips some, is checked where it can be.
pub fn check_link(prev: Option<&Event>, e: &Event) -> Vec<String> {
    let mut out = vec![];
    if e.compute_hash() != e.hash {
        out.push(format!(
            "journal event {}: its hash does not match its content",
            e.seq
        ));
    }
    match prev {
        Some(p) if p.seq + 1 == e.seq && e.prev_hash != p.hash => out.push(format!(
            "journal event {}: it does not link to event {}",
            e.seq, p.seq
        )),
        None if e.seq == 1 && e.prev_hash != crate::audit::event::GENESIS => {
            out.push("journal event 1 does not start the chain".into());
        }
        _ => {}
    }
    out
}
