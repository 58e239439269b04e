//! envd client: process and filesystem RPCs and `/files`, sent to CubeProxy
//! with `Host: <port>-<sandboxID>.<domain>`.

use std::collections::BTreeMap;
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use bytes::Bytes;
use futures_util::StreamExt;
use reqwest::Method;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::client::{CubeClient, SandboxAddr, api_error};
use super::wire::{
    self, EndEvent, EndStream, EntryInfo, EntryResponse, EnvelopeDecoder, EventEnvelope,
    ListDirRequest, ListDirResponse, ListResponse, MoveRequest, PathRequest, ProcessConfig,
    ProcessEvent, ProcessInfo, ProcessInput, ProcessSelector, Pty, PtySize, SelectorRequest,
    SendInputRequest, SendSignalRequest, StartRequest, UpdateRequest,
};
use super::{CubeError, ErrorKind, Result};

/// How to start a process.
#[derive(Debug, Clone, Default)]
pub struct StartOptions {
    pub cmd: String,
    pub args: Vec<String>,
    pub envs: BTreeMap<String, String>,
    pub cwd: Option<String>,
    pub user: Option<String>,
    /// Kill the process after this long (sent as `Connect-Timeout-Ms`).
    /// Leave `None` for background processes.
    pub timeout: Option<Duration>,
    pub pty: Option<PtySize>,
    pub tag: Option<String>,
    /// Give the process a stdin pipe (for `send_stdin`).
    pub stdin: bool,
    /// `run` sends each piece of output here as it comes, `(stderr?,
    /// bytes)`, waiting when the receiver is behind (a recording).
    pub tap: Option<tokio::sync::mpsc::Sender<(bool, Vec<u8>)>>,
}

/// Send a `data` event's bytes to a tap.
async fn tap(to: Option<&tokio::sync::mpsc::Sender<(bool, Vec<u8>)>>, ev: &ProcessEvent) {
    let (Some(to), ProcessEvent::Data(d)) = (to, ev) else {
        return;
    };
    for (err, part) in [(false, &d.stdout), (false, &d.pty), (true, &d.stderr)] {
        if let Some(b) = part.as_deref().and_then(|x| decode_data(x).ok()) {
            let _ = to.send((err, b)).await;
        }
    }
}

impl StartOptions {
    /// `/bin/bash -l -c <command>`, as the SDK runs commands.
    pub fn shell(command: &str) -> Self {
        Self {
            cmd: "/bin/bash".into(),
            args: vec!["-l".into(), "-c".into(), command.into()],
            ..Default::default()
        }
    }
}

/// A collected command result.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommandOutput {
    pub pid: u32,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub exit_code: i32,
    /// `status` as envd reports it (e.g. `signal: killed`).
    pub status: String,
    /// Output beyond the collection limit was dropped.
    pub truncated: bool,
    /// The command was still running at its deadline and was killed, with
    /// everything it started; the output is what it wrote until then.
    pub timed_out: bool,
}

impl CommandOutput {
    /// Add one event's output, keeping at most `limit` bytes per stream.
    fn feed(&mut self, ev: ProcessEvent, limit: usize, end: &mut Option<EndEvent>) -> Result<()> {
        match ev {
            ProcessEvent::Data(d) => {
                let stdout = d.stdout.or(d.pty);
                for (field, buf) in [(stdout, &mut self.stdout), (d.stderr, &mut self.stderr)] {
                    if let Some(b) = field {
                        let bytes = B64
                            .decode(b)
                            .map_err(|_| CubeError::protocol("output is not valid base64"))?;
                        let room = limit.saturating_sub(buf.len());
                        if bytes.len() > room {
                            self.truncated = true;
                        }
                        buf.extend_from_slice(
                            bytes.get(..room.min(bytes.len())).unwrap_or_default(),
                        );
                    }
                }
            }
            ProcessEvent::End(e) => *end = Some(e),
            _ => {}
        }
        Ok(())
    }

    fn finish(&mut self, end: Option<EndEvent>) -> Result<()> {
        let end =
            end.ok_or_else(|| CubeError::protocol("process stream ended without an end event"))?;
        self.exit_code = end
            .code()
            .ok_or_else(|| CubeError::protocol(format!("no exit code in end event: {end:?}")))?;
        self.status = end.status;
        Ok(())
    }
}

/// How long after a command's deadline envd's own deadline falls: ours
/// comes first and ends the whole process tree; envd's (which kills only
/// the direct process) is the backstop.
const ENVD_DEADLINE_GRACE: Duration = Duration::from_secs(10);

/// Kills a process and all its descendants inside the sandbox, each
/// stopped before its children are looked for (so none can fork away).
/// Plain bash and /proc: it works on any template that runs commands.
const KILL_TREE: &str = r#"k() { local p=$1 f s c; kill -STOP "$p" 2>/dev/null; for f in /proc/[0-9]*/stat; do s=$(<"$f") 2>/dev/null || continue; c=${f#/proc/}; c=${c%/stat}; s=${s##*) }; set -- $s; [ "$2" = "$p" ] && k "$c"; done; kill -KILL "$p" 2>/dev/null; }; k "$0"; exit 0"#;

/// The event stream of a started or re-attached process.
/// The bytes `download_range` asked for, piece by piece.
pub struct RangeBody {
    body: std::pin::Pin<Box<dyn futures_util::Stream<Item = reqwest::Result<Bytes>> + Send>>,
    skip: u64,
    left: usize,
}

impl RangeBody {
    /// The next piece; `None` at the end of the range.
    pub async fn next(&mut self) -> Result<Option<Bytes>> {
        while self.left > 0 {
            let Some(chunk) = self.body.next().await else {
                return Ok(None);
            };
            let mut chunk = chunk.map_err(|e| CubeError::from_reqwest("download", e))?;
            if self.skip > 0 {
                let n = (self.skip as usize).min(chunk.len());
                self.skip -= n as u64;
                let _ = chunk.split_to(n);
            }
            chunk.truncate(self.left);
            if !chunk.is_empty() {
                self.left -= chunk.len();
                return Ok(Some(chunk));
            }
        }
        Ok(None)
    }
}

pub struct ProcessStream {
    body: std::pin::Pin<Box<dyn futures_util::Stream<Item = reqwest::Result<Bytes>> + Send>>,
    decoder: EnvelopeDecoder,
    pub pid: u32,
    finished: bool,
    idle: Duration,
}

impl ProcessStream {
    async fn open(resp: reqwest::Response, idle: Duration) -> Result<Self> {
        let mut s = Self {
            body: Box::pin(resp.bytes_stream()),
            decoder: EnvelopeDecoder::new(),
            pid: 0,
            finished: false,
            idle,
        };
        match s.next_raw().await? {
            Some(ProcessEvent::Start { pid }) => {
                s.pid = pid;
                Ok(s)
            }
            Some(other) => Err(CubeError::protocol(format!(
                "process stream began with {other:?} instead of start"
            ))),
            None => Err(CubeError::protocol("process stream ended before start")),
        }
    }

    async fn next_raw(&mut self) -> Result<Option<ProcessEvent>> {
        loop {
            if self.finished {
                return Ok(None);
            }
            match self.decoder.next_envelope() {
                Err(e) => return Err(CubeError::protocol(e.to_string())),
                Ok(Some(env)) => {
                    if env.flags & wire::FLAG_END_STREAM != 0 {
                        self.finished = true;
                        let end: EndStream = serde_json::from_slice(&env.payload).map_err(|e| {
                            CubeError::protocol(format!("invalid end-stream message: {e}"))
                        })?;
                        return match end.error {
                            Some(err) => Err(CubeError::from_connect(&err.code, err.message)),
                            None => Ok(None),
                        };
                    }
                    let ev: EventEnvelope = serde_json::from_slice(&env.payload)
                        .map_err(|e| CubeError::protocol(format!("invalid process event: {e}")))?;
                    return Ok(Some(ev.event));
                }
                Ok(None) => {}
            }
            match tokio::time::timeout(self.idle, self.body.next()).await {
                Err(_) => {
                    return Err(CubeError::new(
                        ErrorKind::Timeout,
                        "process stream idle for too long",
                    ));
                }
                Ok(None) => {
                    self.finished = true;
                    return Err(CubeError::new(
                        ErrorKind::Unavailable,
                        "process stream ended without an end-stream message",
                    ));
                }
                Ok(Some(Err(e))) => return Err(CubeError::from_reqwest("process stream", e)),
                Ok(Some(Ok(chunk))) => self.decoder.push(&chunk),
            }
        }
    }

    /// The next event (`data`, `end`; keepalives are skipped). `Ok(None)`
    /// once the stream has ended cleanly.
    pub async fn next(&mut self) -> Result<Option<ProcessEvent>> {
        loop {
            match self.next_raw().await? {
                Some(ProcessEvent::Keepalive {}) => continue,
                other => return Ok(other),
            }
        }
    }

    /// Collect the whole output, keeping at most `limit` bytes per stream.
    pub async fn collect(mut self, limit: usize) -> Result<CommandOutput> {
        let mut out = CommandOutput {
            pid: self.pid,
            ..Default::default()
        };
        let mut end: Option<EndEvent> = None;
        while let Some(ev) = self.next().await? {
            out.feed(ev, limit, &mut end)?;
        }
        out.finish(end)?;
        Ok(out)
    }
}

/// Decode a `data` event's bytes.
pub fn decode_data(b64: &str) -> Result<Vec<u8>> {
    B64.decode(b64)
        .map_err(|_| CubeError::protocol("output is not valid base64"))
}

impl CubeClient {
    /// A request to CubeProxy for `host` (`<port>-<id>.<domain>`). Never
    /// carries the CubeAPI key: CubeProxy forwards headers into the sandbox.
    pub(crate) fn proxy_request(
        &self,
        method: Method,
        host: &str,
        path_and_query: &str,
        streaming: bool,
    ) -> Result<reqwest::RequestBuilder> {
        // Streams and downloads get a stall timer; other calls a budget each.
        let http = if streaming {
            &self.inner.stream_http
        } else {
            &self.inner.http
        };
        let bad = |e: url::ParseError| CubeError::protocol(format!("bad data-plane path: {e}"));
        if self.inner.dial {
            // The URL names the sandbox (SNI and Host); the resolver sends
            // the connection to the dial address, but only for names under
            // the configured domain: any other (a sandbox domain CubeAPI
            // made up) would go wherever DNS points, with the traffic token.
            if !under_domain(host, &self.inner.cfg.domain) {
                return Err(CubeError::protocol(format!(
                    "data-plane host '{host}' is not under the sandbox domain '{}'",
                    self.inner.cfg.domain
                )));
            }
            let mut base = self.inner.proxy.clone();
            base.set_host(Some(host)).map_err(bad)?;
            let _ = base.set_port(None);
            let url = base.join(path_and_query).map_err(bad)?;
            Ok(http.request(method, url))
        } else {
            let url = self.inner.proxy.join(path_and_query).map_err(bad)?;
            Ok(http
                .request(method, url)
                .header(reqwest::header::HOST, host))
        }
    }

    fn data_request(
        &self,
        sb: &SandboxAddr,
        method: Method,
        path_and_query: &str,
    ) -> Result<reqwest::RequestBuilder> {
        self.data_request_on(sb, method, path_and_query, false)
    }

    fn data_request_on(
        &self,
        sb: &SandboxAddr,
        method: Method,
        path_and_query: &str,
        streaming: bool,
    ) -> Result<reqwest::RequestBuilder> {
        let host = format!("{}-{}.{}", wire::ENVD_PORT, sb.id, sb.domain);
        let mut req = self.proxy_request(method, &host, path_and_query, streaming)?;
        if let Some(t) = &sb.traffic_token {
            let mut v = reqwest::header::HeaderValue::from_str(t.expose())
                .map_err(|_| CubeError::protocol("traffic token contains invalid characters"))?;
            v.set_sensitive(true);
            req = req.header("e2b-traffic-access-token", v);
        }
        Ok(req)
    }

    /// Send a data-plane request built by `build`. When CubeProxy cannot
    /// reach envd (502/503/504, or no answer in time) and the sandbox turns
    /// out to be paused (an idle timeout paused it and nothing resumed it:
    /// real deployments resume only with `cube-lifecycle-manager`), resume
    /// it with `connect` and send once more — after a 502/503 always (the
    /// request never reached envd), after a 504 or a timeout only a call
    /// that is `Replay::Safe` (it may have been delivered).
    async fn send_data(
        &self,
        sb: &SandboxAddr,
        what: &str,
        replay: Replay,
        build: impl Fn() -> Result<reqwest::RequestBuilder>,
    ) -> Result<reqwest::Response> {
        self.send_data_within(sb, what, replay, None, build).await
    }

    /// As `send_data_within`, its failure counted (`CubeClient::count`).
    async fn send_data_within(
        &self,
        sb: &SandboxAddr,
        what: &str,
        replay: Replay,
        headers_within: Option<Duration>,
        build: impl Fn() -> Result<reqwest::RequestBuilder>,
    ) -> Result<reqwest::Response> {
        let r = self
            .send_data_once(sb, what, replay, headers_within, build)
            .await;
        self.count(r)
    }

    /// As `send_data`, each send given at most `headers_within` for its
    /// answer to begin (the resume between them has its own budget).
    async fn send_data_once(
        &self,
        sb: &SandboxAddr,
        what: &str,
        replay: Replay,
        headers_within: Option<Duration>,
        build: impl Fn() -> Result<reqwest::RequestBuilder>,
    ) -> Result<reqwest::Response> {
        let send = |req: reqwest::RequestBuilder| async move {
            match headers_within {
                None => req.send().await.map_err(|e| {
                    (
                        e.is_timeout() || e.is_connect(),
                        CubeError::from_reqwest(what, e),
                    )
                }),
                Some(d) => match tokio::time::timeout(d, req.send()).await {
                    Err(_) => Err((
                        true,
                        CubeError::new(ErrorKind::Timeout, format!("{what}: no response")),
                    )),
                    Ok(r) => r.map_err(|e| {
                        (
                            e.is_timeout() || e.is_connect(),
                            CubeError::from_reqwest(what, e),
                        )
                    }),
                },
            }
        };
        let first = send(build()?).await;
        let again = match &first {
            Ok(r) => {
                matches!(r.status().as_u16(), 502 | 503)
                    || (r.status().as_u16() == 504 && replay == Replay::Safe)
            }
            Err((unanswered, _)) => replay == Replay::Safe && *unanswered,
        };
        if again && self.resume_if_paused(&sb.id).await {
            return send(build()?).await.map_err(|(_, e)| e);
        }
        first.map_err(|(_, e)| e)
    }

    /// Resume the sandbox with `connect` if CubeAPI says it is paused. The
    /// traffic token from create stays valid (connect returns none).
    /// `true`: it was paused and runs now.
    pub async fn resume_if_paused(&self, id: &str) -> bool {
        match self.get(id).await {
            Ok(d) if d.state == "paused" => match self.connect(id, None).await {
                Ok(_) => {
                    tracing::info!(sandbox = %id.get(..8).unwrap_or(id), "resumed a paused sandbox to reach it");
                    true
                }
                Err(e) => {
                    tracing::warn!(error = %e, "could not resume a paused sandbox");
                    false
                }
            },
            _ => false,
        }
    }

    async fn unary<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        sb: &SandboxAddr,
        method: &str,
        body: &Req,
        user: Option<&str>,
        what: &str,
    ) -> Result<Resp> {
        self.unary_as(sb, method, body, user, what, Replay::Safe)
            .await
    }

    /// A unary RPC. Every RPC names a user (root unless told): envds before
    /// 0.4.0 refuse calls without one.
    async fn unary_as<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        sb: &SandboxAddr,
        method: &str,
        body: &Req,
        user: Option<&str>,
        what: &str,
        replay: Replay,
    ) -> Result<Resp> {
        let auth = basic(user.unwrap_or("root"));
        let resp = self
            .send_data(sb, what, replay, || {
                Ok(self
                    .data_request(sb, Method::POST, &format!("/{method}"))?
                    .timeout(self.inner.cfg.timeouts.request)
                    .header("connect-protocol-version", "1")
                    .header(reqwest::header::AUTHORIZATION, &auth)
                    .json(body))
            })
            .await?;
        let status = resp.status();
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| CubeError::from_reqwest(what, e))?;
        if !status.is_success() {
            return self.count(Err(api_error(what, status, &bytes)));
        }
        let bytes = if bytes.is_empty() {
            Bytes::from_static(b"{}")
        } else {
            bytes
        };
        serde_json::from_slice(&bytes)
            .map_err(|e| CubeError::protocol(format!("{what}: invalid response: {e}")))
    }

    async fn stream(
        &self,
        sb: &SandboxAddr,
        method: &str,
        body: &impl Serialize,
        user: Option<&str>,
        deadline: Option<Duration>,
    ) -> Result<ProcessStream> {
        let what = method;
        let payload = serde_json::to_vec(body).map_err(|e| CubeError::protocol(e.to_string()))?;
        let auth = basic(user.unwrap_or("root"));
        // Starting a process again after a lost answer could run it twice.
        let replay = if method.ends_with("/Start") {
            Replay::Unsafe
        } else {
            Replay::Safe
        };
        let build = || {
            let mut req = self
                .data_request_on(sb, Method::POST, &format!("/{method}"), true)?
                .header(reqwest::header::CONTENT_TYPE, "application/connect+json")
                .header("connect-protocol-version", "1")
                .header("connect-content-encoding", "identity")
                .header(reqwest::header::ACCEPT_ENCODING, "identity")
                .header(reqwest::header::AUTHORIZATION, &auth)
                .header(
                    "keepalive-ping-interval",
                    self.inner
                        .cfg
                        .timeouts
                        .keepalive
                        .as_secs()
                        .max(1)
                        .to_string(),
                )
                .body(wire::envelope(0, &payload));
            if let Some(d) = deadline {
                let ms = d.as_millis().max(1);
                req = req.header("connect-timeout-ms", ms.to_string());
            }
            Ok(req)
        };
        let resp = self
            .send_data_within(
                sb,
                what,
                replay,
                Some(self.inner.cfg.timeouts.request),
                build,
            )
            .await?;
        let status = resp.status();
        if !status.is_success() {
            let bytes = resp.bytes().await.unwrap_or_default();
            return Err(api_error(what, status, &bytes));
        }
        ProcessStream::open(resp, self.inner.cfg.timeouts.stream_idle).await
    }

    /// `process.Process/Start`: returns once the process has a pid.
    pub async fn start(&self, sb: &SandboxAddr, o: &StartOptions) -> Result<ProcessStream> {
        let req = StartRequest {
            process: ProcessConfig {
                cmd: o.cmd.clone(),
                args: o.args.clone(),
                envs: o.envs.clone(),
                cwd: o.cwd.clone(),
            },
            pty: o.pty.map(|size| Pty { size }),
            tag: o.tag.clone(),
            stdin: Some(o.stdin),
        };
        self.stream(
            sb,
            "process.Process/Start",
            &req,
            Some(o.user.as_deref().unwrap_or("root")),
            o.timeout,
        )
        .await
    }

    /// Run to completion and collect up to `limit` bytes of each stream.
    ///
    /// With a timeout, the deadline is kept here: when it passes, the
    /// command and everything it started are killed (a real envd's own
    /// deadline kills only the direct process and ends the stream with
    /// `deadline_exceeded`, leaving the rest running and the output lost),
    /// and the output so far is returned with `timed_out`.
    pub async fn run(
        &self,
        sb: &SandboxAddr,
        o: &StartOptions,
        limit: usize,
    ) -> Result<CommandOutput> {
        let Some(limit_time) = o.timeout else {
            let mut s = self.start(sb, o).await?;
            if o.tap.is_none() {
                return s.collect(limit).await;
            }
            let mut out = CommandOutput {
                pid: s.pid,
                ..Default::default()
            };
            let mut end: Option<EndEvent> = None;
            while let Some(ev) = s.next().await? {
                tap(o.tap.as_ref(), &ev).await;
                out.feed(ev, limit, &mut end)?;
            }
            out.finish(end)?;
            return Ok(out);
        };
        let mut backstop = o.clone();
        backstop.timeout = Some(limit_time.saturating_add(ENVD_DEADLINE_GRACE));
        let mut s = self.start(sb, &backstop).await?;
        let mut out = CommandOutput {
            pid: s.pid,
            ..Default::default()
        };
        let mut end: Option<EndEvent> = None;
        let deadline = tokio::time::sleep(limit_time);
        tokio::pin!(deadline);
        // After the kill, how long the stream may take to end.
        let mut after_kill: Option<std::pin::Pin<Box<tokio::time::Sleep>>> = None;
        loop {
            tokio::select! {
                ev = s.next() => match ev {
                    Ok(Some(ev)) => {
                        tap(o.tap.as_ref(), &ev).await;
                        out.feed(ev, limit, &mut end)?;
                    }
                    Ok(None) => break,
                    // envd's own deadline (or the stream cut) after ours.
                    Err(e) if out.timed_out => {
                        tracing::debug!(error = %e, "stream of a killed command ended");
                        break;
                    }
                    Err(e) => return Err(e),
                },
                () = &mut deadline, if !out.timed_out => {
                    out.timed_out = true;
                    if let Err(e) = self.kill_tree(sb, out.pid).await {
                        tracing::warn!(error = %e, "could not end a command's process tree at its deadline; signalling the command");
                        let _ = self.signal(sb, out.pid, true).await;
                    }
                    after_kill = Some(Box::pin(tokio::time::sleep(ENVD_DEADLINE_GRACE)));
                },
                () = async { if let Some(t) = after_kill.as_mut() { t.await } else { std::future::pending().await } } => break,
            }
        }
        if out.timed_out && end.is_none() {
            out.exit_code = -1;
            out.status = "deadline_exceeded".into();
        } else {
            // Exited on its own just as the deadline passed: not timed out.
            if out.timed_out && end.as_ref().is_some_and(|e| e.exited) {
                out.timed_out = false;
            }
            out.finish(end)?;
        }
        Ok(out)
    }

    /// Kill a process and its descendants inside the sandbox (`KILL_TREE`).
    pub async fn kill_tree(&self, sb: &SandboxAddr, pid: u32) -> Result<()> {
        let o = StartOptions {
            cmd: "/bin/bash".into(),
            args: vec!["-c".into(), KILL_TREE.into(), pid.to_string()],
            timeout: Some(Duration::from_secs(20)),
            ..Default::default()
        };
        let done = self.start(sb, &o).await?.collect(4096).await?;
        if done.exit_code == 0 {
            Ok(())
        } else {
            Err(CubeError::new(
                ErrorKind::Internal,
                format!(
                    "kill tree: {} {}",
                    done.status,
                    String::from_utf8_lossy(&done.stderr)
                ),
            ))
        }
    }

    /// `process.Process/Connect`: re-attach; only output from now on.
    pub async fn connect_process(&self, sb: &SandboxAddr, pid: u32) -> Result<ProcessStream> {
        self.stream(
            sb,
            "process.Process/Connect",
            &SelectorRequest {
                process: ProcessSelector::pid(pid),
            },
            None,
            None,
        )
        .await
    }

    pub async fn list_processes(&self, sb: &SandboxAddr) -> Result<Vec<ProcessInfo>> {
        let r: ListResponse = self
            .unary(
                sb,
                "process.Process/List",
                &serde_json::json!({}),
                None,
                "list processes",
            )
            .await?;
        Ok(r.processes)
    }

    pub async fn send_stdin(&self, sb: &SandboxAddr, pid: u32, data: &[u8]) -> Result<()> {
        let req = SendInputRequest {
            process: ProcessSelector::pid(pid),
            input: ProcessInput {
                stdin: Some(B64.encode(data)),
                pty: None,
            },
        };
        self.unary_as::<_, serde_json::Value>(
            sb,
            "process.Process/SendInput",
            &req,
            None,
            "send input",
            Replay::Unsafe,
        )
        .await
        .map(|_| ())
    }

    pub async fn send_pty_input(&self, sb: &SandboxAddr, pid: u32, data: &[u8]) -> Result<()> {
        let req = SendInputRequest {
            process: ProcessSelector::pid(pid),
            input: ProcessInput {
                stdin: None,
                pty: Some(B64.encode(data)),
            },
        };
        self.unary_as::<_, serde_json::Value>(
            sb,
            "process.Process/SendInput",
            &req,
            None,
            "send pty input",
            Replay::Unsafe,
        )
        .await
        .map(|_| ())
    }

    pub async fn close_stdin(&self, sb: &SandboxAddr, pid: u32) -> Result<()> {
        if !sb.envd().close_stdin() {
            return Err(CubeError::new(
                ErrorKind::InvalidArgument,
                format!(
                    "this sandbox's envd ({}) cannot close stdin (it needs 0.5.2 or later)",
                    sb.envd_version.as_deref().unwrap_or("unknown")
                ),
            ));
        }
        let req = SelectorRequest {
            process: ProcessSelector::pid(pid),
        };
        self.unary::<_, serde_json::Value>(
            sb,
            "process.Process/CloseStdin",
            &req,
            None,
            "close stdin",
        )
        .await
        .map(|_| ())
    }

    /// `SendSignal` with SIGTERM (`kill = false`) or SIGKILL.
    pub async fn signal(&self, sb: &SandboxAddr, pid: u32, kill: bool) -> Result<()> {
        let sig = if kill {
            "SIGNAL_SIGKILL"
        } else {
            "SIGNAL_SIGTERM"
        };
        let req = SendSignalRequest {
            process: ProcessSelector::pid(pid),
            signal: serde_json::Value::String(sig.into()),
        };
        self.unary::<_, serde_json::Value>(
            sb,
            "process.Process/SendSignal",
            &req,
            None,
            "send signal",
        )
        .await
        .map(|_| ())
    }

    /// `Update`: resize a PTY.
    pub async fn resize_pty(&self, sb: &SandboxAddr, pid: u32, size: PtySize) -> Result<()> {
        let req = UpdateRequest {
            process: ProcessSelector::pid(pid),
            pty: Some(Pty { size }),
        };
        self.unary::<_, serde_json::Value>(sb, "process.Process/Update", &req, None, "resize pty")
            .await
            .map(|_| ())
    }

    pub async fn stat(&self, sb: &SandboxAddr, path: &str) -> Result<EntryInfo> {
        let r: EntryResponse = self
            .unary(
                sb,
                "filesystem.Filesystem/Stat",
                &PathRequest { path: path.into() },
                None,
                "stat",
            )
            .await?;
        Ok(r.entry)
    }

    pub async fn list_dir(
        &self,
        sb: &SandboxAddr,
        path: &str,
        depth: u32,
    ) -> Result<Vec<EntryInfo>> {
        let req = ListDirRequest {
            path: path.into(),
            depth: Some(depth),
        };
        let r: ListDirResponse = self
            .unary(
                sb,
                "filesystem.Filesystem/ListDir",
                &req,
                None,
                "list directory",
            )
            .await?;
        Ok(r.entries)
    }

    pub async fn make_dir(&self, sb: &SandboxAddr, path: &str) -> Result<EntryInfo> {
        let r: EntryResponse = self
            .unary(
                sb,
                "filesystem.Filesystem/MakeDir",
                &PathRequest { path: path.into() },
                None,
                "make directory",
            )
            .await?;
        Ok(r.entry)
    }

    pub async fn rename(&self, sb: &SandboxAddr, from: &str, to: &str) -> Result<EntryInfo> {
        let req = MoveRequest {
            source: from.into(),
            destination: to.into(),
        };
        let r: EntryResponse = self
            .unary_as(
                sb,
                "filesystem.Filesystem/Move",
                &req,
                None,
                "move",
                Replay::Unsafe,
            )
            .await?;
        Ok(r.entry)
    }

    pub async fn remove(&self, sb: &SandboxAddr, path: &str) -> Result<()> {
        self.unary::<_, serde_json::Value>(
            sb,
            "filesystem.Filesystem/Remove",
            &PathRequest { path: path.into() },
            None,
            "remove",
        )
        .await
        .map(|_| ())
    }

    fn files_path(path: &str, user: &str) -> String {
        let q: String = url::form_urlencoded::Serializer::new(String::new())
            .append_pair("path", path)
            .append_pair("username", user)
            .finish();
        format!("/files?{q}")
    }

    /// `POST /files`: create or replace a file, parents included. As
    /// `application/octet-stream` where envd takes it (0.5.7 and later),
    /// as multipart otherwise; and, as the SDK does, once more as multipart
    /// when envd refuses the octet-stream form.
    pub async fn upload(&self, sb: &SandboxAddr, path: &str, body: impl Into<Bytes>) -> Result<()> {
        let body: Bytes = body.into();
        let url = Self::files_path(path, "root");
        let multipart = || -> Result<reqwest::RequestBuilder> {
            let name = path.rsplit('/').next().unwrap_or("file").to_string();
            let part = reqwest::multipart::Part::stream(reqwest::Body::from(body.clone()))
                .file_name(name)
                .mime_str("application/octet-stream")
                .map_err(|e| CubeError::protocol(e.to_string()))?;
            Ok(self
                .data_request(sb, Method::POST, &url)?
                .timeout(self.inner.cfg.timeouts.lifecycle)
                .multipart(reqwest::multipart::Form::new().part("file", part)))
        };
        let octets = || -> Result<reqwest::RequestBuilder> {
            Ok(self
                .data_request(sb, Method::POST, &url)?
                .timeout(self.inner.cfg.timeouts.lifecycle)
                .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
                .body(body.clone()))
        };
        let resp = if sb.envd().octet_stream_upload() {
            let r = self.send_data(sb, "upload", Replay::Safe, octets).await?;
            if matches!(r.status().as_u16(), 400 | 415) {
                self.send_data(sb, "upload", Replay::Safe, multipart)
                    .await?
            } else {
                r
            }
        } else {
            self.send_data(sb, "upload", Replay::Safe, multipart)
                .await?
        };
        let status = resp.status();
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| CubeError::from_reqwest("upload", e))?;
        if !status.is_success() {
            return Err(api_error("upload", status, &bytes));
        }
        Ok(())
    }

    /// `GET /files`: the response, for streaming the body.
    pub async fn download_stream(&self, sb: &SandboxAddr, path: &str) -> Result<reqwest::Response> {
        let url = Self::files_path(path, "root");
        let resp = self
            .send_data(sb, "download", Replay::Safe, || {
                Ok(self
                    .data_request_on(sb, Method::GET, &url, true)?
                    .header(reqwest::header::ACCEPT_ENCODING, "identity"))
            })
            .await?;
        let status = resp.status();
        if status != reqwest::StatusCode::OK {
            let bytes = resp.bytes().await.unwrap_or_default();
            return Err(api_error("download", status, &bytes));
        }
        Ok(resp)
    }

    /// `GET /files` with `Range: bytes=FROM-(FROM+MAX-1)`: at most `max`
    /// bytes of a file from `from`, raw (no base64, no JSON, no process in
    /// the sandbox), as the body's pieces come. `None` when the file has
    /// nothing at `from` (416). An envd that ignores the range (200) is
    /// read past `from` here.
    pub async fn download_range(
        &self,
        sb: &SandboxAddr,
        path: &str,
        from: u64,
        max: usize,
    ) -> Result<Option<RangeBody>> {
        let url = Self::files_path(path, "root");
        let last = from.saturating_add(max.max(1) as u64 - 1);
        let range = format!("bytes={from}-{last}");
        let resp = self
            .send_data(sb, "download", Replay::Safe, || {
                Ok(self
                    .data_request_on(sb, Method::GET, &url, true)?
                    .header(reqwest::header::ACCEPT_ENCODING, "identity")
                    .header(reqwest::header::RANGE, &range))
            })
            .await?;
        let status = resp.status();
        let skip = match status {
            reqwest::StatusCode::PARTIAL_CONTENT => 0,
            reqwest::StatusCode::OK => from,
            reqwest::StatusCode::RANGE_NOT_SATISFIABLE => return Ok(None),
            _ => {
                let bytes = resp.bytes().await.unwrap_or_default();
                return Err(api_error("download", status, &bytes));
            }
        };
        Ok(Some(RangeBody {
            body: Box::pin(resp.bytes_stream()),
            skip,
            left: max,
        }))
    }

    /// `GET /files`, whole, refusing files larger than `limit` bytes.
    pub async fn download(&self, sb: &SandboxAddr, path: &str, limit: usize) -> Result<Vec<u8>> {
        let resp = self.download_stream(sb, path).await?;
        if resp.content_length().is_some_and(|n| n > limit as u64) {
            return Err(CubeError::new(
                ErrorKind::TooLarge,
                format!("file is larger than {limit} bytes"),
            ));
        }
        let mut out = Vec::new();
        let mut s = resp.bytes_stream();
        while let Some(chunk) = s.next().await {
            let chunk = chunk.map_err(|e| CubeError::from_reqwest("download", e))?;
            if out.len() + chunk.len() > limit {
                return Err(CubeError::new(
                    ErrorKind::TooLarge,
                    format!("file is larger than {limit} bytes"),
                ));
            }
            out.extend_from_slice(&chunk);
        }
        Ok(out)
    }

    /// The first `max` bytes of a file, and whether there was more. Stops
    /// reading at `max`, however large the file is.
    pub async fn download_prefix(
        &self,
        sb: &SandboxAddr,
        path: &str,
        max: usize,
    ) -> Result<(Vec<u8>, bool)> {
        let resp = self.download_stream(sb, path).await?;
        let mut out = Vec::new();
        let mut s = resp.bytes_stream();
        while let Some(chunk) = s.next().await {
            let chunk = chunk.map_err(|e| CubeError::from_reqwest("download", e))?;
            let room = max - out.len();
            if chunk.len() > room {
                out.extend_from_slice(chunk.get(..room).unwrap_or_default());
                return Ok((out, true));
            }
            out.extend_from_slice(&chunk);
        }
        Ok((out, false))
    }

    /// `GET /health` on envd (204).
    pub async fn envd_health(&self, sb: &SandboxAddr) -> Result<()> {
        let resp = self
            .data_request(sb, Method::GET, "/health")?
            .timeout(self.inner.cfg.timeouts.request)
            .send()
            .await
            .map_err(|e| CubeError::from_reqwest("envd health", e))?;
        if resp.status().is_success() {
            Ok(())
        } else {
            let status = resp.status();
            let bytes = resp.bytes().await.unwrap_or_default();
            Err(api_error("envd health", status, &bytes))
        }
    }
}

/// Whether a data-plane call may be sent again once its paused sandbox is
/// resumed, when it may already have been delivered (see `send_data`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Replay {
    /// Reads, and writes that give the same result twice.
    Safe,
    /// Starting a process, input, a move.
    Unsafe,
}

fn basic(user: &str) -> String {
    format!("Basic {}", B64.encode(format!("{user}:")))
}

/// `host` ends in `.{domain}` (ASCII case-insensitive).
fn under_domain(host: &str, domain: &str) -> bool {
    host.len() > domain.len() + 1
        && host
            .get(host.len() - domain.len()..)
            .is_some_and(|d| !d.is_empty() && d.eq_ignore_ascii_case(domain))
        && host.as_bytes().get(host.len() - domain.len() - 1) == Some(&b'.')
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cube::{BackendConfig, ErrorKind, ProxyUrl};

    #[test]
    fn dial_mode_refuses_hosts_outside_the_domain() {
        let mut cfg = BackendConfig::new("t", "http://127.0.0.1:1");
        cfg.domain = "cube.test".into();
        cfg.proxy_url = Some(ProxyUrl::Dial {
            url: "http://cube.test".into(),
            dial: "127.0.0.1:2".into(),
        });
        cfg.insecure_plain_http = true;
        let c = CubeClient::new(cfg).unwrap();
        for ok in ["49983-sbx1.cube.test", "49983-sbx1.CUBE.Test"] {
            assert!(
                c.proxy_request(Method::GET, ok, "/health", false).is_ok(),
                "{ok}"
            );
        }
        for bad in [
            "49983-sbx1.evil.example",
            "49983-sbx1.notcube.test",
            "cube.test",
            ".cube.test",
            "49983-sbx1.cube.test.evil.example",
        ] {
            let e = c
                .proxy_request(Method::GET, bad, "/health", false)
                .unwrap_err();
            assert_eq!(e.kind, ErrorKind::Protocol, "{bad}");
        }

        // Without a dial address the Host goes to the configured proxy URL.
        let mut plain = BackendConfig::new("t", "http://127.0.0.1:1");
        plain.domain = "cube.test".into();
        plain.proxy_url = Some(ProxyUrl::Url("http://127.0.0.1:2".into()));
        let c = CubeClient::new(plain).unwrap();
        assert!(
            c.proxy_request(Method::GET, "49983-sbx1.other.example", "/health", false)
                .is_ok()
        );
    }

    #[test]
    fn under_domain_cases() {
        assert!(under_domain("a.cube.test", "cube.test"));
        assert!(!under_domain("acube.test", "cube.test"));
        assert!(!under_domain("a.cube.test", ""));
    }
}
