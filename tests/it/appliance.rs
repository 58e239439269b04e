//! The appliance: `/v1` over TLS with the generated CA, identity, policy,
//! strict bodies and the audit journal. Each test runs the real server
//! in-process on 127.0.0.1:0 with the embedded backend.

use std::sync::Arc;

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::kit::{BIN, Proc, SandboxReaper, Server, Tmpfs, code, raw_request, revoke};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quick_start_flow_and_idempotent_acquire() {
    let s = Server::start().await;
    let (st, h) = s.get("", "/healthz").await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(h["audit_mode"], "required");
    let (st, r) = s.get("", "/readyz").await;
    assert_eq!(st, StatusCode::OK, "{r}");
    // Both sides of the backend are probed and named, and the templates;
    // no template, profile or backend by name (#34 L9).
    assert_eq!(r["checks"]["cube_api"], "ok", "{r}");
    assert_eq!(r["checks"]["cube_proxy"], "ok", "{r}");
    assert_eq!(r["checks"]["templates"], "ok", "{r}");
    let keys: Vec<&String> = r["checks"].as_object().unwrap().keys().collect();
    assert_eq!(
        keys,
        ["audit", "cube_api", "cube_proxy", "state", "templates"],
        "{r}"
    );

    let (st, a) = s
        .post(
            &s.admin,
            "/v1/leases/acquire",
            json!({"runtime": "mcp", "session_key": "chat-1", "request_id": "req-1"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{a}");
    assert_eq!(a["reused"], false);
    assert_eq!(a["request_id"], "req-1");
    // What ran it: the embedded backend's namespaced process tree, not a
    // MicroVM (a configured CubeSandbox says cubesandbox-microvm:
    // production::new_sandboxes_get_a_workspace).
    assert_eq!(a["executor"], "cube-adapter-namespaces");
    assert_eq!(a["sandbox_ref"].as_str().unwrap().len(), 8);
    let lease = a["lease_ref"].as_str().unwrap().to_string();
    assert!(lease.starts_with("lease_") && lease.len() == 26, "{lease}");

    let (st, e) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/exec"),
            json!({"command": "echo hello; echo err >&2; exit 3"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{e}");
    assert_eq!(e["stdout"], "hello\n");
    assert_eq!(e["stderr"], "err\n");
    assert_eq!(e["exit_code"], 3);

    // Same session: the same lease. Another profile for it: an error.
    let (_, again) = s
        .post(
            &s.admin,
            "/v1/leases/acquire",
            json!({"runtime": "mcp", "session_key": "chat-1"}),
        )
        .await;
    assert_eq!(again["lease_ref"], lease.as_str());
    assert_eq!(again["reused"], true);
    let (st, conflict) = s
        .post(
            &s.admin,
            "/v1/leases/acquire",
            json!({"runtime": "mcp", "session_key": "chat-1", "profile": "checkpoint-code"}),
        )
        .await;
    assert_eq!(st, StatusCode::CONFLICT, "{conflict}");
    assert_eq!(code(&conflict), "profile_conflict");

    let (st, status) = s.get(&s.admin, &format!("/v1/leases/{lease}/status")).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(status["state"], "running");
    let (_, list) = s.get(&s.admin, "/v1/leases").await;
    assert_eq!(list["leases"].as_array().unwrap().len(), 1);

    let (st, rel) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/release"),
            json!({"action": "kill"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{rel}");
    assert_eq!(s.sandboxes(), 0);
    let (st, gone) = s.get(&s.admin, &format!("/v1/leases/{lease}/status")).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    assert_eq!(code(&gone), "lease_not_found");
    // Headers on every answer.
    let r = s
        .http
        .get(format!("{}/v1/leases", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(r.headers()["cache-control"], "no-store");
    assert_eq!(r.headers()["x-content-type-options"], "nosniff");
    // Over HTTPS, HSTS too (#34 L9): API, MCP and health alike.
    for path in ["/v1/leases", "/mcp", "/readyz", "/healthz", "/nowhere"] {
        let r = s.http.get(format!("{}{path}", s.url)).send().await.unwrap();
        assert_eq!(
            r.headers()["strict-transport-security"],
            "max-age=31536000",
            "{path}"
        );
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_acquires_of_one_session_make_one_sandbox_and_quota_holds() {
    let s = Arc::new(
        Server::start_with(|c| {
            if let Some(p) = c.profiles.get_mut("offline-code") {
                p.max_active_leases_per_tenant = 2;
            }
        })
        .await,
    );
    let mut tasks = vec![];
    for _ in 0..8 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            s.acquire(&s.admin, "same-session").await
        }));
    }
    let mut refs = vec![];
    for t in tasks {
        refs.push(t.await.unwrap());
    }
    refs.dedup();
    assert_eq!(refs.len(), 1, "{refs:?}");
    assert_eq!(s.sandboxes(), 1);

    // Quota: 8 concurrent new sessions with one lease left: exactly one wins.
    let mut tasks = vec![];
    for i in 0..8 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            s.post(
                &s.admin,
                "/v1/leases/acquire",
                json!({"runtime": "mcp", "session_key": format!("s{i}")}),
            )
            .await
        }));
    }
    let mut ok = 0;
    let mut limited = 0;
    for t in tasks {
        let (st, v) = t.await.unwrap();
        match st {
            StatusCode::OK => ok += 1,
            StatusCode::TOO_MANY_REQUESTS => {
                assert_eq!(code(&v), "lease_quota_exceeded");
                limited += 1;
            }
            other => panic!("{other}: {v}"),
        }
    }
    assert_eq!((ok, limited), (1, 7));
    assert_eq!(s.sandboxes(), 2);
}

/// A sandbox that dies under its lease (OOM, a crash): the next call on
/// the lease says so (410 `sandbox_gone`, "acquire again"), and the
/// session's next acquire ends the dead lease (audited as a release,
/// `gone`) and answers with a new sandbox in its place, naming the old
/// lease; also when nothing was called in between. Permission denied in the
/// sandbox is the path's fault: 403 `path_denied`, not a backend failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_sandbox_is_replaced_and_permission_denied_is_403() {
    let s = Server::start().await;
    let agent = s.token(&["--tenant", "tenant-a"]);
    let exec = |lease: String, command: &'static str| {
        let s = &s;
        let agent = agent.clone();
        async move {
            s.post(
                &agent,
                &format!("/v1/leases/{lease}/exec"),
                json!({"command": command}),
            )
            .await
        }
    };
    let acquire = || {
        s.post(
            &agent,
            "/v1/leases/acquire",
            json!({"runtime": "mcp", "session_key": "dies"}),
        )
    };
    let first = s.acquire(&agent, "dies").await;
    let (st, v) = exec(
        first.clone(),
        // The init's environment: the init is not dumpable, so not even
        // the sandbox's root may read it.
        "echo old > /workspace/f; ln -s /proc/1/environ /workspace/secret",
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");

    // Permission denied inside: 403 path_denied.
    let (st, v) = s
        .post(
            &agent,
            &format!("/v1/leases/{first}/read"),
            json!({"path": "/workspace/secret"}),
        )
        .await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::FORBIDDEN, "path_denied"),
        "{v}"
    );

    s.kill_sandboxes();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let gone = loop {
        let (st, v) = exec(first.clone(), "true").await;
        if st != StatusCode::OK || std::time::Instant::now() > deadline {
            break (st, v);
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert_eq!(
        (gone.0, code(&gone.1)),
        (StatusCode::GONE, "sandbox_gone"),
        "{}",
        gone.1
    );
    assert!(
        gone.1["error"]["message"]
            .as_str()
            .unwrap()
            .contains("acquire again"),
        "{}",
        gone.1
    );
    let (_, status) = s
        .get(&agent, &format!("/v1/leases/{first}/status?refresh=false"))
        .await;
    assert_eq!(status["state"], "gone", "{status}");

    let (st, v) = acquire().await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["reused"], false, "{v}");
    assert_eq!(v["replaced_lease_ref"], first.as_str(), "{v}");
    let second = v["lease_ref"].as_str().unwrap().to_string();
    assert_ne!(second, first);
    let (st, v) = exec(second.clone(), "cat /workspace/f 2>&1; true").await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert!(
        v["stdout"].as_str().unwrap().contains("No such file"),
        "a new, empty sandbox: {v}"
    );
    let (st, v) = s.get(&agent, &format!("/v1/leases/{first}/status")).await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::NOT_FOUND, "lease_not_found"),
        "{v}"
    );
    // The same session again: the new lease, reused, naming nothing.
    let (_, v) = acquire().await;
    assert_eq!(
        (v["lease_ref"].as_str(), v["reused"].as_bool()),
        (Some(second.as_str()), Some(true)),
        "{v}"
    );
    assert!(v.get("replaced_lease_ref").is_none(), "{v}");

    // Dead again, and acquired with no call in between: replaced at once.
    s.kill_sandboxes();
    let mut third = None;
    for _ in 0..200 {
        let (st, v) = acquire().await;
        assert_eq!(st, StatusCode::OK, "{v}");
        if v["reused"] == false {
            assert_eq!(v["replaced_lease_ref"], second.as_str(), "{v}");
            third = v["lease_ref"].as_str().map(str::to_string);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let third = third.expect("the dead sandbox was replaced");
    let (st, v) = exec(third, "echo alive").await;
    assert_eq!(
        (st, v["stdout"].as_str()),
        (StatusCode::OK, Some("alive\n")),
        "{v}"
    );

    // The journal: the failed call as sandbox_gone, each dead lease ended
    // as a release `gone`.
    let j = s.journal();
    let events: Vec<Value> = j
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        events.iter().any(|e| e["action"] == "exec"
            && e["lease_ref"] == first.as_str()
            && e["outcome"] == "error"
            && e["error_code"] == "sandbox_gone"),
        "{j}"
    );
    for old in [&first, &second] {
        let ends: Vec<&Value> = events
            .iter()
            .filter(|e| e["action"] == "release" && e["lease_ref"] == old.as_str())
            .collect();
        assert_eq!(ends.len(), 2, "intent and outcome for {old}: {j}");
        assert!(ends.iter().all(|e| e["release_action"] == "gone"), "{j}");
        assert_eq!(ends[1]["outcome"], "ok", "{j}");
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_scopes_and_tokens() {
    let s = Server::start().await;
    let a = s.token(&["--tenant", "alpha"]);
    let b = s.token(&["--tenant", "beta"]);
    let reader = s.token(&[
        "--tenant",
        "alpha",
        "--action",
        "file:read",
        "--action",
        "lease:*",
    ]);
    let nothing = s.token(&["--tenant", "alpha", "--no-actions"]);
    let lease = s.acquire(&a, "a-session").await;

    // Another tenant's lease answers exactly like a missing one.
    let (st1, v1) = s
        .post(
            &b,
            &format!("/v1/leases/{lease}/exec"),
            json!({"command": "id"}),
        )
        .await;
    let (st2, v2) = s
        .post(
            &b,
            "/v1/leases/lease_00000000000000000000/exec",
            json!({"command": "id"}),
        )
        .await;
    assert_eq!((st1, v1), (st2, v2));
    assert_eq!(st1, StatusCode::NOT_FOUND);
    let (_, list) = s.get(&b, "/v1/leases").await;
    assert_eq!(list["leases"].as_array().unwrap().len(), 0);

    // Scopes.
    let (st, v) = s
        .post(
            &reader,
            &format!("/v1/leases/{lease}/exec"),
            json!({"command": "id"}),
        )
        .await;
    assert_eq!(st, StatusCode::FORBIDDEN);
    assert_eq!(code(&v), "action_denied");
    let (st, _) = s
        .post(
            &reader,
            &format!("/v1/leases/{lease}/write"),
            json!({"path": "/workspace/x", "content": "x"}),
        )
        .await;
    assert_eq!(st, StatusCode::FORBIDDEN);
    let (st, v) = s
        .post(
            &nothing,
            "/v1/leases/acquire",
            json!({"runtime": "mcp", "session_key": "x"}),
        )
        .await;
    assert_eq!((st, code(&v)), (StatusCode::FORBIDDEN, "action_denied"));
    let rt = s.token(&["--tenant", "alpha", "--runtime", "hermes"]);
    let (st, v) = s
        .post(
            &rt,
            "/v1/leases/acquire",
            json!({"runtime": "mcp", "session_key": "x"}),
        )
        .await;
    assert_eq!((st, code(&v)), (StatusCode::FORBIDDEN, "runtime_denied"));
    let pf = s.token(&["--tenant", "alpha", "--profile", "checkpoint-code"]);
    let (st, v) = s
        .post(
            &pf,
            "/v1/leases/acquire",
            json!({"runtime": "mcp", "session_key": "x"}),
        )
        .await;
    assert_eq!((st, code(&v)), (StatusCode::FORBIDDEN, "profile_denied"));
    let (st, v) = s
        .post(
            &a,
            "/v1/leases/acquire",
            json!({"runtime": "nope", "session_key": "x"}),
        )
        .await;
    assert_eq!((st, code(&v)), (StatusCode::BAD_REQUEST, "invalid_runtime"));

    // Missing, wrong and revoked tokens.
    let (st, v) = s.get("", "/v1/leases").await;
    assert_eq!((st, code(&v)), (StatusCode::UNAUTHORIZED, "unauthorized"));
    let (st, _) = s
        .get(
            "cat_000000000000_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
            "/v1/leases",
        )
        .await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    revoke(&s.state, &b);
    let (st, _) = s.get(&b, "/v1/leases").await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    // token list shows ids and scopes, never secrets.
    let out = std::process::Command::new(BIN)
        .args(["token", "list", "--json", "--state-dir"])
        .arg(&s.state)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("alpha") && !text.contains(&a) && !text.contains("argon2"),
        "{text}"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_bodies_request_ids_and_paths() {
    let s = Server::start().await;
    let lease = s.acquire(&s.admin, "strict").await;
    let url = format!("{}/v1/leases/{lease}/exec", s.url);
    let send = |ct: &'static str, body: Vec<u8>| {
        s.http
            .post(&url)
            .bearer_auth(&s.admin)
            .header("content-type", ct)
            .body(body)
            .send()
    };
    let r = send("text/plain", b"{}".to_vec()).await.unwrap();
    assert_eq!(r.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert_eq!(code(&r.json().await.unwrap()), "unsupported_media_type");
    // An oversize body is refused from its Content-Length, before it is read.
    let head = raw_request(
        &s,
        &format!(
            "POST /v1/leases/{lease}/exec HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {}\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n",
            s.admin,
            17 * 1024 * 1024
        ),
    )
    .await;
    assert!(head.starts_with("HTTP/1.1 413"), "{head}");
    assert!(head.contains("\"invalid_body\""), "{head}");
    let r = send("application/json", b"{nope".to_vec()).await.unwrap();
    assert_eq!(
        (r.status(), code(&r.json().await.unwrap()).to_string()),
        (StatusCode::BAD_REQUEST, "invalid_json".into())
    );
    let r = send("application/json", b"[]".to_vec()).await.unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let r = send(
        "application/json; charset=utf-8",
        br#"{"command":"true","bogus":1}"#.to_vec(),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    assert_eq!(code(&r.json().await.unwrap()), "unknown_fields");
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/exec"),
            json!({"command": "true", "request_id": "bad id!"}),
        )
        .await;
    assert_eq!((st, code(&v)), (StatusCode::BAD_REQUEST, "invalid_request"));
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/exec"),
            json!({"command": "true", "timeout_ms": 0}),
        )
        .await;
    assert_eq!((st, code(&v)), (StatusCode::BAD_REQUEST, "invalid_timeout"));
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/exec"),
            json!({"command": "x".repeat(16 * 1024 + 1)}),
        )
        .await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::PAYLOAD_TOO_LARGE, "value_too_large")
    );
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/exec"),
            json!({"command": "true", "request_id": "ok-1.2:3_4"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(v["request_id"], "ok-1.2:3_4");

    // Path policy.
    for (path, want) in [
        ("/etc/passwd", "path_denied"),
        ("/workspace/../etc", "path_denied"),
        ("relative", "invalid_path"),
    ] {
        let (st, v) = s
            .post(
                &s.admin,
                &format!("/v1/leases/{lease}/read"),
                json!({"path": path}),
            )
            .await;
        assert_eq!(code(&v), want, "{path}: {st} {v}");
    }
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/exec"),
            json!({"command": "pwd", "cwd": "/etc"}),
        )
        .await;
    assert_eq!((st, code(&v)), (StatusCode::FORBIDDEN, "path_denied"));
    let (st, v) = s.post(&s.admin, "/v1/nope", json!({})).await;
    assert_eq!((st, code(&v)), (StatusCode::NOT_FOUND, "not_found"));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_and_artifacts() {
    use base64::Engine;
    use sha2::Digest;
    let s = Server::start().await;
    let l = s.acquire(&s.admin, "files").await;
    let p = |op: &str| format!("/v1/leases/{l}/{op}");
    let (st, v) = s
        .post(
            &s.admin,
            &p("write"),
            json!({"path": "/workspace/dir/a.txt", "content": "héllo"}),
        )
        .await;
    assert_eq!((st, v["bytes"].as_u64()), (StatusCode::OK, Some(6)), "{v}");
    let (_, v) = s
        .post(
            &s.admin,
            &p("read"),
            json!({"path": "/workspace/dir/a.txt"}),
        )
        .await;
    assert_eq!(v["content"], "héllo");
    assert_eq!(v["truncated"], false);
    let (_, v) = s
        .post(&s.admin, &p("list"), json!({"path": "/workspace/dir"}))
        .await;
    assert_eq!(v["entries"][0]["name"], "a.txt");
    let (_, v) = s
        .post(
            &s.admin,
            &p("stat"),
            json!({"path": "/workspace/dir/a.txt"}),
        )
        .await;
    assert_eq!(v["entry"]["size"], 6);
    let (st, _) = s
        .post(
            &s.admin,
            &p("mkdir"),
            json!({"path": "/workspace/new/deep"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK);
    let (st, v) = s
        .post(
            &s.admin,
            &p("move"),
            json!({"path": "/workspace/dir/a.txt", "destination": "/tmp/b.txt"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let (st, v) = s
        .post(
            &s.admin,
            &p("read"),
            json!({"path": "/workspace/dir/a.txt"}),
        )
        .await;
    assert_eq!((st, code(&v)), (StatusCode::NOT_FOUND, "path_not_found"));
    let (st, v) = s
        .post(&s.admin, &p("remove"), json!({"path": "/tmp/b.txt"}))
        .await;
    assert_eq!((st, v["removed"].as_bool()), (StatusCode::OK, Some(true)));

    // Reads return at most 64 KiB, flagged as truncated, however large the file.
    let (st, _) = s
        .post(
            &s.admin,
            &p("exec"),
            json!({"command": "head -c 9000000 /dev/zero | tr '\\0' a > /workspace/big"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK);
    let (st, v) = s
        .post(&s.admin, &p("read"), json!({"path": "/workspace/big"}))
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["truncated"], true);
    assert_eq!(v["content"].as_str().unwrap().len(), 64 * 1024);
    // A command killed at its deadline is a timeout.
    let (st, v) = s
        .post(
            &s.admin,
            &p("exec"),
            json!({"command": "sleep 30", "timeout_ms": 300}),
        )
        .await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::GATEWAY_TIMEOUT, "timeout"),
        "{v}"
    );

    let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let b64 = base64::engine::general_purpose::STANDARD.encode(&data);
    let sha = hex::encode(sha2::Sha256::digest(&data));
    let (st, v) = s
        .post(
            &s.admin,
            &p("artifacts/upload"),
            json!({"path": "/workspace/bin.dat", "content_base64": b64}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["sha256"], sha.as_str());
    let (_, v) = s
        .post(
            &s.admin,
            &p("artifacts/download"),
            json!({"path": "/workspace/bin.dat"}),
        )
        .await;
    assert_eq!(v["sha256"], sha.as_str());
    assert_eq!(v["content_base64"], b64.as_str());
    let (st, v) = s
        .post(
            &s.admin,
            &p("artifacts/download"),
            json!({"path": "/workspace/none"}),
        )
        .await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::NOT_FOUND, "artifact_not_found")
    );
    let (st, v) = s
        .post(
            &s.admin,
            &p("artifacts/upload"),
            json!({"path": "/workspace/x", "content_base64": "!!!"}),
        )
        .await;
    assert_eq!((st, code(&v)), (StatusCode::BAD_REQUEST, "invalid_base64"));
    let (st, v) = s
        .post(&s.admin, &p("release"), json!({"action": "explode"}))
        .await;
    assert_eq!((st, code(&v)), (StatusCode::BAD_REQUEST, "invalid_action"));
    let (st, v) = s.post(&s.admin, &p("release"), json!({})).await;
    assert_eq!((st, v["action"].as_str()), (StatusCode::OK, Some("pause")));
    // A paused lease resumes on use (the profile's auto_resume).
    let (st, v) = s
        .post(&s.admin, &p("exec"), json!({"command": "echo back"}))
        .await;
    assert_eq!(
        (st, v["stdout"].as_str()),
        (StatusCode::OK, Some("back\n")),
        "{v}"
    );
    // A file where a directory of the path is needed: the caller's path is
    // wrong (400 invalid_path), not the sandbox (it was 502).
    let (st, _) = s
        .post(
            &s.admin,
            &p("write"),
            json!({"path": "/workspace/plain", "content": "x"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK);
    for (op, body) in [
        (
            "write",
            json!({"path": "/workspace/plain/x", "content": "x"}),
        ),
        (
            "artifacts/upload",
            json!({"path": "/workspace/plain/y", "content_base64": "eA=="}),
        ),
    ] {
        let (st, v) = s.post(&s.admin, &p(op), body).await;
        assert_eq!(
            (st, code(&v)),
            (StatusCode::BAD_REQUEST, "invalid_path"),
            "{op}: {v}"
        );
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_journal_is_chained_and_holds_no_secrets() {
    let s = Server::start().await;
    let session = "secret-session-key-4711";
    let (_, a) = s
        .post(
            &s.admin,
            "/v1/leases/acquire",
            json!({"runtime": "mcp", "session_key": session}),
        )
        .await;
    let lease = a["lease_ref"].as_str().unwrap().to_string();
    let command = "echo top-secret-command-text";
    let (_, e) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/exec"),
            json!({"command": command}),
        )
        .await;
    assert_eq!(e["stdout"], "top-secret-command-text\n");
    s.post(
        &s.admin,
        &format!("/v1/leases/{lease}/write"),
        json!({"path": "/workspace/f", "content": "file-content-xyz"}),
    )
    .await;
    let reader = s.token(&["--tenant", "t2", "--action", "lease:acquire"]);
    let (st, _) = s
        .post(
            &reader,
            "/v1/leases/lease_00000000000000000000/exec",
            json!({"command": "denied-secret"}),
        )
        .await;
    assert_eq!(st, StatusCode::FORBIDDEN);
    let sandbox_id = std::fs::read_dir(s.state.join("embedded/sandboxes"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .file_name();
    let sandbox_id = sandbox_id.to_str().unwrap().to_string();

    let out = std::process::Command::new(BIN)
        .args(["audit", "export", "--state-dir"])
        .arg(&s.state)
        .output()
        .unwrap();
    assert!(out.status.success());
    let journal = String::from_utf8(out.stdout).unwrap();
    assert!(journal.lines().count() >= 7, "{journal}");
    for secret in [
        session,
        command,
        "top-secret",
        "file-content-xyz",
        "denied-secret",
        &s.admin,
        &reader,
        &sandbox_id,
    ] {
        assert!(!journal.contains(secret), "the journal contains {secret}");
    }
    assert!(
        journal.contains("\"outcome\":\"rejected\""),
        "denials are recorded"
    );
    let events: Vec<Value> = journal
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let exec: Vec<&Value> = events.iter().filter(|e| e["action"] == "exec").collect();
    assert_eq!(exec[0]["phase"], "intent");
    assert_eq!(exec[1]["phase"], "outcome");
    assert!(exec[0]["command_digest"].is_string());
    for w in events.windows(2) {
        assert_eq!(w[1]["prev_hash"], w[0]["hash"]);
    }
    let out = std::process::Command::new(BIN)
        .args(["audit", "verify", "--state-dir"])
        .arg(&s.state)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    s.stop().await;
}

/// `(METHOD, path)` pairs of the OpenAPI document.
fn spec_routes() -> Vec<(String, String)> {
    let mut out = vec![];
    let mut path = None;
    let mut in_paths = false;
    for line in cube_adapter::api::OPENAPI.lines() {
        if line == "paths:" {
            in_paths = true;
            continue;
        }
        if in_paths && !line.starts_with(' ') && !line.is_empty() {
            break;
        }
        if let Some(p) = line.strip_prefix("  /").and_then(|l| l.strip_suffix(':')) {
            path = Some(format!("/{p}"));
        } else if let (Some(p), Some(m)) = (
            &path,
            line.strip_prefix("    ").and_then(|l| l.strip_suffix(':')),
        ) && ["get", "post", "put", "delete", "patch"].contains(&m)
        {
            out.push((m.to_uppercase(), p.clone()));
        }
    }
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_and_openapi_are_in_step() {
    let mut code_routes: Vec<(String, String)> = cube_adapter::api::ROUTES
        .iter()
        .map(|(m, p)| (m.to_string(), p.to_string()))
        .collect();
    code_routes.sort();
    assert_eq!(
        spec_routes(),
        code_routes,
        "docs/openapi.yaml and api::ROUTES differ"
    );
    // Every documented route is served (never the not-found fallback).
    let s = Server::start().await;
    for (m, p) in &code_routes {
        let url = format!(
            "{}{}",
            s.url,
            p.replace("{lease_ref}", "lease_00000000000000000000")
        );
        let req = if m == "GET" {
            s.http.get(&url)
        } else {
            s.http.post(&url).json(&json!({}))
        };
        let r = req.bearer_auth(&s.admin).send().await.unwrap();
        let status = r.status();
        let body = r.text().await.unwrap();
        assert!(
            !body.contains("no such route"),
            "{m} {p} is documented but not routed ({status})"
        );
    }
    let r = s
        .http
        .get(format!("{}/openapi.yaml", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.text().await.unwrap(), cube_adapter::api::OPENAPI);
    s.stop().await;
}

/// The `enum` of `components.schemas.Error`'s `error.code` in the OpenAPI
/// document (a flow sequence, possibly over several lines).
fn spec_error_codes() -> Vec<String> {
    let spec = cube_adapter::api::OPENAPI;
    let schemas = spec
        .find("\n  schemas:\n")
        .expect("components.schemas in docs/openapi.yaml");
    let error = schemas
        + spec[schemas..]
            .find("\n    Error:\n")
            .expect("components.schemas.Error in docs/openapi.yaml");
    let code = error
        + spec[error..]
            .find("\n            code:\n")
            .expect("Error.error.code in docs/openapi.yaml");
    let enum_at = code
        + spec[code..]
            .find("enum: [")
            .expect("Error.error.code.enum in docs/openapi.yaml")
        + "enum: [".len();
    let end = enum_at + spec[enum_at..].find(']').expect("the enum's closing ]");
    spec[enum_at..end]
        .split(',')
        .map(|c| c.trim().to_string())
        .filter(|c| !c.is_empty())
        .collect()
}

#[test]
fn error_catalogue_and_openapi_are_in_step() {
    use std::collections::BTreeSet;
    let listed = spec_error_codes();
    let spec: BTreeSet<&str> = listed.iter().map(String::as_str).collect();
    assert_eq!(
        spec.len(),
        listed.len(),
        "a code is listed twice: {listed:?}"
    );
    let code: BTreeSet<&str> = cube_adapter::broker::Code::ALL
        .iter()
        .map(|c| c.as_str())
        .collect();
    let missing: Vec<_> = code.difference(&spec).collect();
    let unknown: Vec<_> = spec.difference(&code).collect();
    assert!(
        missing.is_empty() && unknown.is_empty(),
        "docs/openapi.yaml's Error.code enum and broker::Code differ: \
         not in the spec {missing:?}, not in the catalogue {unknown:?}"
    );
}

fn cli(args: &[&str], state: &std::path::Path) -> std::process::Output {
    std::process::Command::new(BIN)
        .args(args)
        .arg("--state-dir")
        .arg(state)
        .output()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_intent_and_outcome_blocks_until_reconciled() {
    cube_adapter::tls::install_default_provider();
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let config = dir.path().join("config.toml");
    // The reference's behaviour, kept as a choice.
    std::fs::write(&config, "[audit]\non_crash = \"block\"\n").unwrap();
    let client = |state: &std::path::Path| {
        let ca = std::fs::read(state.join("tls/ca.pem")).unwrap();
        reqwest::Client::builder()
            .tls_backend_preconfigured(cube_adapter::tls::client_config(Some(&ca), None).unwrap())
            .build()
            .unwrap()
    };
    let _cleanup = SandboxReaper(state.join("embedded/sandboxes"));

    // 1. A server that dies right after committing an exec intent.
    let p = Proc::start(
        &state,
        &config,
        &[("CUBE_ADAPTER_FAILPOINT", "after_intent")],
    )
    .unwrap();
    let http = client(&state);
    let admin = std::fs::read_to_string(state.join("admin.token"))
        .unwrap()
        .trim()
        .to_string();
    let r: Value = http
        .post(format!("{}/v1/leases/acquire", p.url))
        .bearer_auth(&admin)
        .json(&json!({"runtime": "mcp", "session_key": "crash"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let lease = r["lease_ref"].as_str().unwrap().to_string();
    let exec = http
        .post(format!("{}/v1/leases/{lease}/exec", p.url))
        .bearer_auth(&admin)
        .json(&json!({"command": "echo never-runs > /workspace/proof"}))
        .send()
        .await;
    assert!(exec.is_err(), "the process should have died mid-request");
    let mut p = p;
    let status = p.child.wait().unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9),
        "{status:?}"
    );

    // 2. Restarted: blocked — readiness and every sandbox effect answer 503.
    let p = Proc::start(&state, &config, &[]).unwrap();
    let r = http.get(format!("{}/readyz", p.url)).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["checks"]["audit"], "reconciliation_required");
    // The metrics say so too (#21 item 3).
    let m = crate::metrics::exposition(&http, &p.url).await;
    for (name, want) in [
        ("cube_adapter_audit_reconcile_needed", 1.0),
        ("cube_adapter_audit_blocked", 1.0),
        ("cube_adapter_audit_incomplete_operations", 1.0),
    ] {
        assert_eq!(
            crate::metrics::sample(&m, name, &[]),
            Some(want),
            "{name}: {m}"
        );
    }
    let r = http
        .post(format!("{}/v1/leases/{lease}/exec", p.url))
        .bearer_auth(&admin)
        .json(&json!({"command": "true"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(code(&r.json().await.unwrap()), "audit_unavailable");
    // Reconcile refuses while the service runs.
    let out = cli(&["audit", "reconcile", "--note", "INC-1"], &state);
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    p.stop();

    // 3. Offline reconcile records a resolution; the chain stays intact.
    let out = cli(
        &[
            "audit",
            "reconcile",
            "--note",
            "INC-1: checked, the command never ran",
        ],
        &state,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("reconciled "));
    let out = cli(&["audit", "verify"], &state);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let export = String::from_utf8(cli(&["audit", "export"], &state).stdout).unwrap();
    assert!(export.contains("\"outcome\":\"reconciled\""));
    assert!(
        !export.contains("INC-1"),
        "the note is kept as a digest only"
    );

    // 4. Unblocked; the sandbox outlived both processes; nothing re-ran.
    let p = Proc::start(&state, &config, &[]).unwrap();
    let r = http.get(format!("{}/readyz", p.url)).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let v: Value = http
        .post(format!("{}/v1/leases/{lease}/exec", p.url))
        .bearer_auth(&admin)
        .json(&json!({"command": "ls /workspace; echo ok"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["stdout"], "ok\n", "{v}");
    p.stop();
}

/// The default crash policy (`on_crash = "resolve"`): the restart serves
/// at once; the exec intent the crash left gets exactly one
/// `audit_recover` event (`uncertain`: nobody can know whether it ran),
/// the chain verifies, `status` counts it, and nothing ran again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_is_resolved_at_the_next_start_without_a_person() {
    cube_adapter::tls::install_default_provider();
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let config = dir.path().join("config.toml");
    std::fs::write(&config, "").unwrap();
    let _cleanup = SandboxReaper(state.join("embedded/sandboxes"));
    let p = Proc::start(
        &state,
        &config,
        &[("CUBE_ADAPTER_FAILPOINT", "after_intent")],
    )
    .unwrap();
    let ca = std::fs::read(state.join("tls/ca.pem")).unwrap();
    let http = reqwest::Client::builder()
        .tls_backend_preconfigured(cube_adapter::tls::client_config(Some(&ca), None).unwrap())
        .build()
        .unwrap();
    let admin = std::fs::read_to_string(state.join("admin.token"))
        .unwrap()
        .trim()
        .to_string();
    let r: Value = http
        .post(format!("{}/v1/leases/acquire", p.url))
        .bearer_auth(&admin)
        .json(&json!({"runtime": "mcp", "session_key": "crash"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let lease = r["lease_ref"].as_str().unwrap().to_string();
    let exec = http
        .post(format!("{}/v1/leases/{lease}/exec", p.url))
        .bearer_auth(&admin)
        .json(&json!({"command": "echo never-runs > /workspace/proof"}))
        .send()
        .await;
    assert!(exec.is_err(), "the process should have died mid-request");
    let mut p = p;
    p.child.wait().unwrap();
    let stopped = std::process::Command::new(BIN)
        .args(["status", "--json", "--state-dir"])
        .arg(&state)
        .arg("--config")
        .arg(&config)
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&stopped.stdout).unwrap();
    assert_eq!(v["audit"]["state"], "resolved_at_next_start", "{v}");
    let pending = v["store"]["pending_intents"].as_u64().unwrap();
    assert_eq!(pending, 1, "{v}");

    // Restarted: ready at once, and the lease serves.
    let p = Proc::start(&state, &config, &[]).unwrap();
    let r = http.get(format!("{}/readyz", p.url)).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let v: Value = http
        .post(format!("{}/v1/leases/{lease}/exec", p.url))
        .bearer_auth(&admin)
        .json(&json!({"command": "ls /workspace; echo ok"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["stdout"], "ok\n", "nothing ran again: {v}");
    let out = std::process::Command::new(BIN)
        .args(["status", "--json", "--state-dir"])
        .arg(&state)
        .arg("--config")
        .arg(&config)
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["ready"], true, "{v}");
    assert_eq!(v["store"]["pending_intents"], 0, "{v}");
    assert_eq!(v["store"]["uncertain_outcomes"], 1, "{v}");
    // Visible as a metric (#21 item 3), and nothing blocks.
    let m = crate::metrics::exposition(&http, &p.url).await;
    for (name, want) in [
        ("cube_adapter_audit_uncertain_outcomes", 1.0),
        ("cube_adapter_audit_reconcile_needed", 0.0),
        ("cube_adapter_audit_blocked", 0.0),
        ("cube_adapter_audit_incomplete_operations", 0.0),
    ] {
        assert_eq!(
            crate::metrics::sample(&m, name, &[]),
            Some(want),
            "{name}: {m}"
        );
    }
    p.stop();
    let export = String::from_utf8(cli(&["audit", "export"], &state).stdout).unwrap();
    let events: Vec<Value> = export
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let intent = events
        .iter()
        .find(|e| e["action"] == "exec" && e["phase"] == "intent")
        .unwrap();
    let op = intent["operation_id"].as_str().unwrap();
    let resolving: Vec<&Value> = events
        .iter()
        .filter(|e| e["operation_id"] == op && e["phase"] == "outcome")
        .collect();
    assert_eq!(resolving.len(), 1, "exactly one resolution: {resolving:?}");
    assert_eq!(resolving[0]["action"], "audit_recover");
    assert_eq!(resolving[0]["outcome"], "uncertain");
    assert_eq!(resolving[0]["error_code"], "recovered:exec");
    let out = cli(&["audit", "verify"], &state);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_process_per_store_keys_sealed_and_config_checked() {
    let s = Server::start().await;
    // A second process on the same state directory exits with a clear message.
    let err = Proc::start(&s.state, &s.empty_config(), &[])
        .err()
        .expect("a second server must not start");
    assert!(
        err.contains("in use by another cube-adapter process"),
        "{err}"
    );
    // Secrets at rest: private keys sealed, 0600; the admin token 0600.
    use std::os::unix::fs::PermissionsExt;
    for f in [
        "tls/ca.key",
        "tls/server.key",
        "admin.token",
        "secret.key",
        "hmac.key",
        "state.redb",
    ] {
        let mode = std::fs::metadata(s.state.join(f))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600, "{f}");
    }
    let ca_key = std::fs::read_to_string(s.state.join("tls/ca.key")).unwrap();
    assert!(ca_key.starts_with("sealed:") && !ca_key.contains("PRIVATE KEY"));
    let ca_pem = std::fs::metadata(s.state.join("tls/ca.pem"))
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(ca_pem, 0o644);
    s.stop().await;

    // config check: unknown keys and non-boolean booleans are refused.
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("c.toml");
    std::fs::write(&f, "listen = \"127.0.0.1:1\"\nsurprise = true\n").unwrap();
    let out = std::process::Command::new(BIN)
        .args(["config", "check", "--config"])
        .arg(&f)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("surprise"));
    std::fs::write(&f, "[audit]\nmode = \"best_effort\"\n[profiles.mine]\ntemplate = \"host\"\nallow_internet_access = \"yes\"\n").unwrap();
    let out = std::process::Command::new(BIN)
        .args(["config", "check", "--config"])
        .arg(&f)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    std::fs::write(
        &f,
        "[profiles.mine]\ntemplate = \"host\"\nmax_command_seconds = 30\n",
    )
    .unwrap();
    let out = std::process::Command::new(BIN)
        .args(["config", "check", "--config"])
        .arg(&f)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("[profiles.mine]"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reference_principals_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("principals.json");
    std::fs::write(
        &file,
        r#"[{"token":"ref-token-aaaaaaaaaaaaaaaaaaaaaaaa","tenant_id":"acme","allowed_actions":"lease:*,file:read"},
            {"token":"ref-token-bbbbbbbbbbbbbbbbbbbbbbbb","tenant_id":"acme","roles":["runtime"],"allowed_actions":[]}]"#,
    )
    .unwrap();
    let s = Server::start_with(|c| c.tokens_file = Some(file.clone())).await;
    let lease = s.acquire("ref-token-aaaaaaaaaaaaaaaaaaaaaaaa", "ref").await;
    let (st, v) = s
        .post(
            "ref-token-aaaaaaaaaaaaaaaaaaaaaaaa",
            &format!("/v1/leases/{lease}/exec"),
            json!({"command": "id"}),
        )
        .await;
    assert_eq!((st, code(&v)), (StatusCode::FORBIDDEN, "action_denied"));
    // An explicit empty action list denies everything.
    let (st, v) = s
        .get("ref-token-bbbbbbbbbbbbbbbbbbbbbbbb", "/v1/leases")
        .await;
    assert_eq!((st, code(&v)), (StatusCode::FORBIDDEN, "action_denied"));
    s.stop().await;
}

/// One agent filling the disk does not take the appliance down: while the
/// disk its sandboxes write to has less than `[embedded] min_free_mb`
/// free, new sandboxes are refused (503 `storage_low`, Retry-After), the
/// existing ones keep working, and new ones are made again as soon as space
/// returns, with no restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_sandboxes_wait_for_disk_space() {
    let outer = tempfile::tempdir().unwrap();
    let sandboxes = outer.path().join("sandboxes");
    let _fs = Tmpfs::mount(&sandboxes, "64m");
    let s = Server::start_with(|c| {
        c.embedded.state_dir = Some(sandboxes.clone());
        c.embedded.min_free_mb = 40;
    })
    .await;
    let first = s.acquire(&s.admin, "filler").await;
    let exec = |command: &'static str| {
        let s = &s;
        let first = first.clone();
        async move {
            s.post(
                &s.admin,
                &format!("/v1/leases/{first}/exec"),
                json!({"command": command}),
            )
            .await
        }
    };
    // (sync: the sandbox's own disk is an image on this file system, whose
    // blocks are taken as the written pages reach it.)
    let (st, v) = exec("head -c 30000000 /dev/zero > /workspace/big && sync && echo filled").await;
    assert_eq!(
        (st, v["stdout"].as_str()),
        (StatusCode::OK, Some("filled\n")),
        "{v}"
    );
    let r = s
        .http
        .post(format!("{}/v1/leases/acquire", s.url))
        .bearer_auth(&s.admin)
        .json(&json!({"runtime": "mcp", "session_key": "second"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.headers()["retry-after"], "30");
    let v: Value = r.json().await.unwrap();
    assert_eq!(code(&v), "storage_low", "{v}");
    assert_eq!(s.sandboxes(), 1, "no sandbox was made");
    // The existing sandbox keeps working, and frees the space.
    let (st, _) = exec("rm /workspace/big && sync").await;
    assert_eq!(st, StatusCode::OK);
    // The freed blocks reach the host as the sandbox's disk discards them,
    // shortly after (the loop device punches holes in the image).
    let mut again = None;
    for _ in 0..100 {
        let (st, v) = s
            .post(
                &s.admin,
                "/v1/leases/acquire",
                json!({"runtime": "mcp", "session_key": "second"}),
            )
            .await;
        if st == StatusCode::OK {
            again = v["lease_ref"].as_str().map(str::to_string);
            break;
        }
        assert_eq!(code(&v), "storage_low", "{v}");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let second = again.expect("made again once the space returned");
    assert_ne!(second, first);
    let j = s.journal();
    assert!(
        j.lines().any(|l| l.contains("\"action\":\"acquire\"")
            && l.contains("\"error_code\":\"storage_low\"")),
        "{j}"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_store_fails_closed_with_no_sandbox_created() {
    let outer = tempfile::tempdir().unwrap();
    let state = outer.path().join("state");
    let _fs = Tmpfs::mount(&state, "8m");
    let sandboxes = outer.path().join("sandboxes");
    let s = Server::start_with(|c| {
        c.state_dir = state.clone();
        c.embedded.state_dir = Some(sandboxes.clone());
        // The store fills up here, past the free-space guard (tested in
        // `new_sandboxes_wait_for_disk_space`).
        c.embedded.min_free_mb = 0;
    })
    .await;
    let count = || {
        std::fs::read_dir(sandboxes.join("sandboxes"))
            .map(|d| d.count())
            .unwrap_or(0)
    };
    let lease = s.acquire(&s.admin, "before").await;
    assert_eq!(count(), 1);
    // Fill the store's filesystem to the last byte.
    {
        use std::io::Write;
        let mut f = std::fs::File::create(state.join("filler")).unwrap();
        let block = vec![0u8; 64 * 1024];
        while f.write_all(&block).is_ok() {}
        let one = [0u8; 1];
        while f.write_all(&one).is_ok() {}
    }
    // The journal cannot grow: sooner or later an intent fails to commit.
    // From then on every effect is refused with 503 and nothing reaches the
    // backend: no sandbox is created, no command runs.
    let mut refused = None;
    for i in 0..5000 {
        let (st, v) = s
            .post(
                &s.admin,
                &format!("/v1/leases/{lease}/write"),
                json!({"path": "/workspace/n", "content": i.to_string()}),
            )
            .await;
        if st == StatusCode::SERVICE_UNAVAILABLE {
            assert_eq!(code(&v), "audit_unavailable", "{v}");
            refused = Some(i);
            break;
        }
        assert_eq!(st, StatusCode::OK, "{v}");
    }
    let refused = refused.expect("a full store never refused a write");
    let (st, v) = s
        .post(
            &s.admin,
            "/v1/leases/acquire",
            json!({"runtime": "mcp", "session_key": "after"}),
        )
        .await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::SERVICE_UNAVAILABLE, "audit_unavailable")
    );
    assert_eq!(
        count(),
        1,
        "no sandbox may be created without a committed intent"
    );
    let (st, _) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/exec"),
            json!({"command": "echo ran > /workspace/proof"}),
        )
        .await;
    assert_eq!(st, StatusCode::SERVICE_UNAVAILABLE);
    let r = s
        .http
        .get(format!("{}/readyz", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    // The last write that was accepted is the one in the sandbox.
    let file = std::fs::read_dir(sandboxes.join("sandboxes"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path()
        .join("state/workspace/n");
    let last = std::fs::read_to_string(file).ok();
    if last == Some(refused.to_string()) {
        // The refusal came after the effect: its intent committed, its
        // outcome could not. Then the journal says so (one intent pending:
        // reconciliation required) and nothing has run since.
        let out = std::process::Command::new(BIN)
            .args(["audit", "export", "--state-dir"])
            .arg(&state)
            .output()
            .unwrap();
        assert!(out.status.success());
        let (mut intents, mut outcomes) = (vec![], vec![]);
        for l in String::from_utf8(out.stdout).unwrap().lines() {
            let v: Value = serde_json::from_str(l).unwrap();
            let op = v["operation_id"].as_str().map(String::from);
            match v["phase"].as_str() {
                Some("intent") => intents.extend(op),
                Some("outcome") => outcomes.extend(op),
                _ => {}
            }
        }
        intents.retain(|op| !outcomes.contains(op));
        assert_eq!(
            intents.len(),
            1,
            "the write (#{refused}) happened, refused after it: its intent must be pending"
        );
    } else {
        let want = (refused > 0).then(|| (refused - 1).to_string());
        assert_eq!(
            last, want,
            "the refused write (#{refused}) must not have happened"
        );
    }
    assert!(
        !std::fs::read_dir(sandboxes.join("sandboxes"))
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path()
            .join("state/workspace/proof")
            .exists()
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_token_is_an_agent_not_an_admin_and_empty_bodies_are_400() {
    let shared = "shared-token-0123456789abcdefghij";
    let secrets = cube_adapter::app::EnvSecrets {
        shared_token: Some(cube_adapter::cube::Secret::new(shared)),
    };
    let s = Server::start_full(|_| {}, secrets).await;
    let lease = s.acquire(shared, "shared").await;
    let (st, v) = s
        .post(
            shared,
            &format!("/v1/leases/{lease}/exec"),
            json!({"command": "echo ok"}),
        )
        .await;
    assert_eq!((st, v["stdout"].as_str()), (StatusCode::OK, Some("ok\n")));
    // Not an admin: the admin's leases stay invisible to it.
    let admin_lease = s.acquire(&s.admin, "admin-session").await;
    let (st, _) = s
        .get(shared, &format!("/v1/leases/{admin_lease}/status"))
        .await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    let r = s
        .http
        .post(format!("{}/v1/leases/{lease}/exec", s.url))
        .bearer_auth(shared)
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    assert_eq!(code(&r.json().await.unwrap()), "invalid_body");
    s.stop().await;
}
