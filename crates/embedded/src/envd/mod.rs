//! The in-sandbox agent: our own envd. It runs inside the sandbox's
//! namespaces (as a child of the sandbox's init) and serves the envd HTTP and
//! Connect API on a unix socket that the backend's Host router forwards to.

pub mod filesystem;
pub mod ports;
pub mod process;
pub mod rpc;
pub mod users;

use std::path::Path;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, FromRequest, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use futures_util::StreamExt;
use serde::Deserialize;
use tokio::io::AsyncWriteExt;

use self::process::{Attached, Processes};
use self::rpc::RpcError;
use crate::wire::{
    self, EntryResponse, EventEnvelope, ListDirRequest, ListDirResponse, ListResponse, MoveRequest,
    PathRequest, ProcessEvent, SelectorRequest, SendInputRequest, SendSignalRequest, StartRequest,
    UpdateRequest,
};

/// Largest upload accepted (CubeProxy's `client_max_body_size`).
pub const MAX_UPLOAD: usize = 256 * 1024 * 1024;

#[derive(Clone)]
pub struct Agent {
    procs: Processes,
}

pub fn router(procs: Processes) -> Router {
    let agent = Agent { procs };
    Router::new()
        .route("/health", get(|| async { StatusCode::NO_CONTENT }))
        .route("/init", post(|| async { StatusCode::NO_CONTENT }))
        .route("/envs", get(envs))
        .route(
            "/files",
            get(download)
                .post(upload)
                .layer(DefaultBodyLimit::max(MAX_UPLOAD)),
        )
        .route("/process.Process/Start", post(start))
        .route("/process.Process/Connect", post(connect))
        .route("/process.Process/List", post(list))
        .route("/process.Process/SendInput", post(send_input))
        .route("/process.Process/SendSignal", post(send_signal))
        .route("/process.Process/Update", post(update))
        .route("/process.Process/CloseStdin", post(close_stdin))
        .route("/filesystem.Filesystem/Stat", post(fs_stat))
        .route("/filesystem.Filesystem/ListDir", post(fs_list_dir))
        .route("/filesystem.Filesystem/MakeDir", post(fs_make_dir))
        .route("/filesystem.Filesystem/Move", post(fs_move))
        .route("/filesystem.Filesystem/Remove", post(fs_remove))
        .route("/_cube/kill-all", post(kill_all))
        .route("/_cube/port/{port}", any(ports::forward))
        .route("/_cube/port/{port}/{*rest}", any(ports::forward))
        .layer(axum::middleware::from_fn_with_state(
            agent.clone(),
            older_envd,
        ))
        .with_state(agent)
}

/// Standing in for an older envd (`AgentEnv::envd_version`): refuse what
/// it refuses, as it refuses it.
async fn older_envd(
    State(a): State<Agent>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    use crate::wire::EnvdVersion;
    let Some(v) = a.procs.env().envd_version else {
        return next.run(req).await;
    };
    let path = req.uri().path();
    let rpc = path.starts_with("/process.") || path.starts_with("/filesystem.");
    let streaming = path == "/process.Process/Start" || path == "/process.Process/Connect";
    let refuse = |e: RpcError| {
        if streaming {
            rpc::stream_error(e)
        } else {
            e.into_response()
        }
    };
    if rpc && v < EnvdVersion(0, 4, 0) && !req.headers().contains_key(header::AUTHORIZATION) {
        return refuse(RpcError::new("unauthenticated", "no user given"));
    }
    if path == "/process.Process/CloseStdin" && !v.close_stdin() {
        return refuse(RpcError::new(
            "unimplemented",
            "process.Process/CloseStdin is not implemented",
        ));
    }
    if path == "/files"
        && req.method() == axum::http::Method::POST
        && !v.octet_stream_upload()
        && !req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|c| c.to_str().ok())
            .is_some_and(|c| c.starts_with("multipart/form-data"))
    {
        return http_error(
            StatusCode::BAD_REQUEST,
            "request Content-Type has bad boundary or is not multipart/form-data",
        );
    }
    next.run(req).await
}

async fn envs(State(a): State<Agent>) -> Response {
    let m: std::collections::BTreeMap<_, _> = a.procs.env().env_vars.iter().cloned().collect();
    axum::Json(m).into_response()
}

async fn kill_all(State(a): State<Agent>) -> StatusCode {
    a.procs.kill_all();
    StatusCode::NO_CONTENT
}

fn header_u64(h: &HeaderMap, name: &str) -> Option<u64> {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.trim().parse().ok())
}

/// Turn an attached process into a Connect event stream:
/// `start` → data/keepalive… → `end` → end-stream. With `deadline` (the
/// faithful envd): when it passes, the direct process is killed and the
/// stream ends with a `deadline_exceeded` end-stream and no `end` event.
fn event_stream(att: Attached, keepalive: Duration, deadline: Option<Duration>) -> Response {
    enum Phase {
        Start,
        Events,
        Finished,
    }
    let Attached { pid, events } = att;
    let until = deadline.map(|d| tokio::time::Instant::now() + d);
    let s =
        futures_util::stream::unfold((Phase::Start, events), move |(phase, mut rx)| async move {
            match phase {
                Phase::Start => {
                    let e = wire::json_envelope(&EventEnvelope {
                        event: ProcessEvent::Start { pid },
                    });
                    Some((e, (Phase::Events, rx)))
                }
                Phase::Events if until.is_some_and(|u| u <= tokio::time::Instant::now()) => {
                    let raw = i32::try_from(pid).unwrap_or(i32::MAX);
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(raw),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                    let err =
                        RpcError::new("deadline_exceeded", "context deadline exceeded").to_wire();
                    Some((wire::end_stream_envelope(Some(err)), (Phase::Finished, rx)))
                }
                Phase::Events => match tokio::time::timeout(
                    until.map_or(keepalive, |u| {
                        keepalive.min(u.saturating_duration_since(tokio::time::Instant::now()))
                    }),
                    rx.recv(),
                )
                .await
                {
                    Err(_) if until.is_some_and(|u| u <= tokio::time::Instant::now()) => {
                        // The deadline: the next turn ends the stream.
                        Some((bytes::Bytes::new(), (Phase::Events, rx)))
                    }
                    Err(_) => {
                        let e = wire::json_envelope(&EventEnvelope {
                            event: ProcessEvent::Keepalive {},
                        });
                        Some((e, (Phase::Events, rx)))
                    }
                    Ok(Some(ProcessEvent::End(end))) => {
                        // `end` and the end-stream message leave together.
                        let mut b = bytes::BytesMut::new();
                        b.extend_from_slice(&wire::json_envelope(&EventEnvelope {
                            event: ProcessEvent::End(end),
                        }));
                        b.extend_from_slice(&wire::end_stream_envelope(None));
                        Some((b.freeze(), (Phase::Finished, rx)))
                    }
                    Ok(Some(ev)) => Some((
                        wire::json_envelope(&EventEnvelope { event: ev }),
                        (Phase::Events, rx),
                    )),
                    Ok(None) => {
                        let err = RpcError::new(
                            "unavailable",
                            format!("process with pid {pid} went away"),
                        )
                        .to_wire();
                        Some((wire::end_stream_envelope(Some(err)), (Phase::Finished, rx)))
                    }
                },
                Phase::Finished => None,
            }
        });
    rpc::stream_response(s)
}

fn keepalive_of(h: &HeaderMap) -> Duration {
    Duration::from_secs(
        header_u64(h, "keepalive-ping-interval")
            .filter(|s| *s > 0)
            .unwrap_or(90),
    )
}

async fn start(State(a): State<Agent>, headers: HeaderMap, body: Bytes) -> Response {
    let req: StartRequest = match rpc::stream_request(&headers, &body) {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    let user = match rpc::basic_user(&headers).and_then(|u| process::user_for(&u)) {
        Ok(u) => u,
        Err(e) => return rpc::stream_error(e),
    };
    let deadline = header_u64(&headers, "connect-timeout-ms")
        .filter(|ms| *ms > 0)
        .map(Duration::from_millis);
    // The faithful envd ends the stream at the deadline itself (and kills
    // only the direct process); otherwise the process's own deadline kills
    // its whole group and the stream ends with its `end` event.
    let faithful = a.procs.env().faithful;
    let (proc_deadline, stream_deadline) = if faithful {
        (None, deadline)
    } else {
        (deadline, None)
    };
    match a.procs.start(req, &user, proc_deadline).await {
        Ok(att) => event_stream(att, keepalive_of(&headers), stream_deadline),
        Err(e) => rpc::stream_error(e),
    }
}

async fn connect(State(a): State<Agent>, headers: HeaderMap, body: Bytes) -> Response {
    let req: SelectorRequest = match rpc::stream_request(&headers, &body) {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    match a.procs.connect(&req.process) {
        Ok(att) => event_stream(att, keepalive_of(&headers), None),
        Err(e) => rpc::stream_error(e),
    }
}

macro_rules! unary {
    ($headers:expr, $body:expr) => {
        match rpc::unary_request(&$headers, &$body) {
            Ok(r) => r,
            Err(resp) => return resp,
        }
    };
}

fn reply<T: serde::Serialize>(r: Result<T, RpcError>) -> Response {
    match r {
        Ok(v) => rpc::unary_ok(&v),
        Err(e) => e.into_response(),
    }
}

async fn list(State(a): State<Agent>, headers: HeaderMap, body: Bytes) -> Response {
    let _: serde_json::Value = unary!(headers, body);
    rpc::unary_ok(&ListResponse {
        processes: a.procs.list(),
    })
}

async fn send_input(State(a): State<Agent>, headers: HeaderMap, body: Bytes) -> Response {
    let req: SendInputRequest = unary!(headers, body);
    let r = a
        .procs
        .send_input(
            &req.process,
            req.input.stdin.as_deref(),
            req.input.pty.as_deref(),
        )
        .await;
    reply(r.map(|()| serde_json::json!({})))
}

async fn send_signal(State(a): State<Agent>, headers: HeaderMap, body: Bytes) -> Response {
    let req: SendSignalRequest = unary!(headers, body);
    reply(
        a.procs
            .signal(&req.process, &req.signal)
            .map(|()| serde_json::json!({})),
    )
}

async fn update(State(a): State<Agent>, headers: HeaderMap, body: Bytes) -> Response {
    let req: UpdateRequest = unary!(headers, body);
    reply(
        a.procs
            .resize(&req.process, req.pty)
            .map(|()| serde_json::json!({})),
    )
}

async fn close_stdin(State(a): State<Agent>, headers: HeaderMap, body: Bytes) -> Response {
    let req: SelectorRequest = unary!(headers, body);
    reply(
        a.procs
            .close_stdin(&req.process)
            .await
            .map(|()| serde_json::json!({})),
    )
}

fn fs_user(headers: &HeaderMap) -> Result<users::User, RpcError> {
    rpc::basic_user(headers).and_then(|u| process::user_for(&u))
}

fn resolve(a: &Agent, p: &str, user: &users::User) -> Result<filesystem::Resolved, RpcError> {
    let env = a.procs.env().clone();
    filesystem::resolve(p, user, &move |x: &Path| env.host_path(x))
}

/// Run blocking filesystem work off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, RpcError> + Send + 'static,
) -> Result<T, RpcError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| RpcError::internal(e.to_string()))?
}

async fn fs_stat(State(a): State<Agent>, headers: HeaderMap, body: Bytes) -> Response {
    let req: PathRequest = unary!(headers, body);
    reply(
        blocking(move || {
            let user = fs_user(&headers)?;
            let r = resolve(&a, &req.path, &user)?;
            filesystem::stat(&r).map(|entry| EntryResponse { entry })
        })
        .await,
    )
}

async fn fs_list_dir(State(a): State<Agent>, headers: HeaderMap, body: Bytes) -> Response {
    let req: ListDirRequest = unary!(headers, body);
    reply(
        blocking(move || {
            let user = fs_user(&headers)?;
            let r = resolve(&a, &req.path, &user)?;
            filesystem::list_dir(&r, req.depth.unwrap_or(0))
                .map(|entries| ListDirResponse { entries })
        })
        .await,
    )
}

async fn fs_make_dir(State(a): State<Agent>, headers: HeaderMap, body: Bytes) -> Response {
    let req: PathRequest = unary!(headers, body);
    reply(
        blocking(move || {
            let user = fs_user(&headers)?;
            let r = resolve(&a, &req.path, &user)?;
            filesystem::make_dir(&r, &user).map(|entry| EntryResponse { entry })
        })
        .await,
    )
}

async fn fs_move(State(a): State<Agent>, headers: HeaderMap, body: Bytes) -> Response {
    let req: MoveRequest = unary!(headers, body);
    reply(
        blocking(move || {
            let user = fs_user(&headers)?;
            let src = resolve(&a, &req.source, &user)?;
            let dst = resolve(&a, &req.destination, &user)?;
            filesystem::move_entry(&src, &dst, &user).map(|entry| EntryResponse { entry })
        })
        .await,
    )
}

async fn fs_remove(State(a): State<Agent>, headers: HeaderMap, body: Bytes) -> Response {
    let req: PathRequest = unary!(headers, body);
    reply(
        blocking(move || {
            let user = fs_user(&headers)?;
            let r = resolve(&a, &req.path, &user)?;
            filesystem::remove(&r).map(|()| serde_json::json!({}))
        })
        .await,
    )
}

// ------------------------------------------------------------ /files

/// envd-HTTP error: `{"code": <int>, "message"}`.
fn http_error(status: StatusCode, message: impl Into<String>) -> Response {
    let body = wire::ApiErrorBody {
        code: status.as_u16(),
        message: message.into(),
    };
    (status, axum::Json(body)).into_response()
}

#[derive(Deserialize)]
struct FilesQuery {
    path: Option<String>,
    username: Option<String>,
}

fn files_user(q: &FilesQuery, headers: &HeaderMap) -> Result<users::User, Response> {
    let name = match &q.username {
        Some(u) if !u.is_empty() => u.clone(),
        _ => {
            rpc::basic_user(headers).map_err(|e| http_error(StatusCode::UNAUTHORIZED, e.message))?
        }
    };
    users::lookup(&name).ok_or_else(|| {
        http_error(
            StatusCode::UNAUTHORIZED,
            format!("invalid username: '{name}'"),
        )
    })
}

async fn download(
    State(a): State<Agent>,
    Query(q): Query<FilesQuery>,
    headers: HeaderMap,
) -> Response {
    let user = match files_user(&q, &headers) {
        Ok(u) => u,
        Err(r) => return r,
    };
    let Some(p) = q.path.as_deref().filter(|p| !p.is_empty()) else {
        return http_error(StatusCode::BAD_REQUEST, "path is required");
    };
    let r = match resolve(&a, p, &user) {
        Ok(r) => r,
        Err(e) => return http_error(StatusCode::BAD_REQUEST, e.message),
    };
    let shown = r.shown.to_string_lossy().into_owned();
    match tokio::fs::metadata(&r.real).await {
        Ok(m) if m.is_dir() => {
            return http_error(
                StatusCode::BAD_REQUEST,
                format!("path '{shown}' is a directory"),
            );
        }
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return http_error(
                StatusCode::NOT_FOUND,
                format!("path '{shown}' does not exist"),
            );
        }
        Err(e) => return io_http_error(&e, &shown),
    }
    let mut file = match tokio::fs::File::open(&r.real).await {
        Ok(f) => f,
        Err(e) => return io_http_error(&e, &shown),
    };
    let len = match file.metadata().await {
        Ok(m) => m.len(),
        Err(e) => return io_http_error(&e, &shown),
    };
    let name = r
        .shown
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    // A `Range` is answered as Go's `http.ServeContent` answers it (the
    // real envd's): 206 with the part, or 416 when it starts past the end.
    let range = headers
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .map_or(ByteRange::Whole, |v| ByteRange::parse(v, len));
    let (status, start, count) = match range {
        ByteRange::Whole => (StatusCode::OK, 0, len),
        ByteRange::Part(first, last) => (StatusCode::PARTIAL_CONTENT, first, last - first + 1),
        ByteRange::Unsatisfiable => {
            let mut resp = (
                StatusCode::RANGE_NOT_SATISFIABLE,
                "invalid range: failed to overlap\n",
            )
                .into_response();
            if let Ok(v) = header::HeaderValue::from_str(&format!("bytes */{len}")) {
                resp.headers_mut().insert(header::CONTENT_RANGE, v);
            }
            return resp;
        }
    };
    if start > 0 {
        use tokio::io::AsyncSeekExt;
        if let Err(e) = file.seek(std::io::SeekFrom::Start(start)).await {
            return io_http_error(&e, &shown);
        }
    }
    use tokio::io::AsyncReadExt;
    let mut resp = Response::new(Body::from_stream(
        tokio_util::io::ReaderStream::with_capacity(file.take(count), 64 * 1024),
    ));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(header::CONTENT_LENGTH, header::HeaderValue::from(count));
    h.insert(
        header::ACCEPT_RANGES,
        header::HeaderValue::from_static("bytes"),
    );
    if status == StatusCode::PARTIAL_CONTENT {
        let v = format!("bytes {start}-{}/{len}", start + count - 1);
        if let Ok(v) = header::HeaderValue::from_str(&v) {
            h.insert(header::CONTENT_RANGE, v);
        }
    }
    if let Ok(v) =
        header::HeaderValue::from_str(&format!("inline; filename=\"{}\"", name.replace('"', "")))
    {
        h.insert(header::CONTENT_DISPOSITION, v);
    }
    resp
}

/// What a `Range` header asks of a file of a given size, as Go's
/// `http.ServeContent` reads it (a range it cannot parse is a 416 there too).
#[derive(Debug, PartialEq, Eq)]
enum ByteRange {
    /// The whole file: we answer several ranges with it (Go sends them as
    /// `multipart/byteranges`; a server may ignore a `Range`).
    Whole,
    /// Bytes `first..=last`.
    Part(u64, u64),
    /// Not a range, or one that starts past the end (416).
    Unsatisfiable,
}

impl ByteRange {
    fn parse(v: &str, size: u64) -> Self {
        let Some(spec) = v.trim().strip_prefix("bytes=") else {
            return Self::Unsatisfiable;
        };
        if spec.contains(',') {
            return Self::Whole;
        }
        let Some((a, b)) = spec.trim().split_once('-') else {
            return Self::Unsatisfiable;
        };
        let (a, b) = (a.trim(), b.trim());
        if a.is_empty() {
            // `bytes=-N`: the last N bytes.
            return match b.parse::<u64>() {
                Ok(n) if n > 0 && size > 0 => Self::Part(size.saturating_sub(n), size - 1),
                _ => Self::Unsatisfiable,
            };
        }
        let Ok(first) = a.parse::<u64>() else {
            return Self::Unsatisfiable;
        };
        if first >= size {
            return Self::Unsatisfiable;
        }
        if b.is_empty() {
            return Self::Part(first, size - 1);
        }
        match b.parse::<u64>() {
            Ok(last) if last >= first => Self::Part(first, last.min(size - 1)),
            _ => Self::Unsatisfiable,
        }
    }
}

async fn upload(
    State(a): State<Agent>,
    Query(q): Query<FilesQuery>,
    headers: HeaderMap,
    req: Request,
) -> Response {
    let user = match files_user(&q, &headers) {
        Ok(u) => u,
        Err(r) => return r,
    };
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let mut written = vec![];
    if ct.starts_with("multipart/form-data") {
        let mut mp = match axum::extract::Multipart::from_request(req, &()).await {
            Ok(m) => m,
            Err(e) => {
                return http_error(
                    StatusCode::BAD_REQUEST,
                    format!("invalid multipart body: {e}"),
                );
            }
        };
        loop {
            let field = match mp.next_field().await {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => {
                    return http_error(
                        StatusCode::BAD_REQUEST,
                        format!("invalid multipart body: {e}"),
                    );
                }
            };
            if field.name() != Some("file") {
                continue;
            }
            let target = match (&q.path, field.file_name()) {
                (Some(p), _) if !p.is_empty() => p.clone(),
                (_, Some(f)) if !f.is_empty() => f.to_string(),
                _ => {
                    return http_error(
                        StatusCode::BAD_REQUEST,
                        "no path given for the uploaded file",
                    );
                }
            };
            let stream = field.map(|r| r.map_err(std::io::Error::other));
            match write_upload(&a, &target, &user, stream).await {
                Ok(e) => written.push(e),
                Err(r) => return r,
            }
        }
    } else if ct.is_empty() || ct.starts_with("application/octet-stream") {
        let Some(p) = q.path.clone().filter(|p| !p.is_empty()) else {
            return http_error(
                StatusCode::BAD_REQUEST,
                "path is required for application/octet-stream uploads",
            );
        };
        let stream = req
            .into_body()
            .into_data_stream()
            .map(|r| r.map_err(std::io::Error::other));
        match write_upload(&a, &p, &user, stream).await {
            Ok(e) => written.push(e),
            Err(r) => return r,
        }
    } else {
        return http_error(
            StatusCode::BAD_REQUEST,
            format!("unsupported content type: {ct}"),
        );
    }
    axum::Json(written).into_response()
}

/// Stream an upload into a temporary file beside the target, then rename it
/// into place: a failed upload never leaves a partial file.
async fn write_upload<S>(
    a: &Agent,
    path: &str,
    user: &users::User,
    mut body: S,
) -> Result<serde_json::Value, Response>
where
    S: futures_util::Stream<Item = std::io::Result<Bytes>> + Unpin,
{
    let r = resolve(a, path, user).map_err(|e| http_error(StatusCode::BAD_REQUEST, e.message))?;
    let shown = r.shown.to_string_lossy().into_owned();
    if r.real.is_dir() {
        return Err(http_error(
            StatusCode::BAD_REQUEST,
            format!("path '{shown}' is a directory"),
        ));
    }
    let parent = r
        .real
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| "/".into());
    let u = user.clone();
    let p2 = parent.clone();
    tokio::task::spawn_blocking(move || filesystem::create_dirs_owned(&p2, &u))
        .await
        .map_err(|e| http_error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map_err(|e| io_http_error(&e, &shown))?;
    let tmp = parent.join(format!(
        ".{}.upload-{:016x}",
        r.shown
            .file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default(),
        rand::random::<u64>()
    ));
    let result = async {
        let mut f = tokio::fs::File::create(&tmp).await?;
        while let Some(chunk) = body.next().await {
            f.write_all(&chunk?).await?;
        }
        f.flush().await?;
        drop(f);
        let _ = std::os::unix::fs::chown(&tmp, Some(user.uid), Some(user.gid));
        tokio::fs::rename(&tmp, &r.real).await
    }
    .await;
    if let Err(e) = result {
        let _ = tokio::fs::remove_file(&tmp).await;
        return Err(io_http_error(&e, &shown));
    }
    let name = r
        .shown
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    Ok(serde_json::json!({"path": shown, "name": name, "type": "file"}))
}

/// A file transfer's I/O error as the envd HTTP status CubeSandbox gives.
fn io_http_error(e: &std::io::Error, shown: &str) -> Response {
    match e.kind() {
        std::io::ErrorKind::StorageFull => http_error(
            StatusCode::INSUFFICIENT_STORAGE,
            format!("not enough disk space for '{shown}'"),
        ),
        std::io::ErrorKind::PermissionDenied => http_error(
            StatusCode::FORBIDDEN,
            format!("permission denied: '{shown}'"),
        ),
        std::io::ErrorKind::ReadOnlyFilesystem => http_error(
            StatusCode::FORBIDDEN,
            format!("read-only file system: '{shown}'"),
        ),
        std::io::ErrorKind::NotFound => {
            http_error(StatusCode::NOT_FOUND, format!("'{shown}': {e}"))
        }
        // The path cannot be used so: a name too long, a file where a
        // directory is needed, a directory where a file is.
        std::io::ErrorKind::InvalidFilename
        | std::io::ErrorKind::InvalidInput
        | std::io::ErrorKind::NotADirectory
        | std::io::ErrorKind::IsADirectory => {
            http_error(StatusCode::BAD_REQUEST, format!("'{shown}': {e}"))
        }
        _ => http_error(StatusCode::INTERNAL_SERVER_ERROR, format!("'{shown}': {e}")),
    }
}

/// Serve the agent on an already-bound unix listener until it fails.
pub async fn serve(listener: tokio::net::UnixListener, procs: Processes) -> std::io::Result<()> {
    axum::serve(listener, router(procs)).await
}

#[cfg(test)]
mod range_tests {
    use super::ByteRange::{self, *};

    #[test]
    fn ranges_read_as_go_reads_them() {
        let p = |v| ByteRange::parse(v, 10);
        assert_eq!(p("bytes=0-"), Part(0, 9));
        assert_eq!(p("bytes=4-"), Part(4, 9));
        assert_eq!(p("bytes=4-6"), Part(4, 6));
        assert_eq!(p("bytes=4-60"), Part(4, 9));
        assert_eq!(p("bytes=-3"), Part(7, 9));
        assert_eq!(p("bytes=-30"), Part(0, 9));
        assert_eq!(p("bytes=10-"), Unsatisfiable);
        assert_eq!(p("bytes=6-4"), Unsatisfiable);
        assert_eq!(p("bytes=x-"), Unsatisfiable);
        assert_eq!(p("lines=1-"), Unsatisfiable);
        assert_eq!(p("bytes=0-1,4-5"), Whole);
        assert_eq!(ByteRange::parse("bytes=0-", 0), Unsatisfiable);
    }
}
