//! envd `process.Process`: start, re-attach, input, signals, PTY resize, list.
//!
//! Output fans out to every attached stream with back-pressure (a slow reader
//! slows the process, as envd does); output produced while nobody is attached
//! is dropped, and a re-attach sees only what comes after it.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use bytes::Bytes;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, ChildStdin};
use tokio::sync::mpsc;

use super::rpc::RpcError;
use super::users::{self, User};
use crate::sys;
use crate::wire::{
    DataEvent, EndEvent, ProcessConfig, ProcessEvent, ProcessInfo, ProcessSelector, Pty,
    StartRequest,
};

/// Chunk sizes envd uses.
const STD_CHUNK: usize = 32 * 1024;
const PTY_CHUNK: usize = 16 * 1024;
/// Events buffered per attached stream before the process is slowed down.
const SUBSCRIBER_QUEUE: usize = 8;

/// What the agent knows about the sandbox it serves.
#[derive(Debug, Clone, Default)]
pub struct AgentEnv {
    /// Environment given at sandbox creation (`envVars`).
    pub env_vars: Vec<(String, String)>,
    /// With `isolation = "none"`: sandbox paths (`/workspace`, `/tmp`, home)
    /// and the host directories that stand in for them.
    pub path_map: Vec<(PathBuf, PathBuf)>,
    /// With `isolation = "none"`: run every process as the agent's own user.
    pub run_as_self: bool,
    /// At a `Connect-Timeout-Ms` deadline, kill only the direct process and
    /// end the stream with `deadline_exceeded`, as the real envd does
    /// (otherwise: the whole process group, and a normal `end` event).
    pub faithful: bool,
    /// Refuse what this older envd version refuses.
    pub envd_version: Option<crate::wire::EnvdVersion>,
    /// The sandbox has a network namespace of its own: its loopback is its
    /// own, and envd may forward the proxy's requests for a port of the
    /// sandbox to it (`ports.rs`). False: its loopback is the host's.
    pub own_netns: bool,
}

impl AgentEnv {
    /// Map a sandbox path to the path this process must use.
    pub fn host_path(&self, p: &Path) -> PathBuf {
        for (from, to) in &self.path_map {
            if let Ok(rest) = p.strip_prefix(from) {
                return to.join(rest);
            }
        }
        p.to_path_buf()
    }
}

enum Input {
    Pipe(tokio::sync::Mutex<Option<ChildStdin>>),
    Pty(Arc<std::fs::File>),
    None,
}

struct Proc {
    pid: u32,
    config: ProcessConfig,
    tag: Option<String>,
    input: Input,
    subscribers: Mutex<Vec<mpsc::Sender<ProcessEvent>>>,
}

/// The process table.
#[derive(Clone, Default)]
pub struct Processes {
    table: Arc<Mutex<HashMap<u32, Arc<Proc>>>>,
    env: Arc<AgentEnv>,
}

/// A started or re-attached process: its pid and the events to stream.
pub struct Attached {
    pub pid: u32,
    pub events: mpsc::Receiver<ProcessEvent>,
}

fn not_found(sel: &ProcessSelector) -> RpcError {
    match (&sel.pid, &sel.tag) {
        (Some(pid), _) => RpcError::not_found(format!("process with pid {pid} not found")),
        (None, Some(tag)) => RpcError::not_found(format!("process with tag {tag} not found")),
        (None, None) => RpcError::invalid("process selector needs a pid or a tag"),
    }
}

impl Processes {
    pub fn new(env: AgentEnv) -> Self {
        Self {
            table: Arc::default(),
            env: Arc::new(env),
        }
    }

    pub fn env(&self) -> &AgentEnv {
        &self.env
    }

    fn get(&self, sel: &ProcessSelector) -> Result<Arc<Proc>, RpcError> {
        let table = self
            .table
            .lock()
            .map_err(|_| RpcError::internal("process table poisoned"))?;
        let found = match (&sel.pid, &sel.tag) {
            (Some(pid), _) => table.get(pid).cloned(),
            (None, Some(tag)) => table
                .values()
                .find(|p| p.tag.as_deref() == Some(tag))
                .cloned(),
            (None, None) => None,
        };
        found.ok_or_else(|| not_found(sel))
    }

    pub fn list(&self) -> Vec<ProcessInfo> {
        let Ok(table) = self.table.lock() else {
            return vec![];
        };
        let mut v: Vec<ProcessInfo> = table
            .values()
            .map(|p| ProcessInfo {
                config: p.config.clone(),
                pid: p.pid,
                tag: p.tag.clone(),
            })
            .collect();
        v.sort_by_key(|p| p.pid);
        v
    }

    /// Start a process. `deadline` (from `Connect-Timeout-Ms`) is also the
    /// process's lifetime: it is killed when it expires.
    pub async fn start(
        &self,
        req: StartRequest,
        user: &User,
        deadline: Option<Duration>,
    ) -> Result<Attached, RpcError> {
        let cfg = &req.process;
        if cfg.cmd.is_empty() {
            return Err(RpcError::invalid("process.cmd is required"));
        }
        let cwd = self.resolve_cwd(cfg.cwd.as_deref(), user)?;
        let mut cmd = std::process::Command::new(&cfg.cmd);
        cmd.args(&cfg.args).current_dir(&cwd).env_clear();
        cmd.env(
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        );
        cmd.env("HOME", self.env.host_path(&user.home));
        cmd.env("USER", &user.name).env("LOGNAME", &user.name);
        if !self.env.path_map.is_empty()
            && let Some((_, tmp)) = self
                .env
                .path_map
                .iter()
                .find(|(f, _)| f == Path::new("/tmp"))
        {
            cmd.env("TMPDIR", tmp);
        }
        for (k, v) in &self.env.env_vars {
            cmd.env(k, v);
        }
        for (k, v) in &cfg.envs {
            cmd.env(k, v);
        }
        // Run as the requested user (no-op when it is us already).
        if !self.env.run_as_self && nix::unistd::geteuid().as_raw() != user.uid {
            cmd.uid(user.uid).gid(user.gid);
        }

        let (tx, rx) = mpsc::channel(SUBSCRIBER_QUEUE);
        let (child, input, outputs) = match req.pty {
            Some(pty) => spawn_pty(cmd, pty)?,
            None => spawn_pipes(cmd, req.stdin.unwrap_or(true))?,
        };
        let pid = child
            .id()
            .ok_or_else(|| RpcError::internal("process exited before it got a pid"))?;
        let proc_ = Arc::new(Proc {
            pid,
            config: req.process.clone(),
            tag: req.tag.clone(),
            input,
            subscribers: Mutex::new(vec![tx]),
        });
        if let Ok(mut t) = self.table.lock() {
            t.insert(pid, proc_.clone());
        }
        let table = self.table.clone();
        tokio::spawn(pump(proc_, child, outputs, deadline, table));
        Ok(Attached { pid, events: rx })
    }

    fn resolve_cwd(&self, cwd: Option<&str>, user: &User) -> Result<PathBuf, RpcError> {
        let p = match cwd {
            // Unisolated sandboxes have no /workspace of their own on the
            // host's paths: start where their files are.
            None | Some("") if self.env.run_as_self => PathBuf::from("/workspace"),
            None | Some("") => user.home.clone(),
            Some(c) => expand_user_path(c, user),
        };
        let host = self.env.host_path(&p);
        match std::fs::metadata(&host) {
            Ok(m) if m.is_dir() => Ok(host),
            Ok(_) => Err(RpcError::invalid(format!(
                "cwd '{}' is not a directory",
                p.display()
            ))),
            Err(_) if cwd.is_none() || cwd == Some("") => Ok(PathBuf::from("/")),
            Err(_) => Err(RpcError::invalid(format!(
                "cwd '{}' does not exist",
                p.display()
            ))),
        }
    }

    /// Re-attach to a running process: only output produced from now on.
    pub fn connect(&self, sel: &ProcessSelector) -> Result<Attached, RpcError> {
        let p = self.get(sel)?;
        let (tx, rx) = mpsc::channel(SUBSCRIBER_QUEUE);
        p.subscribers
            .lock()
            .map_err(|_| RpcError::internal("poisoned"))?
            .push(tx);
        Ok(Attached {
            pid: p.pid,
            events: rx,
        })
    }

    pub async fn send_input(
        &self,
        sel: &ProcessSelector,
        stdin: Option<&str>,
        pty: Option<&str>,
    ) -> Result<(), RpcError> {
        let p = self.get(sel)?;
        let (data, to_pty) = match (stdin, pty) {
            (Some(s), None) => (s, false),
            (None, Some(s)) => (s, true),
            _ => return Err(RpcError::invalid("input needs exactly one of stdin or pty")),
        };
        let bytes = B64
            .decode(data)
            .map_err(|_| RpcError::invalid("input is not valid base64"))?;
        match (&p.input, to_pty) {
            (Input::Pipe(stdin), false) => {
                let mut guard = stdin.lock().await;
                let w = guard
                    .as_mut()
                    .ok_or_else(|| RpcError::internal("stdin is closed"))?;
                w.write_all(&bytes)
                    .await
                    .map_err(|e| RpcError::internal(format!("write to stdin: {e}")))?;
                w.flush()
                    .await
                    .map_err(|e| RpcError::internal(format!("write to stdin: {e}")))?;
                Ok(())
            }
            (Input::Pty(master), true) => {
                let master = master.clone();
                tokio::task::spawn_blocking(move || {
                    use std::io::Write;
                    (&*master).write_all(&bytes)
                })
                .await
                .map_err(|e| RpcError::internal(e.to_string()))?
                .map_err(|e| RpcError::internal(format!("write to pty: {e}")))
            }
            (Input::Pty(_), false) => {
                Err(RpcError::internal("process has a pty: send input as pty"))
            }
            (Input::Pipe(_), true) => Err(RpcError::internal("process has no pty")),
            (Input::None, _) => Err(RpcError::internal("process was started without stdin")),
        }
    }

    pub async fn close_stdin(&self, sel: &ProcessSelector) -> Result<(), RpcError> {
        let p = self.get(sel)?;
        match &p.input {
            Input::Pipe(stdin) => {
                stdin.lock().await.take();
                Ok(())
            }
            _ => Err(RpcError::internal("process has no stdin pipe")),
        }
    }

    pub fn signal(
        &self,
        sel: &ProcessSelector,
        signal: &serde_json::Value,
    ) -> Result<(), RpcError> {
        let sig = match signal {
            serde_json::Value::String(s) if s == "SIGNAL_SIGKILL" => Signal::SIGKILL,
            serde_json::Value::String(s) if s == "SIGNAL_SIGTERM" => Signal::SIGTERM,
            serde_json::Value::Number(n) if n.as_u64() == Some(9) => Signal::SIGKILL,
            serde_json::Value::Number(n) if n.as_u64() == Some(15) => Signal::SIGTERM,
            other => {
                return Err(RpcError::new(
                    "unimplemented",
                    format!("signal {other} is not supported"),
                ));
            }
        };
        let p = self.get(sel)?;
        signal_group(p.pid, sig).map_err(|e| RpcError::internal(format!("signal: {e}")))
    }

    pub fn resize(&self, sel: &ProcessSelector, pty: Option<Pty>) -> Result<(), RpcError> {
        let p = self.get(sel)?;
        let Some(pty) = pty else { return Ok(()) };
        match &p.input {
            Input::Pty(master) => {
                let rows = u16::try_from(pty.size.rows).unwrap_or(u16::MAX);
                let cols = u16::try_from(pty.size.cols).unwrap_or(u16::MAX);
                sys::set_winsize(master.as_fd(), rows, cols)
                    .map_err(|e| RpcError::internal(format!("resize: {e}")))
            }
            _ => Err(RpcError::internal("process has no pty")),
        }
    }

    /// Kill every process this agent started (used on rollback).
    pub fn kill_all(&self) {
        let pids: Vec<u32> = self
            .table
            .lock()
            .map(|t| t.keys().copied().collect())
            .unwrap_or_default();
        for pid in pids {
            let _ = signal_group(pid, Signal::SIGKILL);
        }
    }
}

/// `~` and relative paths resolve under the user's home.
pub fn expand_user_path(p: &str, user: &User) -> PathBuf {
    if p == "~" {
        user.home.clone()
    } else if let Some(rest) = p.strip_prefix("~/") {
        user.home.join(rest)
    } else if p.starts_with('/') {
        PathBuf::from(p)
    } else {
        user.home.join(p)
    }
}

/// Signal the process group (the process and what it started); fall back to
/// the process alone if it left its group.
fn signal_group(pid: u32, sig: Signal) -> nix::Result<()> {
    let pid = Pid::from_raw(i32::try_from(pid).unwrap_or(i32::MAX));
    match killpg(pid, sig) {
        Ok(()) => Ok(()),
        Err(_) => nix::sys::signal::kill(pid, sig),
    }
}

type Outputs = Vec<(Box<dyn AsyncRead + Send + Unpin>, Stream, usize)>;

#[derive(Clone, Copy)]
enum Stream {
    Stdout,
    Stderr,
    Pty,
}

fn spawn_pipes(
    mut cmd: std::process::Command,
    stdin: bool,
) -> Result<(Child, Input, Outputs), RpcError> {
    cmd.stdin(if stdin { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let mut child = tokio::process::Command::from(cmd)
        .spawn()
        .map_err(spawn_error)?;
    let input = match child.stdin.take() {
        Some(s) => Input::Pipe(tokio::sync::Mutex::new(Some(s))),
        None => Input::None,
    };
    let mut outs: Outputs = vec![];
    if let Some(o) = child.stdout.take() {
        outs.push((Box::new(o), Stream::Stdout, STD_CHUNK));
    }
    if let Some(e) = child.stderr.take() {
        outs.push((Box::new(e), Stream::Stderr, STD_CHUNK));
    }
    Ok((child, input, outs))
}

fn spawn_pty(
    mut cmd: std::process::Command,
    pty: Pty,
) -> Result<(Child, Input, Outputs), RpcError> {
    let size = nix::pty::Winsize {
        ws_row: u16::try_from(pty.size.rows).unwrap_or(24).max(1),
        ws_col: u16::try_from(pty.size.cols).unwrap_or(80).max(1),
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    let pair = nix::pty::openpty(Some(&size), None)
        .map_err(|e| RpcError::internal(format!("openpty: {e}")))?;
    let slave: OwnedFd = pair.slave;
    let dup = |fd: &OwnedFd| {
        fd.try_clone()
            .map_err(|e| RpcError::internal(format!("pty: {e}")))
    };
    cmd.stdin(Stdio::from(dup(&slave)?))
        .stdout(Stdio::from(dup(&slave)?))
        .stderr(Stdio::from(slave));
    sys::setsid_with_controlling_tty(&mut cmd);
    let master = std::fs::File::from(pair.master);
    let reader = master
        .try_clone()
        .map_err(|e| RpcError::internal(format!("pty: {e}")))?;
    let child = tokio::process::Command::from(cmd)
        .spawn()
        .map_err(spawn_error)?;
    // The parent's copies of the slave were moved into `cmd` and are closed
    // when it is dropped (end of this function), so reads see EIO at exit.
    let reader: Box<dyn AsyncRead + Send + Unpin> = Box::new(BlockingReader::new(reader));
    Ok((
        child,
        Input::Pty(Arc::new(master)),
        vec![(reader, Stream::Pty, PTY_CHUNK)],
    ))
}

fn spawn_error(e: std::io::Error) -> RpcError {
    match e.kind() {
        std::io::ErrorKind::NotFound => RpcError::invalid(format!("executable not found: {e}")),
        std::io::ErrorKind::PermissionDenied => {
            RpcError::invalid(format!("permission denied: {e}"))
        }
        _ => RpcError::invalid(format!("failed to start process: {e}")),
    }
}

/// Reads a blocking fd (the PTY master) on a dedicated thread.
struct BlockingReader {
    rx: mpsc::Receiver<std::io::Result<Bytes>>,
    pending: Bytes,
}

impl BlockingReader {
    fn new(mut f: std::fs::File) -> Self {
        let (tx, rx) = mpsc::channel::<std::io::Result<Bytes>>(4);
        std::thread::spawn(move || {
            use std::io::Read;
            let mut buf = vec![0u8; PTY_CHUNK];
            loop {
                match f.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        let chunk = Bytes::copy_from_slice(buf.get(..n).unwrap_or_default());
                        if tx.blocking_send(Ok(chunk)).is_err() {
                            break;
                        }
                    }
                    // EIO: every slave fd is closed, the terminal is gone.
                    Err(e) if e.raw_os_error() == Some(libc::EIO) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        let _ = tx.blocking_send(Err(e));
                        break;
                    }
                }
            }
        });
        Self {
            rx,
            pending: Bytes::new(),
        }
    }
}

impl AsyncRead for BlockingReader {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        loop {
            if !self.pending.is_empty() {
                let n = self.pending.len().min(buf.remaining());
                let chunk = self.pending.split_to(n);
                buf.put_slice(&chunk);
                return Poll::Ready(Ok(()));
            }
            match self.rx.poll_recv(cx) {
                Poll::Ready(Some(Ok(b))) => self.pending = b,
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(e)),
                Poll::Ready(None) => return Poll::Ready(Ok(())),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

/// Deliver one event to every attached stream, waiting for room in each
/// (back-pressure); streams that went away are dropped.
async fn deliver(p: &Proc, ev: ProcessEvent) {
    let subs: Vec<mpsc::Sender<ProcessEvent>> =
        p.subscribers.lock().map(|s| s.clone()).unwrap_or_default();
    let mut gone = false;
    for s in &subs {
        if s.send(ev.clone()).await.is_err() {
            gone = true;
        }
    }
    if gone && let Ok(mut s) = p.subscribers.lock() {
        s.retain(|t| !t.is_closed());
    }
}

fn data_event(stream: Stream, bytes: &[u8]) -> ProcessEvent {
    let b = Some(B64.encode(bytes));
    ProcessEvent::Data(match stream {
        Stream::Stdout => DataEvent {
            stdout: b,
            ..Default::default()
        },
        Stream::Stderr => DataEvent {
            stderr: b,
            ..Default::default()
        },
        Stream::Pty => DataEvent {
            pty: b,
            ..Default::default()
        },
    })
}

/// Read all outputs in arrival order, wait for exit, emit `end`.
async fn pump(
    p: Arc<Proc>,
    mut child: Child,
    outputs: Outputs,
    deadline: Option<Duration>,
    table: Arc<Mutex<HashMap<u32, Arc<Proc>>>>,
) {
    let (tx, mut rx) = mpsc::channel::<(Stream, Bytes)>(2);
    let mut readers = Vec::new();
    for (mut r, stream, chunk) in outputs {
        let tx = tx.clone();
        readers.push(tokio::spawn(async move {
            let mut buf = vec![0u8; chunk];
            // Bytes of a UTF-8 character cut by the read, held for the next
            // chunk: the SDK decodes each chunk on its own.
            let mut carry: Vec<u8> = Vec::new();
            loop {
                match r.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        let mut data = std::mem::take(&mut carry);
                        data.extend_from_slice(buf.get(..n).unwrap_or_default());
                        let keep = incomplete_utf8_tail(&data);
                        carry = data.split_off(data.len() - keep);
                        if data.is_empty() {
                            continue;
                        }
                        if tx.send((stream, Bytes::from(data))).await.is_err() {
                            break;
                        }
                    }
                }
            }
            if !carry.is_empty() {
                let _ = tx.send((stream, Bytes::from(carry))).await;
            }
        }));
    }
    drop(tx);

    let mut deadline = deadline.map(|d| Box::pin(tokio::time::sleep(d)));
    let mut status = None;
    let mut outputs_done = false;
    // Until the process has exited, forward output as it comes.
    while status.is_none() {
        tokio::select! {
            biased;
            msg = rx.recv(), if !outputs_done => match msg {
                Some((s, b)) => deliver(&p, data_event(s, &b)).await,
                None => outputs_done = true,
            },
            st = child.wait() => status = Some(st),
            () = async { if let Some(d) = deadline.as_mut() { d.await } else { std::future::pending().await } } => {
                let _ = signal_group(p.pid, Signal::SIGKILL);
                deadline = None;
            }
        }
    }
    // The process is gone: take what is already in the pipes. A grandchild
    // that kept a pipe open may write more, but it is not this process's.
    while !outputs_done {
        match tokio::time::timeout(Duration::from_millis(50), rx.recv()).await {
            Ok(Some((s, b))) => deliver(&p, data_event(s, &b)).await,
            Ok(None) | Err(_) => outputs_done = true,
        }
    }
    for r in readers {
        r.abort();
    }
    if let Ok(mut t) = table.lock() {
        t.remove(&p.pid);
    }
    let end = match status {
        Some(Ok(st)) => end_event(st),
        Some(Err(e)) => EndEvent {
            error: Some(e.to_string()),
            ..Default::default()
        },
        None => EndEvent::default(),
    };
    deliver(&p, ProcessEvent::End(end)).await;
    if let Ok(mut s) = p.subscribers.lock() {
        s.clear();
    }
}

/// How many trailing bytes of `b` start a UTF-8 character that is not yet
/// complete (0 when the tail is complete or is not UTF-8 at all).
pub fn incomplete_utf8_tail(b: &[u8]) -> usize {
    for back in 1..=3usize.min(b.len()) {
        let Some(&byte) = b.get(b.len() - back) else {
            break;
        };
        if byte & 0b1100_0000 == 0b1000_0000 {
            continue; // continuation byte: look further back
        }
        let need = match byte {
            0xC2..=0xDF => 2,
            0xE0..=0xEF => 3,
            0xF0..=0xF4 => 4,
            _ => return 0,
        };
        return if need > back { back } else { 0 };
    }
    0
}

/// Go's `ProcessState` rendering, as envd reports it.
pub fn end_event(st: std::process::ExitStatus) -> EndEvent {
    if let Some(code) = st.code() {
        if code == 0 {
            EndEvent {
                exited: true,
                status: "exit status 0".into(),
                ..Default::default()
            }
        } else {
            let s = format!("exit status {code}");
            EndEvent {
                exit_code: Some(code),
                exited: true,
                status: s.clone(),
                error: Some(s),
            }
        }
    } else {
        let sig = st.signal().unwrap_or(0);
        let s = format!("signal: {}", crate::wire::signal_name(sig));
        EndEvent {
            exit_code: Some(-1),
            exited: false,
            status: s.clone(),
            error: Some(s),
        }
    }
}

/// Resolve the user an RPC runs as.
pub fn user_for(name: &str) -> Result<User, RpcError> {
    users::lookup(name)
        .ok_or_else(|| RpcError::new("unauthenticated", format!("invalid username: '{name}'")))
}

#[cfg(test)]
mod tests {
    use super::incomplete_utf8_tail;

    #[test]
    fn utf8_tail() {
        assert_eq!(incomplete_utf8_tail(b"abc"), 0);
        assert_eq!(incomplete_utf8_tail("h\u{e9}".as_bytes()), 0);
        assert_eq!(incomplete_utf8_tail(&"\u{e9}".as_bytes()[..1]), 1);
        assert_eq!(incomplete_utf8_tail(&"\u{20ac}".as_bytes()[..2]), 2);
        assert_eq!(incomplete_utf8_tail(&"x\u{1f600}".as_bytes()[..4]), 3);
        assert_eq!(incomplete_utf8_tail(&[0xff, 0xfe]), 0);
    }
}
