//! Identities (#14, items 1 and 4): bearer tokens under a keyed hash, old
//! (argon2) token records rekeyed on first use, memory that stays put under
//! many tokens and failed sign-ins (a real `serve` process), and roles
//! whose default scopes mean what they say.

use cube_adapter::auth::{KEYED_PREFIX, Principal, Role, TokenRecord};
use cube_adapter::store::{Store, tables, typed};
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::kit::{BIN, Proc, ProcRig, Server, code};

/// The token record `id` as stored (the service stopped).
async fn stored(state: &std::path::Path, id: &str) -> TokenRecord {
    use typed::ReadOps;
    let store = Store::open(state).unwrap();
    let id = id.to_string();
    let rec: TokenRecord = store
        .read_now(move |txn| txn.record(tables::TOKENS, &id))
        .unwrap()
        .unwrap();
    store.close().await;
    rec
}

fn id_of(token: &str) -> &str {
    token.split('_').nth(1).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_token_records_keep_working_and_are_rekeyed() {
    use argon2::password_hash::{PasswordHasher, SaltString};
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let start = || {
        let state = state.clone();
        Server::start_with(move |c| c.state_dir = state)
    };
    // A new token is kept as a keyed hash.
    let s = start().await;
    let fresh = s.token(&["--tenant", "acme"]);
    s.stop().await;
    let rec = stored(&state, id_of(&fresh)).await;
    assert!(rec.hash.starts_with(KEYED_PREFIX), "{}", rec.hash);
    assert!(!rec.hash.contains(&fresh));

    // A record as an earlier version wrote it: argon2id of the token.
    let old = format!("cat_0123456789ab_{}", "Q".repeat(43));
    let salt = SaltString::encode_b64(&rand::random::<[u8; 16]>()).unwrap();
    let phc = argon2::Argon2::default()
        .hash_password(old.as_bytes(), &salt)
        .unwrap()
        .to_string();
    let rec = TokenRecord {
        id: "0123456789ab".into(),
        hash: phc.clone(),
        principal: Principal::unrestricted("acme", "old-agent", Role::Agent),
        created_at: "2025-01-01T00:00:00Z".into(),
        revoked_at: None,
        description: None,
        cert_sha256: None,
    };
    let store = Store::open(&state).unwrap();
    store
        .write(move |txn, _| typed::put(txn, tables::TOKENS, &rec.id, &rec))
        .await
        .unwrap();
    store.close().await;

    let s = start().await;
    let wrong = format!("cat_0123456789ab_{}", "R".repeat(43));
    let (st, v) = s.get(&wrong, "/v1/leases").await;
    assert_eq!(st, StatusCode::UNAUTHORIZED, "{v}");
    let (st, v) = s.get(&old, "/v1/leases").await;
    assert_eq!(st, StatusCode::OK, "the old token still works: {v}");
    let (st, v) = s.get(&fresh, "/v1/leases").await;
    assert_eq!(st, StatusCode::OK, "{v}");
    s.stop().await;
    let rec = stored(&state, "0123456789ab").await;
    assert!(
        rec.hash.starts_with(KEYED_PREFIX),
        "rewritten on first use: {}",
        rec.hash
    );
    assert_eq!(rec.principal.subject, "old-agent");
    assert_eq!(rec.principal.actions, ["*"], "its grants are untouched");

    // From now on checked by its keyed hash (a fresh process, no cache).
    let s = start().await;
    let (st, v) = s.get(&old, "/v1/leases").await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let (st, _) = s.get(&wrong, "/v1/leases").await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    s.stop().await;
}

/// `token list` as the CLI prints it (through the admin socket).
fn token_list(s: &Server, json: bool) -> String {
    let mut cmd = std::process::Command::new(BIN);
    cmd.args(["token", "list", "--state-dir"])
        .arg(&s.state)
        .arg("--config")
        .arg(s.empty_config());
    if json {
        cmd.arg("--json");
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roles_default_to_their_own_scopes() {
    let s = Server::start().await;
    let auditor = s.token(&["--tenant", "acme", "--subject", "aud", "--role", "auditor"]);
    let approver = s.token(&[
        "--tenant",
        "acme",
        "--subject",
        "appr",
        "--role",
        "approver",
    ]);
    let agent = s.token(&["--tenant", "acme", "--subject", "ag", "--role", "agent"]);
    let plain = s.token(&["--tenant", "acme", "--subject", "plain"]);
    let widened = s.token(&[
        "--tenant",
        "acme",
        "--subject",
        "wide",
        "--role",
        "auditor",
        "--action",
        "lease:*",
    ]);
    let acquire = json!({"runtime": "mcp", "session_key": "k"});

    for (who, t) in [("auditor", &auditor), ("approver", &approver)] {
        let (st, v) = s.post(t, "/v1/leases/acquire", acquire.clone()).await;
        assert_eq!(st, StatusCode::FORBIDDEN, "{who} may not acquire: {v}");
        assert_eq!(code(&v), "action_denied");
        let (st, v) = s.get(t, "/v1/leases").await;
        assert_eq!(st, StatusCode::OK, "{who} may read: {v}");
    }
    let lease = s.acquire(&agent, "agent-session").await;
    let (st, v) = s
        .post(
            &agent,
            &format!("/v1/leases/{lease}/exec"),
            json!({"command": "true"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    s.acquire(&plain, "plain-session").await;
    s.acquire(&widened, "wide-session").await;
    // A lease the auditor's tenant holds: visible, not usable.
    let (st, v) = s
        .post(
            &auditor,
            &format!("/v1/leases/{lease}/exec"),
            json!({"command": "true"}),
        )
        .await;
    assert_eq!(st, StatusCode::FORBIDDEN, "{v}");

    // `token list` shows the effective scopes.
    let listed: Value = serde_json::from_str(&token_list(&s, true)).unwrap();
    let scopes = |subject: &str| -> Vec<String> {
        let t = listed
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["principal"]["subject"] == subject)
            .unwrap();
        serde_json::from_value(t["principal"]["actions"].clone()).unwrap()
    };
    let aud = scopes("aud");
    assert!(aud.contains(&"lease:status".to_string()), "{aud:?}");
    assert!(
        !aud.iter()
            .any(|a| a == "*" || a.starts_with("lease:acquire") || a == "exec:run")
    );
    let appr = scopes("appr");
    assert!(appr.contains(&"task:approve".to_string()), "{appr:?}");
    assert!(!appr.iter().any(|a| a == "*" || a == "lease:*"), "{appr:?}");
    assert!(scopes("ag").contains(&"lease:*".to_string()));
    assert_eq!(scopes("ag"), scopes("plain"), "no role is the agent role");
    assert_eq!(
        scopes("wide"),
        ["lease:*"],
        "an explicit --action overrides"
    );
    let table = token_list(&s, false);
    let header = table.lines().next().unwrap();
    assert!(header.contains("SCOPES"), "{table}");
    let row = table.lines().find(|l| l.contains("aud ")).unwrap();
    assert!(
        row.contains("lease:status") && !row.contains("exec"),
        "{row}"
    );
    let row = table
        .lines()
        .find(|l| l.contains("bootstrap-admin"))
        .unwrap();
    assert!(row.trim_end().ends_with('*'), "{row}");
    s.stop().await;
}

fn rss_kib(pid: u32) -> u64 {
    cube_adapter::bench::rss_kib(pid)
}

/// A real `serve` process: many distinct tokens and many failed sign-ins
/// leave its memory where it was. The margins are generous (a debug build;
/// `bench identities` has the numbers): before #14, each argon2 check
/// allocated 19 MiB on whichever blocking thread ran it, and kept it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_stays_put_with_many_tokens_and_failed_sign_ins() {
    const TOKENS: usize = 24;
    const SIGN_INS: usize = 60;
    let (rig, p): (ProcRig, Proc) = ProcRig::start();
    let pid = p.child.id();
    // Stopped even when an assertion fails.
    struct Stop(Option<Proc>);
    impl Drop for Stop {
        fn drop(&mut self) {
            if let Some(p) = self.0.take() {
                p.stop();
            }
        }
    }
    let p = Stop(Some(p));
    let url = p.0.as_ref().unwrap().url.clone();
    // Warm: the first requests (TLS, pools) are not what is measured.
    for _ in 0..3 {
        let (st, _) = rig.call(format!("{url}/v1/leases"), None).await;
        assert_eq!(st, StatusCode::OK);
    }
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let idle = rss_kib(pid);

    let tokens: Vec<String> = (0..TOKENS)
        .map(|i| {
            let out = std::process::Command::new(BIN)
                .args(["token", "create", "--state-dir"])
                .arg(&rig.state)
                .arg("--config")
                .arg(&rig.config)
                .args(["--tenant", &format!("mem-{i}"), "--subject", "agent"])
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8(out.stdout).unwrap().trim().to_string()
        })
        .collect();
    let mut tasks = vec![];
    for (i, t) in tokens.into_iter().enumerate() {
        let (http, url) = (rig.http.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            let r = http
                .post(format!("{url}/v1/leases/acquire"))
                .bearer_auth(&t)
                .json(&json!({"runtime": "mcp", "session_key": format!("m{i}")}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), StatusCode::OK, "{}", r.text().await.unwrap());
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let loaded = rss_kib(pid);

    let mut tasks = vec![];
    for w in 0..4 {
        let (http, url) = (rig.http.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            let mut answered = [0usize; 2];
            for i in 0..SIGN_INS / 4 {
                let r = http
                    .get(format!("{url}/v1/leases"))
                    .basic_auth(
                        format!("nobody-{w}-{i}-{}", rand::random::<u32>()),
                        Some("not the password"),
                    )
                    .send()
                    .await
                    .unwrap();
                match r.status() {
                    StatusCode::UNAUTHORIZED => answered[0] += 1,
                    StatusCode::TOO_MANY_REQUESTS => answered[1] += 1,
                    s => panic!("a failed sign-in answered {s}"),
                }
            }
            answered
        }));
    }
    let mut refused = 0;
    for t in tasks {
        refused += t.await.unwrap()[0];
    }
    assert!(
        refused > 0,
        "some sign-ins were checked (not all throttled)"
    );
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let after = rss_kib(pid);
    eprintln!(
        "serve RSS: idle {idle} KiB, {TOKENS} tokens with leases {loaded} KiB, after {SIGN_INS} failed sign-ins {after} KiB ({refused} checked)"
    );
    assert!(
        loaded.saturating_sub(idle) < 24 * 1024,
        "{TOKENS} tokens with leases grew RSS from {idle} to {loaded} KiB"
    );
    assert!(
        after.saturating_sub(loaded) < 12 * 1024,
        "{SIGN_INS} failed sign-ins grew RSS from {loaded} to {after} KiB"
    );
    drop(p);
}

/// An HTTPS client of `s` whose connections come from `from` (another
/// loopback address: the appliance tells sources apart by address).
fn client_from(s: &Server, from: &str) -> reqwest::Client {
    let ca = std::fs::read(s.state.join("tls/ca.pem")).unwrap();
    reqwest::Client::builder()
        .tls_backend_preconfigured(cube_adapter::tls::client_config(Some(&ca), None).unwrap())
        .local_address(from.parse::<std::net::IpAddr>().unwrap())
        .build()
        .unwrap()
}

/// Guessing a token's secret, or a person's password, from one address
/// is refused there (429 `sign_in_throttled` with `Retry-After`) without
/// locking the agent or the person out elsewhere; each block is audited
/// once, however many attempts it refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guessing_is_throttled_where_it_comes_from() {
    let s = Server::start().await;
    let agent = s.token(&["--tenant", "acme", "--subject", "agent-7"]);
    let (prefix, id) = (agent.split('_').next().unwrap(), id_of(&agent));
    let wrong = format!("{prefix}_{id}_{}", "x".repeat(43));
    let attacker = client_from(&s, "127.0.0.2");
    let leases = format!("{}/v1/leases", s.url);
    let get = |c: &reqwest::Client, token: &str| {
        let r = c.get(&leases).bearer_auth(token);
        async move {
            let r = r.send().await.unwrap();
            let retry = r
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok());
            let (st, v) = crate::kit::spec::answer("GET", r).await;
            (st, code(&v).to_string(), retry)
        }
    };
    for _ in 0..cube_adapter::auth::MAX_FAILURES {
        let (st, c, _) = get(&attacker, &wrong).await;
        assert_eq!((st, c.as_str()), (StatusCode::UNAUTHORIZED, "unauthorized"));
    }
    // Blocked from there, the right secret included (it was never used).
    for t in [&wrong, &agent, &wrong] {
        let (st, c, retry) = get(&attacker, t).await;
        assert_eq!(
            (st, c.as_str()),
            (StatusCode::TOO_MANY_REQUESTS, "sign_in_throttled")
        );
        let retry = retry.expect("Retry-After");
        assert!((1..=60).contains(&retry), "{retry}");
    }
    // Not from where the agent runs.
    let (st, _) = s.get(&agent, "/v1/leases").await;
    assert_eq!(st, StatusCode::OK);

    // A person: the same, by name and address.
    let user = |args: &[&str], password: Option<&str>| {
        use std::io::Write;
        let mut c = std::process::Command::new(BIN)
            .arg("user")
            .args(args)
            .args(["--state-dir"])
            .arg(&s.state)
            .arg("--config")
            .arg(s.empty_config())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        if let Some(p) = password {
            c.stdin.take().unwrap().write_all(p.as_bytes()).unwrap();
        }
        c.wait_with_output().unwrap()
    };
    let out = user(
        &["add", "carol", "--tenant", "acme"],
        Some("carol's long password\n"),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let basic = |c: &reqwest::Client, pw: &'static str| {
        let r = c.get(&leases).basic_auth("carol", Some(pw));
        async move { r.send().await.unwrap().status() }
    };
    for _ in 0..cube_adapter::auth::MAX_FAILURES {
        assert_eq!(
            basic(&attacker, "a wrong guess").await,
            StatusCode::UNAUTHORIZED
        );
    }
    assert_eq!(
        basic(&attacker, "carol's long password").await,
        StatusCode::TOO_MANY_REQUESTS
    );
    let home = client_from(&s, "127.0.0.1");
    assert_eq!(basic(&home, "carol's long password").await, StatusCode::OK);

    // Two blocks, two events; the refused attempts add none. A block is
    // recorded by a task of its own, after the answer: wait for it.
    let blocks = |exported: &str| {
        exported
            .lines()
            .filter(|l| l.contains("\"action\":\"sign_in_throttled\""))
            .count()
    };
    let mut exported = s.journal();
    for _ in 0..100 {
        if blocks(&exported) >= 2 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        exported = s.journal();
    }
    // A moment more: a third would show now.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let exported = s.journal();
    assert_eq!(blocks(&exported), 2, "{exported}");
    s.stop().await;
}
