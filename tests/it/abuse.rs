//! What one authenticated caller can do to the appliance (issue #34,
//! docs/security.md "What one caller can do to the appliance"): a caller's
//! names reach the journal only bounded (a 4 MB `runtime` or `profile` is
//! recorded as its digest and length, and the store barely grows), and a
//! lease is used only within the profiles and runtimes of the identity
//! that uses it, whoever acquired it.

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::kit::{Server, code};

/// The journal's events, parsed.
fn events(s: &Server) -> Vec<Value> {
    s.journal()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn redb_size(s: &Server) -> u64 {
    std::fs::metadata(s.state.join("state.redb")).unwrap().len()
}

/// H1: refused acquires with 4 MB `runtime` and `profile` values, from an
/// auditor (no effect scope at all) and from an admin: refused as before,
/// each recorded with the values as `~sha256:…:LEN`, the store growing by
/// far less than 64 KiB a request, and the chain whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_megabyte_names_reach_the_journal_as_a_digest_and_a_length() {
    // With a metrics token, /metrics keeps every label (runtime, profile).
    let tmp = tempfile::tempdir().unwrap();
    let metrics_token = "metrics-token-0123456789abcdef";
    let token_file = tmp.path().join("metrics.token");
    std::fs::write(&token_file, format!("{metrics_token}\n")).unwrap();
    let s = Server::start_with(move |c| c.metrics.token_file = Some(token_file)).await;
    let auditor = s.token(&["--tenant", "acme", "--subject", "aud", "--role", "auditor"]);
    let huge_runtime = "r".repeat(4 << 20);
    let huge_profile = "p".repeat(4 << 20);
    let body = json!({"runtime": huge_runtime, "session_key": "s", "profile": huge_profile});
    // Warm the file up with the same kind of event, then measure.
    for _ in 0..4 {
        let (st, _) = s
            .post(
                &auditor,
                "/v1/leases/acquire",
                json!({"runtime": "mcp", "session_key": "s"}),
            )
            .await;
        assert_eq!(st, StatusCode::FORBIDDEN);
    }
    let before_events = events(&s).len();
    let before = redb_size(&s);
    const N: u64 = 12;
    for i in 0..N {
        let token = if i % 2 == 0 { &auditor } else { &s.admin };
        let (st, v) = s.post(token, "/v1/leases/acquire", body.clone()).await;
        if i % 2 == 0 {
            assert_eq!(st, StatusCode::FORBIDDEN, "{v}");
            assert_eq!(code(&v), "action_denied", "{v}");
        } else {
            assert_eq!(st, StatusCode::BAD_REQUEST, "{v}");
            assert_eq!(code(&v), "invalid_runtime", "{v}");
        }
        assert!(
            v.to_string().len() < 4096,
            "the answer does not echo the value"
        );
    }
    let after = redb_size(&s);
    let grown = after.saturating_sub(before);
    assert!(
        grown < N * 64 * 1024,
        "state.redb grew {grown} bytes for {N} requests ({} a request)",
        grown / N
    );
    let evs = events(&s);
    let new: Vec<&Value> = evs[before_events..]
        .iter()
        .filter(|e| e["action"] == "acquire")
        .collect();
    assert_eq!(new.len() as u64, N, "each refusal is recorded");
    let want_runtime = format!(":{}", huge_runtime.len());
    for e in &new {
        let line = e.to_string();
        assert!(line.len() < 4096, "an event of {} bytes", line.len());
        for f in ["runtime", "profile"] {
            let v = e[f].as_str().unwrap_or_default();
            assert!(
                v.starts_with("~sha256:") && v.ends_with(&want_runtime),
                "{f}: {v}"
            );
        }
        assert_eq!(e["outcome"], "rejected");
    }
    // A valid runtime and profile are still recorded as they are.
    let (st, _) = s
        .post(
            &auditor,
            "/v1/leases/acquire",
            json!({"runtime": "mcp", "session_key": "s", "profile": "persistent-code"}),
        )
        .await;
    assert_eq!(st, StatusCode::FORBIDDEN);
    let last = events(&s).pop().unwrap();
    assert_eq!(last["runtime"], "mcp");
    assert_eq!(last["profile"], "persistent-code");
    // An unknown profile name of a valid shape is not the caller's to
    // write either: it is a digest too.
    let (st, v) = s
        .post(
            &s.admin,
            "/v1/leases/acquire",
            json!({"runtime": "mcp", "session_key": "s", "profile": "no-such-profile"}),
        )
        .await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::FORBIDDEN, "profile_denied"),
        "{v}"
    );
    let last = events(&s).pop().unwrap();
    assert!(
        last["profile"].as_str().unwrap().starts_with("~sha256:"),
        "{last}"
    );
    let out = s.cli(&["audit", "verify"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The metrics count a bad name as one label, not one series each.
    let m = s
        .http
        .get(format!("{}/metrics", s.url))
        .bearer_auth(metrics_token)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!m.contains("~sha256:"), "a digest became a metric label");
    assert!(
        m.contains("runtime=\"(invalid)\"") && m.contains("profile=\"(invalid)\""),
        "the refusals are counted under (invalid)"
    );
    assert!(m.contains("profile=\"persistent-code\""), "labels are kept");
    s.stop().await;
}

/// M1: two identities of one tenant, one limited to `offline-code`. The
/// other's `persistent-code` lease, its job and its PTY are refused to the
/// limited one (403 `profile_denied`, recorded) for every operation, and
/// left out of its list; a runtime the identity may not use likewise
/// (`runtime_denied`). The lease's owner is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_is_used_only_within_the_identitys_own_profiles_and_runtimes() {
    let s = Server::start().await;
    let owner = s.token(&["--tenant", "acme", "--subject", "owner"]);
    let offline = s.token(&[
        "--tenant",
        "acme",
        "--subject",
        "limited",
        "--profile",
        "offline-code",
    ]);
    let other_runtime = s.token(&[
        "--tenant",
        "acme",
        "--subject",
        "hermes-only",
        "--runtime",
        "hermes",
    ]);
    let (st, v) = s
        .post(
            &owner,
            "/v1/leases/acquire",
            json!({"runtime": "mcp", "session_key": "net", "profile": "persistent-code"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let lease = v["lease_ref"].as_str().unwrap().to_string();
    let (st, v) = s
        .post(
            &owner,
            &format!("/v1/leases/{lease}/jobs"),
            json!({"command": "sleep 30"}),
        )
        .await;
    assert_eq!(st, StatusCode::ACCEPTED, "{v}");
    let job = v["job_ref"].as_str().unwrap().to_string();
    let (st, v) = s
        .post(&owner, &format!("/v1/leases/{lease}/ptys"), json!({}))
        .await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let pty = v["pty_ref"].as_str().unwrap().to_string();

    let (st, v) = s.get(&offline, "/v1/leases").await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert!(
        v["leases"].as_array().unwrap().is_empty(),
        "the limited identity lists no lease of another profile: {v}"
    );
    let (_, v) = s.get(&owner, "/v1/leases").await;
    assert_eq!(v["leases"].as_array().unwrap().len(), 1, "{v}");

    let lp = |p: &str| format!("/v1/leases/{lease}/{p}");
    let calls: Vec<(&str, String, Value)> = vec![
        ("GET", lp("status"), Value::Null),
        ("POST", lp("exec"), json!({"command": "echo in"})),
        ("POST", lp("read"), json!({"path": "/workspace/x"})),
        (
            "POST",
            lp("write"),
            json!({"path": "/workspace/x", "content": "planted"}),
        ),
        ("POST", lp("list"), json!({"path": "/workspace"})),
        ("POST", lp("jobs"), json!({"command": "echo in"})),
        ("POST", lp("ptys"), json!({})),
        ("POST", lp("renew"), json!({})),
        ("GET", format!("/v1/jobs/{job}/status"), Value::Null),
        ("POST", format!("/v1/jobs/{job}/output"), json!({})),
        ("POST", format!("/v1/jobs/{job}/cancel"), json!({})),
        ("GET", format!("/v1/ptys/{pty}/status"), Value::Null),
        (
            "POST",
            format!("/v1/ptys/{pty}/input"),
            json!({"data": "echo in\n"}),
        ),
        ("POST", format!("/v1/ptys/{pty}/kill"), json!({})),
        ("POST", lp("release"), json!({"action": "kill"})),
    ];
    for (token, want) in [
        (&offline, "profile_denied"),
        (&other_runtime, "runtime_denied"),
    ] {
        for (method, path, body) in &calls {
            let (st, v) = if *method == "GET" {
                s.get(token, path).await
            } else {
                s.post(token, path, body.clone()).await
            };
            assert_eq!(
                (st, code(&v)),
                (StatusCode::FORBIDDEN, want),
                "{method} {path}: {v}"
            );
        }
    }
    let refused: Vec<Value> = events(&s)
        .into_iter()
        .filter(|e| e["error_code"] == "profile_denied" && e["lease_ref"] == lease.as_str())
        .collect();
    assert!(
        refused.len() >= calls.len(),
        "each refusal is recorded with the lease: {}",
        refused.len()
    );
    // Nothing happened: the job still runs, the PTY lives, the file was
    // never written, and the owner releases its own lease.
    let (st, v) = s.get(&owner, &format!("/v1/jobs/{job}/status")).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "running", "{v}");
    let (st, v) = s.get(&owner, &format!("/v1/ptys/{pty}/status")).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let (st, v) = s
        .post(
            &owner,
            &lp("exec"),
            json!({"command": "cat /workspace/x 2>&1 || true"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert!(!v["stdout"].as_str().unwrap().contains("planted"), "{v}");
    let (st, v) = s
        .post(&owner, &lp("release"), json!({"action": "kill"}))
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    s.stop().await;
}
