//! Jobs: reference rows 19–23, plus per-stream cursors and `recover`.

use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::sse::Event;
use axum::routing::{get, post};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use serde::Deserialize;
use serde_json::{Value, json};

use super::{
    ApiError, AppState, Auth, EmptyReq, R, Strict, ctx, err, header_ctx, int_in, ok, with_status,
};
use crate::broker::Code;
use crate::broker::jobs::{Cursors, DEFAULT_CHUNK, MAX_CHUNK, OutputRequest};

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/leases/{lease_ref}/jobs", post(start))
        .route(
            "/v1/jobs/{job_ref}/status",
            get(status_get).post(status_post),
        )
        .route("/v1/jobs/{job_ref}/output", post(output))
        .route("/v1/jobs/{job_ref}/cancel", post(cancel))
        .route("/v1/jobs/{job_ref}/events", get(events))
        .route("/v1/jobs/{job_ref}/recover", get(recover))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StartReq {
    command: String,
    #[serde(default)]
    cwd: Option<String>,
    #[serde(default)]
    request_id: Option<String>,
}

async fn start(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(lease): Path<String>,
    Strict(b): Strict<StartReq>,
) -> R {
    let c = ctx(b.request_id.as_deref())?;
    let v = st
        .broker
        .start_job(&p, &c, &lease, &b.command, b.cwd.as_deref())
        .await?;
    with_status(axum::http::StatusCode::ACCEPTED, v)
}

async fn status_get(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(job): Path<String>,
    h: HeaderMap,
) -> R {
    let c = header_ctx(&h)?;
    ok(st.broker.job_status(&p, &c, &job).await?)
}

async fn status_post(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(job): Path<String>,
    Strict(b): Strict<EmptyReq>,
) -> R {
    let c = ctx(b.request_id.as_deref())?;
    ok(st.broker.job_status(&p, &c, &job).await?)
}

async fn recover(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(job): Path<String>,
    h: HeaderMap,
) -> R {
    let c = header_ctx(&h)?;
    ok(st.broker.recover_job(&p, &c, &job).await?)
}

async fn cancel(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(job): Path<String>,
    Strict(b): Strict<EmptyReq>,
) -> R {
    let c = ctx(b.request_id.as_deref())?;
    ok(st.broker.cancel_job(&p, &c, &job).await?)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OutputReq {
    #[serde(default)]
    offset: Option<Value>,
    #[serde(default)]
    max_bytes: Option<Value>,
    #[serde(default)]
    stdout_offset: Option<Value>,
    #[serde(default)]
    stderr_offset: Option<Value>,
    #[serde(default)]
    request_id: Option<String>,
}

/// A non-negative integer offset (default 0), or 400 `invalid_offset`.
fn offset(v: Option<&Value>, name: &str) -> Result<u64, ApiError> {
    let msg = format!("{name} must be an integer ≥ 0");
    Ok(int_in(v, 0..=u64::MAX, Code::InvalidOffset, &msg)?.unwrap_or(0))
}

/// A chunk size in 1..=1 MiB (default 64 KiB), or 400 `invalid_limit`.
fn limit(v: Option<&Value>) -> Result<usize, ApiError> {
    let msg = format!("max_bytes must be an integer in 1..={MAX_CHUNK}");
    let n = int_in(v, 1..=MAX_CHUNK as u64, Code::InvalidLimit, &msg)?;
    Ok(n.map_or(DEFAULT_CHUNK, |n| n as usize))
}

async fn output(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(job): Path<String>,
    Strict(b): Strict<OutputReq>,
) -> R {
    let c = ctx(b.request_id.as_deref())?;
    let max_bytes = limit(b.max_bytes.as_ref())?;
    let cursors = b.stdout_offset.is_some() || b.stderr_offset.is_some();
    let req = if cursors {
        if b.offset.is_some() {
            return Err(err(
                Code::InvalidRequest,
                "offset pages the reference's fragment; use it without stdout_offset/stderr_offset",
            ));
        }
        OutputRequest::Cursors(Cursors {
            stdout_offset: offset(b.stdout_offset.as_ref(), "stdout_offset")?,
            stderr_offset: offset(b.stderr_offset.as_ref(), "stderr_offset")?,
            max_bytes,
        })
    } else {
        OutputRequest::Fragment {
            offset: offset(b.offset.as_ref(), "offset")?,
            max_bytes,
        }
    };
    ok(st.broker.job_output(&p, &c, &job, req).await?)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EventsQuery {
    #[serde(default)]
    timeout: Option<u64>,
    #[serde(default)]
    stdout_offset: Option<u64>,
    #[serde(default)]
    stderr_offset: Option<u64>,
    /// `base64`: output events carry only the base64 fields (no text copy).
    #[serde(default)]
    encoding: Option<String>,
}

/// Longest an event stream stays open (seconds).
const MAX_STREAM_SECONDS: u64 = 3600;
/// Largest chunk per stream in one `output` event (`encoding=base64`).
const EVENT_CHUNK: usize = 1024 * 1024;
/// The same with text copies (the default).
const TEXT_CHUNK: usize = 64 * 1024;
/// Pause between polls once the output is drained.
const POLL: Duration = Duration::from_millis(500);

/// `GET /v1/jobs/{ref}/events`: `output` events with the new bytes of each
/// stream (text unless `encoding=base64`, base64 and the offsets; the SSE id is `stdout:stderr`
/// offsets, so `Last-Event-ID` resumes), a `status` event per poll, and a
/// final `status` once the job has ended and its output is drained, or
/// `timeout` at the deadline.
async fn events(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(job): Path<String>,
    q: Result<Query<EventsQuery>, axum::extract::rejection::QueryRejection>,
    pc: Option<axum::Extension<crate::auth::PeerCert>>,
    h: HeaderMap,
) -> R {
    let Query(q) = q.map_err(|e| err(Code::InvalidRequest, e.body_text()))?;
    let c = header_ctx(&h)?;
    // Resume: query offsets, else the last event id a client saw.
    let mut cur = Cursors {
        stdout_offset: q.stdout_offset.unwrap_or(0),
        stderr_offset: q.stderr_offset.unwrap_or(0),
        max_bytes: 0,
    };
    if q.stdout_offset.is_none()
        && q.stderr_offset.is_none()
        && let Some(id) = h.get("last-event-id").and_then(|v| v.to_str().ok())
    {
        let (o, e) = id
            .split_once(':')
            .and_then(|(o, e)| Some((o.parse().ok()?, e.parse().ok()?)))
            .ok_or_else(|| {
                err(
                    Code::InvalidOffset,
                    "Last-Event-ID must be <stdout>:<stderr>",
                )
            })?;
        cur.stdout_offset = o;
        cur.stderr_offset = e;
    }
    let secs = q.timeout.unwrap_or(300).clamp(1, MAX_STREAM_SECONDS);
    let text = match q.encoding.as_deref() {
        None | Some("text") => true,
        Some("base64") => false,
        Some(_) => return Err(err(Code::InvalidRequest, "encoding must be text or base64")),
    };
    // Text copies of binary output can be six times its size: smaller
    // chunks keep an event (and a slow client's backlog) small.
    cur.max_bytes = if text { TEXT_CHUNK } else { EVENT_CHUNK };
    let opened = st.broker.open_job_events(&p, &c, &job).await?;
    let broker = st.broker.clone();
    let mut still = super::StreamAuth::new(&st, &h).with_cert(pc.map(|e| e.0));
    // Two events in flight: a slow client holds little memory.
    let (tx, rx) = tokio::sync::mpsc::channel::<Event>(2);
    let job_ref = opened.job_ref.clone();
    tokio::spawn(async move {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            // The stream lives on the token that opened it: a revoked one ends it.
            if !still.still_valid(&tx).await {
                return;
            }
            let polled = broker.job_poll(&job_ref, cur).await;
            let (job, sandbox_ref, out, errb, drained) = match polled {
                Ok(x) => x,
                Err(e) => {
                    let ev = Event::default()
                        .event("error")
                        .data(json!({"code": e.code, "message": e.message}).to_string());
                    let _ = tx.send(ev).await;
                    return;
                }
            };
            if !out.is_empty() || !errb.is_empty() {
                let (on, en) = (
                    cur.stdout_offset + out.len() as u64,
                    cur.stderr_offset + errb.len() as u64,
                );
                let mut data = json!({
                    "stdout_base64": B64.encode(&out),
                    "stderr_base64": B64.encode(&errb),
                    "stdout_offset": cur.stdout_offset,
                    "stderr_offset": cur.stderr_offset,
                    "stdout_next_offset": on,
                    "stderr_next_offset": en,
                });
                if text && let Some(m) = data.as_object_mut() {
                    m.insert("stdout".into(), json!(String::from_utf8_lossy(&out)));
                    m.insert("stderr".into(), json!(String::from_utf8_lossy(&errb)));
                }
                let ev = Event::default()
                    .event("output")
                    .id(format!("{on}:{en}"))
                    .data(data.to_string());
                if tx.send(ev).await.is_err() {
                    return;
                }
                cur.stdout_offset = on;
                cur.stderr_offset = en;
            }
            let mut fields = serde_json::Map::new();
            fields.insert(
                "executor".into(),
                json!(broker.lease_executor(&job.lease_ref)),
            );
            fields.insert("sandbox_ref".into(), json!(sandbox_ref));
            fields.insert("job_ref".into(), json!(job.job_ref));
            fields.insert("state".into(), json!(job.state));
            fields.insert("exit_code".into(), json!(job.exit_code));
            fields.insert("cancelled".into(), json!(job.cancelled));
            fields.insert("timed_out".into(), json!(job.state == "timed_out"));
            fields.insert("created_at".into(), json!(job.created_at));
            fields.insert("updated_at".into(), json!(job.updated_at));
            let ev = Event::default()
                .event("status")
                .data(Value::Object(fields).to_string());
            if tx.send(ev).await.is_err() {
                return;
            }
            if job.is_terminal() && drained {
                return;
            }
            if Instant::now() >= deadline {
                let ev = Event::default()
                    .event("timeout")
                    .data(json!({"job_ref": job.job_ref}).to_string());
                let _ = tx.send(ev).await;
                return;
            }
            if drained {
                tokio::select! {
                    _ = tokio::time::sleep(POLL) => {}
                    _ = tx.closed() => return,
                }
            }
        }
    });
    Ok(super::sse(rx))
}
