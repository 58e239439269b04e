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
    // Each write a moment after the last (and, before out3, after a quiet
    // spell long enough for the recording to wait for the waker); a
    // character split over two writes; bytes that are not UTF-8; an end
    // without a newline.
    let cmd = "for i in 1 2 3; do echo out$i; sleep 0.3; echo err$i >&2; sleep 0.3; \
               if [ $i = 2 ]; then sleep 1.5; fi; done; \
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
    // Recorded as they were written, the quiet spell too (not all at the
    // end): out3 well after err2, and err3 after out3.
    let t = |w: &str| {
        evs.iter()
            .find(|e| String::from_utf8_lossy(&e.bytes).contains(w))
            .map(|e| e.t)
            .unwrap()
    };
    assert!(t("out3") - t("err2") > 1.0, "{order}");
    assert!(t("err3") - t("out3") > 0.15, "{order}");
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
    // Killed, the lease's release names its recordings' digests.
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/release"),
            json!({"action": "kill"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let seal = s
        .events("recording_sealed")
        .into_iter()
        .find(|e| e["job_ref"] == job.as_str())
        .unwrap();
    let rec = seal["recording_ref"].as_str().unwrap();
    let sha = seal["content_sha256"].as_str().unwrap();
    use sha2::Digest;
    assert_eq!(
        sha,
        hex::encode(sha2::Sha256::digest(std::fs::read(&file).unwrap()))
    );
    let want = hex::encode(sha2::Sha256::digest(format!("{rec} {sha}\n").as_bytes()));
    let release = s
        .events("release")
        .into_iter()
        .find(|e| e["lease_ref"] == lease.as_str() && e["phase"] == "outcome")
        .unwrap();
    assert_eq!(release["recordings_digest"], want.as_str(), "{release}");
    s.stop().await;
}

/// Start a job printing `n` bytes and wait for its recording's seal: the
/// recording's ref.
async fn recorded_job(s: &Server, lease: &str, n: usize) -> String {
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/jobs"),
            json!({"command": format!("head -c {n} /dev/zero | tr '\\0' x")}),
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
    file.file_stem().unwrap().to_str().unwrap().to_string()
}

/// Retention removes recordings past their profile's age and beyond a
/// lease's cap, oldest first, never one under a legal hold; each removal
/// is a `recording_deleted` event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_by_age_and_size_never_under_a_hold() {
    let clock = cube_adapter::clock::ManualClock::starting_now();
    let c2 = clock.clone();
    let s = Server::start_with(move |c| {
        c.clock = c2.into();
        c.gc_interval_seconds = 0;
        c.profiles.get_mut("offline-code").unwrap().recordings =
            Some(cube_adapter::config::ProfileRecordings {
                enabled: true,
                execs: false,
                retain_days: 7,
                max_lease_bytes: 9000,
            });
    })
    .await;
    let lease = s.acquire(&s.admin, "rec-retention").await;
    let mut recs = vec![];
    for _ in 0..4 {
        recs.push(recorded_job(&s, &lease, 3000).await);
        clock.advance(time::Duration::minutes(1));
    }
    let cli = |args: &[&str]| crate::kit::cli_at(&s.state, &s.empty_config(), args);
    // The oldest under a hold.
    let out = cli(&["recording", "hold", &recs[0], "--note", "case 42"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = cli(&["recording", "list", "--json"]);
    let listed: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 4, "{listed}");
    assert!(listed[0]["hold"].is_object(), "{listed}");

    // Four of ~3.4 KB each over a 9000-byte cap: the oldest that may go
    // (the second; the first is held) goes, and the next, until under.
    let (st, v) = s.post(&s.admin, "/v1/admin/gc", json!({})).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let gone = |s: &Server| -> Vec<(String, String)> {
        s.events("recording_deleted")
            .iter()
            .map(|e| {
                (
                    e["recording_ref"].as_str().unwrap().to_string(),
                    e["cleanup"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    };
    let first = gone(&s);
    assert_eq!(
        first,
        vec![
            (recs[1].clone(), "lease_cap".to_string()),
            (recs[2].clone(), "lease_cap".to_string())
        ]
    );
    for r in &recs[1..3] {
        assert!(!s.state.join(format!("recordings/{r}.cast")).exists());
    }
    // Past the profile's 7 days: all but the held one.
    clock.advance(time::Duration::days(8));
    let (st, _) = s.post(&s.admin, "/v1/admin/gc", json!({})).await;
    assert_eq!(st, StatusCode::OK);
    let all = gone(&s);
    assert_eq!(all.len(), 3, "{all:?}");
    assert_eq!(all[2], (recs[3].clone(), "age".to_string()));
    assert!(
        s.state
            .join(format!("recordings/{}.cast", recs[0]))
            .exists()
    );
    // The hold lifted: the next pass removes it.
    let out = cli(&["recording", "unhold", &recs[0], "--note", "case closed"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (st, _) = s.post(&s.admin, "/v1/admin/gc", json!({})).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(gone(&s).len(), 4);
    assert!(
        !s.state
            .join(format!("recordings/{}.cast", recs[0]))
            .exists()
    );
    let holds = s.events("recording_hold");
    assert_eq!(holds.len(), 2);
    assert_eq!(holds[0]["decision"], "hold");
    assert!(holds[0]["note_digest"].is_string() && holds[0].get("note").is_none());
    s.stop().await;
}

/// A profile with `execs = true` records each synchronous exec too: both
/// streams, whole, in one sealed recording; without it, none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn execs_are_recorded_when_the_profile_says_so() {
    let s = Server::start_with(|c| {
        c.profiles.get_mut("offline-code").unwrap().recordings =
            Some(cube_adapter::config::ProfileRecordings {
                execs: true,
                ..Default::default()
            });
    })
    .await;
    let lease = s.acquire(&s.admin, "rec-exec").await;
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/exec"),
            json!({"command": "echo exec-out; sleep 0.2; echo exec-err >&2"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let seals = s.events("recording_sealed");
    assert_eq!(seals.len(), 1, "{seals:?}");
    let r = seals[0]["recording_ref"].as_str().unwrap();
    let (head, evs) = read(&s.state.join(format!("recordings/{r}.cast")));
    assert_eq!(head["cube_adapter"]["kind"], "exec");
    assert_eq!(stream(&evs, "o"), b"exec-out\n");
    assert_eq!(stream(&evs, "e"), b"exec-err\n");
    s.stop().await;

    // The shipped profile records no exec.
    let s = Server::start().await;
    let lease = s.acquire(&s.admin, "rec-exec").await;
    let (st, _) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/exec"),
            json!({"command": "echo not-recorded"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK);
    assert!(s.events("recording_sealed").is_empty());
    s.stop().await;
}

/// A sealed chunk changed on disk while the appliance was down: the next
/// start finds it (`recording_damaged`, naming the chunk), goes on with the
/// recording, and `recording verify` fails on that chunk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_changed_while_down_is_found_at_the_restart() {
    use crate::kit::ProcRig;
    let (rig, p) = ProcRig::start();
    let lease = rig.acquire(&p.url, "rec-damaged").await;
    let (st, v) = rig
        .call(format!("{}/v1/leases/{lease}/ptys", p.url), Some(json!({})))
        .await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let pty = v["pty_ref"].as_str().unwrap().to_string();
    let (st, v) = rig
        .call(
            format!("{}/v1/ptys/{pty}/input", p.url),
            Some(json!({"data": "echo damaged-test\n"})),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    // The first chunk seals within 5 s of its first byte.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let chunk = loop {
        let j = rig.journal();
        if let Some(e) = j
            .iter()
            .find(|e| e["action"] == "recording_chunk" && e["pty_ref"] == pty.as_str())
        {
            break e.clone();
        }
        assert!(std::time::Instant::now() < deadline, "no chunk sealed");
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    let rec = chunk["recording_ref"].as_str().unwrap().to_string();
    let file = rig.state.join(format!("recordings/{rec}.cast"));
    ProcRig::kill(p);
    // One byte of the sealed chunk's header changed (its title).
    let mut bytes = std::fs::read(&file).unwrap();
    let at = bytes.windows(5).position(|w| w == b"title").unwrap();
    bytes[at] = b'T';
    std::fs::write(&file, &bytes).unwrap();
    let p = rig.start_again();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let damaged = loop {
        let j = rig.journal();
        if let Some(e) = j.iter().find(|e| e["action"] == "recording_damaged") {
            break e.clone();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the damage was not found"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert_eq!(damaged["recording_ref"], rec.as_str());
    assert_eq!(damaged["chunk"], 0);
    assert_eq!(damaged["outcome"], "error");
    let out = rig.cli(&["recording", "verify", file.to_str().unwrap()]);
    let verdict: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(1), "{verdict}");
    let problems = verdict["problems"].to_string();
    assert!(problems.contains("chunk 0 (bytes 0.."), "{problems}");
    assert!(problems.contains("changed at a restart"), "{problems}");
    // The console says so.
    let list = rig.cli(&["recording", "list", "--json"]);
    let v: Value = serde_json::from_slice(&list.stdout).unwrap();
    assert_eq!(v[0]["damaged"], json!([0]), "{v}");
    p.stop();
}
