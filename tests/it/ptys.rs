//! PTYs: create, input, resize, several viewers, reconnect by offset, kill,
//! the shared quota with jobs, and `lost` after an appliance restart.

use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use futures_util::StreamExt;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::kit::Server;

/// A viewer: reads `output` events into `buf` until `want` appears in it
/// (or the stream ends); returns the last SSE id seen and the events' kinds.
async fn watch_until(
    body: &mut (impl futures_util::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin),
    pending: &mut Vec<u8>,
    buf: &mut Vec<u8>,
    want: &str,
) -> Vec<(String, Value)> {
    let mut seen = vec![];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        while let Some(end) = pending.windows(2).position(|w| w == b"\n\n") {
            let block = String::from_utf8(pending[..end].to_vec()).unwrap();
            pending.drain(..end + 2);
            let ev = block
                .lines()
                .find_map(|l| l.strip_prefix("event: "))
                .unwrap_or("")
                .to_string();
            let data = block
                .lines()
                .find_map(|l| l.strip_prefix("data: "))
                .unwrap_or("");
            if ev.is_empty() {
                continue;
            }
            let v: Value = serde_json::from_str(data).unwrap();
            if ev == "output" {
                assert_eq!(
                    v["offset"].as_u64().unwrap() as usize,
                    buf.len(),
                    "no gap, no overlap"
                );
                buf.extend(B64.decode(v["content_base64"].as_str().unwrap()).unwrap());
            }
            seen.push((ev, v));
        }
        if String::from_utf8_lossy(buf).contains(want) {
            return seen;
        }
        let next = tokio::time::timeout_at(deadline, body.next()).await;
        match next {
            Ok(Some(chunk)) => pending.extend_from_slice(&chunk.unwrap()),
            Ok(None) => return seen,
            Err(_) => panic!(
                "timed out waiting for {want:?}; got {:?}",
                String::from_utf8_lossy(buf)
            ),
        }
    }
}

async fn open(
    s: &Server,
    pty: &str,
    offset: usize,
) -> impl futures_util::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin + use<> {
    let r = s
        .http
        .get(format!(
            "{}/v1/ptys/{pty}/events?timeout=60&offset={offset}",
            s.url
        ))
        .bearer_auth(&s.admin)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    r.bytes_stream()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pty_viewers_resize_reconnect_and_kill() {
    let s = Server::start_with(|c| {
        c.profiles
            .get_mut("offline-code")
            .unwrap()
            .max_jobs_per_lease = 2;
    })
    .await;
    let lease = s.acquire(&s.admin, "pty").await;
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/ptys"),
            json!({"rows": 24, "cols": 80}),
        )
        .await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    assert_eq!(v["state"], "running");
    let pty = v["pty_ref"].as_str().unwrap().to_string();
    for bad in [
        json!({"rows": 0}),
        json!({"cols": 1001}),
        json!({"rows": "x"}),
    ] {
        let (st, v) = s
            .post(&s.admin, &format!("/v1/leases/{lease}/ptys"), bad)
            .await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{v}");
        assert_eq!(v["error"]["code"], "invalid_pty_size");
    }

    // Viewer A from the start.
    let mut a = open(&s, &pty, 0).await;
    let (mut pa, mut ba) = (vec![], vec![]);
    let input = |text: &'static str| {
        let s = &s;
        let pty = pty.clone();
        async move {
            let (st, v) = s
                .post(
                    &s.admin,
                    &format!("/v1/ptys/{pty}/input"),
                    json!({"data": text}),
                )
                .await;
            assert_eq!(st, StatusCode::OK, "{v}");
        }
    };
    input("stty size; echo MARK-$((6*7))\n").await;
    let seen = watch_until(&mut a, &mut pa, &mut ba, "MARK-42").await;
    assert_eq!(seen.first().map(|(e, _)| e.as_str()), Some("status"));
    assert!(
        String::from_utf8_lossy(&ba).contains("24 80"),
        "{}",
        String::from_utf8_lossy(&ba)
    );

    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/ptys/{pty}/resize"),
            json!({"rows": 40, "cols": 120}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(
        (v["rows"].as_u64(), v["cols"].as_u64()),
        (Some(40), Some(120))
    );
    input("stty size; echo MARK-$((7*7))\n").await;
    watch_until(&mut a, &mut pa, &mut ba, "MARK-49").await;
    assert!(String::from_utf8_lossy(&ba).contains("40 120"));

    // Viewer B connects later from offset 0 and sees the same bytes; a
    // viewer that reconnects from where it was gets only what follows.
    let mut b = open(&s, &pty, 0).await;
    let (mut pb, mut bb) = (vec![], vec![]);
    watch_until(&mut b, &mut pb, &mut bb, "MARK-49").await;
    assert_eq!(bb[..ba.len().min(bb.len())], ba[..ba.len().min(bb.len())]);
    drop(a);
    let cut = ba.len();
    input("echo MARK-$((8*8))\n").await;
    let mut a2 = open(&s, &pty, cut).await;
    let (mut pa2, mut ba2) = (vec![], ba.clone());
    watch_until(&mut a2, &mut pa2, &mut ba2, "MARK-64").await;
    watch_until(&mut b, &mut pb, &mut bb, "MARK-64").await;
    let n = ba2.len().min(bb.len());
    assert_eq!(
        ba2[..n],
        bb[..n],
        "a reconnected viewer lost or repeated bytes"
    );

    // Quota: the PTY and a job fill the lease's two slots.
    let (st, _) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/jobs"),
            json!({"command": "sleep 30"}),
        )
        .await;
    assert_eq!(st, StatusCode::ACCEPTED);
    let (st, v) = s
        .post(&s.admin, &format!("/v1/leases/{lease}/ptys"), json!({}))
        .await;
    assert_eq!(st, StatusCode::TOO_MANY_REQUESTS, "{v}");
    assert_eq!(v["error"]["code"], "job_quota_exceeded");

    // `exit` ends it: the streams end with a final status.
    input("exit 3\n").await;
    let seen = watch_until(&mut b, &mut pb, &mut bb, "\u{0}never").await;
    let last = seen.last().unwrap();
    assert_eq!(last.0, "status", "{seen:?}");
    assert_eq!(last.1["state"], "exited");
    assert_eq!(last.1["exit_code"], 3);
    let (_, v) = s.get(&s.admin, &format!("/v1/ptys/{pty}/status")).await;
    assert_eq!(v["state"], "exited");
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/ptys/{pty}/input"),
            json!({"data": "x"}),
        )
        .await;
    assert_eq!(
        (st, crate::kit::code(&v)),
        (StatusCode::CONFLICT, "pty_not_running"),
        "{v}"
    );

    // Kill: cancelled.
    let (_, v) = s
        .post(&s.admin, &format!("/v1/leases/{lease}/ptys"), json!({}))
        .await;
    let p2 = v["pty_ref"].as_str().unwrap().to_string();
    let (st, v) = s
        .post(&s.admin, &format!("/v1/ptys/{p2}/kill"), json!({}))
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "cancelled");
    for bad in ["pty_00000000000000000000", "nope"] {
        let (st, v) = s.get(&s.admin, &format!("/v1/ptys/{bad}/status")).await;
        assert_eq!(st, StatusCode::NOT_FOUND, "{v}");
        assert_eq!(v["error"]["code"], "pty_not_found");
    }

    // The journal keeps each input's size and keyed digest (issue #34,
    // L7), never the input: the two `stty size; …` lines are as long as
    // each other and digest apart.
    let journal = s.journal();
    assert!(!journal.contains("MARK-$"), "input reached the journal");
    let inputs: Vec<Value> = journal
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|e| e["action"] == "pty_input")
        .collect();
    // By intent (size and digest); its outcome carries the same digest.
    let line = |n: u64| {
        inputs
            .iter()
            .filter(|e| e["phase"] == "intent" && e["bytes"] == n)
            .map(|e| {
                let d = e["command_digest"].as_str().unwrap_or("").to_string();
                assert!(
                    inputs.iter().any(|o| o["phase"] == "outcome"
                        && o["operation_id"] == e["operation_id"]
                        && o["command_digest"] == d.as_str()),
                    "{inputs:?}"
                );
                d
            })
            .collect::<Vec<_>>()
    };
    let stty = line("stty size; echo MARK-$((6*7))\n".len() as u64);
    assert_eq!(stty.len(), 2, "{inputs:?}");
    assert!(
        stty.iter()
            .all(|d| d.len() == 32 && d.bytes().all(|b| b.is_ascii_hexdigit())),
        "{stty:?}"
    );
    assert_ne!(stty[0], stty[1]);
    assert_eq!(line("exit 3\n".len() as u64).len(), 1, "{inputs:?}");
    s.stop().await;
}

/// A PTY's terminal belongs to the appliance process: after a SIGKILL and
/// restart it is `lost`, and its lease and sandbox are still there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pty_is_lost_after_a_restart() {
    let (rig, p) = crate::kit::ProcRig::start();
    let call = |url: String, body: Option<Value>| rig.call(url, body);
    let (_, v) = call(
        format!("{}/v1/leases/acquire", p.url),
        Some(json!({"runtime": "mcp", "session_key": "pty-restart"})),
    )
    .await;
    let lease = v["lease_ref"].as_str().unwrap().to_string();
    let (st, v) = call(format!("{}/v1/leases/{lease}/ptys", p.url), Some(json!({}))).await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let pty = v["pty_ref"].as_str().unwrap().to_string();
    let p = rig.kill_and_restart(p);
    let (st, v) = call(format!("{}/v1/ptys/{pty}/status", p.url), None).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "lost", "{v}");
    let (st, v) = call(
        format!("{}/v1/leases/{lease}/exec", p.url),
        Some(json!({"command": "echo still-here"})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["stdout"], "still-here\n");
    p.stop();
}
