//! Session recordings: a job's recording is its output byte for byte, the
//! two streams interleaved as they were written; helpers for the other
//! recording tests (PTYs in `ptys`, a SIGKILL in `jobs`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::kit::Server;

/// One event of a recording: time, code, and its bytes (text, or base64
/// decoded for the `*b` codes).
pub struct Ev {
    pub t: f64,
    pub code: String,
    pub bytes: Vec<u8>,
}

/// A recording's header and events.
pub fn read(path: &Path) -> (Value, Vec<Ev>) {
    let text = std::fs::read_to_string(path).unwrap();
    let mut lines = text.lines();
    let head: Value = serde_json::from_str(lines.next().unwrap()).unwrap();
    let evs = lines
        .map(|l| {
            let (t, code, data): (f64, String, String) = serde_json::from_str(l).unwrap();
            let bytes = if code.ends_with('b') {
                B64.decode(data).unwrap()
            } else {
                data.into_bytes()
            };
            Ev { t, code, bytes }
        })
        .collect();
    (head, evs)
}

/// The bytes of one stream (`o`, `e`, `i`), text and base64 events alike.
pub fn stream(evs: &[Ev], code: &str) -> Vec<u8> {
    evs.iter()
        .filter(|e| e.code == code || e.code == format!("{code}b"))
        .flat_map(|e| e.bytes.clone())
        .collect()
}

/// The recording file of `subject` (a PTY's or job's ref) under a state
/// directory, once its `recording_sealed` is in `journal()`.
pub async fn sealed(state: &Path, subject: &str, journal: impl Fn() -> Vec<Value>) -> PathBuf {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let j = journal();
        let seal = j.iter().find(|e| {
            e["action"] == "recording_sealed"
                && (e["job_ref"] == subject || e["pty_ref"] == subject)
        });
        if let Some(e) = seal {
            let r = e["recording_ref"].as_str().unwrap();
            return state.join("recordings").join(format!("{r}.cast"));
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the recording of {subject} was never sealed"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jobs_recording_is_its_output_interleaved_as_written() {
    let s = Server::start().await;
    let lease = s.acquire(&s.admin, "rec-job").await;
    // Each write a moment after the last; a character split over two
    // writes; bytes that are not UTF-8; an end without a newline.
    let cmd = "for i in 1 2 3; do echo out$i; sleep 0.3; echo err$i >&2; sleep 0.3; done; \
               printf 'caf\\303'; sleep 0.3; printf '\\251\\n'; printf '\\377\\376' >&2; \
               printf 'end'";
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/jobs"),
            json!({"command": cmd}),
        )
        .await;
    assert_eq!(st, StatusCode::ACCEPTED, "{v}");
    let job = v["job_ref"].as_str().unwrap().to_string();
    let file = sealed(&s.state, &job, || {
        s.journal()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    })
    .await;
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/jobs/{job}/output"),
            json!({"stdout_offset": 0, "stderr_offset": 0}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "succeeded", "{v}");
    let out = B64.decode(v["stdout_base64"].as_str().unwrap()).unwrap();
    let err = B64.decode(v["stderr_base64"].as_str().unwrap()).unwrap();
    let (head, evs) = read(&file);
    assert_eq!(head["cube_adapter"]["kind"], "job");
    assert_eq!(head["cube_adapter"]["subject"], job.as_str());
    assert_eq!(stream(&evs, "o"), out, "stdout byte for byte");
    assert_eq!(stream(&evs, "e"), err, "stderr byte for byte");
    assert_eq!(out, b"out1\nout2\nout3\ncaf\xc3\xa9\nend");
    // The order they were written in.
    let order: String = evs
        .iter()
        .filter(|e| e.code == "o" || e.code == "e")
        .map(|e| String::from_utf8_lossy(&e.bytes).to_string())
        .collect::<Vec<_>>()
        .join("|");
    let seq = ["out1", "err1", "out2", "err2", "out3", "err3", "caf", "é"];
    let mut at = 0;
    for w in seq {
        let i = order[at..]
            .find(w)
            .unwrap_or_else(|| panic!("{w} out of order in {order}"));
        at += i + w.len();
    }
    assert!(evs.windows(2).all(|w| w[0].t <= w[1].t));
    // And the journal agrees with the file.
    let none = s.state.join("empty.toml");
    std::fs::write(&none, "").unwrap();
    let out = crate::kit::cli_at(
        &s.state,
        &none,
        &["recording", "verify", file.to_str().unwrap()],
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    s.stop().await;
}
