//! `cube-adapter connect HOST`: the real binary, a temporary HOME and the
//! real appliance. Each host's file is parsed as the host would read it;
//! the token file it names is used over /v1.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use reqwest::StatusCode;
use serde_json::json;
use serde_norway::Value;

use crate::kit::{BIN, Server};

/// Every host: its id, its file under HOME, the format, the keys of its
/// `cube` entry and its runtime.
const HOSTS: &[(&str, &str, &str, &[&str], &str)] = &[
    (
        "codex",
        ".codex/config.toml",
        "toml",
        &["mcp_servers", "cube"],
        "mcp",
    ),
    (
        "claude-code",
        ".claude.json",
        "json",
        &["mcpServers", "cube"],
        "mcp",
    ),
    (
        "opencode",
        ".config/opencode/opencode.json",
        "json",
        &["mcp", "cube"],
        "mcp",
    ),
    (
        "openclaw",
        ".openclaw/openclaw.json",
        "json",
        &["mcp", "servers", "cube"],
        "openclaw",
    ),
    (
        "hermes",
        ".hermes/config.yaml",
        "yaml",
        &["mcp_servers", "cube"],
        "hermes",
    ),
];

struct Run {
    code: i32,
    out: String,
    err: String,
}

/// `cube-adapter connect ARGS` with HOME at `home`, a PATH of `path` only
/// (no agent host, no `cube-adapter`) and nothing else from this
/// environment.
fn connect_in(s: &Server, home: &Path, path: &Path, args: &[&str]) -> Run {
    let out = std::process::Command::new(BIN)
        .arg("connect")
        .args(args)
        .arg("--state-dir")
        .arg(&s.state)
        .arg("--config")
        .arg(s.empty_config())
        .args(["--url", &s.url])
        .env_clear()
        .env("HOME", home)
        .env("PATH", path)
        .output()
        .unwrap();
    Run {
        code: out.status.code().unwrap_or(-1),
        out: String::from_utf8_lossy(&out.stdout).into_owned(),
        err: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn connect(s: &Server, home: &Path, args: &[&str]) -> Run {
    let empty = home.join("empty-path");
    std::fs::create_dir_all(&empty).unwrap();
    connect_in(s, home, &empty, args)
}

fn ok(r: &Run) {
    assert_eq!(r.code, 0, "connect failed:\n{}\n{}", r.out, r.err);
}

/// A file as the host reads it, as one tree (JSON and YAML as they are,
/// TOML through the toml crate).
fn parse(text: &str, format: &str) -> Value {
    match format {
        "toml" => {
            let v: toml::Value = toml::from_str(text).unwrap();
            serde_norway::to_value(v).unwrap()
        }
        "json" => serde_json::from_str(text).unwrap(),
        _ => serde_norway::from_str(text).unwrap(),
    }
}

fn at<'a>(v: &'a Value, keys: &[&str]) -> &'a Value {
    keys.iter().fold(v, |v, k| {
        v.get(*k)
            .unwrap_or_else(|| panic!("no {k} in {}", serde_json::to_string(v).unwrap()))
    })
}

fn strings(v: &Value) -> Vec<String> {
    v.as_sequence()
        .unwrap()
        .iter()
        .map(|x| x.as_str().unwrap().to_string())
        .collect()
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

/// The backups of `file` (`FILE.bak-…`), oldest first.
fn backups(file: &Path) -> Vec<PathBuf> {
    let name = file.file_name().unwrap().to_str().unwrap().to_string();
    let mut v: Vec<PathBuf> = std::fs::read_dir(file.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with(&format!("{name}.bak-"))
        })
        .collect();
    v.sort();
    v
}

fn token_in(home: &Path, host: &str) -> String {
    std::fs::read_to_string(home.join(format!(".config/cube-adapter/{host}.token")))
        .unwrap()
        .trim()
        .to_string()
}

/// The token acquires a lease over /v1 as the host's runtime.
async fn lease_with(s: &Server, token: &str, runtime: &str) {
    let (st, v) = s
        .post(
            token,
            "/v1/leases/acquire",
            json!({"runtime": runtime, "session_key": format!("connect-{runtime}")}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert!(v["lease_ref"].as_str().is_some(), "{v}");
}

/// Run the command an entry names, as the host would (nothing of this
/// environment), and call `cube_profiles` over MCP on its stdin: the
/// answer's `result`.
fn call_through(argv: &[String]) -> serde_json::Value {
    use std::io::{BufRead, Write};
    let mut child = std::process::Command::new(&argv[0])
        .args(&argv[1..])
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    for m in [
        json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "connect-test", "version": "1"}}}),
        json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
        json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
            "params": {"name": "cube_profiles", "arguments": {}}}),
    ] {
        writeln!(stdin, "{m}").unwrap();
    }
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
            if v["id"] == 2 {
                let _ = tx.send(v);
                break;
            }
        }
    });
    let answer = rx.recv_timeout(std::time::Duration::from_secs(60));
    drop(stdin);
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let answer = answer.unwrap_or_else(|_| {
        panic!(
            "no answer from {argv:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    answer["result"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_host_gets_its_entry_a_token_file_and_the_ca() {
    let s = Server::start().await;
    let home = tempfile::tempdir().unwrap();
    let ca = std::fs::read(s.state.join("tls/ca.pem")).unwrap();
    for (host, file, format, keys, runtime) in HOSTS {
        let before = s.token_list().len();
        let r = connect(&s, home.path(), &[host, "--tenant", "team-a"]);
        ok(&r);
        assert_eq!(s.token_list().len(), before + 1, "{host}: one new token");
        let token_file = home
            .path()
            .join(format!(".config/cube-adapter/{host}.token"));
        let token = token_in(home.path(), host);
        assert!(token.starts_with("cat_"), "{host}");
        assert_eq!(mode(&token_file), 0o600, "{host}");
        assert!(
            !r.out.contains(&token) && !r.err.contains(&token),
            "{host}: the token was printed"
        );
        let ca_file = home.path().join(".config/cube-adapter/ca.pem");
        assert_eq!(std::fs::read(&ca_file).unwrap(), ca, "{host}");

        let text = std::fs::read_to_string(home.path().join(file)).unwrap();
        assert!(!text.contains(&token), "{host}: the token is in its file");
        let entry = at(&parse(&text, format), keys).clone();
        // The command the host starts, with the appliance, the files and
        // the host's runtime.
        let argv = if *host == "opencode" {
            strings(&entry["command"])
        } else {
            let mut v = vec![entry["command"].as_str().unwrap().to_string()];
            v.extend(strings(&entry["args"]));
            v
        };
        assert_eq!(
            argv[0], BIN,
            "{host}: this binary (cube-adapter is not on PATH)"
        );
        let flag = |f: &str| {
            let i = argv.iter().position(|a| a == f).unwrap();
            argv[i + 1].clone()
        };
        assert_eq!(argv[1], "mcp", "{host}");
        assert_eq!(flag("--url"), s.url, "{host}");
        assert_eq!(flag("--token-file"), token_file.to_str().unwrap(), "{host}");
        assert_eq!(flag("--ca-file"), ca_file.to_str().unwrap(), "{host}");
        assert_eq!(flag("--profile"), "offline-code", "{host}");
        assert_eq!(flag("--runtime"), *runtime, "{host}");
        if *host == "codex" {
            assert_eq!(
                entry["default_tools_approval_mode"].as_str(),
                Some("approve")
            );
        }
        // The token in the file it names works, as the host's runtime.
        lease_with(&s, &token, runtime).await;
        // And the command as written starts and answers a tool call.
        let argv2 = argv.clone();
        let result = tokio::task::spawn_blocking(move || call_through(&argv2))
            .await
            .unwrap();
        assert_ne!(result["isError"], true, "{host}: {result}");
        assert!(
            result.to_string().contains("offline-code"),
            "{host}: {result}"
        );
    }
    // Over HTTP: /mcp with the profile and runtime, the token from the
    // environment, never in the file.
    for (host, file, format, keys, runtime) in HOSTS {
        let r = connect(&s, home.path(), &[host, "--http", "--tenant", "team-a"]);
        ok(&r);
        let token = token_in(home.path(), host);
        assert!(!r.out.contains(&token) && !r.err.contains(&token), "{host}");
        assert!(r.err.contains("CUBE_ADAPTER_TOKEN"), "{host}: {}", r.err);
        let text = std::fs::read_to_string(home.path().join(file)).unwrap();
        assert!(!text.contains(&token), "{host}");
        let entry = at(&parse(&text, format), keys).clone();
        assert_eq!(
            entry["url"].as_str().unwrap(),
            format!("{}/mcp?profile=offline-code&runtime={runtime}", s.url),
            "{host}"
        );
        assert!(
            entry.get("command").is_none(),
            "{host}: the stdio entry replaced"
        );
        if *host == "hermes" {
            assert_eq!(
                entry["ssl_verify"].as_str().unwrap(),
                home.path()
                    .join(".config/cube-adapter/ca.pem")
                    .to_str()
                    .unwrap()
            );
        }
        lease_with(&s, &token, runtime).await;
    }
}

/// What each host's file holds before `connect`: another server, another
/// setting (and, in TOML, comments), and an old `cube` entry.
fn existing(host: &str) -> &'static str {
    match host {
        "codex" => {
            "# my Codex settings\nmodel = \"o3\"  # keep this comment\n\n[mcp_servers.other]\ncommand = \"other-mcp\"\n\n# the appliance\n[mcp_servers.cube]\ncommand = \"old\"\n\n[profiles.fast]\nmodel = \"o4-mini\"\n"
        }
        "claude-code" => {
            r#"{"numStartups": 7, "mcpServers": {"other": {"type": "stdio", "command": "other-mcp"}, "cube": {"command": "old"}}, "theme": "dark"}"#
        }
        "opencode" => {
            r#"{"model": "anthropic/claude", "mcp": {"other": {"type": "local", "command": ["other-mcp"]}, "cube": {"type": "local", "command": ["old"]}}}"#
        }
        "openclaw" => {
            r#"{"gateway": {"port": 18789}, "mcp": {"servers": {"other": {"command": "other-mcp"}, "cube": {"command": "old"}}}}"#
        }
        _ => {
            "model: hermes-4\nmcp_servers:\n  other:\n    command: other-mcp\n  cube:\n    command: old\n"
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn it_merges_backs_up_and_replaces_its_own_entry() {
    let s = Server::start().await;
    let home = tempfile::tempdir().unwrap();
    for (host, file, format, keys, _) in HOSTS {
        let path = home.path().join(file);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, existing(host)).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();

        ok(&connect(&s, home.path(), &[host, "--tenant", "team-a"]));
        let first = std::fs::read_to_string(&path).unwrap();
        let b = backups(&path);
        assert_eq!(b.len(), 1, "{host}: one backup");
        assert_eq!(
            std::fs::read_to_string(&b[0]).unwrap(),
            existing(host),
            "{host}"
        );
        assert_eq!(mode(&b[0]), 0o640, "{host}: the backup keeps the mode");
        assert_eq!(mode(&path), 0o640, "{host}: the file keeps its mode");

        let doc = parse(&first, format);
        let servers = at(&doc, &keys[..keys.len() - 1]);
        let other = &servers["other"];
        assert!(
            serde_json::to_string(other).unwrap().contains("other-mcp"),
            "{host}: the other server kept: {first}"
        );
        assert!(
            !serde_json::to_string(&servers["cube"])
                .unwrap()
                .contains("\"old\""),
            "{host}: the old entry replaced: {first}"
        );
        assert!(
            serde_json::to_string(&servers["cube"])
                .unwrap()
                .contains(&s.url),
            "{host}"
        );
        match *host {
            "codex" => {
                assert_eq!(doc["model"].as_str(), Some("o3"));
                assert_eq!(doc["profiles"]["fast"]["model"].as_str(), Some("o4-mini"));
                for c in [
                    "# my Codex settings",
                    "# keep this comment",
                    "# the appliance",
                ] {
                    assert!(first.contains(c), "the comment {c:?} was lost:\n{first}");
                }
            }
            "claude-code" => {
                assert_eq!(doc["numStartups"].as_u64(), Some(7));
                assert_eq!(doc["theme"].as_str(), Some("dark"));
            }
            "opencode" => assert_eq!(doc["model"].as_str(), Some("anthropic/claude")),
            "openclaw" => assert_eq!(doc["gateway"]["port"].as_u64(), Some(18789)),
            _ => assert_eq!(doc["model"].as_str(), Some("hermes-4")),
        }

        // Again, over HTTP: the entry is replaced, not duplicated; a second
        // backup of what the first run wrote.
        std::thread::sleep(std::time::Duration::from_millis(1100));
        let r = connect(&s, home.path(), &[host, "--http", "--tenant", "team-a"]);
        ok(&r);
        assert!(
            r.err.contains("still works"),
            "{host}: the old token named: {}",
            r.err
        );
        let second = std::fs::read_to_string(&path).unwrap();
        let b = backups(&path);
        assert_eq!(b.len(), 2, "{host}: {b:?}");
        assert_eq!(std::fs::read_to_string(&b[1]).unwrap(), first, "{host}");
        let doc = parse(&second, format);
        let servers = at(&doc, &keys[..keys.len() - 1]).as_mapping().unwrap();
        let mut names: Vec<&str> = servers.keys().map(|k| k.as_str().unwrap()).collect();
        if *format == "toml" {
            names.sort(); // the toml crate's order, not the file's
            names.reverse();
        }
        assert_eq!(names, ["other", "cube"], "{host}: kept in place, once");
        assert_eq!(
            second.matches(&s.url).count(),
            1,
            "{host}: one entry:\n{second}"
        );
        assert!(
            servers["cube"]["url"].as_str().unwrap().contains("/mcp?"),
            "{host}"
        );
        assert!(servers["cube"].get("command").is_none(), "{host}");
        // A third identical run (the same token file) changes nothing.
        let tf = home
            .path()
            .join(format!(".config/cube-adapter/{host}.token"));
        let r = connect(
            &s,
            home.path(),
            &[host, "--http", "--token-file", tf.to_str().unwrap()],
        );
        ok(&r);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), second, "{host}");
        assert_eq!(backups(&path).len(), 2, "{host}");
        if *host == "codex" {
            assert_eq!(second.matches("[mcp_servers.cube]").count(), 1);
            assert!(second.contains("# keep this comment"));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_prints_the_change_and_writes_nothing() {
    let s = Server::start().await;
    let home = tempfile::tempdir().unwrap();
    for (host, file, _, _, _) in HOSTS {
        let path = home.path().join(file);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, existing(host)).unwrap();
        let before = s.token_list().len();
        let r = connect(&s, home.path(), &[host, "--tenant", "team-a", "--dry-run"]);
        ok(&r);
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            existing(host),
            "{host}"
        );
        assert!(backups(&path).is_empty(), "{host}");
        assert_eq!(s.token_list().len(), before, "{host}: no token made");
        assert!(!home.path().join(".config/cube-adapter").exists(), "{host}");
        assert!(
            r.out.contains(&format!("+++ {}", path.display())),
            "{host}: {}",
            r.out
        );
        assert!(
            r.out.contains(&s.url),
            "{host}: the new entry shown: {}",
            r.out
        );
        assert!(
            r.out.contains("\n-"),
            "{host}: the old entry shown removed: {}",
            r.out
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tools_are_restricted_with_each_hosts_filter() {
    let s = Server::start().await;
    let home = tempfile::tempdir().unwrap();
    let task = [
        "cube_task_templates",
        "cube_task_plan",
        "cube_task_submit",
        "cube_task_status",
        "cube_task_result",
        "cube_task_cancel",
        "cube_task_receipt",
    ];
    // The filter alone (hardened mode, the default here, has its own tests).
    let args = |h: &'static str| {
        [
            h,
            "--tenant",
            "team-a",
            "--tools",
            "cube_task_*",
            "--no-hardened",
        ]
    };

    ok(&connect(&s, home.path(), &args("codex")));
    let doc = parse(
        &std::fs::read_to_string(home.path().join(".codex/config.toml")).unwrap(),
        "toml",
    );
    assert_eq!(strings(&doc["mcp_servers"]["cube"]["enabled_tools"]), task);

    ok(&connect(&s, home.path(), &args("hermes")));
    let doc = parse(
        &std::fs::read_to_string(home.path().join(".hermes/config.yaml")).unwrap(),
        "yaml",
    );
    assert_eq!(
        strings(&doc["mcp_servers"]["cube"]["tools"]["include"]),
        task
    );

    // OpenCode: deny the server's tools, then allow those (last match wins).
    let oc = home.path().join(".config/opencode/opencode.json");
    std::fs::create_dir_all(oc.parent().unwrap()).unwrap();
    std::fs::write(
        &oc,
        r#"{"permission": {"bash": "ask", "cube_cube_exec": "allow"}}"#,
    )
    .unwrap();
    ok(&connect(&s, home.path(), &args("opencode")));
    let doc = parse(&std::fs::read_to_string(&oc).unwrap(), "json");
    let rules: Vec<(String, String)> = doc["permission"]
        .as_mapping()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.as_str().unwrap().into(), v.as_str().unwrap().into()))
        .collect();
    let mut want = vec![("bash".to_string(), "ask".to_string())];
    want.push(("cube_*".into(), "deny".into()));
    want.extend(
        task.iter()
            .map(|t| (format!("cube_{t}"), "allow".to_string())),
    );
    assert_eq!(rules, want, "the old cube rule replaced, in order");

    // Claude Code: its settings allow those and deny every other tool.
    let settings = home.path().join(".claude/settings.json");
    std::fs::create_dir_all(settings.parent().unwrap()).unwrap();
    std::fs::write(
        &settings,
        r#"{"model": "opus", "permissions": {"allow": ["Bash(ls:*)", "mcp__cube__cube_exec"], "deny": ["Read(./.env)"]}}"#,
    )
    .unwrap();
    ok(&connect(&s, home.path(), &args("claude-code")));
    let doc = parse(&std::fs::read_to_string(&settings).unwrap(), "json");
    assert_eq!(doc["model"].as_str(), Some("opus"));
    let allow = strings(&doc["permissions"]["allow"]);
    let deny = strings(&doc["permissions"]["deny"]);
    let mut want = vec!["Bash(ls:*)".to_string()];
    want.extend(task.iter().map(|t| format!("mcp__cube__{t}")));
    assert_eq!(allow, want);
    assert_eq!(deny[0], "Read(./.env)");
    for t in ["cube_exec", "cube_acquire", "cube_write_text"] {
        assert!(
            deny.contains(&format!("mcp__cube__{t}")),
            "{t} not denied: {deny:?}"
        );
    }
    assert!(!deny.iter().any(|d| d.contains("cube_task_")), "{deny:?}");
    assert_eq!(backups(&settings).len(), 1);

    // OpenClaw has no filter in its file: refused, nothing written.
    let before = s.token_list().len();
    let r = connect(&s, home.path(), &args("openclaw"));
    assert_eq!(r.code, 2, "{}", r.err);
    assert!(r.err.contains("openclaw mcp tools cube"), "{}", r.err);
    assert!(!home.path().join(".openclaw").exists());
    assert_eq!(s.token_list().len(), before);

    // An unknown tool is refused before anything happens.
    let r = connect(
        &s,
        home.path(),
        &["codex", "--tenant", "team-a", "--tools", "cube_nope"],
    );
    assert_eq!(r.code, 2);
    assert!(
        r.err.contains("cube_nope") && r.err.contains("cube_exec"),
        "{}",
        r.err
    );
    assert_eq!(s.token_list().len(), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_given_token_file_is_used_and_bad_input_is_refused() {
    let s = Server::start().await;
    let home = tempfile::tempdir().unwrap();
    // An existing token file: named as it is, no new token.
    let token = s.token(&["--tenant", "team-b", "--runtime", "mcp"]);
    let tf = home.path().join("my.token");
    std::fs::write(&tf, format!("{token}\n")).unwrap();
    let before = s.token_list().len();
    let r = connect(
        &s,
        home.path(),
        &["codex", "--token-file", tf.to_str().unwrap()],
    );
    ok(&r);
    assert_eq!(s.token_list().len(), before);
    assert!(!r.out.contains(&token) && !r.err.contains(&token));
    let doc = parse(
        &std::fs::read_to_string(home.path().join(".codex/config.toml")).unwrap(),
        "toml",
    );
    let args = strings(&doc["mcp_servers"]["cube"]["args"]);
    assert!(args.contains(&tf.to_str().unwrap().to_string()), "{args:?}");
    assert_eq!(std::fs::read_to_string(&tf).unwrap(), format!("{token}\n"));

    // No tenant and no token file: refused, nothing written.
    let r = connect(&s, home.path(), &["hermes"]);
    assert_eq!(r.code, 2);
    assert!(r.err.contains("--tenant"), "{}", r.err);
    assert!(!home.path().join(".hermes").exists());

    // A file that does not parse is left as it is.
    let bad = home.path().join(".openclaw/openclaw.json");
    std::fs::create_dir_all(bad.parent().unwrap()).unwrap();
    std::fs::write(&bad, "{ not json").unwrap();
    let r = connect(&s, home.path(), &["openclaw", "--tenant", "team-a"]);
    assert_eq!(r.code, 2, "{}", r.err);
    assert!(r.err.contains("not valid JSON"), "{}", r.err);
    assert_eq!(std::fs::read_to_string(&bad).unwrap(), "{ not json");
    assert!(backups(&bad).is_empty());
    assert_eq!(s.token_list().len(), before);

    // A bad profile, URL or token file.
    for (args, says) in [
        (
            vec!["codex", "--tenant", "t", "--profile", "a b"],
            "--profile",
        ),
        (
            vec!["codex", "--token-file", "/nonexistent/t"],
            "--token-file",
        ),
    ] {
        let r = connect(&s, home.path(), &args);
        assert_eq!(r.code, 2, "{args:?}: {}", r.err);
        assert!(r.err.contains(says), "{}", r.err);
    }
    let empty = home.path().join("empty-path");
    let out = std::process::Command::new(BIN)
        .args([
            "connect",
            "codex",
            "--tenant",
            "t",
            "--url",
            "http://cube.example:80/x",
        ])
        .arg("--state-dir")
        .arg(&s.state)
        .env_clear()
        .env("HOME", home.path())
        .env("PATH", &empty)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--url"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hosts_own_check_runs_when_it_is_installed() {
    let s = Server::start().await;
    let home = tempfile::tempdir().unwrap();
    // A `claude` on PATH that shows what it was asked and what it reads.
    let bin = home.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let claude = bin.join("claude");
    std::fs::write(
        &claude,
        "#!/bin/sh\nPATH=/usr/bin:/bin\necho \"checked: $*\"\ngrep -c '\"cube\"' \"$HOME/.claude.json\"\nexit 0\n",
    )
    .unwrap();
    std::fs::set_permissions(&claude, std::fs::Permissions::from_mode(0o755)).unwrap();
    let r = connect_in(
        &s,
        home.path(),
        &bin,
        &["claude-code", "--tenant", "team-a"],
    );
    ok(&r);
    assert!(r.out.contains("checked: mcp list"), "{}\n{}", r.out, r.err);
    assert!(
        r.out.contains("\n1\n"),
        "the check ran after the write: {}",
        r.out
    );
    // A failing check fails the command (the files stay written).
    std::fs::write(&claude, "#!/bin/sh\necho 'cube: failed' >&2\nexit 1\n").unwrap();
    let r = connect_in(
        &s,
        home.path(),
        &bin,
        &["claude-code", "--tenant", "team-a"],
    );
    assert_eq!(r.code, 1, "{}", r.err);
    assert!(r.err.contains("cube: failed"), "{}", r.err);
}

/// What `connect --hardened` writes, per host, as its page's "Hardened mode"
/// section says: the file (under HOME), its format, the lists that gain
/// entries and the keys set (and to what).
struct Hardened {
    host: &'static str,
    file: &'static str,
    format: &'static str,
    lists: &'static [(&'static [&'static str], &'static [&'static str])],
    values: &'static [(&'static [&'static str], &'static str)],
}

const HARDENED: &[Hardened] = &[
    Hardened {
        host: "claude-code",
        file: ".claude/settings.json",
        format: "json",
        lists: &[(
            &["permissions", "deny"],
            &[
                "Bash",
                "PowerShell",
                "Monitor",
                "Read",
                "Glob",
                "Grep",
                "LSP",
                "Edit",
                "Write",
                "NotebookEdit",
                "WebFetch",
                "WebSearch",
                "EnterWorktree",
                "ExitWorktree",
                "Workflow",
            ],
        )],
        values: &[],
    },
    Hardened {
        host: "codex",
        file: ".codex/config.toml",
        format: "toml",
        lists: &[],
        values: &[
            (&["sandbox_mode"], "read-only"),
            (&["approval_policy"], "never"),
            (&["web_search"], "disabled"),
            (&["features", "shell_tool"], "false"),
            (&["features", "view_image"], "false"),
            (&["features", "browser_use"], "false"),
            (&["features", "computer_use"], "false"),
        ],
    },
    Hardened {
        host: "opencode",
        file: ".config/opencode/opencode.json",
        format: "json",
        lists: &[],
        values: &[
            (&["permission", "bash"], "deny"),
            (&["permission", "edit"], "deny"),
            (&["permission", "read"], "deny"),
            (&["permission", "glob"], "deny"),
            (&["permission", "grep"], "deny"),
            (&["permission", "list"], "deny"),
            (&["permission", "lsp"], "deny"),
            (&["permission", "webfetch"], "deny"),
            (&["permission", "websearch"], "deny"),
            (&["permission", "external_directory"], "deny"),
        ],
    },
    Hardened {
        host: "openclaw",
        file: ".openclaw/openclaw.json",
        format: "json",
        lists: &[(
            &["tools", "deny"],
            &[
                "group:runtime",
                "group:fs",
                "group:web",
                "group:ui",
                "group:nodes",
                "group:automation",
                "ls",
                "view_image",
                "pdf",
            ],
        )],
        values: &[],
    },
    Hardened {
        host: "hermes",
        file: ".hermes/config.yaml",
        format: "yaml",
        lists: &[(
            &["agent", "disabled_toolsets"],
            &[
                "terminal",
                "file",
                "code_execution",
                "web",
                "browser",
                "computer_use",
                "vision",
                "video",
            ],
        )],
        values: &[],
    },
];

/// The "Hardened mode" section of a host's page.
fn hardened_section(host: &str) -> String {
    let page = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("docs/clients/{host}.md"));
    let text = std::fs::read_to_string(page).unwrap();
    let start = text
        .find("## Hardened mode")
        .unwrap_or_else(|| panic!("{host}.md has no \"## Hardened mode\" section"));
    let rest = &text[start + 3..];
    rest[..rest.find("\n## ").unwrap_or(rest.len())].to_string()
}

fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Bool(b) => b.to_string(),
        other => serde_json::to_string(other).unwrap(),
    }
}

/// The keys of a mapping, as a sorted list.
fn keys_of(v: &Value) -> Vec<String> {
    let mut k: Vec<String> = v
        .as_mapping()
        .map(|m| m.keys().map(|k| k.as_str().unwrap().to_string()).collect())
        .unwrap_or_default();
    k.sort();
    k
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hardened_mode_turns_off_each_hosts_own_tools_and_keeps_the_rest() {
    let s = Server::start().await;
    let home = tempfile::tempdir().unwrap();
    let token = s.token(&["--tenant", "team-a"]);
    let tf = home.path().join("hosts.token");
    std::fs::write(&tf, format!("{token}\n")).unwrap();
    let tf = tf.to_str().unwrap();
    for h in HARDENED {
        let (_, entry_file, entry_format, ..) = HOSTS.iter().find(|x| x.0 == h.host).unwrap();
        let entry_path = home.path().join(entry_file);
        std::fs::create_dir_all(entry_path.parent().unwrap()).unwrap();
        std::fs::write(&entry_path, existing(h.host)).unwrap();
        let path = home.path().join(h.file);
        // Claude Code's settings are a file of their own, with the user's rules.
        if h.host == "claude-code" {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(
                &path,
                r#"{"model": "opus", "permissions": {"allow": ["Bash(ls:*)"], "deny": ["Read(./.env)", "Bash"]}}"#,
            )
            .unwrap();
        }
        let before = parse(&std::fs::read_to_string(&path).unwrap(), h.format);

        // --dry-run shows it and writes nothing.
        let r = connect(
            &s,
            home.path(),
            &[h.host, "--hardened", "--token-file", tf, "--dry-run"],
        );
        ok(&r);
        assert!(r.out.contains("would turn off"), "{}: {}", h.host, r.out);
        assert_eq!(
            parse(&std::fs::read_to_string(&path).unwrap(), h.format),
            before
        );

        let r = connect(&s, home.path(), &[h.host, "--hardened", "--token-file", tf]);
        ok(&r);
        assert!(
            r.err.contains(&format!(
                "hardened: the host's own shell, file and web tools are off in {}",
                path.display()
            )),
            "{}: {}",
            h.host,
            r.err
        );
        let text = std::fs::read_to_string(&path).unwrap();
        let doc = parse(&text, h.format);
        let section = hardened_section(h.host);

        // Exactly the documented lists and keys, the user's own entries first.
        for (keys, names) in h.lists {
            let old = keys
                .iter()
                .try_fold(&before, |v, k| v.get(*k))
                .map(strings)
                .unwrap_or_default();
            let mut want = old.clone();
            want.extend(
                names
                    .iter()
                    .filter(|n| !old.contains(&n.to_string()))
                    .map(|n| n.to_string()),
            );
            assert_eq!(strings(at(&doc, keys)), want, "{}", h.host);
            for n in *names {
                assert!(r.err.contains(n), "{}: {n} not said: {}", h.host, r.err);
                assert!(
                    section.contains(&format!("`{n}`")),
                    "{}.md, Hardened mode, does not name `{n}`",
                    h.host
                );
            }
        }
        for (keys, v) in h.values {
            assert_eq!(scalar(at(&doc, keys)), *v, "{}: {}", h.host, keys.join("."));
            let key = keys.join(".");
            assert!(r.err.contains(&key), "{}: {key} not said", h.host);
            // As the page's block writes it: TOML or JSON.
            let k = keys[keys.len() - 1];
            assert!(
                [
                    format!("{k} = \"{v}\""),
                    format!("{k} = {v}"),
                    format!("\"{k}\": \"{v}\""),
                ]
                .iter()
                .any(|w| section.contains(w)),
                "{}.md, Hardened mode, does not show {key} = {v}",
                h.host
            );
        }
        // Nothing else: the top-level keys are the user's, the entry's and
        // the documented ones; the mappings the hardening writes into hold
        // only the documented keys (none of them was there before).
        let mut want_top: Vec<String> = keys_of(&before);
        want_top.extend(
            h.lists
                .iter()
                .map(|(k, _)| k[0])
                .chain(h.values.iter().map(|(k, _)| k[0]))
                .map(str::to_string),
        );
        if path == entry_path {
            want_top.extend(keys_of(&parse(existing(h.host), entry_format)));
            let entry_key = HOSTS.iter().find(|x| x.0 == h.host).unwrap().3[0];
            want_top.push(entry_key.to_string());
            if h.host == "opencode" {
                want_top.push("$schema".into());
            }
        }
        want_top.sort();
        want_top.dedup();
        assert_eq!(keys_of(&doc), want_top, "{}: {text}", h.host);
        for (keys, _) in h.values.iter().filter(|(k, _)| k.len() == 2) {
            let mut want: Vec<String> = h
                .values
                .iter()
                .filter(|(k, _)| k[0] == keys[0])
                .map(|(k, _)| k[1].to_string())
                .collect();
            want.sort();
            assert_eq!(keys_of(&doc[keys[0]]), want, "{}: {text}", h.host);
        }
        // The user's own settings are kept.
        match h.host {
            "claude-code" => {
                assert_eq!(doc["model"].as_str(), Some("opus"));
                assert_eq!(strings(&doc["permissions"]["allow"]), ["Bash(ls:*)"]);
            }
            "codex" => {
                assert_eq!(doc["model"].as_str(), Some("o3"));
                for c in ["# my Codex settings", "# keep this comment"] {
                    assert!(text.contains(c), "{c:?} lost:\n{text}");
                }
            }
            "opencode" => assert_eq!(doc["model"].as_str(), Some("anthropic/claude")),
            "openclaw" => assert_eq!(doc["gateway"]["port"].as_u64(), Some(18789)),
            _ => assert_eq!(doc["model"].as_str(), Some("hermes-4")),
        }

        // A second run changes nothing and backs up nothing more.
        let n = backups(&path).len();
        let r = connect(&s, home.path(), &[h.host, "--hardened", "--token-file", tf]);
        ok(&r);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), text, "{}", h.host);
        assert_eq!(backups(&path).len(), n, "{}", h.host);
        // Without --hardened, connect leaves the hardening as it is.
        ok(&connect(&s, home.path(), &[h.host, "--token-file", tf]));
        assert_eq!(
            parse(&std::fs::read_to_string(&path).unwrap(), h.format),
            doc,
            "{}",
            h.host
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hardened_mode_goes_with_tools() {
    let s = Server::start().await;
    let home = tempfile::tempdir().unwrap();
    let args = |h: &'static str| {
        [
            h,
            "--tenant",
            "team-a",
            "--tools",
            "cube_task_*",
            "--hardened",
        ]
    };
    let file = |f: &str, format: &str| {
        parse(
            &std::fs::read_to_string(home.path().join(f)).unwrap(),
            format,
        )
    };

    ok(&connect(&s, home.path(), &args("codex")));
    let doc = file(".codex/config.toml", "toml");
    assert!(
        strings(&doc["mcp_servers"]["cube"]["enabled_tools"])
            .iter()
            .all(|t| t.starts_with("cube_task_"))
    );
    assert_eq!(doc["features"]["shell_tool"].as_bool(), Some(false));
    assert_eq!(doc["sandbox_mode"].as_str(), Some("read-only"));

    ok(&connect(&s, home.path(), &args("hermes")));
    let doc = file(".hermes/config.yaml", "yaml");
    assert!(!strings(&doc["mcp_servers"]["cube"]["tools"]["include"]).is_empty());
    assert!(strings(&doc["agent"]["disabled_toolsets"]).contains(&"terminal".to_string()));

    ok(&connect(&s, home.path(), &args("opencode")));
    let doc = file(".config/opencode/opencode.json", "json");
    let p = &doc["permission"];
    assert_eq!(p["cube_*"].as_str(), Some("deny"));
    assert_eq!(p["cube_cube_task_plan"].as_str(), Some("allow"));
    assert_eq!(p["bash"].as_str(), Some("deny"));
    assert_eq!(p["read"].as_str(), Some("deny"));

    // Claude Code: one file with both, once each.
    ok(&connect(&s, home.path(), &args("claude-code")));
    ok(&connect(&s, home.path(), &args("claude-code")));
    let doc = file(".claude/settings.json", "json");
    let allow = strings(&doc["permissions"]["allow"]);
    let deny = strings(&doc["permissions"]["deny"]);
    assert!(
        allow.iter().all(|a| a.starts_with("mcp__cube__cube_task_")),
        "{allow:?}"
    );
    for d in ["mcp__cube__cube_exec", "Bash", "Read", "WebFetch"] {
        assert_eq!(deny.iter().filter(|x| *x == d).count(), 1, "{d}: {deny:?}");
    }

    // OpenClaw still refuses --tools, hardened or not; nothing written.
    let r = connect(&s, home.path(), &args("openclaw"));
    assert_eq!(r.code, 2, "{}", r.err);
    assert!(!home.path().join(".openclaw").exists());
}

/// On the appliance's own machine (the token is made there: a jump host)
/// hardened mode is the default, and `--no-hardened` refuses it; with a
/// token file (a host elsewhere) it is given or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hardened_mode_is_the_default_where_the_token_is_made() {
    let s = Server::start().await;
    let denied = |home: &Path| -> Vec<String> {
        std::fs::read_to_string(home.join(".claude/settings.json"))
            .map(|t| strings(&parse(&t, "json")["permissions"]["deny"]))
            .unwrap_or_default()
    };

    let here = tempfile::tempdir().unwrap();
    let r = connect(&s, here.path(), &["claude-code", "--tenant", "team-a"]);
    ok(&r);
    assert!(r.err.contains("hardened:"), "{}", r.err);
    assert!(denied(here.path()).contains(&"Bash".to_string()));

    let opted_out = tempfile::tempdir().unwrap();
    ok(&connect(
        &s,
        opted_out.path(),
        &["claude-code", "--tenant", "team-a", "--no-hardened"],
    ));
    assert!(!denied(opted_out.path()).contains(&"Bash".to_string()));

    let elsewhere = tempfile::tempdir().unwrap();
    let token = s.token(&["--tenant", "team-a"]);
    let tf = elsewhere.path().join("cube.token");
    std::fs::write(&tf, format!("{token}\n")).unwrap();
    ok(&connect(
        &s,
        elsewhere.path(),
        &["claude-code", "--token-file", tf.to_str().unwrap()],
    ));
    assert!(!denied(elsewhere.path()).contains(&"Bash".to_string()));

    let r = connect(
        &s,
        elsewhere.path(),
        &[
            "claude-code",
            "--hardened",
            "--no-hardened",
            "--token-file",
            tf.to_str().unwrap(),
        ],
    );
    assert_eq!(r.code, 2, "{}", r.err);
}
