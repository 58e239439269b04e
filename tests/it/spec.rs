//! `docs/openapi.yaml` against the code: the document is well formed
//! (every reference resolves, every schema is valid JSON Schema 2020-12),
//! and a tour of every operation over a live appliance gets answers that
//! match their documented schemas (`kit::spec`).

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::kit::spec::spec;
use crate::kit::{Server, code};

/// Every `$ref` names something; every schema under `components.schemas`
/// and every request and answer schema is valid JSON Schema 2020-12; every
/// operation has an `operationId` and a `default` (error) answer.
#[test]
fn the_document_is_well_formed() {
    let sp = spec();
    let mut problems = vec![];
    fn refs(v: &Value, at: String, out: &mut Vec<(String, String)>) {
        match v {
            Value::Object(m) => {
                for (k, x) in m {
                    if k == "$ref"
                        && let Some(r) = x.as_str()
                    {
                        out.push((at.clone(), r.to_string()));
                    }
                    refs(x, format!("{at}/{k}"), out);
                }
            }
            Value::Array(a) => {
                for (i, x) in a.iter().enumerate() {
                    refs(x, format!("{at}/{i}"), out);
                }
            }
            _ => {}
        }
    }
    let mut all = vec![];
    refs(&sp.doc, String::new(), &mut all);
    for (at, r) in &all {
        match r.strip_prefix('#') {
            Some(p) if sp.doc.pointer(p).is_some() => {}
            _ => problems.push(format!("{at}: $ref {r} names nothing")),
        }
    }
    for (name, s) in sp.doc["components"]["schemas"].as_object().unwrap() {
        if let Err(e) = jsonschema::draft202012::meta::validate(s) {
            problems.push(format!("components.schemas.{name}: {e}"));
        }
        if let Err(e) = sp.validator(&format!("/components/schemas/{name}")) {
            problems.push(e);
        }
    }
    for (m, t) in sp.operations() {
        let op = &sp.doc["paths"][&t][m.to_ascii_lowercase()];
        if op.get("operationId").is_none() {
            problems.push(format!("{m} {t}: no operationId"));
        }
        if op["responses"].get("default").is_none() {
            problems.push(format!("{m} {t}: no default answer"));
        }
        for (status, r) in op["responses"].as_object().unwrap() {
            let r = match r.get("$ref").and_then(Value::as_str) {
                Some(p) => sp.doc.pointer(p.trim_start_matches('#')).unwrap(),
                None => r,
            };
            for (media, c) in r["content"].as_object().into_iter().flatten() {
                if let Some(s) = c.get("schema")
                    && let Err(e) = jsonschema::draft202012::meta::validate(s)
                {
                    problems.push(format!("{m} {t} {status} {media}: {e}"));
                }
            }
        }
        if let Some(s) = op.pointer("/requestBody/content/application~1json/schema")
            && let Err(e) = jsonschema::draft202012::meta::validate(s)
        {
            problems.push(format!("{m} {t} request: {e}"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// What the tour found outside the document (all of it is reported at once).
static FOUND: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(vec![]);

/// One request through the kit's client, its answer checked against the
/// document.
async fn call(s: &Server, token: &str, path: &str, body: Option<Value>) -> (StatusCode, Value) {
    let url = format!("{}{path}", s.url);
    let (method, r) = match body {
        Some(b) => ("POST", s.http.post(&url).bearer_auth(token).json(&b)),
        None => ("GET", s.http.get(&url).bearer_auth(token)),
    };
    let r = r.send().await.unwrap();
    let st = r.status();
    let ct = r
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let text = r.text().await.unwrap();
    let v = if ct.starts_with("application/json") {
        serde_json::from_str(&text).unwrap()
    } else {
        // A document served as text: checked as a string.
        Value::String(text)
    };
    if let Err(e) = spec().check(method, &url, st.as_u16(), &v) {
        FOUND
            .lock()
            .unwrap()
            .push(format!("{method} {path} answered {st}: {e}"));
    }
    (st, v)
}

async fn post(s: &Server, token: &str, path: &str, body: Value) -> Value {
    let (st, v) = call(s, token, path, Some(body)).await;
    assert!(st.is_success(), "POST {path}: {st} {v}");
    v
}

async fn get(s: &Server, token: &str, path: &str) -> Value {
    let (st, v) = call(s, token, path, None).await;
    assert!(st.is_success(), "GET {path}: {st} {v}");
    v
}

/// A whole event stream (`timeout` bounds it), its events checked.
async fn events(s: &Server, path: &str) -> Vec<Value> {
    let url = format!("{}{path}", s.url);
    let r = s.http.get(&url).bearer_auth(&s.admin).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let text = r.text().await.unwrap();
    let evs: Vec<Value> = text
        .split("\n\n")
        .filter(|b| !b.trim().is_empty())
        .map(|b| {
            let mut ev = serde_json::Map::new();
            for l in b.lines() {
                if let Some((k, v)) = l.split_once(": ") {
                    ev.insert(k.to_string(), json!(v));
                }
            }
            Value::Object(ev)
        })
        .filter(|e| e.get("event").is_some())
        .collect();
    assert!(!evs.is_empty(), "{path}: no events in {text:?}");
    if let Err(e) = spec().check_events("GET", &url, &evs) {
        FOUND
            .lock()
            .unwrap()
            .push(format!("GET {path} events: {e}"));
    }
    evs
}

/// Every operation of the document, with real leases, files, checkpoints,
/// a fork, jobs, PTYs and trusted tasks: each answer matches its schema,
/// and every operation (MCP's aside: `mcp::` drives it with the official
/// SDK) has been seen answering with success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_answers_as_documented() {
    let s = Server::start_with(crate::tasks::configure).await;
    let a = s.admin.clone();

    // The unauthenticated documents.
    get(&s, "", "/healthz").await;
    get(&s, "", "/readyz").await;
    get(&s, "", "/metrics").await;
    get(&s, "", "/openapi.yaml").await;

    // Leases and files.
    get(&s, &a, "/v1/profiles").await;
    let lease = post(
        &s,
        &a,
        "/v1/leases/acquire",
        json!({"runtime": "mcp", "session_key": "spec-tour", "profile": "checkpoint-code"}),
    )
    .await;
    let l = lease["lease_ref"].as_str().unwrap().to_string();
    get(&s, &a, "/v1/leases").await;
    get(&s, &a, &format!("/v1/leases/{l}/status")).await;
    post(&s, &a, &format!("/v1/leases/{l}/status"), json!({})).await;
    post(
        &s,
        &a,
        &format!("/v1/leases/{l}/exec"),
        json!({"command": "echo hi; echo err >&2"}),
    )
    .await;
    let f = "/workspace/a.txt";
    post(
        &s,
        &a,
        &format!("/v1/leases/{l}/write"),
        json!({"path": f, "content": "hello"}),
    )
    .await;
    post(&s, &a, &format!("/v1/leases/{l}/read"), json!({"path": f})).await;
    post(
        &s,
        &a,
        &format!("/v1/leases/{l}/list"),
        json!({"path": "/workspace"}),
    )
    .await;
    post(&s, &a, &format!("/v1/leases/{l}/stat"), json!({"path": f})).await;
    post(
        &s,
        &a,
        &format!("/v1/leases/{l}/mkdir"),
        json!({"path": "/workspace/d"}),
    )
    .await;
    post(
        &s,
        &a,
        &format!("/v1/leases/{l}/move"),
        json!({"path": f, "destination": "/workspace/d/b.txt"}),
    )
    .await;
    post(
        &s,
        &a,
        &format!("/v1/leases/{l}/artifacts/upload"),
        json!({"path": "/workspace/c.bin", "content_base64": "AAEC"}),
    )
    .await;
    post(
        &s,
        &a,
        &format!("/v1/leases/{l}/artifacts/download"),
        json!({"path": "/workspace/c.bin"}),
    )
    .await;
    post(
        &s,
        &a,
        &format!("/v1/leases/{l}/remove"),
        json!({"path": "/workspace/c.bin"}),
    )
    .await;
    post(
        &s,
        &a,
        &format!("/v1/leases/{l}/renew"),
        json!({"seconds": 60}),
    )
    .await;
    get(&s, &a, &format!("/v1/leases/{l}/recover")).await;

    // What schemathesis found, kept: a name longer than the file system
    // takes is a bad path (400), not a backend failure (502); 60.0 is an
    // integer, as JSON Schema says.
    let long = format!("/workspace/{}", "n".repeat(300));
    for (op, body) in [
        ("mkdir", json!({"path": long})),
        ("list", json!({"path": long})),
        ("read", json!({"path": long})),
        ("artifacts/download", json!({"path": long})),
        (
            "artifacts/upload",
            json!({"path": long, "content_base64": "AA=="}),
        ),
    ] {
        let (st, v) = call(&s, &a, &format!("/v1/leases/{l}/{op}"), Some(body)).await;
        assert_eq!(
            (st, code(&v)),
            (StatusCode::BAD_REQUEST, "invalid_path"),
            "{op}: {v}"
        );
    }
    let v = post(
        &s,
        &a,
        &format!("/v1/leases/{l}/renew"),
        json!({"seconds": 60.0}),
    )
    .await;
    assert_eq!(v["timeout_seconds"], 60);

    // Checkpoints and a fork.
    let cp = post(
        &s,
        &a,
        &format!("/v1/leases/{l}/checkpoints"),
        json!({"name": "one"}),
    )
    .await;
    let c = cp["checkpoint_ref"].as_str().unwrap().to_string();
    get(&s, &a, &format!("/v1/leases/{l}/checkpoints")).await;
    let fork = post(
        &s,
        &a,
        &format!("/v1/leases/{l}/checkpoints/{c}/fork"),
        json!({"branch": "b"}),
    )
    .await;
    post(
        &s,
        &a,
        &format!("/v1/leases/{l}/checkpoints/{c}/rollback"),
        json!({}),
    )
    .await;
    post(
        &s,
        &a,
        &format!("/v1/leases/{l}/checkpoints/{c}/delete"),
        json!({}),
    )
    .await;
    let fl = fork["lease_ref"].as_str().unwrap().to_string();
    post(
        &s,
        &a,
        &format!("/v1/leases/{fl}/release"),
        json!({"action": "kill"}),
    )
    .await;

    // Jobs: one that ends, one cancelled.
    let job = post(
        &s,
        &a,
        &format!("/v1/leases/{l}/jobs"),
        json!({"command": "echo out; echo err >&2"}),
    )
    .await;
    let j = job["job_ref"].as_str().unwrap().to_string();
    events(&s, &format!("/v1/jobs/{j}/events?timeout=30")).await;
    get(&s, &a, &format!("/v1/jobs/{j}/status")).await;
    post(&s, &a, &format!("/v1/jobs/{j}/status"), json!({})).await;
    post(&s, &a, &format!("/v1/jobs/{j}/output"), json!({})).await;
    post(
        &s,
        &a,
        &format!("/v1/jobs/{j}/output"),
        json!({"stdout_offset": 0}),
    )
    .await;
    get(&s, &a, &format!("/v1/jobs/{j}/recover")).await;
    let long = post(
        &s,
        &a,
        &format!("/v1/leases/{l}/jobs"),
        json!({"command": "sleep 60"}),
    )
    .await;
    let lj = long["job_ref"].as_str().unwrap();
    post(&s, &a, &format!("/v1/jobs/{lj}/cancel"), json!({})).await;

    // A PTY.
    let pty = post(&s, &a, &format!("/v1/leases/{l}/ptys"), json!({})).await;
    let p = pty["pty_ref"].as_str().unwrap().to_string();
    get(&s, &a, &format!("/v1/ptys/{p}/status")).await;
    post(
        &s,
        &a,
        &format!("/v1/ptys/{p}/input"),
        json!({"data": "echo tour\n"}),
    )
    .await;
    post(
        &s,
        &a,
        &format!("/v1/ptys/{p}/resize"),
        json!({"rows": 30, "cols": 100}),
    )
    .await;
    post(
        &s,
        &a,
        &format!("/v1/ptys/{p}/output"),
        json!({"wait_ms": 1000}),
    )
    .await;
    post(&s, &a, &format!("/v1/ptys/{p}/kill"), json!({})).await;
    events(&s, &format!("/v1/ptys/{p}/events?timeout=5")).await;

    // Trusted tasks: the admin's own chore (self-approval allowed by its
    // profile), and a sleeper that is cancelled.
    get(&s, &a, "/v1/task-templates").await;
    get(&s, &a, "/v1/receipts/public-key").await;
    let plan = post(
        &s,
        &a,
        "/v1/tasks/plan",
        json!({"template": "admin-ok", "parameters": {}}),
    )
    .await;
    let pr = plan["plan_ref"].as_str().unwrap().to_string();
    get(&s, &a, &format!("/v1/task-plans/{pr}")).await;
    post(&s, &a, &format!("/v1/task-plans/{pr}/approve"), json!({})).await;
    let task = post(&s, &a, &format!("/v1/task-plans/{pr}/submit"), json!({})).await;
    let t = task["task_ref"].as_str().unwrap().to_string();
    let mut ended = false;
    for _ in 0..300 {
        let v = get(&s, &a, &format!("/v1/tasks/{t}/status")).await;
        if v["execution_ended"] == true {
            ended = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ended, "task {t} did not end");
    post(&s, &a, &format!("/v1/tasks/{t}/status"), json!({})).await;
    post(&s, &a, &format!("/v1/tasks/{t}/result"), json!({})).await;
    get(&s, &a, &format!("/v1/tasks/{t}/receipt")).await;
    post(&s, &a, &format!("/v1/tasks/{t}/receipt"), json!({})).await;
    let plan = post(
        &s,
        &a,
        "/v1/tasks/plan",
        json!({"template": "sleeper", "parameters": {"secs": 30}}),
    )
    .await;
    let pr = plan["plan_ref"].as_str().unwrap();
    let task = post(&s, &a, &format!("/v1/task-plans/{pr}/submit"), json!({})).await;
    let t2 = task["task_ref"].as_str().unwrap();
    post(&s, &a, &format!("/v1/tasks/{t2}/cancel"), json!({})).await;

    // Errors answer in the documented shape too.
    let (st, v) = call(&s, &a, "/v1/leases/lease_00000000000000000000/status", None).await;
    assert_eq!((st, code(&v)), (StatusCode::NOT_FOUND, "lease_not_found"));
    let (st, _) = call(&s, "wrong", "/v1/leases", None).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);

    // The end of the tour.
    post(&s, &a, &format!("/v1/leases/{l}/release"), json!({})).await;
    post(&s, &a, "/v1/admin/gc", json!({})).await;

    let found = FOUND.lock().unwrap().clone();
    assert!(
        found.is_empty(),
        "answers outside docs/openapi.yaml:\n{}",
        found.join("\n")
    );
    let seen = spec().seen();
    let missing: Vec<String> = spec()
        .operations()
        .into_iter()
        .filter(|(_, t)| t != "/mcp")
        .filter(|(m, t)| {
            !seen
                .iter()
                .any(|(sm, st, code)| sm == m && st == t && (200..300).contains(code))
        })
        .map(|(m, t)| format!("{m} {t}"))
        .collect();
    assert!(
        missing.is_empty(),
        "operations the tour never saw succeed: {missing:?}"
    );
}

/// The property-based run: schemathesis (PyPI, pinned in `kit::python`)
/// generates requests from `docs/openapi.yaml`, valid and invalid, against
/// a live appliance with a real lease, checkpoint, job, PTY, plan and task
/// to aim at, and checks every answer: no 5xx, status codes, content types
/// and bodies as documented, schema-valid requests accepted and
/// schema-violating ones rejected. Bounded by `CUBE_SPEC_FUZZ_SECS`
/// (default 90 s) and a fixed seed (`CUBE_SPEC_FUZZ_SEED`, default 1).
///
/// What a schema cannot say is configured, not ignored: limits counted in
/// bytes answer 413 for some strings whose length in characters is within
/// `maxLength`; a file operation may name a directory where it needs a
/// file, or `/workspace` itself, and a command a working directory that
/// does not exist (400 `invalid_path`); a job's output
/// cursor may lie past what the job has written (400 `invalid_offset`).
/// A 504 (a sandbox operation that timed out) is not counted as a server
/// error: on a loaded machine a stat may take longer than the backend
/// timeout, and 504 `timeout` is the documented answer for that.
/// The stateful phase is off: its sequences share the one lease, and a
/// release or rollback in one ends what the next one aims at. MCP (`/mcp`)
/// is driven by the official SDK in `mcp::`, not here: its media-type
/// negotiation is not in the document.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_nothing() {
    let tools = crate::kit::spec_tools();
    let s = Server::start_with(crate::tasks::configure).await;
    let a = s.admin.clone();
    let lease = post(
        &s,
        &a,
        "/v1/leases/acquire",
        json!({"runtime": "mcp", "session_key": "fuzz", "profile": "checkpoint-code"}),
    )
    .await;
    let l = lease["lease_ref"].as_str().unwrap().to_string();
    let cp = post(&s, &a, &format!("/v1/leases/{l}/checkpoints"), json!({})).await;
    let job = post(
        &s,
        &a,
        &format!("/v1/leases/{l}/jobs"),
        json!({"command": "echo out"}),
    )
    .await;
    let pty = post(&s, &a, &format!("/v1/leases/{l}/ptys"), json!({})).await;
    let plan = post(
        &s,
        &a,
        "/v1/tasks/plan",
        json!({"template": "word-count", "parameters": {"text": "a b", "repeat": 1}}),
    )
    .await;
    let ready = post(
        &s,
        &a,
        "/v1/tasks/plan",
        json!({"template": "sleeper", "parameters": {"secs": 1}}),
    )
    .await;
    let task = post(
        &s,
        &a,
        &format!(
            "/v1/task-plans/{}/submit",
            ready["plan_ref"].as_str().unwrap()
        ),
        json!({}),
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let secs: u32 = std::env::var("CUBE_SPEC_FUZZ_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(90);
    let seed: u64 = std::env::var("CUBE_SPEC_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let config = format!(
        r#"base-url = "{url}"
tls-verify = "{ca}"
seed = {seed}
workers = 1
max-time = {secs}
request-timeout = 60
[headers]
Authorization = "Bearer {a}"
[parameters]
lease_ref = "{l}"
checkpoint_ref = "{c}"
job_ref = "{j}"
pty_ref = "{p}"
plan_ref = "{pl}"
task_ref = "{t}"
[generation]
max-examples = 20
database = "none"
[phases.stateful]
enabled = false
[checks.not_a_server_error]
expected-statuses = ["1xx", "2xx", "3xx", "4xx", 504]
[checks.negative_data_rejection]
expected-statuses = [400, 401, 403, 404, 409, 413, 415, 422, 429]
[checks.positive_data_acceptance]
expected-statuses = ["2xx", 401, 403, 404, 409, 413, 429, "5xx"]
[[operations]]
include-path = "/mcp"
enabled = false
[[operations]]
include-path-regex = "/(read|write|list|stat|move|mkdir|remove|artifacts/upload|artifacts/download|exec|jobs|ptys)$"
checks.positive_data_acceptance.expected-statuses = ["2xx", 400, 401, 403, 404, 409, 413, 429, "5xx"]
[[operations]]
include-path = "/v1/jobs/{{job_ref}}/output"
checks.positive_data_acceptance.expected-statuses = ["2xx", 400, 401, 403, 404, 409, 413, 429, "5xx"]
"#,
        url = s.url,
        ca = s.state.join("tls/ca.pem").display(),
        c = cp["checkpoint_ref"].as_str().unwrap(),
        j = job["job_ref"].as_str().unwrap(),
        p = pty["pty_ref"].as_str().unwrap(),
        pl = plan["plan_ref"].as_str().unwrap(),
        t = task["task_ref"].as_str().unwrap(),
    );
    let cfg = dir.path().join("schemathesis.toml");
    std::fs::write(&cfg, config).unwrap();
    // A run whose only errors are network errors (a handshake cut short on
    // a loaded machine) is run once more; any finding fails at once.
    let run = || {
        tokio::process::Command::new(tools.join("schemathesis"))
            .arg("--config-file")
            .arg(&cfg)
            .arg("run")
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/openapi.yaml"))
            .arg("--no-color")
            .current_dir(dir.path())
            .output()
    };
    let mut out = run().await.unwrap();
    let only_network = |o: &std::process::Output| {
        let t = String::from_utf8_lossy(&o.stdout);
        !o.status.success() && t.contains("Network Error") && !t.contains("= FAILURES =")
    };
    if only_network(&out) {
        eprintln!(
            "schemathesis: network errors only, running once more:\n{}",
            String::from_utf8_lossy(&out.stdout)
        );
        out = run().await.unwrap();
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let start = (text.len().saturating_sub(30_000)..text.len())
        .find(|i| text.is_char_boundary(*i))
        .unwrap_or(0);
    let tail = &text[start..];
    assert!(
        out.status.success(),
        "schemathesis found answers outside docs/openapi.yaml (seed {seed}):\n{tail}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
