//! Durable jobs: start, status, both output pagings, SSE, cancel, the time
//! limit, the quota race, and output read across a SIGKILL of the appliance.

use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::appliance::Server;

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

    // Missing and malformed refs answer alike.
    for j in ["job_00000000000000000000", "nope"] {
        let (st, v) = s.get(&s.admin, &format!("/v1/jobs/{j}/status")).await;
        assert_eq!(st, StatusCode::NOT_FOUND, "{v}");
        assert_eq!(v["error"]["code"], "job_not_found");
    }
    let (_, ls) = s.get(&s.admin, &format!("/v1/leases/{lease}/status")).await;
    assert_eq!(ls["jobs"][0]["job_ref"], job.as_str());
    s.stop().await;
}
