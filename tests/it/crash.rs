//! Back to work after a crash without a person (issue #21 item 3): a job
//! whose start the crash interrupted is adopted from its files; five
//! SIGKILLs under a concurrent exec load each restart serving at once,
//! with no exec run twice or without its intent, every interrupted intent
//! resolved by exactly one event, and the chain verifying.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::kit::{Proc, ProcRig};

/// Every intent has exactly one outcome, and the chain verifies.
fn assert_settled(rig: &ProcRig) -> Vec<Value> {
    let events = rig.journal();
    let mut outcomes: BTreeMap<&str, usize> = BTreeMap::new();
    for e in events.iter().filter(|e| e["phase"] == "outcome") {
        if let Some(op) = e["operation_id"].as_str() {
            *outcomes.entry(op).or_default() += 1;
        }
    }
    for i in events.iter().filter(|e| e["phase"] == "intent") {
        let op = i["operation_id"].as_str().unwrap();
        assert_eq!(
            outcomes.get(op).copied().unwrap_or(0),
            1,
            "intent {op} ({}) has {} outcomes",
            i["action"],
            outcomes.get(op).copied().unwrap_or(0)
        );
    }
    let out = rig.cli(&["audit", "verify"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    events
}

/// A crash after a job's runner started and before its outcome: the next
/// start adopts the job (one `audit_recover`, `ok`), and it is read to its
/// end as if nothing had happened; a crash before the job started
/// resolves as `error` and leaves no job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_job_start_is_adopted_from_its_files() {
    let failpoint = |fp| [("CUBE_ADAPTER_FAILPOINT", fp)];
    let (rig, mut p) = ProcRig::start_with("", &failpoint("before_outcome:job_start"));
    let start = |fp| Proc::start(&rig.state, &rig.config, &failpoint(fp)).unwrap();
    let (http, admin) = (rig.http.clone(), rig.admin.clone());
    let lease = rig.acquire(&p.url, "adopt").await;
    let r = http
        .post(format!("{}/v1/leases/{lease}/jobs", p.url))
        .bearer_auth(&admin)
        .json(&json!({"command": "sleep 1; echo adopted; exit 3"}))
        .send()
        .await;
    assert!(r.is_err(), "the process dies before the job's outcome");
    p.child.wait().unwrap();

    // The next start (no failpoint) adopts it.
    let p = start("none");
    let events = assert_settled(&rig);
    let intent = events
        .iter()
        .find(|e| e["action"] == "job_start" && e["phase"] == "intent")
        .unwrap();
    let job = intent["job_ref"].as_str().unwrap().to_string();
    let rec: Vec<&Value> = events
        .iter()
        .filter(|e| e["operation_id"] == intent["operation_id"] && e["phase"] == "outcome")
        .collect();
    assert_eq!(rec[0]["action"], "audit_recover");
    assert_eq!(rec[0]["outcome"], "ok", "{:?}", rec[0]);
    assert_eq!(rec[0]["error_code"], "recovered:job_start");
    let r = http.get(format!("{}/readyz", p.url)).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let v = loop {
        let v: Value = http
            .post(format!("{}/v1/jobs/{job}/output", p.url))
            .bearer_auth(&admin)
            .json(&json!({"stdout_offset": 0, "stderr_offset": 0}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if v["eof"] == true {
            break v;
        }
        assert!(std::time::Instant::now() < deadline, "{v}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(v["exit_code"], 3, "{v}");
    use base64::Engine;
    let stdout = base64::engine::general_purpose::STANDARD
        .decode(v["stdout_base64"].as_str().unwrap())
        .unwrap();
    assert_eq!(stdout, b"adopted\n", "{v}");
    p.stop();

    // Killed before anything of the job was made: `error`, no job.
    let mut p = start("after_intent");
    let r = http
        .post(format!("{}/v1/leases/{lease}/jobs", p.url))
        .bearer_auth(&admin)
        .json(&json!({"command": "echo never"}))
        .send()
        .await;
    assert!(r.is_err());
    p.child.wait().unwrap();
    let p = start("none");
    let events = assert_settled(&rig);
    let last = events
        .iter()
        .rev()
        .find(|e| e["action"] == "audit_recover")
        .unwrap();
    assert_eq!(last["outcome"], "error", "{last}");
    let never = last["job_ref"].as_str().unwrap();
    assert_ne!(never, job);
    let r = http
        .get(format!("{}/v1/jobs/{never}/recover", p.url))
        .bearer_auth(&admin)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    p.stop();
}

/// 24 clients exec'ing on 6 leases, each exec appending its own id to a
/// file in its sandbox; the appliance is SIGKILLed five times under that
/// load. Each restart is ready without a person; in the end no exec ran
/// twice, none ran without an intent, every intent has exactly one
/// resolving event, and the chain verifies.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn five_sigkills_under_concurrent_execs_resolve_without_a_person() {
    let (rig, mut p) = ProcRig::start();
    let (http, admin) = (rig.http.clone(), rig.admin.clone());
    let mut leases = vec![];
    for i in 0..6 {
        leases.push(rig.acquire(&p.url, &format!("load-{i}")).await);
    }
    let next = Arc::new(AtomicU64::new(0));
    let answered = Arc::new(std::sync::Mutex::new(BTreeSet::<String>::new()));
    for round in 0..5 {
        let url = Arc::new(p.url.clone());
        let stop = tokio_util::sync::CancellationToken::new();
        let mut clients = vec![];
        for c in 0..24 {
            let (http, admin, url, stop) = (http.clone(), admin.clone(), url.clone(), stop.clone());
            let (next, answered) = (next.clone(), answered.clone());
            let lease = leases[c % leases.len()].clone();
            clients.push(tokio::spawn(async move {
                while !stop.is_cancelled() {
                    let id = format!("x{}", next.fetch_add(1, Ordering::SeqCst));
                    let r = http
                        .post(format!("{url}/v1/leases/{lease}/exec"))
                        .bearer_auth(&admin)
                        .json(&json!({
                            "command": format!("echo {id} >> /workspace/ran"),
                            "request_id": id,
                        }))
                        .send()
                        .await;
                    match r {
                        Ok(r) if r.status() == StatusCode::OK => {
                            answered.lock().unwrap().insert(id);
                        }
                        Ok(_) => {}
                        // The process died under this request.
                        Err(_) => break,
                    }
                }
            }));
        }
        // Under load for a while, then SIGKILL.
        tokio::time::sleep(Duration::from_millis(700 + 300 * round)).await;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(p.child.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        p.child.wait().unwrap();
        stop.cancel();
        for c in clients {
            let _ = c.await;
        }
        // Restarted: ready at once, no reconcile.
        p = Proc::start(&rig.state, &rig.config, &[]).unwrap();
        let r = http.get(format!("{}/readyz", p.url)).send().await.unwrap();
        assert_eq!(
            r.status(),
            StatusCode::OK,
            "round {round}: ready without a person"
        );
        let v = rig.status();
        assert_eq!(v["store"]["pending_intents"], 0, "round {round}: {v}");
    }
    // What ran, from each sandbox's own file.
    let mut ran: Vec<String> = vec![];
    for lease in &leases {
        let v: Value = http
            .post(format!("{}/v1/leases/{lease}/exec", p.url))
            .bearer_auth(&admin)
            .json(&json!({"command": "cat /workspace/ran"}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        ran.extend(v["stdout"].as_str().unwrap().lines().map(str::to_string));
    }
    p.stop();
    let events = assert_settled(&rig);
    let unique: BTreeSet<&String> = ran.iter().collect();
    assert_eq!(unique.len(), ran.len(), "an exec ran twice");
    let intents: BTreeSet<&str> = events
        .iter()
        .filter(|e| e["action"] == "exec" && e["phase"] == "intent")
        .filter_map(|e| e["request_id"].as_str())
        .collect();
    for id in &ran {
        assert!(
            intents.contains(id.as_str()),
            "{id} ran without an intent; an exec intent: {:?}",
            events
                .iter()
                .find(|e| e["action"] == "exec" && e["phase"] == "intent")
        );
    }
    // Every answered exec ran; the crashes left some resolved uncertain.
    let answered = answered.lock().unwrap();
    for id in answered.iter() {
        assert!(unique.contains(id), "{id} was answered 200 but did not run");
    }
    assert!(
        answered.len() > 50,
        "load: {} execs answered",
        answered.len()
    );
    let recovered = events
        .iter()
        .filter(|e| e["action"] == "audit_recover")
        .count();
    eprintln!(
        "five SIGKILLs: {} execs answered, {} ran, {} intents resolved at restarts",
        answered.len(),
        ran.len(),
        recovered
    );
}
