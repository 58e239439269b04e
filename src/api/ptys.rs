//! PTYs: reference rows 24–29, with viewers that resume by offset.

use std::time::Duration;

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

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/leases/{lease_ref}/ptys", post(create))
        .route("/v1/ptys/{pty_ref}/status", get(status))
        .route("/v1/ptys/{pty_ref}/input", post(input))
        .route("/v1/ptys/{pty_ref}/resize", post(resize))
        .route("/v1/ptys/{pty_ref}/kill", post(kill))
        .route("/v1/ptys/{pty_ref}/events", get(events))
        .route("/v1/ptys/{pty_ref}/output", post(output))
}

/// A size in 1..=1000, or 400 `invalid_pty_size`.
fn size(v: Option<&Value>, default: u32) -> Result<u32, ApiError> {
    let n = int_in(
        v,
        1..=1000,
        Code::InvalidPtySize,
        "rows and cols must be integers in 1..=1000",
    )?;
    Ok(n.map_or(default, |n| n as u32))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateReq {
    #[serde(default)]
    rows: Option<Value>,
    #[serde(default)]
    cols: Option<Value>,
    #[serde(default)]
    cwd: Option<String>,
    #[serde(default)]
    request_id: Option<String>,
}

async fn create(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(lease): Path<String>,
    Strict(b): Strict<CreateReq>,
) -> R {
    let c = ctx(b.request_id.as_deref())?;
    let (rows, cols) = (size(b.rows.as_ref(), 24)?, size(b.cols.as_ref(), 80)?);
    let v = st
        .broker
        .create_pty(&p, &c, &lease, rows, cols, b.cwd.as_deref())
        .await?;
    with_status(axum::http::StatusCode::CREATED, v)
}

async fn status(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(pty): Path<String>,
    h: HeaderMap,
) -> R {
    let c = header_ctx(&h)?;
    ok(st.broker.pty_status(&p, &c, &pty).await?)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct InputReq {
    /// Text (the reference's field).
    #[serde(default)]
    data: Option<String>,
    /// Or bytes, base64.
    #[serde(default)]
    data_base64: Option<String>,
    #[serde(default)]
    request_id: Option<String>,
}

async fn input(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(pty): Path<String>,
    Strict(b): Strict<InputReq>,
) -> R {
    let c = ctx(b.request_id.as_deref())?;
    let data = match (b.data, b.data_base64) {
        (Some(d), None) => d.into_bytes(),
        (None, Some(d)) => B64
            .decode(d.as_bytes())
            .map_err(|_| err(Code::InvalidBase64, "data_base64 is not valid base64"))?,
        _ => {
            return Err(err(
                Code::InvalidRequest,
                "send exactly one of data and data_base64",
            ));
        }
    };
    ok(st.broker.pty_input(&p, &c, &pty, data).await?)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ResizeReq {
    rows: Value,
    cols: Value,
    #[serde(default)]
    request_id: Option<String>,
}

async fn resize(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(pty): Path<String>,
    Strict(b): Strict<ResizeReq>,
) -> R {
    let c = ctx(b.request_id.as_deref())?;
    let (rows, cols) = (size(Some(&b.rows), 24)?, size(Some(&b.cols), 80)?);
    ok(st.broker.pty_resize(&p, &c, &pty, rows, cols).await?)
}

async fn kill(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(pty): Path<String>,
    Strict(b): Strict<EmptyReq>,
) -> R {
    let c = ctx(b.request_id.as_deref())?;
    ok(st.broker.pty_kill(&p, &c, &pty).await?)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OutputReq {
    #[serde(default)]
    offset: Option<Value>,
    #[serde(default)]
    max_bytes: Option<Value>,
    #[serde(default)]
    wait_ms: Option<Value>,
    #[serde(default)]
    request_id: Option<String>,
}

async fn output(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(pty): Path<String>,
    Strict(b): Strict<OutputReq>,
) -> R {
    let c = ctx(b.request_id.as_deref())?;
    let offset = int_in(
        b.offset.as_ref(),
        0..=u64::MAX,
        Code::InvalidOffset,
        "offset must be an integer ≥ 0",
    )?;
    let max = int_in(
        b.max_bytes.as_ref(),
        1..=1024 * 1024,
        Code::InvalidLimit,
        "max_bytes must be an integer in 1..=1048576",
    )?;
    let wait = int_in(
        b.wait_ms.as_ref(),
        0..=30_000,
        Code::InvalidRequest,
        "wait_ms must be an integer in 0..=30000",
    )?;
    ok(st
        .broker
        .pty_output(
            &p,
            &c,
            &pty,
            offset.unwrap_or(0),
            max.map_or(64 * 1024, |n| n as usize),
            std::time::Duration::from_millis(wait.unwrap_or(0)),
        )
        .await?)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EventsQuery {
    #[serde(default)]
    timeout: Option<u64>,
    #[serde(default)]
    offset: Option<u64>,
}

/// Largest chunk in one `output` event.
const EVENT_CHUNK: usize = 64 * 1024;

fn status_event(
    pty: &crate::broker::ptys::Pty,
    executor: crate::broker::dto::Executor,
    sandbox_ref: &str,
) -> Event {
    let v = json!({
        "executor": executor, "sandbox_ref": sandbox_ref,
        "lease_ref": pty.lease_ref, "pty_ref": pty.pty_ref, "state": pty.state,
        "exit_code": pty.exit_code, "rows": pty.rows, "cols": pty.cols,
        "created_at": pty.created_at, "updated_at": pty.updated_at,
    });
    Event::default().event("status").data(v.to_string())
}

/// `GET /v1/ptys/{ref}/events`: `status`, then `output` events
/// (`content_base64`, `encoding: base64`, `offset`, `next_offset`; the SSE
/// id is the next offset, so `Last-Event-ID` or `?offset=` resumes), a
/// `gap` event if the viewer's offset is older than what is retained, and a
/// final `status` once the PTY has ended and its output is drained (or
/// `timeout`). Any number of viewers may watch one PTY.
async fn events(
    State(st): State<AppState>,
    Auth(p): Auth,
    Path(pty_ref): Path<String>,
    q: Result<Query<EventsQuery>, axum::extract::rejection::QueryRejection>,
    pc: Option<axum::Extension<crate::auth::PeerCert>>,
    h: HeaderMap,
) -> R {
    let Query(q) = q.map_err(|e| err(Code::InvalidRequest, e.body_text()))?;
    let c = header_ctx(&h)?;
    let mut cur = match q.offset {
        Some(o) => o,
        None => match h.get("last-event-id").and_then(|v| v.to_str().ok()) {
            Some(id) => id
                .parse()
                .map_err(|_| err(Code::InvalidOffset, "Last-Event-ID must be an offset"))?,
            None => 0,
        },
    };
    let secs = q.timeout.unwrap_or(300).clamp(1, 3600);
    let (pty, sandbox_ref, hub) = st.broker.open_pty_events(&p, &c, &pty_ref).await?;
    let broker = st.broker.clone();
    let mut still = super::StreamAuth::new(&st, &h).with_cert(pc.map(|e| e.0));
    // Two events in flight: a slow viewer holds little memory.
    let (tx, rx) = tokio::sync::mpsc::channel::<Event>(2);
    tokio::spawn(async move {
        if tx
            .send(status_event(
                &pty,
                broker.lease_executor(&pty.lease_ref),
                &sandbox_ref,
            ))
            .await
            .is_err()
        {
            return;
        }
        let Some(hub) = hub else {
            return; // not running in this process (ended long ago, or lost)
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
        let mut tick = hub.tick.subscribe();
        loop {
            // The stream lives on the token that opened it: a revoked one ends it.
            if !still.still_valid(&tx).await {
                return;
            }
            let chunk = hub.read(cur, EVENT_CHUNK);
            if let Some((from, to)) = chunk.missed {
                let ev = Event::default()
                    .event("gap")
                    .data(json!({"from": from, "to": to}).to_string());
                if tx.send(ev).await.is_err() {
                    return;
                }
            }
            if !chunk.bytes.is_empty() {
                let next = chunk.from + chunk.bytes.len() as u64;
                let ev = Event::default().event("output").id(next.to_string()).data(
                    json!({
                        "content_base64": B64.encode(&chunk.bytes),
                        "encoding": "base64",
                        "offset": chunk.from,
                        "next_offset": next,
                    })
                    .to_string(),
                );
                if tx.send(ev).await.is_err() {
                    return;
                }
                cur = next;
                if tokio::time::Instant::now() < deadline {
                    continue;
                }
            }
            cur = cur.max(chunk.from);
            if chunk.ended {
                // The pump records the end right after the stream closes.
                for _ in 0..20 {
                    match broker.get_pty(&pty_ref) {
                        Ok(Some(p)) if p.is_running() => {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                        Ok(Some(p)) => {
                            let _ = tx
                                .send(status_event(
                                    &p,
                                    broker.lease_executor(&p.lease_ref),
                                    &sandbox_ref,
                                ))
                                .await;
                            return;
                        }
                        _ => return,
                    }
                }
                return;
            }
            tokio::select! {
                r = tick.changed() => if r.is_err() { return },
                _ = tokio::time::sleep(super::STILL_VALID_EVERY) => {}
                _ = tokio::time::sleep_until(deadline) => {
                    let ev = Event::default()
                        .event("timeout")
                        .data(json!({"pty_ref": pty_ref}).to_string());
                    let _ = tx.send(ev).await;
                    return;
                }
                _ = tx.closed() => return,
            }
        }
    });
    Ok(super::sse(rx))
}
