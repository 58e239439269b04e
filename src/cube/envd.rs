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
}

/// The event stream of a started or re-attached process.
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
            match ev {
                ProcessEvent::Data(d) => {
                    let stdout = d.stdout.or(d.pty);
                    for (field, buf) in [(stdout, &mut out.stdout), (d.stderr, &mut out.stderr)] {
                        if let Some(b) = field {
                            let bytes = B64
                                .decode(b)
                                .map_err(|_| CubeError::protocol("output is not valid base64"))?;
                            let room = limit.saturating_sub(buf.len());
                            if bytes.len() > room {
                                out.truncated = true;
                            }
                            buf.extend_from_slice(
                                bytes.get(..room.min(bytes.len())).unwrap_or_default(),
                            );
                        }
                    }
                }
                ProcessEvent::End(e) => end = Some(e),
                _ => {}
            }
        }
        let end =
            end.ok_or_else(|| CubeError::protocol("process stream ended without an end event"))?;
        out.exit_code = end
            .code()
            .ok_or_else(|| CubeError::protocol(format!("no exit code in end event: {end:?}")))?;
        out.status = end.status;
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

    async fn unary<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        sb: &SandboxAddr,
        method: &str,
        body: &Req,
        user: Option<&str>,
        what: &str,
    ) -> Result<Resp> {
        let mut req = self
            .data_request(sb, Method::POST, &format!("/{method}"))?
            .timeout(self.inner.cfg.timeouts.request)
            .header("connect-protocol-version", "1")
            .json(body);
        if let Some(u) = user {
            req = req.header(reqwest::header::AUTHORIZATION, basic(u));
        }
        let resp = req
            .send()
            .await
            .map_err(|e| CubeError::from_reqwest(what, e))?;
        let status = resp.status();
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| CubeError::from_reqwest(what, e))?;
        if !status.is_success() {
            return Err(api_error(what, status, &bytes));
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
        let mut req = self
            .data_request_on(sb, Method::POST, &format!("/{method}"), true)?
            .header(reqwest::header::CONTENT_TYPE, "application/connect+json")
            .header("connect-protocol-version", "1")
            .header("connect-content-encoding", "identity")
            .header(reqwest::header::ACCEPT_ENCODING, "identity")
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
        if let Some(u) = user {
            req = req.header(reqwest::header::AUTHORIZATION, basic(u));
        }
        if let Some(d) = deadline {
            let ms = d.as_millis().max(1);
            req = req.header("connect-timeout-ms", ms.to_string());
        }
        let resp = tokio::time::timeout(self.inner.cfg.timeouts.request, req.send())
            .await
            .map_err(|_| CubeError::new(ErrorKind::Timeout, format!("{what}: no response")))?
            .map_err(|e| CubeError::from_reqwest(what, e))?;
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
    pub async fn run(
        &self,
        sb: &SandboxAddr,
        o: &StartOptions,
        limit: usize,
    ) -> Result<CommandOutput> {
        self.start(sb, o).await?.collect(limit).await
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
        self.unary::<_, serde_json::Value>(
            sb,
            "process.Process/SendInput",
            &req,
            None,
            "send input",
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
        self.unary::<_, serde_json::Value>(
            sb,
            "process.Process/SendInput",
            &req,
            None,
            "send pty input",
        )
        .await
        .map(|_| ())
    }

    pub async fn close_stdin(&self, sb: &SandboxAddr, pid: u32) -> Result<()> {
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
            .unary(sb, "filesystem.Filesystem/Move", &req, None, "move")
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

    /// `POST /files` (octet-stream): create or replace a file, parents included.
    pub async fn upload(
        &self,
        sb: &SandboxAddr,
        path: &str,
        body: impl Into<reqwest::Body>,
    ) -> Result<()> {
        let resp = self
            .data_request(sb, Method::POST, &Self::files_path(path, "root"))?
            .timeout(self.inner.cfg.timeouts.lifecycle)
            .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
            .body(body)
            .send()
            .await
            .map_err(|e| CubeError::from_reqwest("upload", e))?;
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
        let resp = self
            .data_request_on(sb, Method::GET, &Self::files_path(path, "root"), true)?
            .header(reqwest::header::ACCEPT_ENCODING, "identity")
            .send()
            .await
            .map_err(|e| CubeError::from_reqwest("download", e))?;
        let status = resp.status();
        if status != reqwest::StatusCode::OK {
            let bytes = resp.bytes().await.unwrap_or_default();
            return Err(api_error("download", status, &bytes));
        }
        Ok(resp)
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
