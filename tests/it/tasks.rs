//! Trusted tasks (plan → approve → submit → status → result → receipt) and
//! checkpoint forks, against the real server with real sandboxes.

use std::time::Duration;

use cube_adapter::clock::ManualClock;
use cube_adapter::config::{Config, TaskTemplate};
use reqwest::StatusCode;
use serde_json::{Value, json};
use sha2::Digest;

use crate::kit::{BIN, Server, code};

/// The task templates the tests use, in the configuration's shape.
pub fn templates() -> Value {
    json!({
        // Counts the words of `text`; writes a JSON summary (exposed) and the
        // text itself (digest only); an optional output it never writes.
        "word-count": {
            "description": "Count the words of a text.",
            "profile": "trusted",
            "parameters": {
                "type": "object", "additionalProperties": false,
                "required": ["text", "repeat"],
                "properties": {
                    "text": {"type": "string", "maxLength": 200},
                    "repeat": {"type": "integer", "minimum": 1, "maximum": 5},
                },
            },
            "command": {"argv": [
                "/bin/sh", "-c",
                "printf '%s\\n' \"$1\" > echo.txt; printf '{\"words\": %s, \"repeat\": %s}' \"$(printf '%s' \"$1\" | wc -w)\" \"$2\" > /workspace/summary.json",
                "task", "${text}", "${repeat}",
            ], "cwd": "/workspace"},
            "outputs": [
                {"name": "summary", "path": "/workspace/summary.json", "format": "json",
                 "schema": {"type": "object", "required": ["words"], "properties": {"words": {"type": "integer"}}}},
                {"name": "echo", "path": "/workspace/echo.txt", "format": "text", "expose": "digest"},
                {"name": "extra", "path": "/workspace/never.txt", "format": "text", "required": false},
            ],
        },
        // Runs for a while; no approval needed.
        "sleeper": {
            "description": "Sleep.",
            "profile": "trusted",
            "approval_required": false,
            "parameters": {"type": "object", "additionalProperties": false,
                           "properties": {"secs": {"type": "integer", "minimum": 1, "maximum": 60}}},
            "command": {"argv": ["sleep", "${secs}"]},
        },
        // Writes an output that does not match its schema.
        "bad-output": {
            "description": "Writes a wrong summary.",
            "profile": "trusted",
            "approval_required": false,
            "parameters": {"type": "object", "additionalProperties": false, "properties": {}},
            "command": {"argv": ["/bin/sh", "-c", "echo '{\"words\": \"many\"}' > /workspace/summary.json"]},
            "outputs": [{"name": "summary", "path": "/workspace/summary.json",
                         "schema": {"type": "object", "properties": {"words": {"type": "integer"}}}}],
        },
        // Its profile lets an admin approve their own plan.
        "admin-ok": {
            "description": "An admin's own chore.",
            "profile": "trusted-self",
            "parameters": {"type": "object", "additionalProperties": false, "properties": {}},
            "command": {"argv": ["true"]},
        },
        // Expires fast.
        "short-lived": {
            "description": "A plan that expires in a second.",
            "profile": "trusted",
            "plan_ttl_seconds": 1,
            "parameters": {"type": "object", "additionalProperties": false, "properties": {}},
            "command": {"argv": ["true"]},
        },
    })
}

pub fn configure(c: &mut Config) {
    let trusted = cube_adapter::config::Profile {
        allowed_runtimes: vec!["mcp".into()],
        max_active_leases_per_tenant: 4,
        ..Default::default()
    };
    let trusted_self = cube_adapter::config::Profile {
        admin_self_approval: true,
        ..trusted.clone()
    };
    c.profiles.insert("trusted".into(), trusted);
    c.profiles.insert("trusted-self".into(), trusted_self);
    c.tasks =
        serde_json::from_value::<std::collections::BTreeMap<String, TaskTemplate>>(templates())
            .unwrap();
    c.validate().unwrap();
}

async fn wait_ended(s: &Server, token: &str, task: &str) -> Value {
    for _ in 0..300 {
        let (st, v) = s.get(token, &format!("/v1/tasks/{task}/status")).await;
        assert_eq!(st, StatusCode::OK, "{v}");
        if v["execution_ended"] == true {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("task {task} did not end");
}

fn verify_receipt(args: &[&str], receipt: &Value, dir: &std::path::Path) -> (i32, Value) {
    let f = dir.join("receipt.json");
    std::fs::write(&f, receipt.to_string()).unwrap();
    let out = std::process::Command::new(BIN)
        .args(["receipt", "verify"])
        .arg(&f)
        .args(args)
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (out.status.code().unwrap_or(-1), v)
}

/// The whole flow with separate identities: an agent plans, an approver of
/// its tenant approves (nobody approves their own plan, admins included),
/// the agent submits and finalizes; outputs are validated, the sandbox is
/// gone, and the receipt verifies offline with the public key and fails
/// once changed. The agent never reaches the task's sandbox, and no raw
/// parameter reaches the receipt or the audit journal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trusted_task_from_plan_to_verified_receipt() {
    let s = Server::start_with(configure).await;
    let alice = s.token(&[
        "--tenant",
        "acme",
        "--subject",
        "alice",
        "--action",
        "task:*",
        "--action",
        "lease:*",
        "--action",
        "exec:run",
    ]);
    let carol = s.token(&[
        "--tenant",
        "acme",
        "--subject",
        "carol",
        "--action",
        "task:*",
    ]);
    let bob = s.token(&[
        "--tenant",
        "acme",
        "--subject",
        "bob",
        "--role",
        "approver",
        "--action",
        "task:approve",
        "--action",
        "task:status",
        "--action",
        "task:receipt",
    ]);
    let dave = s.token(&[
        "--tenant",
        "acme",
        "--subject",
        "dave",
        "--role",
        "agent",
        "--role",
        "approver",
        "--action",
        "task:*",
    ]);
    let eve = s.token(&[
        "--tenant",
        "other",
        "--subject",
        "eve",
        "--role",
        "approver",
        "--action",
        "task:*",
    ]);
    let narrow = s.token(&[
        "--tenant",
        "acme",
        "--subject",
        "nina",
        "--action",
        "task:*",
        "--task-template",
        "sleeper",
    ]);

    // The contract: no output paths or sizes.
    let (st, v) = s.get(&alice, "/v1/task-templates").await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let wc = v["task_templates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "word-count")
        .unwrap()
        .clone();
    assert!(wc["template_sha256"].as_str().unwrap().len() == 64);
    assert!(wc["outputs"][0].get("path").is_none() && wc["outputs"][0].get("max_bytes").is_none());
    let (_, v) = s.get(&narrow, "/v1/task-templates").await;
    assert_eq!(v["task_templates"].as_array().unwrap().len(), 1, "{v}");
    let (st, v) = s
        .post(
            &narrow,
            "/v1/tasks/plan",
            json!({"template": "word-count", "parameters": {}}),
        )
        .await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::FORBIDDEN, "task_template_denied")
    );

    // Parameters are checked; an error names where, never the value.
    let secret = "SECRET-TEXT-4711 the quick brown fox";
    for (params, at) in [
        (json!({"text": secret, "repeat": 9}), "repeat"),
        (json!({"text": secret, "repeat": 1, "more": 1}), "$"),
        (json!({"repeat": 1}), "$"),
    ] {
        let (st, v) = s
            .post(
                &alice,
                "/v1/tasks/plan",
                json!({"template": "word-count", "parameters": params}),
            )
            .await;
        assert_eq!(
            (st, code(&v)),
            (StatusCode::BAD_REQUEST, "invalid_parameters"),
            "{v}"
        );
        let m = v["error"]["message"].as_str().unwrap();
        assert!(
            m.ends_with(&format!("at {at}")) && !m.contains("SECRET"),
            "{m}"
        );
    }
    let (st, v) = s
        .post(
            &alice,
            "/v1/tasks/plan",
            json!({"template": "no-such", "parameters": {}}),
        )
        .await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::FORBIDDEN, "task_template_denied")
    );
    let (st, v) = s
        .post(
            &alice,
            "/v1/tasks/plan",
            json!({"template": "word-count", "parameters": [1]}),
        )
        .await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::BAD_REQUEST, "invalid_parameters")
    );

    let params = json!({"text": secret, "repeat": 2});
    let (st, plan) = s
        .post(
            &alice,
            "/v1/tasks/plan",
            json!({"template": "word-count", "parameters": params}),
        )
        .await;
    assert_eq!(st, StatusCode::CREATED, "{plan}");
    assert_eq!(plan["state"], "pending_approval");
    assert!(
        plan.get("parameters").is_none(),
        "parameters are not echoed"
    );
    assert_eq!(plan["template_sha256"], wc["template_sha256"]);
    let pr = plan["plan_ref"].as_str().unwrap().to_string();
    let expect_cmd = format!(
        "/bin/sh -c '{}' task '{secret}' 2",
        wc_script().replace('\'', "'\"'\"'")
    );
    assert_eq!(
        plan["command_sha256"],
        hex::encode(sha2::Sha256::digest(expect_cmd.as_bytes())),
        "the command is rendered with shell quoting, as the reference does"
    );

    // Not yet approved; agents cannot approve; other tenants see nothing.
    let (st, v) = s
        .post(&alice, &format!("/v1/task-plans/{pr}/submit"), json!({}))
        .await;
    assert_eq!((st, code(&v)), (StatusCode::CONFLICT, "plan_not_approved"));
    let (st, v) = s
        .post(&alice, &format!("/v1/task-plans/{pr}/approve"), json!({}))
        .await;
    assert_eq!((st, code(&v)), (StatusCode::FORBIDDEN, "approver_required"));
    let (st, v) = s
        .post(&eve, &format!("/v1/task-plans/{pr}/approve"), json!({}))
        .await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::NOT_FOUND, "task_plan_not_found")
    );
    let (st, v) = s
        .post(
            &bob,
            &format!("/v1/task-plans/{pr}/approve"),
            json!({"decision": "maybe"}),
        )
        .await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::BAD_REQUEST, "invalid_decision")
    );

    // Review: approvers see the parameters, the requester does not, others nothing.
    let (st, v) = s.get(&bob, &format!("/v1/task-plans/{pr}")).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["parameters"], params);
    assert_eq!(v["contract"]["name"], "word-count");
    let (st, v) = s.get(&alice, &format!("/v1/task-plans/{pr}")).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert!(v.get("parameters").is_none());
    let (st, _) = s.get(&carol, &format!("/v1/task-plans/{pr}")).await;
    assert_eq!(st, StatusCode::NOT_FOUND);

    // Nobody approves their own plan: an approver who plans, nor an admin.
    for who in [&dave, &s.admin] {
        let (st, own) = s
            .post(
                who,
                "/v1/tasks/plan",
                json!({"template": "word-count", "parameters": {"text": "x", "repeat": 1}}),
            )
            .await;
        assert_eq!(st, StatusCode::CREATED, "{own}");
        let own = own["plan_ref"].as_str().unwrap();
        let (st, v) = s
            .post(who, &format!("/v1/task-plans/{own}/approve"), json!({}))
            .await;
        assert_eq!(
            (st, code(&v)),
            (StatusCode::FORBIDDEN, "self_approval_denied"),
            "{v}"
        );
    }
    // Unless the template's profile lets admins (and only admins).
    let (_, own) = s
        .post(
            &s.admin,
            "/v1/tasks/plan",
            json!({"template": "admin-ok", "parameters": {}}),
        )
        .await;
    let own_ref = own["plan_ref"].as_str().unwrap();
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/task-plans/{own_ref}/approve"),
            json!({}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let (_, own) = s
        .post(
            &dave,
            "/v1/tasks/plan",
            json!({"template": "admin-ok", "parameters": {}}),
        )
        .await;
    let own_ref = own["plan_ref"].as_str().unwrap();
    let (st, v) = s
        .post(
            &dave,
            &format!("/v1/task-plans/{own_ref}/approve"),
            json!({}),
        )
        .await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::FORBIDDEN, "self_approval_denied")
    );

    // Bob approves; a second decision is refused.
    let (st, v) = s
        .post(
            &bob,
            &format!("/v1/task-plans/{pr}/approve"),
            json!({"reason": "ticket OPS-1"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "approved");
    let (st, v) = s
        .post(
            &bob,
            &format!("/v1/task-plans/{pr}/approve"),
            json!({"decision": "deny"}),
        )
        .await;
    assert_eq!((st, code(&v)), (StatusCode::CONFLICT, "plan_not_pending"));

    // Only the requester submits; submitting again gives the same task.
    let (st, _) = s
        .post(&carol, &format!("/v1/task-plans/{pr}/submit"), json!({}))
        .await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    let (st, task) = s
        .post(&alice, &format!("/v1/task-plans/{pr}/submit"), json!({}))
        .await;
    assert_eq!(st, StatusCode::ACCEPTED, "{task}");
    let tr = task["task_ref"].as_str().unwrap().to_string();
    let (st, again) = s
        .post(&alice, &format!("/v1/task-plans/{pr}/submit"), json!({}))
        .await;
    assert_eq!(st, StatusCode::ACCEPTED);
    assert_eq!(again["task_ref"], tr.as_str());

    // The task's sandbox is nobody's to touch: not listed for the agent,
    // not reachable by the agent or an admin through /v1.
    let (_, v) = s.get(&alice, "/v1/leases").await;
    assert_eq!(v["leases"].as_array().unwrap().len(), 0, "{v}");
    let (_, v) = s.get(&s.admin, "/v1/leases").await;
    let task_lease = v["leases"][0]["lease_ref"].as_str().unwrap().to_string();
    for who in [&alice, &s.admin] {
        let (st, v) = s
            .post(
                who,
                &format!("/v1/leases/{task_lease}/exec"),
                json!({"command": "echo tamper > /workspace/summary.json"}),
            )
            .await;
        assert_eq!((st, code(&v)), (StatusCode::NOT_FOUND, "lease_not_found"));
    }
    // Its session is in a domain of its own: the reference's session key
    // gives the agent a lease of its own, never the task's.
    let (st, v) = s.post(&alice, "/v1/leases/acquire", json!({"runtime": "mcp", "session_key": format!("trusted-task:{tr}"), "profile": "trusted"})).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let own = v["lease_ref"].as_str().unwrap().to_string();
    assert_ne!(own, task_lease, "the task's session cannot be taken over");
    let (st, _) = s
        .post(
            &alice,
            &format!("/v1/leases/{own}/release"),
            json!({"action": "kill"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK);

    let ended = wait_ended(&s, &alice, &tr).await;
    assert_eq!(ended["state"], "succeeded", "{ended}");
    // Approvers of the tenant may follow it; others may not.
    let (st, _) = s.get(&bob, &format!("/v1/tasks/{tr}/status")).await;
    assert_eq!(st, StatusCode::OK);
    let (st, _) = s.get(&carol, &format!("/v1/tasks/{tr}/status")).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    let (st, v) = s.get(&alice, &format!("/v1/tasks/{tr}/receipt")).await;
    assert_eq!((st, code(&v)), (StatusCode::CONFLICT, "receipt_not_ready"));

    let (st, res) = s
        .post(&alice, &format!("/v1/tasks/{tr}/result"), json!({}))
        .await;
    assert_eq!(st, StatusCode::OK, "{res}");
    let r = &res["result"];
    assert_eq!(res["state"], "succeeded", "{res}");
    assert_eq!(r["output_validation"], "ok");
    assert_eq!(r["cleanup"], "verified");
    assert_eq!(r["outputs"]["summary"]["words"], 5, "{r}");
    assert_eq!(r["outputs"]["summary"]["repeat"], 2);
    assert!(
        r["outputs"].get("echo").is_none(),
        "digest-only outputs are not returned"
    );
    let ev: Vec<&Value> = r["output_evidence"].as_array().unwrap().iter().collect();
    let echo = ev.iter().find(|e| e["name"] == "echo").unwrap();
    assert_eq!(
        echo["sha256"],
        hex::encode(sha2::Sha256::digest(format!("{secret}\n").as_bytes()))
    );
    assert_eq!(echo["exposed"], false);
    let extra = ev.iter().find(|e| e["name"] == "extra").unwrap();
    assert_eq!(
        (extra["present"].clone(), extra["required"].clone()),
        (json!(false), json!(false))
    );
    let (_, v) = s.get(&s.admin, "/v1/leases").await;
    assert_eq!(
        v["leases"].as_array().unwrap().len(),
        0,
        "the task's sandbox is gone: {v}"
    );

    // Idempotent; the receipt endpoint gives the same receipt, to the
    // approver too.
    let (_, res2) = s
        .post(&alice, &format!("/v1/tasks/{tr}/result"), json!({}))
        .await;
    assert_eq!(res2["receipt"], res["receipt"]);
    let (st, rc) = s.get(&bob, &format!("/v1/tasks/{tr}/receipt")).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(rc["receipt"], res["receipt"]);
    let receipt = res["receipt"].clone();
    // The HS256 value is what the reference's Python computes (json.dumps
    // with sorted keys and no spaces, HMAC-SHA256, unpadded base64url).
    let key = cube_adapter::broker::receipts::derived_hs_key(
        &std::fs::read(s.state.join("hmac.key")).unwrap(),
    );
    let rf = s.dir.path().join("golden.json");
    std::fs::write(&rf, receipt.to_string()).unwrap();
    let py = std::process::Command::new("python3")
        .args([
            "-c",
            "import json,hmac,hashlib,base64,sys\n\
             d=json.load(open(sys.argv[1]))\n\
             m=json.dumps(d['payload'],sort_keys=True,separators=(',',':'),ensure_ascii=False).encode()\n\
             k=bytes.fromhex(sys.argv[2])\n\
             print(base64.urlsafe_b64encode(hmac.new(k,m,hashlib.sha256).digest()).rstrip(b'=').decode())",
        ])
        .arg(&rf)
        .arg(hex::encode(&key))
        .output()
        .expect("python3 is needed (Debian's python3 package)");
    assert!(
        py.status.success(),
        "{}",
        String::from_utf8_lossy(&py.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&py.stdout).trim(),
        receipt["signature"]["value"].as_str().unwrap()
    );
    let p = &receipt["payload"];
    assert_eq!(p["task_ref"], tr.as_str());
    assert_eq!(p["state"], "succeeded");
    assert_eq!(p["template_sha256"], wc["template_sha256"]);
    assert!(p["approver_hash"].is_string() && p["approver_hash"] != p["requester_hash"]);
    // The task's job was recorded; the receipt names its sealed recording.
    let recs = p["recordings"]
        .as_array()
        .expect("the receipt names recordings");
    assert_eq!(recs.len(), 1, "{p}");
    let sealed = s.events("recording_sealed");
    assert!(
        sealed
            .iter()
            .any(|e| e["recording_ref"] == recs[0]["recording_ref"]
                && e["content_sha256"] == recs[0]["sha256"]),
        "{recs:?}"
    );
    assert_eq!(receipt["signature"]["alg"], "HS256");
    let text = receipt.to_string();
    assert!(
        !text.contains("SECRET") && !text.contains("summary.json"),
        "{text}"
    );

    // Offline verification: with the state directory (both signatures), and
    // with only the public key as served by the appliance.
    let empty = s.empty_config();
    let (rc, v) = verify_receipt(
        &[
            "--state-dir",
            s.state.to_str().unwrap(),
            "--config",
            empty.to_str().unwrap(),
        ],
        &res,
        s.dir.path(),
    );
    assert_eq!(rc, 0, "{v}");
    assert_eq!(
        (v["valid"].clone(), v["ed25519"].clone(), v["hs256"].clone()),
        (json!(true), json!(true), json!(true))
    );
    let (_, pk) = s.get(&bob, "/v1/receipts/public-key").await;
    let pk_file = s.dir.path().join("pk.json");
    std::fs::write(&pk_file, pk.to_string()).unwrap();
    let (rc, v) = verify_receipt(
        &["--public-key", pk_file.to_str().unwrap()],
        &receipt,
        s.dir.path(),
    );
    assert_eq!(
        (rc, v["valid"].clone(), v["hs256"].clone()),
        (0, json!(true), Value::Null),
        "{v}"
    );
    let mut forged = receipt.clone();
    forged["payload"]["outputs"][0]["sha256"] = json!("00");
    let (rc, v) = verify_receipt(
        &["--public-key", pk_file.to_str().unwrap()],
        &forged,
        s.dir.path(),
    );
    assert_eq!((rc, v["valid"].clone()), (1, json!(false)), "{v}");
    let (rc, _) = verify_receipt(&[], &receipt, s.dir.path());
    assert_eq!(rc, 2, "a verification needs a key");

    // The journal has the decisions and nothing of the parameters.
    let audit = s.journal();
    for action in ["task_plan", "task_approve", "task_submit", "task_finalize"] {
        assert!(
            audit.contains(&format!("\"action\":\"{action}\"")),
            "{action}"
        );
    }
    assert!(
        !audit.contains("SECRET") && !audit.contains("quick brown"),
        "parameters stay out of the journal"
    );
    s.stop().await;
}

fn wc_script() -> String {
    templates()["word-count"]["command"]["argv"][2]
        .as_str()
        .unwrap()
        .to_string()
}

/// Cancel, deny, expiry, a failed output validation, and a plan that needs
/// no approval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trusted_task_cancel_deny_expire_and_bad_outputs() {
    let clock = ManualClock::starting_now();
    let s = Server::start_with(|c| {
        configure(c);
        c.clock = clock.clone().into();
    })
    .await;
    let alice = s.token(&[
        "--tenant",
        "acme",
        "--subject",
        "alice",
        "--action",
        "task:*",
    ]);
    let bob = s.token(&[
        "--tenant",
        "acme",
        "--subject",
        "bob",
        "--role",
        "approver",
        "--action",
        "task:approve",
    ]);

    // No approval needed: ready at once; cancel ends it and signs.
    let (st, plan) = s
        .post(
            &alice,
            "/v1/tasks/plan",
            json!({"template": "sleeper", "parameters": {"secs": 60}}),
        )
        .await;
    assert_eq!(st, StatusCode::CREATED, "{plan}");
    assert_eq!(plan["state"], "ready");
    let pr = plan["plan_ref"].as_str().unwrap();
    let (st, task) = s
        .post(&alice, &format!("/v1/task-plans/{pr}/submit"), json!({}))
        .await;
    assert_eq!(st, StatusCode::ACCEPTED, "{task}");
    let tr = task["task_ref"].as_str().unwrap();
    assert_eq!(task["state"], "running");
    let (st, v) = s
        .post(&alice, &format!("/v1/tasks/{tr}/result"), json!({}))
        .await;
    assert_eq!((st, code(&v)), (StatusCode::CONFLICT, "task_running"));
    let (st, v) = s
        .post(&alice, &format!("/v1/tasks/{tr}/cancel"), json!({}))
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "cancelled", "{v}");
    assert_eq!(v["cleanup"], "verified");
    assert_eq!(v["receipt"]["payload"]["state"], "cancelled");
    assert!(v["receipt"]["payload"]["approver_hash"].is_null());

    // Denied: never runs.
    let (_, plan) = s
        .post(
            &alice,
            "/v1/tasks/plan",
            json!({"template": "word-count", "parameters": {"text": "a", "repeat": 1}}),
        )
        .await;
    let pr = plan["plan_ref"].as_str().unwrap();
    let (st, v) = s
        .post(
            &bob,
            &format!("/v1/task-plans/{pr}/approve"),
            json!({"decision": "deny", "reason": "not today"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "denied");
    let (st, v) = s
        .post(&alice, &format!("/v1/task-plans/{pr}/submit"), json!({}))
        .await;
    assert_eq!((st, code(&v)), (StatusCode::CONFLICT, "plan_not_approved"));

    // Expired.
    let (_, plan) = s
        .post(
            &alice,
            "/v1/tasks/plan",
            json!({"template": "short-lived", "parameters": {}}),
        )
        .await;
    let pr = plan["plan_ref"].as_str().unwrap();
    clock.advance(time::Duration::milliseconds(2100));
    let (st, v) = s
        .post(&bob, &format!("/v1/task-plans/{pr}/approve"), json!({}))
        .await;
    assert_eq!((st, code(&v)), (StatusCode::CONFLICT, "plan_expired"));
    let (st, v) = s
        .post(&alice, &format!("/v1/task-plans/{pr}/submit"), json!({}))
        .await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::CONFLICT, "plan_expired"),
        "{v}"
    );

    // An output that does not match its schema: the task fails validation,
    // still with a receipt saying so.
    let (_, plan) = s
        .post(
            &alice,
            "/v1/tasks/plan",
            json!({"template": "bad-output", "parameters": {}}),
        )
        .await;
    let pr = plan["plan_ref"].as_str().unwrap();
    let (_, task) = s
        .post(&alice, &format!("/v1/task-plans/{pr}/submit"), json!({}))
        .await;
    let tr = task["task_ref"].as_str().unwrap();
    wait_ended(&s, &alice, tr).await;
    let (st, v) = s
        .post(&alice, &format!("/v1/tasks/{tr}/result"), json!({}))
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "output_validation_failed", "{v}");
    assert_eq!(v["result"]["execution_state"], "succeeded");
    assert_eq!(
        v["result"]["output_evidence"][0]["error"],
        "schema_mismatch"
    );
    assert!(v["result"]["outputs"].as_object().unwrap().is_empty());
    assert_eq!(v["receipt"]["payload"]["state"], "output_validation_failed");
    s.stop().await;
}

/// A template that changes after a plan was made: the plan is refused, and
/// the change is seen across a restart of a real `serve` process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_template_invalidates_its_plans() {
    let (rig, p) = crate::kit::ProcRig::start();
    let write_config = |argv: &str| {
        std::fs::write(
            &rig.config,
            format!(
                "[profiles.trusted]\nallowed_runtimes = [\"mcp\"]\n\n[tasks.hello]\ndescription = \"Say hello\"\nprofile = \"trusted\"\n[tasks.hello.parameters]\ntype = \"object\"\nadditionalProperties = false\n[tasks.hello.command]\nargv = {argv}\n"
            ),
        )
        .unwrap();
    };
    write_config(r#"["echo", "hello"]"#);
    let p = rig.kill_and_restart(p);
    let alice = token(
        &rig,
        &[
            "--tenant",
            "acme",
            "--subject",
            "alice",
            "--action",
            "task:*",
        ],
    );
    let bob = token(
        &rig,
        &[
            "--tenant",
            "acme",
            "--subject",
            "bob",
            "--role",
            "approver",
            "--action",
            "task:approve",
        ],
    );
    let (st, plan) = call(
        &rig,
        &p,
        &alice,
        "/v1/tasks/plan",
        json!({"template": "hello", "parameters": {}}),
    )
    .await;
    assert_eq!(st, StatusCode::CREATED, "{plan}");
    let pr = plan["plan_ref"].as_str().unwrap().to_string();
    write_config(r#"["echo", "goodbye"]"#);
    let p = rig.kill_and_restart(p);
    let (st, v) = call(
        &rig,
        &p,
        &bob,
        &format!("/v1/task-plans/{pr}/approve"),
        json!({}),
    )
    .await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::CONFLICT, "task_template_changed"),
        "{v}"
    );
    // The description is not part of the digest.
    let (_, plan) = call(
        &rig,
        &p,
        &alice,
        "/v1/tasks/plan",
        json!({"template": "hello", "parameters": {}}),
    )
    .await;
    let pr = plan["plan_ref"].as_str().unwrap().to_string();
    let text = std::fs::read_to_string(&rig.config)
        .unwrap()
        .replace("Say hello", "Say goodbye");
    std::fs::write(&rig.config, text).unwrap();
    let p = rig.kill_and_restart(p);
    let (st, v) = call(
        &rig,
        &p,
        &bob,
        &format!("/v1/task-plans/{pr}/approve"),
        json!({}),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    // Run it; change the template once it has ended: its result is refused,
    // and a cancel ends it without claiming its outputs were checked.
    let (st, task) = call(
        &rig,
        &p,
        &alice,
        &format!("/v1/task-plans/{pr}/submit"),
        json!({}),
    )
    .await;
    assert_eq!(st, StatusCode::ACCEPTED, "{task}");
    let tr = task["task_ref"].as_str().unwrap().to_string();
    for _ in 0..300 {
        let (_, v) = call(
            &rig,
            &p,
            &alice,
            &format!("/v1/tasks/{tr}/status"),
            json!({}),
        )
        .await;
        if v["execution_ended"] == true {
            assert_eq!(v["state"], "succeeded", "{v}");
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    write_config(r#"["echo", "changed"]"#);
    let p = rig.kill_and_restart(p);
    let (st, v) = call(
        &rig,
        &p,
        &alice,
        &format!("/v1/tasks/{tr}/result"),
        json!({}),
    )
    .await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::CONFLICT, "task_template_changed"),
        "{v}"
    );
    let (st, v) = call(
        &rig,
        &p,
        &alice,
        &format!("/v1/tasks/{tr}/cancel"),
        json!({}),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "output_validation_failed", "{v}");
    assert_eq!(v["result"]["output_validation"], "skipped");
    assert_eq!(v["result"]["cleanup"], "verified");
    // A changed profile changes what runs: its plans are refused too.
    let (_, plan) = call(
        &rig,
        &p,
        &alice,
        "/v1/tasks/plan",
        json!({"template": "hello", "parameters": {}}),
    )
    .await;
    let pr = plan["plan_ref"].as_str().unwrap().to_string();
    let text = std::fs::read_to_string(&rig.config).unwrap().replace(
        "allowed_runtimes = [\"mcp\"]\n",
        "allowed_runtimes = [\"mcp\"]\nmax_command_seconds = 77\n",
    );
    std::fs::write(&rig.config, text).unwrap();
    let p = rig.kill_and_restart(p);
    let (st, v) = call(
        &rig,
        &p,
        &bob,
        &format!("/v1/task-plans/{pr}/approve"),
        json!({}),
    )
    .await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::CONFLICT, "task_template_changed"),
        "{v}"
    );
    // A template that cannot be used safely stops the start, with the reason.
    write_config(r#"["echo", "--name=${name}:${name}"]"#);
    let mut p = p;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(p.child.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    p.child.wait().unwrap();
    let e = crate::kit::Proc::start(&rig.state, &rig.config, &[])
        .err()
        .unwrap();
    assert!(e.contains("at most one placeholder"), "{e}");
}

fn token(rig: &crate::kit::ProcRig, args: &[&str]) -> String {
    let out = std::process::Command::new(BIN)
        .args(["token", "create", "--state-dir"])
        .arg(&rig.state)
        .arg("--config")
        .arg(&rig.config)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

async fn call(
    rig: &crate::kit::ProcRig,
    p: &crate::kit::Proc,
    token: &str,
    path: &str,
    body: Value,
) -> (StatusCode, Value) {
    rig.call_as(token, format!("{}{path}", p.url), Some(body))
        .await
}

/// Fork (row 32): a new lease from a checkpoint, independent of its source,
/// idempotent per branch, gated by the profile, counted in the quota.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forks_start_from_a_checkpoint_and_are_idempotent_per_branch() {
    let s = Server::start_with(|c| {
        c.profiles
            .get_mut("checkpoint-code")
            .unwrap()
            .max_active_leases_per_tenant = 4;
    })
    .await;
    let t = s.token(&["--tenant", "forks"]);
    let (_, v) = s
        .post(
            &t,
            "/v1/leases/acquire",
            json!({"runtime": "mcp", "session_key": "src", "profile": "checkpoint-code"}),
        )
        .await;
    let src = v["lease_ref"].as_str().unwrap().to_string();
    let write = |lease: String, content: &'static str| {
        let (s, t) = (&s, t.clone());
        async move {
            let (st, v) = s
                .post(
                    &t,
                    &format!("/v1/leases/{lease}/write"),
                    json!({"path": "/workspace/f.txt", "content": content}),
                )
                .await;
            assert_eq!(st, StatusCode::OK, "{v}");
        }
    };
    let read = |lease: String| {
        let (s, t) = (&s, t.clone());
        async move {
            let (_, v) = s
                .post(
                    &t,
                    &format!("/v1/leases/{lease}/read"),
                    json!({"path": "/workspace/f.txt"}),
                )
                .await;
            v["content"].as_str().unwrap_or("").to_string()
        }
    };
    write(src.clone(), "at checkpoint").await;
    let (st, c) = s
        .post(&t, &format!("/v1/leases/{src}/checkpoints"), json!({}))
        .await;
    assert_eq!(st, StatusCode::CREATED, "{c}");
    let ckpt = c["checkpoint_ref"].as_str().unwrap().to_string();
    assert!(
        ckpt.starts_with("checkpoint_"),
        "the reference's prefix: {ckpt}"
    );
    write(src.clone(), "after").await;

    let fork_path = format!("/v1/leases/{src}/checkpoints/{ckpt}/fork");
    let (st, f) = s.post(&t, &fork_path, json!({"branch": "try-a"})).await;
    assert_eq!(st, StatusCode::CREATED, "{f}");
    assert_eq!(
        (f["reused"].clone(), f["checkpoint_ref"].clone()),
        (json!(false), json!(ckpt))
    );
    assert_eq!(f["profile"], "checkpoint-code");
    let fork = f["lease_ref"].as_str().unwrap().to_string();
    assert_ne!(fork, src);
    assert_eq!(read(fork.clone()).await, "at checkpoint");
    write(fork.clone(), "fork's own").await;
    assert_eq!(read(src.clone()).await, "after", "the source is untouched");

    let (st, again) = s.post(&t, &fork_path, json!({"branch": "try-a"})).await;
    assert_eq!(st, StatusCode::CREATED);
    assert_eq!(
        (again["lease_ref"].clone(), again["reused"].clone()),
        (json!(fork), json!(true))
    );
    let (_, other) = s.post(&t, &fork_path, json!({})).await;
    assert_ne!(other["lease_ref"], json!(fork), "no branch: a new fork");
    // A branch belongs to the checkpoint it forked.
    let (_, c2) = s
        .post(&t, &format!("/v1/leases/{src}/checkpoints"), json!({}))
        .await;
    let ckpt2 = c2["checkpoint_ref"].as_str().unwrap();
    let (st, v) = s
        .post(
            &t,
            &format!("/v1/leases/{src}/checkpoints/{ckpt2}/fork"),
            json!({"branch": "try-a"}),
        )
        .await;
    assert_eq!((st, code(&v)), (StatusCode::CONFLICT, "fork_conflict"));
    // Quota: 3 leases now, limit 4.
    let (st, _) = s.post(&t, &fork_path, json!({"branch": "try-c"})).await;
    assert_eq!(st, StatusCode::CREATED);
    let (st, v) = s.post(&t, &fork_path, json!({"branch": "try-d"})).await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::TOO_MANY_REQUESTS, "lease_quota_exceeded")
    );

    let (st, v) = s
        .post(&t, &fork_path, json!({"branch": "x".repeat(129)}))
        .await;
    assert_eq!((st, code(&v)), (StatusCode::BAD_REQUEST, "invalid_branch"));
    let other_tenant = s.token(&["--tenant", "elsewhere"]);
    let (st, _) = s.post(&other_tenant, &fork_path, json!({})).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    // Releasing the fork leaves the source and its checkpoint.
    let (st, _) = s
        .post(
            &t,
            &format!("/v1/leases/{fork}/release"),
            json!({"action": "kill"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(read(src.clone()).await, "after");
    let (_, v) = s.get(&t, &format!("/v1/leases/{src}/checkpoints")).await;
    assert_eq!(v["checkpoints"].as_array().unwrap().len(), 2);
    // A profile without checkpoints forks nothing.
    let (_, v) = s
        .post(
            &t,
            "/v1/leases/acquire",
            json!({"runtime": "mcp", "session_key": "plain", "profile": "offline-code"}),
        )
        .await;
    let plain = v["lease_ref"].as_str().unwrap().to_string();
    let (st, v) = s
        .post(
            &t,
            &format!("/v1/leases/{plain}/checkpoints/{ckpt}/fork"),
            json!({}),
        )
        .await;
    assert_eq!((st, code(&v)), (StatusCode::FORBIDDEN, "checkpoint_denied"));
    s.stop().await;
}

/// The template in `docs/tasks.md` is a valid configuration, and the
/// mistake the page warns about is refused with the reason it gives.
#[test]
fn the_documented_template_checks() {
    let doc = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/tasks.md"),
    )
    .unwrap();
    let example = doc
        .split("```toml\n")
        .nth(1)
        .and_then(|r| r.split("```").next())
        .unwrap()
        .to_string();
    let dir = tempfile::tempdir().unwrap();
    let check = |text: &str| {
        let f = dir.path().join("c.toml");
        std::fs::write(&f, text).unwrap();
        std::process::Command::new(BIN)
            .args(["config", "check", "--config"])
            .arg(&f)
            .env_remove("CUBE_ADAPTER_CONFIG")
            .output()
            .unwrap()
    };
    let out = check(&example);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("train-model"));
    // The attached form is fine; two placeholders in one element are not.
    let attached = example.replace(r#""--epochs", "${epochs}""#, r#""--epochs=${epochs}""#);
    assert_ne!(attached, example);
    let out = check(&attached);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bad = example.replace(
        r#""--dataset", "${dataset}""#,
        r#""--run=${dataset}-${epochs}""#,
    );
    assert_ne!(bad, example);
    let out = check(&bad);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("at most one placeholder"));
    // A workspace other leases share is refused for a task's profile
    // (issue #34, M2), naming both.
    let shared = format!(
        "{example}\n[profiles.trusted-training.workspace]\nmode = \"existing-volume\"\nvolume_id = \"datasets\"\nread_only = true\n"
    );
    let out = check(&shared);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("task train-model: profile trusted-training")
            && err.contains("existing-volume"),
        "{err}"
    );
}

/// GC leaves a trusted task's sandbox alone while its command may still
/// run (and a while after, for its result), where an ordinary lease of the
/// same profile, idle as long, is collected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_waits_for_a_trusted_task() {
    let clock = ManualClock::starting_now();
    let s = Server::start_with(|c| {
        configure(c);
        c.clock = clock.clone().into();
        c.gc_interval_seconds = 0;
        let p = c.profiles.get_mut("trusted").unwrap();
        p.lease_idle_ttl_seconds = 1;
        p.max_command_seconds = 60;
    })
    .await;
    let alice = s.token(&[
        "--tenant",
        "acme",
        "--subject",
        "alice",
        "--action",
        "task:*",
    ]);
    let plain = s.token(&["--tenant", "acme", "--subject", "plain"]);
    let (st, v) = s
        .post(
            &plain,
            "/v1/leases/acquire",
            json!({"runtime": "mcp", "session_key": "idle", "profile": "trusted"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let (_, plan) = s
        .post(
            &alice,
            "/v1/tasks/plan",
            json!({"template": "sleeper", "parameters": {"secs": 3}}),
        )
        .await;
    let pr = plan["plan_ref"].as_str().unwrap();
    let (st, task) = s
        .post(&alice, &format!("/v1/task-plans/{pr}/submit"), json!({}))
        .await;
    assert_eq!(st, StatusCode::ACCEPTED, "{task}");
    let tr = task["task_ref"].as_str().unwrap();
    clock.advance(time::Duration::milliseconds(1500));
    let (st, v) = s.post(&s.admin, "/v1/admin/gc", json!({})).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["collected"], 1, "only the ordinary lease: {v}");
    let ended = wait_ended(&s, &alice, tr).await;
    assert_eq!(ended["state"], "succeeded", "{ended}");
    let (st, v) = s
        .post(&alice, &format!("/v1/tasks/{tr}/result"), json!({}))
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["result"]["cleanup"], "verified");
    s.stop().await;
}

/// A trusted task never runs on a workspace volume other leases mount
/// (issue #34, M2): a configuration that gives its profile one is refused
/// at load (`config check` names task and profile); should one be served
/// anyway, the task's lease is refused (403 `profile_denied`) and nothing
/// runs, while an agent's own lease of the profile still works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trusted_tasks_refuse_shared_workspaces() {
    use cube_adapter::config::{Workspace, WorkspaceMode};
    let shared = Workspace {
        mode: WorkspaceMode::PerSessionVolume,
        volume_name: Some("team-shared".into()),
        ..Workspace::default()
    };
    let mut c = Config::default();
    configure(&mut c);
    c.profiles.get_mut("trusted").unwrap().workspace = shared.clone();
    let e = c.validate().unwrap_err().to_string();
    assert!(
        e.contains("profile trusted") && e.contains("team-shared") && e.contains("shared"),
        "{e}"
    );
    // Served without the load's check: the second guard holds.
    let s = Server::start_with(|c| {
        configure(c);
        c.profiles.get_mut("trusted").unwrap().workspace = shared;
    })
    .await;
    let alice = s.token(&[
        "--tenant",
        "acme",
        "--subject",
        "alice",
        "--action",
        "task:*",
    ]);
    let plain = s.token(&["--tenant", "acme", "--subject", "plain"]);
    let (st, v) = s
        .post(
            &plain,
            "/v1/leases/acquire",
            json!({"runtime": "mcp", "session_key": "planter", "profile": "trusted"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "an agent's lease is not a task's: {v}");
    let (st, plan) = s
        .post(
            &alice,
            "/v1/tasks/plan",
            json!({"template": "sleeper", "parameters": {"secs": 1}}),
        )
        .await;
    assert_eq!(st, StatusCode::CREATED, "{plan}");
    let pr = plan["plan_ref"].as_str().unwrap();
    let (st, v) = s
        .post(&alice, &format!("/v1/task-plans/{pr}/submit"), json!({}))
        .await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::FORBIDDEN, "profile_denied"),
        "{v}"
    );
    s.stop().await;
}

/// One identity's open plans are bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_plans_are_bounded_per_identity() {
    let s = Server::start_with(configure).await;
    let a = s.token(&[
        "--tenant",
        "acme",
        "--subject",
        "planner",
        "--action",
        "task:*",
    ]);
    let b = s.token(&[
        "--tenant",
        "acme",
        "--subject",
        "other",
        "--action",
        "task:*",
    ]);
    let body = json!({"template": "sleeper", "parameters": {"secs": 1}});
    for _ in 0..cube_adapter::broker::tasks::MAX_OPEN_PLANS {
        let (st, v) = s.post(&a, "/v1/tasks/plan", body.clone()).await;
        assert_eq!(st, StatusCode::CREATED, "{v}");
    }
    let (st, v) = s.post(&a, "/v1/tasks/plan", body.clone()).await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::TOO_MANY_REQUESTS, "plan_quota_exceeded")
    );
    let (st, _) = s.post(&b, "/v1/tasks/plan", body).await;
    assert_eq!(st, StatusCode::CREATED, "another identity is not affected");
    s.stop().await;
}

/// Plans that never ran go a while after their expiry (GC, with an audit
/// event); plans that ran stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_prunes_plans_that_never_ran() {
    let clock = ManualClock::starting_now();
    let s = Server::start_with(|c| {
        configure(c);
        c.clock = clock.clone().into();
        c.gc_interval_seconds = 0;
        c.plan_retention_seconds = 0;
    })
    .await;
    let alice = s.token(&[
        "--tenant",
        "acme",
        "--subject",
        "alice",
        "--action",
        "task:*",
    ]);
    let (_, plan) = s
        .post(
            &alice,
            "/v1/tasks/plan",
            json!({"template": "short-lived", "parameters": {}}),
        )
        .await;
    let pr = plan["plan_ref"].as_str().unwrap().to_string();
    clock.advance(time::Duration::milliseconds(2100));
    let (st, _) = s.get(&alice, &format!("/v1/task-plans/{pr}")).await;
    assert_eq!(st, StatusCode::CONFLICT, "expired, still there");
    let (st, v) = s.post(&s.admin, "/v1/admin/gc", json!({})).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let (st, v) = s.get(&alice, &format!("/v1/task-plans/{pr}")).await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::NOT_FOUND, "task_plan_not_found")
    );
    assert!(s.journal().contains("\"action\":\"task_plan_pruned\""));
    s.stop().await;
}

/// SIGHUP swaps the policy of a running service: new profiles and task
/// templates apply at once, plans of a changed template are refused, the
/// principals file is re-read (a removed token stops working); a reload
/// that would break a template is refused and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_swaps_profiles_templates_and_principals() {
    let (rig, p) = crate::kit::ProcRig::start();
    let tokens = rig.state.with_file_name("principals.json");
    let (tok_a, tok_b) = (
        "token-a-0123456789abcdefghij",
        "token-b-0123456789abcdefghij",
    );
    let principals = |t: &str| {
        std::fs::write(
            &tokens,
            format!(r#"[{{"token": "{t}", "tenant_id": "acme", "subject": "alice"}}]"#),
        )
        .unwrap();
    };
    principals(tok_a);
    let config = |profiles: &str, argv: &str| {
        std::fs::write(
            &rig.config,
            format!(
                "tokens_file = {:?}\n{profiles}\n[tasks.hello]\ndescription = \"Say hello\"\nprofile = \"alpha\"\napproval_required = false\n[tasks.hello.parameters]\ntype = \"object\"\nadditionalProperties = false\n[tasks.hello.command]\nargv = {argv}\n",
                tokens.to_str().unwrap()
            ),
        )
        .unwrap();
    };
    config(
        "[profiles.alpha]\nallowed_runtimes = [\"mcp\"]\n",
        r#"["echo", "hello"]"#,
    );
    let p = rig.kill_and_restart(p);
    let get = |token: &str, path: &str| {
        let (http, url) = (rig.http.clone(), format!("{}{path}", p.url));
        let token = token.to_string();
        async move {
            let r = http.get(url).bearer_auth(token).send().await.unwrap();
            let st = r.status();
            (st, r.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let names = |v: &Value| -> Vec<String> {
        v["profiles"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|p| p["name"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    };
    let (st, v) = get(tok_a, "/v1/profiles").await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(names(&v), ["alpha"]);
    let (st, plan) = call(
        &rig,
        &p,
        tok_a,
        "/v1/tasks/plan",
        json!({"template": "hello", "parameters": {}}),
    )
    .await;
    assert_eq!(st, StatusCode::CREATED, "{plan}");
    let pr = plan["plan_ref"].as_str().unwrap().to_string();

    config(
        "[profiles.alpha]\nallowed_runtimes = [\"mcp\"]\n[profiles.beta]\n",
        r#"["echo", "goodbye"]"#,
    );
    principals(tok_b);
    let pid = nix::unistd::Pid::from_raw(p.child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).unwrap();
    let mut reloaded = false;
    for _ in 0..300 {
        let (st, v) = get(tok_b, "/v1/profiles").await;
        if st == StatusCode::OK && names(&v).contains(&"beta".to_string()) {
            reloaded = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(reloaded, "the new profile and principal never applied");
    let (st, _) = get(tok_a, "/v1/profiles").await;
    assert_eq!(
        st,
        StatusCode::UNAUTHORIZED,
        "a removed principal stops working"
    );
    let (st, v) = call(
        &rig,
        &p,
        tok_b,
        &format!("/v1/task-plans/{pr}/submit"),
        json!({}),
    )
    .await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::CONFLICT, "task_template_changed"),
        "{v}"
    );

    // A template that cannot be used: refused whole (beta stays, hello runs).
    config(
        "[profiles.alpha]\nallowed_runtimes = [\"mcp\"]\n",
        r#"["echo", "--name=${name}:${name}"]"#,
    );
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).unwrap();
    let cli = rig.state.with_file_name("cli.toml");
    std::fs::write(&cli, "").unwrap();
    let mut refused = false;
    for _ in 0..300 {
        let out = std::process::Command::new(BIN)
            .args(["status", "--json", "--state-dir"])
            .arg(&rig.state)
            .arg("--config")
            .arg(&cli)
            .output()
            .unwrap();
        let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        if v["last_reload"]["ok"] == false {
            assert!(
                v["last_reload"]["error"]
                    .as_str()
                    .unwrap_or("")
                    .contains("at most one placeholder"),
                "{v}"
            );
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(refused);
    let (_, v) = get(tok_b, "/v1/profiles").await;
    assert!(
        names(&v).contains(&"beta".to_string()),
        "nothing changed: {v}"
    );
    let (st, v) = call(
        &rig,
        &p,
        tok_b,
        "/v1/tasks/plan",
        json!({"template": "hello", "parameters": {}}),
    )
    .await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    p.stop();
}

/// People: `cube-adapter user …` makes an approver who signs in with a
/// password (HTTP Basic) and approves a plan; a new password, a disabled or
/// removed user take effect at once; the password is never shown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn users_approve_with_a_password() {
    let s = Server::start_with(configure).await;
    let alice = s.token(&[
        "--tenant",
        "acme",
        "--subject",
        "alice",
        "--action",
        "task:*",
    ]);
    let pw = s.dir.path().join("pw");
    std::fs::write(&pw, "correct horse battery staple\n").unwrap();
    let user = |args: &[&str], stdin: Option<&str>| {
        use std::io::Write;
        let mut c = std::process::Command::new(BIN)
            .arg("user")
            .args(args)
            .arg("--state-dir")
            .arg(&s.state)
            .arg("--config")
            .arg(s.empty_config())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        if let Some(t) = stdin {
            // A command that refuses before it reads (a duplicate name)
            // closes its stdin: a broken pipe here is its answer, not ours.
            let _ = c.stdin.take().unwrap().write_all(t.as_bytes());
        }
        c.wait_with_output().unwrap()
    };
    let out = user(
        &[
            "add",
            "bob",
            "--tenant",
            "acme",
            "--password-file",
            pw.to_str().unwrap(),
        ],
        None,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        user(
            &["add", "bob", "--tenant", "acme"],
            Some("another long password\n")
        )
        .status
        .code(),
        Some(1),
        "exists"
    );
    assert_eq!(
        user(&["add", "carl", "--tenant", "acme"], Some("short\n"))
            .status
            .code(),
        Some(2)
    );
    assert_eq!(
        user(
            &["add", "Carl", "--tenant", "acme"],
            Some("a long enough password\n")
        )
        .status
        .code(),
        Some(2)
    );
    let out = user(&["list", "--json"], None);
    let listed = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        listed.contains("\"bob\"") && !listed.contains("argon2") && !listed.contains("horse"),
        "{listed}"
    );

    let as_bob = |password: &str, path: String, body: Value| {
        let (http, url, password) = (
            s.http.clone(),
            format!("{}{path}", s.url),
            password.to_string(),
        );
        async move {
            let r = http
                .post(url)
                .basic_auth("bob", Some(password))
                .json(&body)
                .send()
                .await
                .unwrap();
            let st = r.status();
            (st, r.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let (_, plan) = s
        .post(
            &alice,
            "/v1/tasks/plan",
            json!({"template": "word-count", "parameters": {"text": "a b", "repeat": 1}}),
        )
        .await;
    let pr = plan["plan_ref"].as_str().unwrap().to_string();
    let approve = format!("/v1/task-plans/{pr}/approve");
    let (st, _) = as_bob("wrong password entirely", approve.clone(), json!({})).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    let (st, v) = as_bob(
        "correct horse battery staple",
        format!("/v1/tasks/{}/status", "task_00000000000000000000"),
        json!({}),
    )
    .await;
    assert_eq!(st, StatusCode::NOT_FOUND, "signed in: {v}");

    // A new password: the old one stops at once.
    let out = user(&["passwd", "bob"], Some("a brand new passphrase\n"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (st, _) = as_bob("correct horse battery staple", approve.clone(), json!({})).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    // Disabled, enabled.
    assert!(user(&["disable", "bob"], None).status.success());
    let (st, _) = as_bob("a brand new passphrase", approve.clone(), json!({})).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    assert!(user(&["enable", "bob"], None).status.success());
    let (st, v) = as_bob(
        "a brand new passphrase",
        approve.clone(),
        json!({"reason": "ok"}),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "approved");
    let audit = s.journal();
    assert!(!audit.contains("passphrase") && !audit.contains("horse"));
    // Removed.
    assert!(user(&["remove", "bob"], None).status.success());
    assert_eq!(user(&["remove", "bob"], None).status.code(), Some(1));
    let (st, _) = as_bob("a brand new passphrase", approve, json!({})).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    // Guessing: after five failures in a minute a name is refused without
    // a check, the right password included.
    let out = user(
        &["add", "eve", "--tenant", "acme"],
        Some("eve's long password\n"),
    );
    assert!(out.status.success());
    let as_eve = |password: &'static str| {
        let (http, url) = (s.http.clone(), format!("{}/v1/leases", s.url));
        async move {
            http.get(url)
                .basic_auth("eve", Some(password))
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    // (A signed-in credential stays in the cache meanwhile: guessing
    // cannot lock out someone already signed in.)
    for _ in 0..cube_adapter::auth::MAX_FAILURES {
        assert_eq!(as_eve("a wrong guess here").await, StatusCode::UNAUTHORIZED);
    }
    let r = s
        .http
        .get(format!("{}/v1/leases", s.url))
        .basic_auth("eve", Some("eve's long password"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(code(&r.json().await.unwrap()), "sign_in_throttled");
    s.stop().await;
}

/// Approvals people can trust (issue #36), on `/v1`: a plan names who asked
/// (subject, the token's label, the lease and runtime it works in, what
/// the client said it is) and why; a template may require a reason and
/// two approvals from distinct people; the requester never counts, nobody
/// counts twice, and the receipt names every approver with their words.
/// Bidirectional controls in parameters are refused by default; a
/// template may take printable ASCII only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorum_reasons_and_who_asked() {
    let s = Server::start_with(|c| {
        configure(c);
        let deploy: TaskTemplate = serde_json::from_value(json!({
            "description": "Deploy a ref.",
            "profile": "trusted",
            "approvals_required": 2,
            "reason_required": true,
            "parameters": {"type": "object", "additionalProperties": false,
                "required": ["ref", "replicas"],
                "properties": {"ref": {"type": "string", "maxLength": 64},
                               "replicas": {"type": "integer", "minimum": 1, "maximum": 50}}},
            "command": {"argv": ["/bin/sh", "-c", "echo deploy \"$1\" x \"$2\"", "deploy", "${ref}", "${replicas}"]},
        }))
        .unwrap();
        let mut strict = deploy.clone();
        strict.parameters_ascii_only = true;
        strict.approvals_required = 1;
        strict.reason_required = false;
        let mut sre = strict.clone();
        sre.parameters_ascii_only = false;
        sre.approvers = vec!["bob".into()];
        c.tasks.insert("deploy".into(), deploy);
        c.tasks.insert("deploy-ascii".into(), strict);
        c.tasks.insert("deploy-sre".into(), sre);
        c.validate().unwrap();
    })
    .await;
    let alice = s.token(&[
        "--tenant",
        "acme",
        "--subject",
        "alice",
        "--description",
        "release bot on build-7",
        "--role",
        "agent",
        "--role",
        "approver",
        "--action",
        "task:*",
        "--action",
        "lease:*",
    ]);
    let approver = |who: &str| {
        s.token(&[
            "--tenant",
            "acme",
            "--subject",
            who,
            "--role",
            "approver",
            "--action",
            "task:approve",
            "--action",
            "task:status",
        ])
    };
    let (bob, carol) = (approver("bob"), approver("carol"));

    // The contract says what a plan needs.
    let (_, v) = s.get(&alice, "/v1/task-templates").await;
    let deploy = v["task_templates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "deploy")
        .unwrap()
        .clone();
    assert_eq!(
        (&deploy["approvals_required"], &deploy["reason_required"]),
        (&json!(2), &json!(true))
    );

    let params = json!({"ref": "main", "replicas": 30});
    let (st, v) = s
        .post(
            &alice,
            "/v1/tasks/plan",
            json!({"template": "deploy", "parameters": params}),
        )
        .await;
    assert_eq!((st, code(&v)), (StatusCode::BAD_REQUEST, "reason_required"));
    // A reason is bounded, and kept as written (the console shows what it
    // hides escaped).
    let (st, v) = s
        .post(
            &alice,
            "/v1/tasks/plan",
            json!({"template": "deploy", "parameters": params, "reason": "x".repeat(1025)}),
        )
        .await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::PAYLOAD_TOO_LARGE, "value_too_large"),
        "{v}"
    );

    // Who asked: the lease it works in and what the client said it is.
    let (st, lease) = s
        .post(
            &alice,
            "/v1/leases/acquire",
            json!({"runtime": "mcp", "session_key": "quorum", "profile": "trusted"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{lease}");
    let lr = lease["lease_ref"].as_str().unwrap();
    let r = s
        .http
        .post(format!("{}/v1/tasks/plan", s.url))
        .bearer_auth(&alice)
        .header("x-cube-agent", "hermes-agent 0.19.0 (MCP)")
        .json(
            &json!({"template": "deploy", "parameters": params, "lease_ref": lr,
                      "reason": "Roll out the fix for ticket 4711.\nRollback: redeploy v1.2."}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    let plan: Value = r.json().await.unwrap();
    assert_eq!(
        plan["requested_by"],
        json!({"subject": "alice", "label": "release bot on build-7", "lease_ref": lr,
               "runtime": "mcp", "agent": "hermes-agent 0.19.0 (MCP)"})
    );
    assert_eq!(
        plan["reason"],
        "Roll out the fix for ticket 4711.\nRollback: redeploy v1.2."
    );
    assert_eq!(
        (&plan["approvals_required"], &plan["approvals"]),
        (&json!(2), &json!([]))
    );
    let pr = plan["plan_ref"].as_str().unwrap();
    let approve = |token: String, reason: &'static str| {
        let s = &s;
        async move {
            s.post(
                &token,
                &format!("/v1/task-plans/{pr}/approve"),
                json!({"decision": "approve", "reason": reason}),
            )
            .await
        }
    };

    // The requester never counts; one approval leaves it pending; the
    // same person does not count twice.
    let (st, v) = approve(alice.clone(), "mine").await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::FORBIDDEN, "self_approval_denied")
    );
    let (st, v) = approve(bob.clone(), "diff looks right").await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "pending_approval", "{v}");
    assert_eq!(v["approvals"][0]["subject"], "bob");
    assert_eq!(v["approvals"][0]["reason"], "diff looks right");
    assert_eq!(v["approvals"][0]["via"], "api");
    let (st, v) = approve(bob.clone(), "again").await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::CONFLICT, "already_approved"),
        "{v}"
    );
    let (st, v) = s
        .post(&alice, &format!("/v1/task-plans/{pr}/submit"), json!({}))
        .await;
    assert_eq!((st, code(&v)), (StatusCode::CONFLICT, "plan_not_approved"));
    let (st, v) = approve(carol.clone(), "on call agrees").await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "approved");
    let subjects: Vec<&str> = v["approvals"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["subject"].as_str().unwrap())
        .collect();
    assert_eq!(subjects, ["bob", "carol"]);

    // The review shows the same to an approver; the receipt names both.
    let (st, v) = s.get(&carol, &format!("/v1/task-plans/{pr}")).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["reason"], plan["reason"]);
    assert_eq!(v["requested_by"]["label"], "release bot on build-7");
    let (st, task) = s
        .post(&alice, &format!("/v1/task-plans/{pr}/submit"), json!({}))
        .await;
    assert_eq!(st, StatusCode::ACCEPTED, "{task}");
    let tr = task["task_ref"].as_str().unwrap();
    wait_ended(&s, &alice, tr).await;
    let (st, v) = s
        .post(&alice, &format!("/v1/tasks/{tr}/result"), json!({}))
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let approvers = v["receipt"]["payload"]["approvers"].as_array().unwrap();
    let named: Vec<(&str, &str)> = approvers
        .iter()
        .map(|a| {
            (
                a["subject"].as_str().unwrap(),
                a["reason"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        named,
        [("bob", "diff looks right"), ("carol", "on call agrees")]
    );
    // The journal keeps the words too, one line each (a newline escaped).
    let j = s.journal();
    assert!(j.contains("\"reason\":\"diff looks right\""), "{j}");
    assert!(
        j.contains(
            "\"reason\":\"Roll out the fix for ticket 4711.\\\\u{a}Rollback: redeploy v1.2.\""
        ),
        "{j}"
    );

    // A denial ends a plan with its reason, kept as written.
    let (_, p2) = s
        .post(
            &alice,
            "/v1/tasks/plan",
            json!({"template": "deploy", "parameters": params, "reason": "again"}),
        )
        .await;
    let p2 = p2["plan_ref"].as_str().unwrap();
    let (st, v) = s
        .post(
            &carol,
            &format!("/v1/task-plans/{p2}/approve"),
            json!({"decision": "deny", "reason": "not during the freeze"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(
        (&v["state"], &v["denial"]["subject"], &v["denial"]["reason"]),
        (
            &json!("denied"),
            &json!("carol"),
            &json!("not during the freeze")
        )
    );

    // Nothing hidden: a right-to-left override is refused by default (the
    // message names the parameter and the character, never the value); a
    // zero-width space is taken (and shown escaped to approvers); an
    // ASCII-only template refuses a Cyrillic homoglyph.
    let (st, v) = s
        .post(
            &alice,
            "/v1/tasks/plan",
            json!({"template": "deploy", "reason": "r",
                   "parameters": {"ref": "release-\u{202E}txt.exe", "replicas": 1}}),
        )
        .await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::BAD_REQUEST, "invalid_parameters")
    );
    let m = v["error"]["message"].as_str().unwrap_or_default();
    assert!(m.contains("parameters.ref") && m.contains("U+202E"), "{v}");
    assert!(!m.contains("txt.exe"), "{v}");
    let (st, v) = s
        .post(
            &alice,
            "/v1/tasks/plan",
            json!({"template": "deploy", "reason": "r",
                   "parameters": {"ref": "ma\u{200B}in", "replicas": 1}}),
        )
        .await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let (st, v) = s
        .post(
            &alice,
            "/v1/tasks/plan",
            json!({"template": "deploy-ascii", "parameters": {"ref": "m\u{0430}in", "replicas": 1}}),
        )
        .await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::BAD_REQUEST, "invalid_parameters")
    );
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("U+0430"),
        "{v}"
    );
    let (st, _) = s
        .post(
            &alice,
            "/v1/tasks/plan",
            json!({"template": "deploy-ascii", "parameters": {"ref": "main", "replicas": 1}}),
        )
        .await;
    assert_eq!(st, StatusCode::CREATED);

    // An approver group: only the approvers the template names decide.
    let (st, p3) = s
        .post(
            &alice,
            "/v1/tasks/plan",
            json!({"template": "deploy-sre", "parameters": {"ref": "main", "replicas": 2}}),
        )
        .await;
    assert_eq!(st, StatusCode::CREATED, "{p3}");
    let p3 = p3["plan_ref"].as_str().unwrap();
    let (st, v) = s
        .post(
            &carol,
            &format!("/v1/task-plans/{p3}/approve"),
            json!({"decision": "approve"}),
        )
        .await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::FORBIDDEN, "approver_required"),
        "{v}"
    );
    let (st, v) = s
        .post(
            &bob,
            &format!("/v1/task-plans/{p3}/approve"),
            json!({"decision": "approve"}),
        )
        .await;
    assert_eq!(
        (st, &v["state"]),
        (StatusCode::OK, &json!("approved")),
        "{v}"
    );
    s.stop().await;
}

/// A task whose setup fails says why (issue #36): its status carries the
/// code and message (`setup_error`), not only `setup_failed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_setup_says_why() {
    let s = Server::start_with(|c| {
        configure(c);
        let mut broken = c.profiles["trusted"].clone();
        broken.template = "no-such-template".into();
        c.profiles.insert("broken".into(), broken);
        let mut t: TaskTemplate = serde_json::from_value(templates()["admin-ok"].clone()).unwrap();
        t.profile = "broken".into();
        t.approval_required = false;
        c.tasks.insert("broken-task".into(), t);
        c.validate().unwrap();
    })
    .await;
    let agent = s.token(&["--tenant", "acme", "--subject", "a", "--action", "task:*"]);
    let (st, plan) = s
        .post(
            &agent,
            "/v1/tasks/plan",
            json!({"template": "broken-task", "parameters": {}}),
        )
        .await;
    assert_eq!(st, StatusCode::CREATED, "{plan}");
    let pr = plan["plan_ref"].as_str().unwrap();
    let (st, v) = s
        .post(&agent, &format!("/v1/task-plans/{pr}/submit"), json!({}))
        .await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::BAD_GATEWAY, "template_not_found"),
        "{v}"
    );
    let (_, p) = s.get(&agent, &format!("/v1/task-plans/{pr}")).await;
    let tr = p["task_ref"].as_str().expect("the plan names its task");
    let (st, v) = s.get(&agent, &format!("/v1/tasks/{tr}/status")).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "setup_failed");
    let why = v["setup_error"].as_str().unwrap_or_default();
    assert!(
        why.starts_with("template_not_found: ") && why.contains("no-such-template"),
        "{v}"
    );
    s.stop().await;
}
