//! The console in real headless Chromium (issue 15): Debian's `chromium`
//! driven by playwright-core (`tests/browser/console.mjs`, installed by
//! `.ci/run`). This test starts the appliance, makes the people, the
//! agent's token and two plans, runs the script with them in its
//! environment, and checks its exit status, its JSON report and what the
//! appliance recorded: the decisions through `/v1`, the audit journal, the
//! downloaded receipt with the real `cube-adapter receipt verify`, the
//! exported CSV, and every page the browser saw with `assert_clean`.
//!
//! Screenshots go to `target/console-screens/`; with
//! `CUBE_UPDATE_SCREENSHOTS=1` the few of `docs/console.md` are also
//! written to `docs/console/`. A stage whose page does not exist yet is
//! "skipped" by the script, and this test fails on it unless
//! `CUBE_BROWSER_ALLOW_SKIP=1`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine;
use sha2::Digest;

use super::*;

const CHROMIUM: &str = "/usr/bin/chromium";
/// The largest screenshot we keep (docs/console.md links them).
const MAX_PNG: u64 = 200 * 1024;

fn manifest() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Chromium and the script's node_modules, or a clear failure.
pub fn preflight() -> PathBuf {
    let chromium = std::env::var("CUBE_CHROMIUM").unwrap_or_else(|_| CHROMIUM.into());
    assert!(
        Path::new(&chromium).exists(),
        "the browser tests need Chromium at {chromium} (Debian's chromium package): run .ci/run, \
         or apt-get install chromium"
    );
    let dir = manifest().join("tests/browser");
    assert!(
        dir.join("node_modules/playwright-core/package.json")
            .exists(),
        "the browser tests need playwright-core in tests/browser/node_modules: run .ci/run, or \
         `PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci` in tests/browser"
    );
    dir
}

/// Base64 SHA-256 of the certificate's SubjectPublicKeyInfo, as Chromium's
/// `--ignore-certificate-errors-spki-list` wants it: that key and no other.
pub fn spki_sha256(pem: &[u8]) -> String {
    let (_, pem) = x509_parser::pem::parse_x509_pem(pem).unwrap();
    let cert = pem.parse_x509().unwrap();
    let spki = cert.tbs_certificate.subject_pki.raw;
    base64::engine::general_purpose::STANDARD.encode(sha2::Sha256::digest(spki))
}

fn read(path: &Value) -> String {
    std::fs::read_to_string(path.as_str().unwrap()).unwrap()
}

/// A template that needs two approvals, takes bidirectional controls (to
/// show them), and has risk rules (issue #36).
fn deploy_template() -> cube_adapter::config::TaskTemplate {
    serde_json::from_value(json!({
        "description": "Deploy a ref.",
        "profile": "trusted",
        "approvals_required": 2,
        "allow_bidi_controls": true,
        "parameters": {"type": "object", "additionalProperties": false,
            "required": ["ref", "replicas", "note"],
            "properties": {"ref": {"type": "string", "maxLength": 64},
                           "replicas": {"type": "integer", "minimum": 1, "maximum": 50},
                           "note": {"type": "string", "maxLength": 200}}},
        "command": {"argv": ["/bin/sh", "-c", "echo deploy \"$1\" x \"$2\": \"$3\"", "deploy",
                             "${ref}", "${replicas}", "${note}"]},
        "risk": [
            {"parameter": "replicas", "above": 10, "note": "more than 10 replicas"},
            {"parameter": "note", "pattern": "(?i)rm -rf|drop table", "note": "a destructive command"},
        ],
    }))
    .unwrap()
}

/// The plans of the approvals-people-can-trust stage (issue #36).
struct TrustPlans {
    /// Approved by two people through `/v1`.
    before: String,
    /// The same but one value (replicas 3 → 30, risky), pending.
    diff: String,
    /// Hidden characters and a homoglyph in its values, pending.
    hidden: String,
}

async fn trust_plans(s: &Server, agent: &str) -> TrustPlans {
    // Refused by default: a bidirectional control in a parameter of a
    // template that does not allow them.
    let (st, v) = s
        .post(
            agent,
            "/v1/tasks/plan",
            json!({"template": "word-count", "parameters": {"text": "a\u{202E}b", "repeat": 1}}),
        )
        .await;
    assert_eq!(
        (st, crate::kit::code(&v)),
        (StatusCode::BAD_REQUEST, "invalid_parameters"),
        "{v}"
    );
    let plan = |params: Value, reason: &str| {
        let body = json!({"template": "deploy", "parameters": params, "reason": reason});
        async move {
            let (st, v) = s.post(agent, "/v1/tasks/plan", body).await;
            assert_eq!(st, StatusCode::CREATED, "{v}");
            v["plan_ref"].as_str().unwrap().to_string()
        }
    };
    let before = plan(
        json!({"ref": "main", "replicas": 3, "note": "weekly"}),
        "The weekly rollout.",
    )
    .await;
    for who in ["alice", "bob"] {
        let r = s
            .http
            .post(format!("{}/v1/task-plans/{before}/approve", s.url))
            .basic_auth(who, Some(PASSWORD))
            .json(&json!({"decision": "approve", "reason": "as every week"}))
            .send()
            .await
            .unwrap();
        assert_eq!(
            r.status(),
            StatusCode::OK,
            "{who}: {}",
            r.text().await.unwrap()
        );
    }
    let diff = plan(
        json!({"ref": "main", "replicas": 30, "note": "weekly"}),
        "More capacity for the sale.",
    )
    .await;
    let hidden = plan(
        json!({"ref": "m\u{0430}in", "replicas": 3,
               "note": "RTL-override: \u{202E}txt.exe and zero\u{200B}width"}),
        "Looks like the weekly one.",
    )
    .await;
    TrustPlans {
        before,
        diff,
        hidden,
    }
}

/// An agent plans two tasks; an approver signs in with the keyboard alone,
/// finds the first in the queue, reviews the command and approves it; an
/// auditor sees the second but no form, and a decision forged from the
/// auditor's session is refused; a second approver approves it with
/// JavaScript off; the agent submits the first, the task runs, and the
/// approver opens it, downloads the receipt and verifies it; the auditor
/// searches the audit log for it and exports the CSV. No console error, no
/// CSP violation, no unexpected error answer, no secret on any page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_in_headless_chromium() {
    let dir = preflight();
    let s = Server::start_with(|c| {
        crate::tasks::configure(c);
        c.tasks.insert("deploy".into(), deploy_template());
        c.validate().unwrap();
    })
    .await;
    let agent = s.token(&[
        "--tenant",
        "acme",
        "--subject",
        "agent-a",
        "--action",
        "task:*",
        "--action",
        "lease:*",
    ]);
    for (name, tenant, role) in [
        ("alice", "acme", "approver"),
        ("bob", "acme", "approver"),
        ("dora", "acme", "auditor"),
        ("root", "ops", "admin"),
    ] {
        user(&s, &["add", name, "--tenant", tenant, "--role", role]);
    }
    let secret1 = "browser parameter one";
    let secret2 = "browser parameter two";
    let p1 = plan_word_count(&s, &agent, secret1).await;
    let p2 = plan_word_count(&s, &agent, secret2).await;
    let plan1 = p1["plan_ref"].as_str().unwrap().to_string();
    let plan2 = p2["plan_ref"].as_str().unwrap().to_string();
    // A live lease, for the Leases page.
    let lease = s.acquire(&agent, "browser-test").await;
    let trust = trust_plans(&s, &agent).await;

    let out = manifest().join("target/console-browser");
    let _ = std::fs::remove_dir_all(&out);
    let screens = manifest().join("target/console-screens");
    let spki = spki_sha256(&std::fs::read(s.state.join("tls/server.pem")).unwrap());
    let mut cmd = tokio::process::Command::new("node");
    cmd.arg(dir.join("console.mjs"))
        .current_dir(&dir)
        .env("CUBE_URL", &s.url)
        .env("CUBE_SPKI", &spki)
        .env("NODE_EXTRA_CA_CERTS", s.state.join("tls/ca.pem"))
        .env("CUBE_PASSWORD", PASSWORD)
        .env("CUBE_APPROVER", "alice")
        .env("CUBE_SECOND_APPROVER", "bob")
        .env("CUBE_AUDITOR", "dora")
        .env("CUBE_ADMIN", "root")
        .env("CUBE_AGENT_TOKEN", &agent)
        .env("CUBE_PLAN", &plan1)
        .env("CUBE_PLAN2", &plan2)
        .env("CUBE_TRUST_DIFF", &trust.diff)
        .env("CUBE_TRUST_HIDDEN", &trust.hidden)
        .env("CUBE_TRUST_BEFORE", &trust.before)
        .env("CUBE_OUT", &out)
        .env("CUBE_SCREENS", &screens)
        .kill_on_drop(true);
    if std::env::var("CUBE_UPDATE_SCREENSHOTS").is_ok_and(|v| v == "1") {
        cmd.env("CUBE_DOC_SCREENS", manifest().join("docs/console"));
    }
    let run = tokio::time::timeout(Duration::from_secs(300), cmd.output())
        .await
        .expect("the browser test ends within 5 minutes")
        .expect("node runs (Node 20 and npm: run .ci/run)");
    let log = String::from_utf8_lossy(&run.stderr).into_owned();
    let report: Value = serde_json::from_slice(
        &std::fs::read(out.join("report.json"))
            .unwrap_or_else(|e| panic!("no report from the browser script ({e}):\n{log}")),
    )
    .unwrap();
    assert!(
        run.status.success() && report["ok"] == true,
        "the browser test failed (target/console-browser/ has the report and the failing page):\n{log}\n{}",
        report["error"]
    );
    eprintln!("{log}");

    // Nothing skipped, unless asked (pages still being built).
    let skipped = report["skipped"].as_array().unwrap();
    if !skipped.is_empty() {
        assert!(
            std::env::var("CUBE_BROWSER_ALLOW_SKIP").is_ok_and(|v| v == "1"),
            "browser stages skipped: {skipped:?}"
        );
        eprintln!("browser stages skipped (CUBE_BROWSER_ALLOW_SKIP=1): {skipped:?}");
    }
    assert_eq!(
        report["problems"],
        json!([]),
        "console errors, CSP violations or unexpected error answers"
    );
    // Readable on a phone: no page is wider than the phone's screen.
    let wide = report["phone_overflow"].as_array().unwrap();
    assert!(wide.is_empty(), "pages wider than a phone: {wide:?}");
    // And at 1280 px no table is clipped (issue #36).
    let clipped = report["desktop_overflow"].as_array().unwrap();
    assert!(clipped.is_empty(), "tables clipped at 1280 px: {clipped:?}");

    // The keyboard: name, password, Sign in; the reason, then Approve.
    let order: Vec<&str> = report["focus"]["sign_in"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(
        order.ends_with(&["input#name", "input#password", "button[Sign in]"]),
        "{order:?}"
    );
    let approve: Vec<&str> = report["focus"]["approve"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    let reason = approve.iter().position(|f| *f == "textarea#reason");
    assert!(
        reason.is_some() && approve.last() == Some(&"button[approve]"),
        "{approve:?}"
    );

    // Every page the browser saw: no secret, nothing inline; parameters
    // only where an approver reviews them.
    let pages = report["pages"].as_array().unwrap();
    assert!(pages.len() >= 6, "{pages:?}");
    for p in pages {
        let html = read(&p["file"]);
        let name = p["name"].as_str().unwrap();
        assert_clean(&html, &s, None);
        assert!(!html.contains(&agent), "the agent's token on {name}");
        if !name.starts_with("plan-") || name == "plan-auditor" {
            assert!(
                !html.contains(secret1) && !html.contains(secret2),
                "parameters on {name}"
            );
        }
        assert!(html.contains("/console/static/console.css?v="), "{name}");
    }
    let review = pages.iter().find(|p| p["name"] == "plan-review").unwrap();
    assert!(
        read(&review["file"]).contains(secret1),
        "the approver sees the parameters"
    );

    // Screenshots: real PNGs, small enough to commit.
    let shots = report["screenshots"].as_array().unwrap();
    for want in [
        "sign-in-desktop",
        "sign-in-phone",
        "overview-desktop",
        "approvals-phone",
        "plan-review-desktop",
        "plan-review-phone",
    ] {
        assert!(
            shots.iter().any(|x| x["name"] == want),
            "no {want} screenshot"
        );
    }
    for x in shots {
        let f = PathBuf::from(x["file"].as_str().unwrap());
        let png = std::fs::read(&f).unwrap();
        assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "{f:?} is no PNG");
        assert!((png.len() as u64) < MAX_PNG, "{f:?}: {} bytes", png.len());
    }

    // The appliance agrees: both plans approved through the broker, by two
    // people (the first since submitted); the auditor's try refused as on
    // /v1; sign-ins audited.
    assert_eq!(plan_state(&s, &agent, &plan1).await, "submitted");
    assert_eq!(plan_state(&s, &agent, &plan2).await, "approved");
    let j = s.journal();
    let approvals = events(&j, "task_approve", "ok");
    let of = |plan: &str| approvals.iter().filter(|e| e.contains(plan)).count();
    assert_eq!((of(&plan1), of(&plan2)), (1, 1), "{j}");
    // Issue #36: the plan that needed two approvals has them, by two
    // people, the console's recorded as such; the notification link took
    // two actions, and Approve was within the first 800 px.
    assert_eq!(of(&trust.diff), 2, "{j}");
    assert!(
        approvals
            .iter()
            .filter(|e| e.contains(&trust.diff))
            .all(|e| e.contains("\"runtime\":\"console\"")),
        "{j}"
    );
    let (st, v) = s
        .get(&agent, &format!("/v1/task-plans/{}", trust.diff))
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "approved");
    let who: Vec<&str> = v["approvals"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["subject"].as_str().unwrap())
        .collect();
    assert_eq!(who, ["alice", "bob"], "{v}");
    assert_eq!(v["approvals"][0]["reason"], "sale week, capacity agreed");
    assert_eq!(report["trust"]["actions"], 2, "{report}");
    assert!(
        report["trust"]["approve_bottom"].as_u64().unwrap() <= 800,
        "{report}"
    );
    // The auditor's forged decision was refused with the code /v1 gives
    // the auditor for the same decision; both refusals audited.
    let code = report["auditor_refused"]
        .as_str()
        .expect("the auditor's code");
    let r = client(&s)
        .post(format!("{}/v1/task-plans/{plan2}/approve", s.url))
        .basic_auth("dora", Some(PASSWORD))
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], code, "{v}");
    let j = s.journal();
    assert_eq!(refusals(&j, "task_approve", code).len(), 2, "{j}");
    assert_eq!(events(&j, "console_sign_in", "rejected").len(), 1);
    assert!(events(&j, "console_sign_in", "ok").len() >= 4);
    assert_eq!(events(&j, "console_sign_out", "ok").len(), 1);
    assert!(!j.contains(secret1));
    assert!(
        j.contains("\"reason\":\"reviewed in the browser test\""),
        "{j}"
    );

    // The task ran; its receipt as downloaded verifies with the real CLI.
    let task = report["task_ref"].as_str().expect("a task ref").to_string();
    let (st, v) = s.get(&agent, &format!("/v1/tasks/{task}/status")).await;
    assert_eq!(
        (st, v["state"].as_str()),
        (StatusCode::OK, Some("succeeded"))
    );
    if let Some(f) = report["receipt_file"].as_str() {
        let got: Value = serde_json::from_str(&std::fs::read_to_string(f).unwrap()).unwrap();
        let payload = got
            .get("receipt")
            .unwrap_or(&got)
            .get("payload")
            .cloned()
            .unwrap_or_default();
        assert_eq!(payload["task_ref"], task.as_str(), "{got}");
        let empty = s.empty_config();
        let verify = std::process::Command::new(BIN)
            .args(["receipt", "verify", f, "--state-dir"])
            .arg(&s.state)
            .arg("--config")
            .arg(&empty)
            .output()
            .unwrap();
        let v: Value = serde_json::from_slice(&verify.stdout).unwrap_or_default();
        assert!(verify.status.success() && v["valid"] == true, "{v}");
    } else {
        assert!(!skipped.is_empty(), "no receipt downloaded");
    }
    if let Some(f) = report["csv_file"].as_str() {
        let csv = std::fs::read_to_string(f).unwrap();
        let lines: Vec<&str> = csv.lines().filter(|l| l.contains(&task)).collect();
        for action in ["task_submit", "task_finalize"] {
            assert!(
                lines.iter().any(|l| l.contains(action)),
                "{action} for {task} in the CSV:\n{csv}"
            );
        }
        assert!(!csv.contains(secret1));
        // Looking at the audit log is itself audited.
        let j = s.journal();
        assert!(!events(&j, "audit_search", "ok").is_empty(), "{j}");
        assert!(!events(&j, "audit_export", "ok").is_empty(), "{j}");
    } else {
        assert!(!skipped.is_empty(), "no CSV exported");
    }

    let (st, _) = s
        .post(
            &agent,
            &format!("/v1/leases/{lease}/release"),
            json!({"action": "kill"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK);
    s.stop().await;
}
