//! Durable jobs: start, status, both output pagings, SSE, cancel, the time
//! limit, the quota race, and output read across a SIGKILL of the appliance.

use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::kit::Server;

/// Poll a job's status until it leaves `running`.
async fn wait_end(s: &Server, job: &str) -> Value {
    for _ in 0..600 {
        let (st, v) = s.get(&s.admin, &format!("/v1/jobs/{job}/status")).await;
        assert_eq!(st, StatusCode::OK, "{v}");
        if v["state"] != "running" {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("job {job} did not end");
}

async fn start(s: &Server, lease: &str, command: &str) -> String {
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/jobs"),
            json!({"command": command}),
        )
        .await;
    assert_eq!(st, StatusCode::ACCEPTED, "{v}");
    assert_eq!(v["state"], "running");
    v["job_ref"].as_str().unwrap().to_string()
}

/// Read both streams to the end by cursors; returns (stdout, stderr, calls).
async fn read_all(s: &Server, job: &str, max: usize) -> (Vec<u8>, Vec<u8>, usize) {
    let (mut out, mut err) = (vec![], vec![]);
    let mut calls = 0;
    loop {
        calls += 1;
        let (st, v) = s
            .post(
                &s.admin,
                &format!("/v1/jobs/{job}/output"),
                json!({"stdout_offset": out.len(), "stderr_offset": err.len(), "max_bytes": max}),
            )
            .await;
        assert_eq!(st, StatusCode::OK, "{v}");
        // Offsets echo what was asked: no overlap, no gap.
        assert_eq!(v["stdout_offset"].as_u64().unwrap() as usize, out.len());
        assert_eq!(v["stderr_offset"].as_u64().unwrap() as usize, err.len());
        out.extend(B64.decode(v["stdout_base64"].as_str().unwrap()).unwrap());
        err.extend(B64.decode(v["stderr_base64"].as_str().unwrap()).unwrap());
        assert_eq!(
            v["stdout_next_offset"].as_u64().unwrap() as usize,
            out.len()
        );
        assert_eq!(
            v["stderr_next_offset"].as_u64().unwrap() as usize,
            err.len()
        );
        if v["eof"] == true {
            return (out, err, calls);
        }
        if v["stdout_base64"] == "" && v["stderr_base64"] == "" {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_start_status_output_and_events() {
    let s = Server::start().await;
    let lease = s.acquire(&s.admin, "jobs-basic").await;
    let job = start(
        &s,
        &lease,
        "echo out1; echo err1 >&2; sleep 0.3; echo out2; exit 3",
    )
    .await;
    let end = wait_end(&s, &job).await;
    assert_eq!(end["state"], "failed", "{end}");
    assert_eq!(end["exit_code"], 3);
    assert_eq!(end["cancelled"], false);
    assert_eq!(end["timed_out"], false);

    // The reference's paging: a JSON fragment, sliced by bytes.
    let (st, v) = s
        .post(&s.admin, &format!("/v1/jobs/{job}/output"), json!({}))
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["encoding"], "json-fragment");
    assert_eq!(v["eof"], true);
    let frag: Value = serde_json::from_str(v["data"].as_str().unwrap()).unwrap();
    assert_eq!(frag, json!({"stdout": "out1\nout2\n", "stderr": "err1\n"}));
    let whole = v["data"].as_str().unwrap().to_string();
    let (_, p1) = s
        .post(
            &s.admin,
            &format!("/v1/jobs/{job}/output"),
            json!({"offset": 0, "max_bytes": 10}),
        )
        .await;
    assert_eq!(p1["next_offset"], 10);
    assert_eq!(p1["eof"], false);
    let (_, p2) = s
        .post(
            &s.admin,
            &format!("/v1/jobs/{job}/output"),
            json!({"offset": 10, "max_bytes": 1000}),
        )
        .await;
    assert_eq!(
        format!(
            "{}{}",
            p1["data"].as_str().unwrap(),
            p2["data"].as_str().unwrap()
        ),
        whole
    );

    // Cursors.
    let (out, err, _) = read_all(&s, &job, 3).await;
    assert_eq!(out, b"out1\nout2\n");
    assert_eq!(err, b"err1\n");
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/jobs/{job}/output"),
            json!({"stdout_offset": 999}),
        )
        .await;
    assert_eq!(st, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["error"]["code"], "invalid_offset");
    for bad in [
        json!({"max_bytes": 0}),
        json!({"max_bytes": 2_000_000}),
        json!({"offset": -1}),
    ] {
        let (st, v) = s
            .post(&s.admin, &format!("/v1/jobs/{job}/output"), bad)
            .await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{v}");
    }

    // SSE: the output events carry exactly the bytes, then a final status.
    let r = s
        .http
        .get(format!("{}/v1/jobs/{job}/events?timeout=30", s.url))
        .bearer_auth(&s.admin)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let body = r.text().await.unwrap();
    let (mut o, mut e, mut last) = (vec![], vec![], Value::Null);
    for block in body.split("\n\n") {
        let ev = block
            .lines()
            .find_map(|l| l.strip_prefix("event: "))
            .unwrap_or("");
        let data = block
            .lines()
            .find_map(|l| l.strip_prefix("data: "))
            .unwrap_or("");
        match ev {
            "output" => {
                let v: Value = serde_json::from_str(data).unwrap();
                o.extend(B64.decode(v["stdout_base64"].as_str().unwrap()).unwrap());
                e.extend(B64.decode(v["stderr_base64"].as_str().unwrap()).unwrap());
            }
            "status" => last = serde_json::from_str(data).unwrap(),
            _ => {}
        }
    }
    assert_eq!(o, b"out1\nout2\n");
    assert_eq!(e, b"err1\n");
    assert_eq!(last["state"], "failed");
    // Base64 only, on request; an unknown encoding is refused.
    let body = s
        .http
        .get(format!("{}/v1/jobs/{job}/events?encoding=base64", s.url))
        .bearer_auth(&s.admin)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let out_ev = body
        .split("\n\n")
        .find(|b| b.contains("event: output"))
        .unwrap();
    let data: Value = serde_json::from_str(
        out_ev
            .lines()
            .find_map(|l| l.strip_prefix("data: "))
            .unwrap(),
    )
    .unwrap();
    assert!(
        data.get("stdout").is_none() && data.get("stdout_base64").is_some(),
        "{data}"
    );
    let r = s
        .http
        .get(format!("{}/v1/jobs/{job}/events?encoding=utf16", s.url))
        .bearer_auth(&s.admin)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);

    // Missing and malformed refs answer alike.
    for j in ["job_00000000000000000000", "nope"] {
        let (st, v) = s.get(&s.admin, &format!("/v1/jobs/{j}/status")).await;
        assert_eq!(st, StatusCode::NOT_FOUND, "{v}");
        assert_eq!(v["error"]["code"], "job_not_found");
    }
    let (_, ls) = s.get(&s.admin, &format!("/v1/leases/{lease}/status")).await;
    // The reference's count, and the list beside it.
    assert_eq!(ls["jobs"], 1, "{ls}");
    assert_eq!(ls["job_list"][0]["job_ref"], job.as_str());
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_time_limit_cancel_and_quota_race() {
    let s = Server::start_with(|c| {
        c.profiles
            .get_mut("offline-code")
            .unwrap()
            .max_command_seconds = 2;
        c.profiles
            .get_mut("persistent-code")
            .unwrap()
            .max_jobs_per_lease = 1;
    })
    .await;
    // The time limit ends the job's process group: a state of its own.
    let lease = s.acquire(&s.admin, "jobs-limit").await;
    let job = start(&s, &lease, "echo started; sleep 60 & sleep 60").await;
    let end = wait_end(&s, &job).await;
    assert_eq!(end["state"], "timed_out", "{end}");
    assert_eq!(end["timed_out"], true);
    assert_eq!(end["exit_code"], 143);
    let (out, _, _) = read_all(&s, &job, 65536).await;
    assert_eq!(out, b"started\n");

    // 8 concurrent starts with quota 1: exactly one wins.
    let (st, v) = s
        .post(
            &s.admin,
            "/v1/leases/acquire",
            json!({"runtime": "mcp", "session_key": "jobs-quota", "profile": "persistent-code"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let lease = v["lease_ref"].as_str().unwrap().to_string();
    let mut tasks = vec![];
    for _ in 0..8 {
        let (http, url, admin, lease) = (
            s.http.clone(),
            s.url.clone(),
            s.admin.clone(),
            lease.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let r = http
                .post(format!("{url}/v1/leases/{lease}/jobs"))
                .bearer_auth(admin)
                .json(&json!({"command": "sleep 30"}))
                .send()
                .await
                .unwrap();
            let st = r.status();
            (st, r.json::<Value>().await.unwrap())
        }));
    }
    let mut won = vec![];
    let mut refused = 0;
    for t in tasks {
        let (st, v) = t.await.unwrap();
        match st {
            StatusCode::ACCEPTED => won.push(v["job_ref"].as_str().unwrap().to_string()),
            StatusCode::TOO_MANY_REQUESTS => {
                assert_eq!(v["error"]["code"], "job_quota_exceeded");
                refused += 1;
            }
            other => panic!("{other}: {v}"),
        }
    }
    assert_eq!((won.len(), refused), (1, 7));

    // Cancel ends the process group; the slot is free again.
    let (st, v) = s
        .post(&s.admin, &format!("/v1/jobs/{}/cancel", won[0]), json!({}))
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "cancelled", "{v}");
    assert_eq!(v["cancelled"], true);
    // Cancelling an ended job changes nothing.
    let (st, again) = s
        .post(&s.admin, &format!("/v1/jobs/{}/cancel", won[0]), json!({}))
        .await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(again["state"], "cancelled");
    let next = start(&s, &lease, "true").await;
    assert_eq!(wait_end(&s, &next).await["state"], "succeeded");
    // Nothing of the cancelled job is left running in the sandbox.
    let (_, ps) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/exec"),
            json!({"command": "ps -eo args | grep -c '^sleep 30' || true"}),
        )
        .await;
    assert_eq!(ps["stdout"].as_str().unwrap().trim(), "0", "{ps}");
    s.stop().await;
}

/// Parse an SSE body into `(event, id, data)` triples (complete events
/// only: a chunk may end inside one, even inside a UTF-8 character).
fn sse_events(buf: &[u8]) -> (Vec<(String, String, String)>, usize) {
    let mut out = vec![];
    let mut used = 0;
    while let Some(end) = buf[used..].windows(2).position(|w| w == b"\n\n") {
        let block = std::str::from_utf8(&buf[used..used + end]).unwrap();
        used += end + 2;
        let get = |k: &str| {
            block
                .lines()
                .find_map(|l| l.strip_prefix(k))
                .unwrap_or("")
                .to_string()
        };
        out.push((get("event: "), get("id: "), get("data: ")));
    }
    (out, used)
}

/// The whole output of a job, streamed by SSE from the given cursors;
/// gives up after `stop_after` output bytes (a client that goes away).
async fn sse_read(
    http: &reqwest::Client,
    url: &str,
    token: &str,
    job: &str,
    from: (usize, usize),
    stop_after: Option<usize>,
) -> (Vec<u8>, Vec<u8>, bool) {
    use futures_util::StreamExt;
    let r = http
        .get(format!(
            "{url}/v1/jobs/{job}/events?timeout=120&stdout_offset={}&stderr_offset={}",
            from.0, from.1
        ))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let mut body = r.bytes_stream();
    let (mut out, mut err, mut text) = (vec![], vec![], Vec::<u8>::new());
    let mut ended = false;
    while let Some(chunk) = body.next().await {
        text.extend_from_slice(&chunk.unwrap());
        let (events, used) = sse_events(&text);
        text.drain(..used);
        for (ev, id, data) in events {
            if ev == "output" {
                let v: Value = serde_json::from_str(&data).unwrap();
                assert_eq!(
                    v["stdout_offset"].as_u64().unwrap() as usize,
                    from.0 + out.len()
                );
                assert_eq!(
                    v["stderr_offset"].as_u64().unwrap() as usize,
                    from.1 + err.len()
                );
                out.extend(B64.decode(v["stdout_base64"].as_str().unwrap()).unwrap());
                err.extend(B64.decode(v["stderr_base64"].as_str().unwrap()).unwrap());
                assert_eq!(id, format!("{}:{}", from.0 + out.len(), from.1 + err.len()));
            }
            if ev == "status" {
                let v: Value = serde_json::from_str(&data).unwrap();
                ended = v["state"] != "running";
            }
            assert_ne!(ev, "error", "{data}");
        }
        if stop_after.is_some_and(|n| out.len() + err.len() >= n) {
            return (out, err, false); // dropped: the client goes away
        }
    }
    (out, err, ended)
}

/// ≥ 10 MB of mixed binary stdout/stderr, read by cursors across a SIGKILL
/// and restart of the appliance, and by SSE across a client disconnect:
/// both give exactly the bytes the job wrote, with no overlap and no gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_output_survives_sigkill_restart_and_disconnect() {
    use crate::kit::ProcRig;
    let (rig, p) = ProcRig::start();
    let (http, admin) = (rig.http.clone(), rig.admin.clone());
    let post = |url: String, body: Value| rig.call(url, Some(body));
    let (_, v) = post(
        format!("{}/v1/leases/acquire", p.url),
        json!({"runtime": "mcp", "session_key": "jobs-crash"}),
    )
    .await;
    let lease = v["lease_ref"].as_str().unwrap().to_string();
    // Random stdout (6 MiB) and stderr (5 MiB), written in interleaved 1 MiB
    // pieces with pauses, so the job is still running while it is read.
    let cmd = "head -c 6291456 /dev/urandom > /workspace/o.bin; \
               head -c 5242880 /dev/urandom > /workspace/e.bin; \
               for i in 0 1 2 3 4 5; do \
                 dd if=/workspace/o.bin bs=1048576 skip=$i count=1 status=none; \
                 dd if=/workspace/e.bin bs=1048576 skip=$i count=1 status=none >&2; \
                 sleep 0.4; \
               done; exit 7";
    let (st, v) = post(
        format!("{}/v1/leases/{lease}/jobs", p.url),
        json!({"command": cmd}),
    )
    .await;
    assert_eq!(st, StatusCode::ACCEPTED, "{v}");
    let job = v["job_ref"].as_str().unwrap().to_string();

    // Read by cursors until some output has arrived, then SIGKILL the appliance.
    let (mut out, mut err) = (Vec::<u8>::new(), Vec::<u8>::new());
    let mut url = p.url.clone();
    while out.len() + err.len() < 2 * 1024 * 1024 {
        let (st, v) = post(
            format!("{url}/v1/jobs/{job}/output"),
            json!({"stdout_offset": out.len(), "stderr_offset": err.len(), "max_bytes": 262144}),
        )
        .await;
        assert_eq!(st, StatusCode::OK, "{v}");
        out.extend(B64.decode(v["stdout_base64"].as_str().unwrap()).unwrap());
        err.extend(B64.decode(v["stderr_base64"].as_str().unwrap()).unwrap());
        assert_eq!(v["eof"], false);
    }
    let p = rig.kill_and_restart(p);
    url = p.url.clone();

    // After the restart: the job is still addressable and (still) running.
    let r = http
        .get(format!("{url}/v1/jobs/{job}/recover"))
        .bearer_auth(&admin)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let rec: Value = r.json().await.unwrap();
    assert_eq!(rec["recoverable"], true, "{rec}");
    assert_eq!(rec["lease_ref"], lease.as_str());

    // Continue from the same cursors to the end.
    loop {
        let (st, v) = post(
            format!("{url}/v1/jobs/{job}/output"),
            json!({"stdout_offset": out.len(), "stderr_offset": err.len(), "max_bytes": 1048576}),
        )
        .await;
        assert_eq!(st, StatusCode::OK, "{v}");
        out.extend(B64.decode(v["stdout_base64"].as_str().unwrap()).unwrap());
        err.extend(B64.decode(v["stderr_base64"].as_str().unwrap()).unwrap());
        if v["eof"] == true {
            assert_eq!(v["state"], "failed");
            assert_eq!(v["exit_code"], 7);
            break;
        }
        if v["stdout_base64"] == "" && v["stderr_base64"] == "" {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    // What the job wrote, fetched as artifacts.
    let want = |path: &str| {
        let (http, admin, url, lease) = (http.clone(), admin.clone(), url.clone(), lease.clone());
        let path = path.to_string();
        async move {
            let v: Value = http
                .post(format!("{url}/v1/leases/{lease}/artifacts/download"))
                .bearer_auth(admin)
                .json(&json!({"path": path}))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            B64.decode(v["content_base64"].as_str().unwrap()).unwrap()
        }
    };
    let (want_out, want_err) = (
        want("/workspace/o.bin").await,
        want("/workspace/e.bin").await,
    );
    assert_eq!(want_out.len() + want_err.len(), 11 * 1024 * 1024);
    assert!(
        out == want_out,
        "stdout differs ({} vs {} bytes)",
        out.len(),
        want_out.len()
    );
    assert!(
        err == want_err,
        "stderr differs ({} vs {} bytes)",
        err.len(),
        want_err.len()
    );

    // SSE: a client that goes away after 3 MiB, then resumes from its cursors.
    let (o1, e1, ended) = sse_read(&http, &url, &admin, &job, (0, 0), Some(3 * 1024 * 1024)).await;
    assert!(!ended);
    let (o2, e2, ended) = sse_read(&http, &url, &admin, &job, (o1.len(), e1.len()), None).await;
    assert!(ended, "the stream ends with the job's final status");
    assert!(
        [o1, o2].concat() == want_out,
        "SSE stdout differs from paging"
    );
    assert!(
        [e1, e2].concat() == want_err,
        "SSE stderr differs from paging"
    );

    // The job's recording, across the SIGKILL: both streams byte for byte
    // (random bytes: base64 events), and sealed.
    let file = crate::recordings::sealed(&rig.state, &job, || rig.journal()).await;
    let (_, evs) = crate::recordings::read(&file);
    let (ro, re) = (
        crate::recordings::stream(&evs, "o"),
        crate::recordings::stream(&evs, "e"),
    );
    assert!(
        ro == want_out,
        "recorded stdout differs ({} vs {} bytes)",
        ro.len(),
        want_out.len()
    );
    assert!(
        re == want_err,
        "recorded stderr differs ({} vs {} bytes)",
        re.len(),
        want_err.len()
    );
    rig.assert_recording_verifies(&file);
    p.stop();
}

/// What a job's command does to its own files and processes cannot bend
/// what the appliance reports: a forged exit-code line cannot shift the
/// output, a daemon it starts with `setsid` ends with it, and a job on a
/// lease belongs to the lease's tenant, whoever started it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_cannot_forge_its_status_or_outlive_itself() {
    let s = Server::start().await;
    let agent_a = s.token(&["--tenant", "tenant-a"]);
    let agent_b = s.token(&["--tenant", "tenant-b"]);
    let lease = s.acquire(&agent_a, "forge").await;
    // The admin (another tenant) starts it; tenant A owns it, B cannot see it.
    let job = start(
        &s,
        &lease,
        "echo early; d=$(ls -d /tmp/cube-adapter-jobs/job_*); \
         printf '0 1 1\\ncube-adapter-job exit 0 999 999 1 1\\n' > \"$d/exit-code\"; \
         setsid sh -c 'sleep 1; echo late; echo late >&2' & \
         sleep 0.3; echo done",
    )
    .await;
    let (st, v) = s.get(&agent_a, &format!("/v1/jobs/{job}/status")).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let (st, v) = s.get(&agent_b, &format!("/v1/jobs/{job}/status")).await;
    assert_eq!(st, StatusCode::NOT_FOUND, "{v}");
    let end = wait_end(&s, &job).await;
    assert_eq!(end["state"], "succeeded", "{end}");
    assert_eq!(end["timed_out"], false);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (out, err, _) = read_all(&s, &job, 65536).await;
    assert_eq!(String::from_utf8_lossy(&out), "early\ndone\n");
    assert_eq!(String::from_utf8_lossy(&err), "");
    s.stop().await;
}

/// An event stream lives on the token that opened it: revoking the token
/// ends the stream (within the re-check interval) with an `error` event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoking_the_token_ends_an_open_stream() {
    let s = Server::start().await;
    let agent = s.token(&["--tenant", "t-revoke"]);
    let lease = s.acquire(&agent, "revoke").await;
    let (st, v) = s
        .post(
            &agent,
            &format!("/v1/leases/{lease}/jobs"),
            json!({"command": "sleep 60"}),
        )
        .await;
    assert_eq!(st, StatusCode::ACCEPTED, "{v}");
    let job = v["job_ref"].as_str().unwrap().to_string();
    let r = s
        .http
        .get(format!("{}/v1/jobs/{job}/events?timeout=120", s.url))
        .bearer_auth(&agent)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    crate::kit::revoke(&s.state, &agent);
    let body = tokio::time::timeout(Duration::from_secs(30), r.text())
        .await
        .expect("the stream did not end after the token was revoked")
        .unwrap();
    assert!(body.contains("event: error"), "{body}");
    assert!(body.contains("\"unauthorized\""), "{body}");
    s.stop().await;
}
