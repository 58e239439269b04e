//! A real MCP host in CI: Hermes Agent (pinned, from PyPI, unmodified),
//! driven by a scripted model on 127.0.0.1, calls `cube_acquire →
//! cube_exec → cube_read_text` through the appliance, configured with the
//! very snippets `docs/clients/hermes.md` shows: over stdio (`cube-adapter
//! mcp`) and over `/mcp`. The effects are checked where they land: in the
//! audit journal and in the sandbox. `tests/hosts/run.sh` (outside CI)
//! drives all five hosts the same way.
//!
//! Nothing leaves loopback: the model is `tests/hosts/model.py`, and
//! Hermes runs with a dead proxy for anything but 127.0.0.1 (and a context
//! length in its config, so it does not look the model up on the internet).

use std::path::{Path, PathBuf};
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::kit::{BIN, Server};

/// Where the scripted model leaves its proof (as `tests/hosts/model.py`).
const PROOF: &str = "/workspace/proof.txt";

/// The scripted model (`tests/hosts/model.py`, shared with
/// `tests/hosts/run.sh`): a provider endpoint on 127.0.0.1 whose answers
/// follow a fixed script (acquire, write `marker` to a file with
/// `cube_exec`, read it back with `cube_read_text`, say what it read).
struct Model {
    _proc: tokio::process::Child,
    url: String,
    log: PathBuf,
}

impl Model {
    async fn start(dir: &Path, marker: &str, mcp_call: &Value) -> Self {
        use tokio::io::AsyncBufReadExt;
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/hosts/model.py");
        let log = dir.join("model.jsonl");
        let mut proc = tokio::process::Command::new("python3")
            .arg(script)
            .args(["--marker", marker, "--session-key", "hosts-ci", "--log"])
            .arg(&log)
            .arg("--mcp-call")
            .arg(mcp_call.to_string())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("python3 runs the scripted model");
        let mut lines = tokio::io::BufReader::new(proc.stdout.take().unwrap()).lines();
        let first = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("the scripted model starts")
            .unwrap()
            .unwrap_or_default();
        let url = first
            .strip_prefix("model listening on ")
            .unwrap_or_else(|| panic!("scripted model said: {first}"))
            .to_string();
        Model {
            _proc: proc,
            url: format!("{url}/v1"),
            log,
        }
    }

    /// What each request held: the tools offered, the results sent back,
    /// and the model's answer.
    fn requests(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }
}

/// The first `lease_` + 20 hex digits in `text`.
fn lease_ref(text: &str) -> Option<String> {
    text.match_indices("lease_").find_map(|(i, _)| {
        let id = text.get(i..i + 26)?;
        id[6..]
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
            .then(|| id.to_string())
    })
}

/// The fenced block under `<!-- check: HOST TRANSPORT DEST -->` in a page of
/// `docs/clients`, as `tests/hosts/run.sh` pastes it.
fn snippet(page: &str, marker: &str) -> String {
    let doc = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("docs/clients")
            .join(page),
    )
    .unwrap();
    let at = doc
        .find(&format!("<!-- check: {marker} -->"))
        .unwrap_or_else(|| panic!("no `{marker}` snippet in docs/clients/{page}"));
    let block = doc[at..].split("```").nth(1).unwrap();
    block.split_once('\n').unwrap().1.to_string()
}

/// Run Hermes once with the docs' snippet for `transport`, against the
/// scripted model; check what it did.
async fn hermes_drives_the_tools(transport: &str) {
    let hermes = crate::kit::python::hermes();
    // The snippet's profile serves the controlled-echo policy (governed
    // MCP in the sandbox), which the model calls last.
    let s = Server::start_with(|c| {
        crate::governed_mcp::configure(c);
        if let Some(p) = c.profiles.get_mut("offline-code") {
            p.mcp_policy = Some("controlled-echo".into());
        }
    })
    .await;
    let token = s.token(&["--tenant", "hosts"]);
    let marker = format!("hermes-{transport}-{:08x}", rand::random::<u32>());
    let echo = format!("echoed-{marker}");
    let mcp_call = json!({"tool": "echo", "arguments": {"text": echo}});
    let model = Model::start(s.dir.path(), &marker, &mcp_call).await;

    let home = s.dir.path().join("home");
    let etc = home.join(".config/cube-adapter");
    std::fs::create_dir_all(&etc).unwrap();
    std::fs::create_dir_all(home.join(".hermes")).unwrap();
    std::fs::write(etc.join("token"), format!("{token}\n")).unwrap();
    std::fs::copy(s.state.join("tls/ca.pem"), etc.join("ca.pem")).unwrap();
    let cube = snippet(
        "hermes.md",
        &format!("hermes {transport} ~/.hermes/config.yaml"),
    )
    .replace("https://cube.example.internal:18080", &s.url)
    .replace("/home/alice", home.to_str().unwrap());
    let config = format!(
        "{cube}\nmodel:\n  provider: custom\n  base_url: {}\n  default: scripted\n  \
         api_key: scripted\n  context_length: 131072\n",
        model.url
    );
    std::fs::write(home.join(".hermes/config.yaml"), config).unwrap();

    // `cube-adapter` on PATH, as the stdio snippet names it; nothing of
    // the caller's environment (no CUBE_ADAPTER_* of ours, no proxy).
    let bin_dir = Path::new(BIN).parent().unwrap();
    let path = format!("{}:/usr/local/bin:/usr/bin:/bin", bin_dir.display());
    let run = tokio::process::Command::new(&hermes)
        .args(["chat", "-Q", "-q"])
        .arg("Leave a proof in the sandbox and read it back.")
        .env_clear()
        .env("HOME", &home)
        .env("PATH", path)
        .env("LANG", "C.UTF-8")
        .env("CUBE_ADAPTER_TOKEN", &token)
        // Anything but loopback goes to a port where nothing listens.
        .env("HTTP_PROXY", "http://127.0.0.1:9")
        .env("HTTPS_PROXY", "http://127.0.0.1:9")
        .env("ALL_PROXY", "http://127.0.0.1:9")
        .env("NO_PROXY", "127.0.0.1,localhost")
        .current_dir(&home)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(300), run)
        .await
        .expect("hermes finished within 300 s")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let requests = model.requests();
    let context = format!(
        "hermes {transport}: exit {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}\nmodel saw {} requests",
        out.status.code(),
        requests.len()
    );
    assert!(out.status.success(), "{context}");

    // The host offered the appliance's tools under its own names, sent
    // each result back, and printed the model's last word.
    let first = requests.first().unwrap_or_else(|| panic!("{context}"));
    let offered: Vec<&str> = first["tools"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| t.as_str())
        .collect();
    for tool in [
        "cube_acquire",
        "cube_exec",
        "cube_read_text",
        "cube_mcp_tools",
        "cube_mcp_call",
    ] {
        assert!(
            offered.contains(&format!("mcp__cube__{tool}").as_str()),
            "{tool} among {offered:?}\n{context}"
        );
    }
    assert_eq!(requests.len(), 5, "{context}");
    let final_line = format!("read back {marker}");
    assert!(stdout.contains(&final_line), "{context}");
    // The governed echo ran in the sandbox and its result came back.
    let last = requests.last().unwrap();
    let mcp_result = last["results"][3].as_str().unwrap_or("");
    assert!(mcp_result.contains(&echo), "{mcp_result}\n{context}");
    let lease = lease_ref(&stdout).unwrap_or_else(|| panic!("{context}"));

    // The journal: each call's intent and outcome, as this host's runtime,
    // under the snippet's profile.
    let journal = s.journal();
    for action in ["acquire", "exec", "read", "mcp_call"] {
        let ok: Vec<Value> = journal
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|e| {
                e["action"] == action && e["lease_ref"] == lease.as_str() && e["outcome"] == "ok"
            })
            .collect();
        assert_eq!(ok.len(), 1, "{action} in {journal}");
        assert_eq!(ok[0]["runtime"], "hermes", "{}", ok[0]);
        assert_eq!(ok[0]["profile"], "offline-code", "{}", ok[0]);
    }
    assert!(
        !journal.contains(&marker),
        "the journal keeps digests, not commands"
    );

    // The sandbox: the file is there, with what the model wrote.
    let (st, v) = s
        .post(
            &token,
            &format!("/v1/leases/{lease}/exec"),
            json!({"command": format!("cat {PROOF}")}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["stdout"], format!("{marker}\n"), "{v}");
    s.stop().await;
}

/// Hermes over stdio: it starts `cube-adapter mcp` with the snippet's flags.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hermes_over_stdio_calls_the_tools() {
    hermes_drives_the_tools("stdio").await;
}

/// Hermes over `/mcp`, with a bearer token from its environment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hermes_over_http_calls_the_tools() {
    hermes_drives_the_tools("http").await;
}
