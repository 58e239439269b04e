//! PTYs: create, input, resize, several viewers, reconnect by offset, kill,
//! the shared quota with jobs, and a restart the PTY outlives (one
//! recording across it).

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

/// Reads a PTY's output from `offset` until `want` appears: the text read
/// and the next offset; `None` while the appliance has no stream of it (a
/// restart that has not re-attached yet) or when it ends first.
async fn read_until(
    rig: &crate::kit::ProcRig,
    url: &str,
    pty: &str,
    mut offset: u64,
    want: &str,
) -> Option<(String, u64)> {
    let mut text = String::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while std::time::Instant::now() < deadline {
        let (st, v) = rig
            .call(
                format!("{url}/v1/ptys/{pty}/output"),
                Some(json!({"offset": offset, "wait_ms": 1000})),
            )
            .await;
        assert_eq!(st, StatusCode::OK, "{v}");
        let b = B64.decode(v["content_base64"].as_str().unwrap()).unwrap();
        text.push_str(&String::from_utf8_lossy(&b));
        offset = v["next_offset"].as_u64().unwrap();
        if text.contains(want) {
            return Some((text, offset));
        }
        if v["eof"] == true {
            return None;
        }
    }
    None
}

/// The recording files under a state directory.
pub(crate) fn recordings(state: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(state.join("recordings"))
        .map(|d| d.map(|e| e.unwrap().path()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// A PTY's shell lives in its sandbox: after an appliance SIGKILL and
/// restart the appliance re-attaches to it, and the session before and
/// after is one recording (input, output, a resize, a marker for the
/// restart) that `recording verify` passes and that one changed byte
/// fails, naming its chunk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pty_survives_a_sigkill_in_one_sealed_recording() {
    let (rig, p) = crate::kit::ProcRig::start();
    let lease = rig.acquire(&p.url, "pty-restart").await;
    let (st, v) = rig
        .call(format!("{}/v1/leases/{lease}/ptys", p.url), Some(json!({})))
        .await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let pty = v["pty_ref"].as_str().unwrap().to_string();
    let input = |url: String, data: &'static str| {
        let rig = &rig;
        let pty = pty.clone();
        async move {
            let (st, v) = rig
                .call(
                    format!("{url}/v1/ptys/{pty}/input"),
                    Some(json!({"data": data})),
                )
                .await;
            assert_eq!(st, StatusCode::OK, "{v}");
        }
    };
    input(p.url.clone(), "echo before-$((6*7))\n").await;
    read_until(&rig, &p.url, &pty, 0, "before-42")
        .await
        .expect("output before the restart");
    let (st, v) = rig
        .call(
            format!("{}/v1/ptys/{pty}/resize", p.url),
            Some(json!({"rows": 30, "cols": 100})),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");

    let p = rig.kill_and_restart(p);
    // Re-attached: the PTY is still running and its output flows again.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (st, v) = rig
            .call(
                format!("{}/v1/ptys/{pty}/output", p.url),
                Some(json!({"offset": 0})),
            )
            .await;
        assert_eq!(st, StatusCode::OK, "{v}");
        assert_eq!(v["state"], "running", "{v}");
        if v["eof"] == false {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never re-attached");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    input(p.url.clone(), "echo after-$((7*8))\n").await;
    let (_, at) = read_until(&rig, &p.url, &pty, 0, "after-56")
        .await
        .expect("output after the restart");
    input(p.url.clone(), "exit 0\n").await;
    let _ = read_until(&rig, &p.url, &pty, at, "\u{0}").await;
    // The recording is sealed once the shell has ended.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !rig
        .journal()
        .iter()
        .any(|e| e["action"] == "recording_sealed" && e["pty_ref"] == pty.as_str())
    {
        assert!(std::time::Instant::now() < deadline, "never sealed");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let files = recordings(&rig.state);
    assert_eq!(files.len(), 1, "one recording: {files:?}");
    let cast = std::fs::read_to_string(&files[0]).unwrap();
    let mut lines = cast.lines();
    let head: Value = serde_json::from_str(lines.next().unwrap()).unwrap();
    assert_eq!(head["version"], 2);
    assert_eq!(head["cube_adapter"]["subject"], pty.as_str());
    let events: Vec<Value> = lines.map(|l| serde_json::from_str(l).unwrap()).collect();
    let text = |code: &str| -> String {
        events
            .iter()
            .filter(|e| e[1] == code)
            .map(|e| e[2].as_str().unwrap())
            .collect()
    };
    assert!(text("o").contains("before-42") && text("o").contains("after-56"));
    assert!(
        text("i").contains("echo before-$((6*7))\n"),
        "{}",
        text("i")
    );
    assert!(text("i").contains("exit 0\n"));
    assert_eq!(text("r"), "100x30");
    assert!(text("m").contains("restarted"), "{}", text("m"));
    let times: Vec<f64> = events.iter().map(|e| e[0].as_f64().unwrap()).collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");

    // Verified against the journal (through the service, and offline
    // against an export).
    let out = rig.cli(&["recording", "verify", files[0].to_str().unwrap()]);
    let verdict: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(out.status.code(), Some(0), "{verdict}");
    assert_eq!(verdict["ok"], true);
    assert_eq!(verdict["sealed"], true);
    let chunks = verdict["chunks"].as_u64().unwrap();
    assert!(chunks >= 2, "a chunk before the kill, one after: {verdict}");
    let export = rig.state.parent().unwrap().join("journal.jsonl");
    let j = rig.cli(&["audit", "export"]);
    std::fs::write(&export, &j.stdout).unwrap();
    let out = rig.cli(&[
        "recording",
        "verify",
        files[0].to_str().unwrap(),
        "--journal",
        export.to_str().unwrap(),
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );

    // One byte changed: its chunk is named.
    let chunk_events: Vec<Value> = rig
        .journal()
        .into_iter()
        .filter(|e| e["action"] == "recording_chunk" && e["pty_ref"] == pty.as_str())
        .collect();
    let last = chunk_events.last().unwrap();
    let (off, len) = (
        last["offset"].as_u64().unwrap(),
        last["bytes"].as_u64().unwrap(),
    );
    let mut bytes = std::fs::read(&files[0]).unwrap();
    let at = (off + len / 2) as usize;
    bytes[at] = if bytes[at] == b'x' { b'y' } else { b'x' };
    let bad = rig.state.parent().unwrap().join("changed.cast");
    std::fs::write(&bad, &bytes).unwrap();
    let out = rig.cli(&["recording", "verify", bad.to_str().unwrap()]);
    let verdict: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(1), "{verdict}");
    assert_eq!(verdict["ok"], false);
    let problems = verdict["problems"].to_string();
    let name = format!("chunk {} (bytes {off}..{})", last["chunk"], off + len);
    assert!(problems.contains(&name), "{problems} names {name}");

    // It replays in Chromium for an auditor of its tenant, and the file it
    // downloads is the recording.
    let rec = files[0].file_stem().unwrap().to_str().unwrap().to_string();
    let dir = crate::console::browser::preflight();
    let pw = rig.state.parent().unwrap().join("pw");
    std::fs::write(&pw, "correct horse battery staple\n").unwrap();
    let out = rig.cli(&[
        "user",
        "add",
        "dora",
        "--tenant",
        "admin",
        "--role",
        "auditor",
        "--password-file",
        pw.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out_dir = rig.state.parent().unwrap().join("browser");
    let spki = crate::console::browser::spki_sha256(
        &std::fs::read(rig.state.join("tls/server.pem")).unwrap(),
    );
    let run = tokio::process::Command::new("node")
        .arg(dir.join("recording.mjs"))
        .current_dir(&dir)
        .env("CUBE_URL", &p.url)
        .env("CUBE_SPKI", &spki)
        .env("CUBE_USER", "dora")
        .env("CUBE_PASSWORD", "correct horse battery staple")
        .env("CUBE_RECORDING", &rec)
        .env("CUBE_BEFORE", "before-42")
        .env("CUBE_AFTER", "after-56")
        .env("CUBE_OUT", &out_dir)
        .kill_on_drop(true)
        .output();
    let run = tokio::time::timeout(Duration::from_secs(180), run)
        .await
        .expect("the player test ends")
        .expect("node runs");
    let report: Value = serde_json::from_slice(
        &std::fs::read(out_dir.join("report.json")).unwrap_or_else(|e| {
            panic!("no report ({e}): {}", String::from_utf8_lossy(&run.stderr))
        }),
    )
    .unwrap();
    assert!(
        run.status.success() && report["ok"] == true,
        "the player failed: {report}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let downloaded = std::fs::read(report["download"].as_str().unwrap()).unwrap();
    assert_eq!(downloaded, std::fs::read(&files[0]).unwrap());
    // Each view and download is in the journal.
    let j = rig.journal();
    for a in ["recording_view", "recording_download"] {
        assert!(
            j.iter().any(|e| e["action"] == a
                && e["recording_ref"] == rec.as_str()
                && e["outcome"] == "ok"),
            "{a} recorded"
        );
    }
    p.stop();
}

/// A PTY whose sandbox ended while the appliance was down cannot be
/// re-attached: after the restart it is `lost`, and its recording is
/// sealed with a marker saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pty_whose_sandbox_ended_while_down_is_lost_and_its_recording_sealed() {
    let (rig, p) = crate::kit::ProcRig::start();
    let lease = rig.acquire(&p.url, "pty-lost").await;
    let (st, v) = rig
        .call(format!("{}/v1/leases/{lease}/ptys", p.url), Some(json!({})))
        .await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let pty = v["pty_ref"].as_str().unwrap().to_string();
    crate::kit::ProcRig::kill(p);
    let out = rig.cli(&["sandboxes", "kill", "--all"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let p = rig.start_again();
    let file = crate::recordings::sealed(&rig.state, &pty, || rig.journal()).await;
    let (_, evs) = crate::recordings::read(&file);
    let markers = String::from_utf8(crate::recordings::stream(&evs, "m")).unwrap();
    assert!(markers.contains("has ended"), "{markers}");
    let (st, v) = rig
        .call(format!("{}/v1/ptys/{pty}/status", p.url), None)
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "lost", "{v}");
    rig.assert_recording_verifies(&file);
    p.stop();
}
