//! Governed MCP inside the sandbox (`[mcp_policies.NAME]`, `cube_mcp_call`)
//! on the embedded backend, end to end: the reference's controlled-echo
//! policy through `/v1`, through `/mcp` and through stdio with the official
//! Python `mcp` SDK; what is refused before the sandbox sees it (the
//! gateway's own log, read in the sandbox, says what reached it); what the
//! journal keeps; a call past its timeout that holds its lease until an
//! operator reconciles it.

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::kit::{Server, code};
use cube_adapter::config::{Config, McpPolicy, Profile};

/// The dependency-free MCP stdio server (`echo`, `sleep`) the gateway runs.
const ECHO_SERVER: &str = include_str!("../mcp/echo-server.js");

/// A policy running the test server, with these tools' schemas.
fn policy(timeout: u64, tools: &str) -> McpPolicy {
    let mut p: McpPolicy = toml::from_str(&format!(
        r#"
description = "The reference's controlled echo"
command = 'exec node -e "$SERVER_JS"'
call_timeout_seconds = {timeout}
max_input_bytes = 1024
max_output_bytes = 4096
{tools}
"#
    ))
    .unwrap();
    p.env.insert("SERVER_JS".into(), ECHO_SERVER.into());
    p
}

const ECHO: &str = r#"
[tools.echo]
description = "Echo the text back"
input_schema = { type = "object", additionalProperties = false, required = ["text"], properties = { text = { type = "string", maxLength = 256 } } }
"#;

const SLEEP: &str = r#"
[tools.sleep]
description = "Wait, then answer"
input_schema = { type = "object", additionalProperties = false, required = ["seconds"], properties = { seconds = { type = "integer", minimum = 0, maximum = 60 } } }
"#;

/// `mcp-echo` (controlled echo, 15 s), `mcp-slow` (echo and sleep, 2 s)
/// and `mcp-tiny` (results of at most 100 bytes).
pub fn configure(c: &mut Config) {
    c.mcp_policies
        .insert("controlled-echo".into(), policy(15, ECHO));
    c.mcp_policies
        .insert("slow-echo".into(), policy(2, &format!("{ECHO}{SLEEP}")));
    let mut tiny = policy(15, ECHO);
    tiny.max_output_bytes = 100;
    c.mcp_policies.insert("tiny-echo".into(), tiny);
    for (name, pol) in [
        ("mcp-echo", "controlled-echo"),
        ("mcp-slow", "slow-echo"),
        ("mcp-tiny", "tiny-echo"),
    ] {
        c.profiles.insert(
            name.into(),
            Profile {
                mcp_policy: Some(pol.into()),
                ..Profile::default()
            },
        );
    }
}

async fn acquire(s: &Server, profile: &str, session: &str) -> String {
    s.acquire_in(profile, session).await
}

async fn call(s: &Server, lease: &str, body: Value) -> (StatusCode, Value) {
    s.post(&s.admin, &format!("/v1/leases/{lease}/mcp/call"), body)
        .await
}

/// What reached the gateway in the sandbox, one JSON line per request.
async fn gateway_log(s: &Server, lease: &str) -> Vec<Value> {
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/exec"),
            json!({"command": "cat /run/mcp-gateway/calls.log"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    v["stdout"]
        .as_str()
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn tool_calls(log: &[Value]) -> Vec<&Value> {
    log.iter().filter(|l| l["method"] == "tools/call").collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controlled_echo_policy_through_v1_refuses_before_the_sandbox() {
    let s = Server::start_with(configure).await;
    let lease = acquire(&s, "mcp-echo", "governed-v1").await;

    // The agent sees the policy's tools and schemas, nothing else.
    let (st, v) = s
        .get(&s.admin, &format!("/v1/leases/{lease}/mcp/tools"))
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["policy"], "controlled-echo");
    assert_eq!(v["call_timeout_seconds"], 15);
    let tools = v["tools"].as_array().unwrap();
    assert_eq!(tools.len(), 1, "{v}");
    assert_eq!(tools[0]["name"], "echo");
    assert_eq!(
        tools[0]["input_schema"]["properties"]["text"]["maxLength"],
        256
    );

    // 256 characters: echoed by the server in the sandbox.
    let text = format!("{:x<256}", "governed-marker-");
    let (st, v) = call(
        &s,
        &lease,
        json!({"tool": "echo", "arguments": {"text": text}}),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["is_error"], false, "{v}");
    assert_eq!(v["content"][0]["text"], text.as_str(), "{v}");
    assert!(v["result_bytes"].as_u64().unwrap() > 256, "{v}");
    let log = gateway_log(&s, &lease).await;
    assert_eq!(tool_calls(&log).len(), 1, "{log:?}");
    assert_eq!(tool_calls(&log)[0]["tool"], "echo");

    // Refused here, never sent: 257 characters, an extra field, an unlisted
    // tool, a server the agent names, arguments that are not an object.
    for (body, status, want) in [
        (
            json!({"tool": "echo", "arguments": {"text": format!("{text}y")}}),
            StatusCode::BAD_REQUEST,
            "mcp_arguments_invalid",
        ),
        (
            json!({"tool": "echo", "arguments": {"text": "a", "extra": true}}),
            StatusCode::BAD_REQUEST,
            "mcp_arguments_invalid",
        ),
        (
            json!({"tool": "echo", "arguments": {}}),
            StatusCode::BAD_REQUEST,
            "mcp_arguments_invalid",
        ),
        (
            json!({"tool": "sleep", "arguments": {"seconds": 1}}),
            StatusCode::FORBIDDEN,
            "mcp_tool_denied",
        ),
        (
            json!({"tool": "echo", "server": "github/evil/server", "arguments": {"text": "a"}}),
            StatusCode::BAD_REQUEST,
            "unknown_fields",
        ),
        (
            json!({"tool": "echo", "arguments": ["a"]}),
            StatusCode::BAD_REQUEST,
            "mcp_arguments_invalid",
        ),
        (
            json!({"tool": "echo", "arguments": {"text": "z".repeat(2000)}}),
            StatusCode::PAYLOAD_TOO_LARGE,
            "value_too_large",
        ),
    ] {
        let (st, v) = call(&s, &lease, body.clone()).await;
        assert_eq!((st, code(&v)), (status, want), "{body}: {v}");
        // Where the schema failed, never the value.
        assert!(!v.to_string().contains("zzzz"), "{v}");
    }
    let log = gateway_log(&s, &lease).await;
    assert_eq!(
        tool_calls(&log).len(),
        1,
        "nothing refused reached the sandbox: {log:?}"
    );

    // A result over the policy's limit is not returned; the call ran, and
    // its outcome says so.
    let tiny = acquire(&s, "mcp-tiny", "governed-tiny").await;
    let (st, v) = call(
        &s,
        &tiny,
        json!({"tool": "echo", "arguments": {"text": "ok"}}),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let (st, v) = call(
        &s,
        &tiny,
        json!({"tool": "echo", "arguments": {"text": "w".repeat(120)}}),
    )
    .await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::BAD_GATEWAY, "mcp_result_too_large"),
        "{v}"
    );
    assert!(!v.to_string().contains("wwww"), "{v}");

    // A lease without a policy calls nothing.
    let plain = acquire(&s, "offline-code", "governed-plain").await;
    let (st, v) = call(
        &s,
        &plain,
        json!({"tool": "echo", "arguments": {"text": "a"}}),
    )
    .await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::FORBIDDEN, "mcp_tool_denied"),
        "{v}"
    );

    // No checkpoint of an MCP profile (it would copy the gateway's token).
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/checkpoints"),
            json!({}),
        )
        .await;
    assert_eq!(st, StatusCode::FORBIDDEN, "{v}");

    // The journal: intent and outcome with the tool, digests and sizes;
    // refusals recorded; no value anywhere.
    let journal = s.journal();
    let events: Vec<Value> = journal
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|e: &Value| e["action"] == "mcp_call")
        .collect();
    let intent = events
        .iter()
        .find(|e| e["phase"] == "intent")
        .expect("an intent");
    assert_eq!(intent["tool"], "echo");
    assert_eq!(
        intent["bytes"],
        json!(format!("{{\"text\":\"{text}\"}}").len())
    );
    assert_eq!(intent["parameters_digest"].as_str().unwrap().len(), 32);
    let outcome = events
        .iter()
        .find(|e| e["phase"] == "outcome" && e["operation_id"] == intent["operation_id"])
        .expect("its outcome");
    assert_eq!(outcome["outcome"], "ok");
    assert_eq!(outcome["tool"], "echo");
    assert_eq!(outcome["result_digest"].as_str().unwrap().len(), 32);
    let rejected: Vec<&str> = events
        .iter()
        .filter(|e| e["outcome"] == "rejected")
        .map(|e| e["error_code"].as_str().unwrap_or(""))
        .collect();
    assert!(
        rejected.contains(&"mcp_arguments_invalid") && rejected.contains(&"mcp_tool_denied"),
        "{rejected:?}"
    );
    assert!(
        !journal.contains("governed-marker"),
        "no argument or result value in the journal"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_past_its_timeout_holds_the_lease_until_reconciled() {
    let s = Server::start_with(configure).await;
    let lease = acquire(&s, "mcp-slow", "governed-slow").await;
    let (st, v) = call(
        &s,
        &lease,
        json!({"tool": "echo", "arguments": {"text": "quick"}}),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");

    let (st, v) = call(
        &s,
        &lease,
        json!({"tool": "sleep", "arguments": {"seconds": 6}}),
    )
    .await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::GATEWAY_TIMEOUT, "mcp_call_timeout"),
        "{v}"
    );

    // Its intent stays pending: no outcome names the operation.
    let journal = s.journal();
    let events: Vec<Value> = journal
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|e: &Value| e["action"] == "mcp_call" && e["tool"] == "sleep")
        .collect();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["phase"], "intent");
    let op = events[0]["operation_id"].as_str().unwrap().to_string();

    // The lease does nothing more, a release included; others work.
    for (path, body) in [
        (
            "mcp/call",
            json!({"tool": "echo", "arguments": {"text": "again"}}),
        ),
        ("exec", json!({"command": "true"})),
        ("release", json!({"action": "kill"})),
    ] {
        let (st, v) = s
            .post(&s.admin, &format!("/v1/leases/{lease}/{path}"), body)
            .await;
        assert_eq!(
            (st, code(&v)),
            (StatusCode::CONFLICT, "lease_blocked"),
            "{path}: {v}"
        );
        assert!(v["error"]["message"].as_str().unwrap().contains(&op), "{v}");
    }
    let other = acquire(&s, "mcp-echo", "governed-other").await;
    let (st, v) = call(
        &s,
        &other,
        json!({"tool": "echo", "arguments": {"text": "fine"}}),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "another lease is not blocked: {v}");

    // The operator reconciles it while the service runs; the lease is free.
    let out = s.cli(&[
        "audit",
        "reconcile",
        "--operation",
        &op,
        "--note",
        "checked: the sleep tool has no side effects",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains(&op));
    let (st, v) = call(
        &s,
        &lease,
        json!({"tool": "echo", "arguments": {"text": "after"}}),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    // Only held operations are reconciled while it runs.
    let out = s.cli(&["audit", "reconcile", "--operation", &op, "--note", "again"]);
    assert!(!out.status.success());
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/release"),
            json!({"action": "kill"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
}

/// The official Python `mcp` SDK over `/mcp` and over stdio.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controlled_echo_policy_through_mcp_with_the_official_sdk() {
    let s = Server::start_with(configure).await;
    let token = s.token(&["--tenant", "acme"]);
    let py = crate::kit::sdk_python();
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/mcp_governed.py");
    for (mode, url) in [("http", format!("{}/mcp", s.url)), ("stdio", s.url.clone())] {
        let out = tokio::process::Command::new(&py)
            .arg(&script)
            .env("MCP_MODE", mode)
            .env("MCP_URL", &url)
            .env("MCP_TOKEN", &token)
            .env("MCP_CA", s.state.join("tls/ca.pem"))
            .env("MCP_BIN", crate::kit::BIN)
            .env("MCP_PROFILE", "mcp-echo")
            .output()
            .await
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains(&format!("mcp-governed ({mode}): all ok")),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Where `.ci/run` installs the MCP project's reference server from npm
/// (`@modelcontextprotocol/server-everything`), in the host's `/usr`,
/// which the `minimal` template shows every sandbox read-only.
const EVERYTHING: &str = "/usr/local/bin/mcp-server-everything";

/// A real server from a registry, not one written for the test, through the
/// same path: its `echo` and `get-sum` allowed, its `get-env` (which would
/// show the server's environment) not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_mcp_server_runs_in_the_sandbox() {
    assert!(
        std::path::Path::new(EVERYTHING).exists(),
        "{EVERYTHING} is missing: npm install -g --prefix /usr/local @modelcontextprotocol/server-everything (.ci/run does)"
    );
    let s = Server::start_with(|c| {
        let p: McpPolicy = toml::from_str(
            r#"
command = "exec mcp-server-everything stdio"
call_timeout_seconds = 30
[tools.echo]
input_schema = { type = "object", additionalProperties = false, required = ["message"], properties = { message = { type = "string", maxLength = 256 } } }
[tools.get-sum]
input_schema = { type = "object", additionalProperties = false, required = ["a", "b"], properties = { a = { type = "number" }, b = { type = "number" } } }
"#,
        )
        .unwrap();
        c.mcp_policies.insert("everything".into(), p);
        c.profiles.insert(
            "mcp-everything".into(),
            Profile {
                mcp_policy: Some("everything".into()),
                ..Profile::default()
            },
        );
    })
    .await;
    let lease = acquire(&s, "mcp-everything", "governed-everything").await;
    let (st, v) = call(
        &s,
        &lease,
        json!({"tool": "echo", "arguments": {"message": "from the registry"}}),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["content"][0]["text"], "Echo: from the registry", "{v}");
    let (st, v) = call(
        &s,
        &lease,
        json!({"tool": "get-sum", "arguments": {"a": 2, "b": 40}}),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert!(
        v["content"][0]["text"].as_str().unwrap().contains("42"),
        "{v}"
    );
    let (st, v) = call(&s, &lease, json!({"tool": "get-env", "arguments": {}})).await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::FORBIDDEN, "mcp_tool_denied"),
        "{v}"
    );
    let log = gateway_log(&s, &lease).await;
    let tools: Vec<&str> = tool_calls(&log)
        .iter()
        .map(|l| l["tool"].as_str().unwrap())
        .collect();
    assert_eq!(tools, ["echo", "get-sum"], "{log:?}");
}

/// A held lease across a SIGKILL of the appliance: the next start neither
/// resolves the held intent nor blocks the other leases (`/readyz` ready);
/// the lease stays blocked until the operator reconciles it. A lease
/// paused and resumed calls its gateway again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_lease_stays_held_across_a_restart_and_resumes_after_a_pause() {
    let mut cfg = Config::default();
    configure(&mut cfg);
    let doc = json!({
        "mcp_policies": cfg.mcp_policies,
        "profiles": {
            "mcp-slow": {"mcp_policy": "slow-echo"},
            "mcp-echo": {"mcp_policy": "controlled-echo"},
        },
    });
    let text = toml::to_string(&doc).unwrap();
    let (rig, p) = crate::kit::rig::ProcRig::start_with(&text, &[]);
    let acquire = |profile: &'static str, session: &'static str| {
        let (rig, url) = (&rig, p.url.clone());
        async move {
            let (st, v) = rig
                .call(
                    format!("{url}/v1/leases/acquire"),
                    Some(json!({"runtime": "mcp", "session_key": session, "profile": profile})),
                )
                .await;
            assert_eq!(st, StatusCode::OK, "{v}");
            v["lease_ref"].as_str().unwrap().to_string()
        }
    };
    let held = acquire("mcp-slow", "held").await;
    let paused = acquire("mcp-echo", "paused").await;
    let (st, v) = rig
        .call(
            format!("{}/v1/leases/{held}/mcp/call", p.url),
            Some(json!({"tool": "sleep", "arguments": {"seconds": 5}})),
        )
        .await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::GATEWAY_TIMEOUT, "mcp_call_timeout"),
        "{v}"
    );
    // Paused (its processes frozen), then used: resumed, the gateway answers.
    let (st, v) = rig
        .call(
            format!("{}/v1/leases/{paused}/release", p.url),
            Some(json!({"action": "pause"})),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");

    let p = rig.kill_and_restart(p);
    let (st, _) = rig.call(format!("{}/readyz", p.url), None).await;
    assert_eq!(
        st,
        StatusCode::OK,
        "a held intent does not block the appliance"
    );
    let op = rig
        .journal()
        .into_iter()
        .find(|e| e["action"] == "mcp_call" && e["tool"] == "sleep")
        .map(|e| e["operation_id"].as_str().unwrap().to_string())
        .unwrap();
    assert!(
        !rig.journal()
            .iter()
            .any(|e| e["operation_id"] == op.as_str() && e["phase"] != "intent"),
        "the restart resolved nothing"
    );
    let (st, v) = rig
        .call(
            format!("{}/v1/leases/{held}/exec", p.url),
            Some(json!({"command": "true"})),
        )
        .await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::CONFLICT, "lease_blocked"),
        "{v}"
    );
    let (st, v) = rig
        .call(
            format!("{}/v1/leases/{paused}/mcp/call", p.url),
            Some(json!({"tool": "echo", "arguments": {"text": "awake"}})),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["content"][0]["text"], "awake");

    let out = rig.cli(&[
        "audit",
        "reconcile",
        "--operation",
        &op,
        "--note",
        "checked",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (st, v) = rig
        .call(
            format!("{}/v1/leases/{held}/exec", p.url),
            Some(json!({"command": "true"})),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let reconciled = rig
        .journal()
        .into_iter()
        .find(|e| e["operation_id"] == op.as_str() && e["phase"] == "outcome")
        .unwrap();
    assert_eq!(reconciled["outcome"], "reconciled");
    p.stop();
}

/// A server that does not start fails the acquire: no lease, no sandbox
/// left, the acquire's outcome an error with the code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_that_does_not_start_fails_the_acquire_and_keeps_no_sandbox() {
    let s = Server::start_with(|c| {
        let mut p = policy(15, ECHO);
        p.command = "echo 'no such server' >&2; exit 3".into();
        c.mcp_policies.insert("broken".into(), p);
        c.profiles.insert(
            "mcp-broken".into(),
            Profile {
                mcp_policy: Some("broken".into()),
                ..Profile::default()
            },
        );
    })
    .await;
    let (st, v) = s
        .post(
            &s.admin,
            "/v1/leases/acquire",
            json!({"runtime": "mcp", "session_key": "broken", "profile": "mcp-broken"}),
        )
        .await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::BAD_GATEWAY, "mcp_gateway_unavailable"),
        "{v}"
    );
    for _ in 0..50 {
        if s.sandboxes() == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(s.sandboxes(), 0, "the sandbox was killed");
    let (_, v) = s.get(&s.admin, "/v1/leases").await;
    assert_eq!(v["leases"].as_array().map(Vec::len), Some(0), "{v}");
    let acquire = s
        .journal()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|e| e["action"] == "acquire" && e["phase"] == "outcome")
        .unwrap();
    assert_eq!(acquire["outcome"], "error");
    assert_eq!(acquire["error_code"], "mcp_gateway_unavailable");
}

/// The configuration of `configure` as a file's TOML, with `change`
/// applied to it first.
fn config_text(change: impl FnOnce(&mut Config)) -> String {
    let mut cfg = Config::default();
    configure(&mut cfg);
    change(&mut cfg);
    let profiles: serde_json::Map<String, Value> = cfg
        .profiles
        .iter()
        .filter_map(|(n, p)| {
            p.mcp_policy
                .as_ref()
                .map(|m| (n.clone(), json!({"mcp_policy": m})))
        })
        .collect();
    toml::to_string(&json!({"mcp_policies": cfg.mcp_policies, "profiles": profiles})).unwrap()
}

/// SIGHUP, as `systemctl reload` sends it: the reload's record once done.
async fn reload(rig: &crate::kit::rig::ProcRig, p: &crate::kit::rig::Proc) -> Value {
    // Asked with an empty configuration: the file may be one the service
    // refuses (the CLI would refuse it too).
    let empty = rig.state.with_file_name("empty.toml");
    std::fs::write(&empty, "").unwrap();
    let status = || {
        let out = crate::kit::cli_at(&rig.state, &empty, &["status", "--json"]);
        serde_json::from_slice::<Value>(&out.stdout).unwrap()
    };
    let before = status()["last_reload"]["at"].clone();
    // Its time is in seconds: the next one must be told apart.
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(p.child.id() as i32),
        nix::sys::signal::Signal::SIGHUP,
    )
    .unwrap();
    for _ in 0..200 {
        let v = status()["last_reload"].clone();
        if v["at"] != before {
            return v;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("no reload")
}

/// A reload (SIGHUP) changes a policy for the
/// leases that use it at once; a bad policy is refused and the one before
/// stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_changes_a_policy_and_a_bad_one_is_refused() {
    let (rig, p) = crate::kit::rig::ProcRig::start_with(&config_text(|_| {}), &[]);
    let (st, v) = rig
        .call(
            format!("{}/v1/leases/acquire", p.url),
            Some(json!({"runtime": "mcp", "session_key": "reload", "profile": "mcp-echo"})),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let lease = v["lease_ref"].as_str().unwrap().to_string();
    let echo = |text: String| {
        let (rig, url, lease) = (&rig, p.url.clone(), lease.clone());
        async move {
            rig.call(
                format!("{url}/v1/leases/{lease}/mcp/call"),
                Some(json!({"tool": "echo", "arguments": {"text": text}})),
            )
            .await
        }
    };
    let (st, v) = echo("x".repeat(20)).await;
    assert_eq!(st, StatusCode::OK, "{v}");

    // At most 10 characters now.
    std::fs::write(
        &rig.config,
        config_text(|c| {
            let t = c.mcp_policies.get_mut("controlled-echo").unwrap();
            t.tools.get_mut("echo").unwrap().input_schema["properties"]["text"]["maxLength"] =
                json!(10);
        }),
    )
    .unwrap();
    let last = reload(&rig, &p).await;
    assert_eq!(last["ok"], true, "{last}");
    let (st, v) = echo("x".repeat(20)).await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::BAD_REQUEST, "mcp_arguments_invalid"),
        "{v}"
    );
    let (st, v) = echo("x".repeat(10)).await;
    assert_eq!(st, StatusCode::OK, "{v}");

    // An open schema: the reload is refused, naming it; 10 still holds.
    std::fs::write(
        &rig.config,
        config_text(|c| {
            let t = c.mcp_policies.get_mut("controlled-echo").unwrap();
            t.tools.get_mut("echo").unwrap().input_schema["additionalProperties"] = json!(true);
        }),
    )
    .unwrap();
    let last = reload(&rig, &p).await;
    assert_eq!(last["ok"], false, "{last}");
    let said = last.to_string();
    assert!(
        said.contains("mcp_policies.controlled-echo") && said.contains("closed object schema"),
        "{said}"
    );
    let (st, v) = echo("x".repeat(20)).await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::BAD_REQUEST, "mcp_arguments_invalid"),
        "{v}"
    );
    p.stop();
}
