//! Template presets (`[presets.NAME]`) applied at acquire on the embedded
//! backend: bootstrap, a file with two `${FILE:…}` secrets written 0600 with
//! the values read, a command after, pre-checks; a failing pre-check fails
//! the acquire and leaves no sandbox; each step is in the journal, never a
//! secret.

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::kit::{Server, code};
use cube_adapter::config::{Preset, Profile};

fn preset(key: &std::path::Path, url: &std::path::Path, precheck: &str) -> Preset {
    toml::from_str(&format!(
        r#"
version = "2026-12-07"
bootstrap = ["mkdir -p /root/.claw && echo booted > /root/.claw/boot"]
after = ["echo restarted > /root/.claw/after"]
prechecks = ["test -s /root/.claw/claw.json", "{precheck}"]
[[files]]
path = "/root/.claw/claw.json"
content = '{{"apiKey": "${{FILE:{}}}", "baseUrl": "${{FILE:{}}}"}}'
[[files]]
path = "/root/.claw/big.txt"
content = "{big}"
mode = "0640"
[models]
provider = "deepseek"
available = ["deepseek-chat"]
default = "deepseek/deepseek-chat"
"#,
        key.display(),
        url.display(),
        big = "b".repeat(200 * 1024),
    ))
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preset_writes_its_secrets_0600_and_a_failed_precheck_keeps_no_sandbox() {
    let secrets = tempfile::tempdir().unwrap();
    let key = secrets.path().join("api-key");
    let url = secrets.path().join("base-url");
    std::fs::write(&key, "sk-preset-secret-4711\n").unwrap();
    std::fs::write(&url, "http://models.test.invalid/v1").unwrap();
    let (k2, u2) = (key.clone(), url.clone());
    let s = Server::start_with(move |c| {
        c.presets.insert("claw".into(), preset(&k2, &u2, "true"));
        c.presets.insert(
            "claw-broken".into(),
            preset(&k2, &u2, "test -e /nonexistent"),
        );
        for (name, pr) in [("claw", "claw"), ("claw-broken", "claw-broken")] {
            c.profiles.insert(
                name.into(),
                Profile {
                    template_preset: Some(pr.into()),
                    ..Profile::default()
                },
            );
        }
    })
    .await;

    let lease = s.acquire_in("claw", "preset").await;
    // Its status names the preset as applied (and no egress: none here).
    let (st, v) = s.get(&s.admin, &format!("/v1/leases/{lease}/status")).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["preset"], "claw@2026-12-07", "{v}");
    let digest = v["preset_digest"].as_str().unwrap_or_default();
    assert!(
        digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_hexdigit()),
        "{v}"
    );
    assert!(v.get("egress").is_none(), "{v}");
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/exec"),
            json!({"command": "stat -c %a /root/.claw/claw.json; cat /root/.claw/claw.json; echo; cat /root/.claw/boot /root/.claw/after; stat -c '%a %s' /root/.claw/big.txt; ls /root/.claw"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(
        v["stdout"],
        "600\n{\"apiKey\": \"sk-preset-secret-4711\", \"baseUrl\": \"http://models.test.invalid/v1\"}\nbooted\nrestarted\n640 204800\nafter\nbig.txt\nboot\nclaw.json\n",
        "{v}"
    );

    // A failing pre-check: no lease, no sandbox.
    let before = s.sandboxes();
    let (st, v) = s
        .post(
            &s.admin,
            "/v1/leases/acquire",
            json!({"runtime": "mcp", "session_key": "broken", "profile": "claw-broken"}),
        )
        .await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::BAD_GATEWAY, "preset_check_failed"),
        "{v}"
    );
    for _ in 0..50 {
        if s.sandboxes() == before {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(s.sandboxes(), before, "the sandbox was killed");

    // The journal: every step, with digests; no secret.
    let journal = s.journal();
    let steps: Vec<Value> = journal
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|e| e["action"] == "preset_step" && e["phase"] == "outcome")
        .collect();
    let kinds: Vec<&str> = steps
        .iter()
        .take(6)
        .map(|e| e["release_action"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        [
            "preset:bootstrap",
            "preset:file",
            "preset:file",
            "preset:after",
            "preset:precheck",
            "preset:precheck"
        ]
    );
    assert!(
        steps.iter().take(5).all(|e| e["outcome"] == "ok"),
        "{steps:?}"
    );
    let failed: Vec<&Value> = steps.iter().filter(|e| e["outcome"] == "error").collect();
    assert_eq!(failed.len(), 1, "{steps:?}");
    assert_eq!(failed[0]["error_code"], "preset_check_failed");
    assert!(
        !journal.contains("sk-preset-secret"),
        "no secret in the journal"
    );
    assert!(!journal.contains("models.test.invalid"));
}
