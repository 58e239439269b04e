//! Brokered egress (issue #39): a sandbox reaches the destinations its
//! profile names through the appliance's egress proxy (inside its own
//! network, `127.0.0.1:3128`), by name, with the credential added on the
//! way; the secret is nowhere in the sandbox; other names are refused, and
//! a direct connection has no way out. The destinations are servers of a
//! network namespace the test makes (`kit::world`): nothing leaves the host.

use std::net::{Ipv4Addr, SocketAddr};

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::kit::Server;
use crate::kit::world::World;
use cube_adapter::config::{Profile, ProfileEgress};

const ECHO: u16 = 8080;

/// Python for the sandbox: fetch each URL through the proxy, print
/// `STATUS BODY` or `STATUS CODE` for a refusal.
const FETCH: &str = r#"
import sys, urllib.request, urllib.error
o = urllib.request.build_opener(urllib.request.ProxyHandler({"http": "http://127.0.0.1:3128"}))
for u in sys.argv[1:]:
    req = urllib.request.Request(u, headers={"Authorization": "Bearer placeholder"})
    try:
        r = o.open(req, timeout=15)
        print(r.status, r.read().decode().replace("\r\n", "|"))
    except urllib.error.HTTPError as e:
        print(e.code, e.headers.get("x-cube-egress-error"))
    except Exception as e:
        print("cut", type(e).__name__)
"#;

async fn exec(s: &Server, lease: &str, command: &str) -> String {
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/exec"),
            json!({"command": command, "timeout_ms": 60000}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    format!(
        "{}{}",
        v["stdout"].as_str().unwrap_or(""),
        v["stderr"].as_str().unwrap_or("")
    )
}

fn fetch(urls: &[&str]) -> String {
    format!("python3 -c '{FETCH}' {}", urls.join(" "))
}

/// Where in the sandbox a value is found: every file outside the
/// read-only image of programs (`/usr`, the host's), and every process's
/// environment and command line. `pattern` is an extended regular
/// expression that matches the value without containing it, so the
/// search's own command line does not match.
fn search(pattern: &str) -> String {
    format!(
        "grep -rlaE '{pattern}' / --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev --exclude-dir=usr 2>/dev/null; \
         for f in /proc/[0-9]*/environ /proc/[0-9]*/cmdline; do grep -qaE '{pattern}' $f 2>/dev/null && echo $f; done; \
         env | grep -E '{pattern}' | sed 's/^/env: /'; echo searched"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_reaches_an_allowed_name_with_the_credential_it_never_holds() {
    let echo_at = Ipv4Addr::new(10, 79, 1, 2);
    let mut world = World::new(&[echo_at], &[], None, &[]);
    world.serve_http_echo(SocketAddr::from((echo_at, ECHO)));

    let secrets = tempfile::tempdir().unwrap();
    let secret = format!("sk-brokered-{}", std::process::id());
    let key = secrets.path().join("api-token");
    std::fs::write(&key, format!("{secret}\n")).unwrap();
    let egress: ProfileEgress = toml::from_str(&format!(
        r#"
destinations = ["api.test.invalid:{ECHO}", "*.mirror.test.invalid:{ECHO}"]
[credentials."api.test.invalid:{ECHO}"]
secret_file = "{}"
"#,
        key.display()
    ))
    .unwrap();
    let mut tight = egress.clone();
    tight.credentials.clear();
    tight.requests_per_second = 1;
    let mut budget = tight.clone();
    budget.requests_per_second = 100;
    budget.max_bytes = 700;
    let s = Server::start_with(move |c| {
        for name in [
            "api.test.invalid",
            "pkgs.mirror.test.invalid",
            "other.test.invalid",
        ] {
            c.egress.resolve.insert(name.into(), echo_at.into());
        }
        c.profiles.insert(
            "brokered".into(),
            Profile {
                egress: Some(egress),
                ..Profile::default()
            },
        );
        c.profiles.insert(
            "tight".into(),
            Profile {
                egress: Some(tight),
                ..Profile::default()
            },
        );
        c.profiles.insert(
            "budget".into(),
            Profile {
                egress: Some(budget),
                ..Profile::default()
            },
        );
    })
    .await;
    let lease = s.acquire_in("brokered", "egress").await;

    // Through the proxy: the allowed name gets the credential (in place of
    // the sandbox's placeholder), a wildcard name none, another name is
    // refused.
    let api = format!("http://api.test.invalid:{ECHO}/v1/models?x=1");
    let mirror = format!("http://pkgs.mirror.test.invalid:{ECHO}/simple/");
    let other = format!("http://other.test.invalid:{ECHO}/");
    let out = exec(&s, &lease, &fetch(&[&api, &mirror, &other])).await;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    assert!(
        lines[0].starts_with("200 GET /v1/models?x=1 HTTP/1.1|"),
        "{out}"
    );
    assert!(
        lines[0].contains(&format!("|authorization: Bearer {secret}|")),
        "{out}"
    );
    assert!(!lines[0].contains("placeholder"), "{out}");
    assert!(!lines[0].to_ascii_lowercase().contains("proxy-"), "{out}");
    assert!(lines[1].starts_with("200 GET /simple/ HTTP/1.1|"), "{out}");
    assert!(
        lines[1].contains("|authorization: Bearer placeholder|"),
        "{out}"
    );
    assert_eq!(lines[2], "403 egress_destination_denied", "{out}");
    // Commands find the proxy in their environment: a tool that reads
    // http_proxy needs no setting of its own.
    let out = exec(
        &s,
        &lease,
        &format!(
            "python3 -c 'import os, urllib.request; print(os.environ[\"http_proxy\"], os.environ[\"no_proxy\"]); r = urllib.request.urlopen(\"http://api.test.invalid:{ECHO}/env\", timeout=15); print(r.status, \"Bearer sk-brokered\" in r.read().decode())'"
        ),
    )
    .await;
    assert_eq!(
        out, "http://127.0.0.1:3128 localhost,127.0.0.1,::1\n200 True\n",
        "{out}"
    );

    // A direct connection has no way out of the sandbox.
    let direct = exec(
        &s,
        &lease,
        &format!(
            "python3 -c 'import socket; socket.create_connection((\"{echo_at}\", {ECHO}), timeout=5)' 2>&1 | tail -n1"
        ),
    )
    .await;
    assert!(
        direct.contains("Network is unreachable") || direct.contains("refused"),
        "{direct}"
    );

    // The secret is nowhere in the sandbox. The search finds what is
    // there: a value put in a file and in a process's environment.
    let (head, tail) = secret.split_at(4);
    let pattern = format!("{head}[{}]{}", &tail[..1], &tail[1..]);
    let canary = format!("canary-{}", std::process::id());
    let (ch, ct) = canary.split_at(3);
    let canary_pattern = format!("{ch}[{}]{}", &ct[..1], &ct[1..]);
    let found = exec(
        &s,
        &lease,
        &format!(
            "echo {canary} > /workspace/canary; CANARY={canary} sleep 30 & sleep 0.2; {}",
            search(&canary_pattern)
        ),
    )
    .await;
    assert!(found.contains("/workspace/canary\n"), "{found}");
    assert!(found.contains("/environ\n"), "{found}");
    let found = exec(&s, &lease, &search(&pattern)).await;
    assert_eq!(found, "searched\n", "the secret is in the sandbox: {found}");

    // The journal: an intent and an outcome per allowed request (the
    // destination in clear, the status, the bytes), a refusal with a
    // digest only; never the secret.
    let journal = s.journal();
    assert!(!journal.contains(&secret), "the secret is in the journal");
    let events = s.events("egress_request");
    let ok: Vec<&Value> = events
        .iter()
        .filter(|e| e["phase"] == "outcome" && e["outcome"] == "ok")
        .collect();
    assert_eq!(ok.len(), 3, "{events:#?}");
    let api_ok = ok
        .iter()
        .find(|e| e["destination"] == format!("api.test.invalid:{ECHO}"))
        .expect("the api request's outcome");
    assert_eq!(api_ok["method"], "GET");
    assert_eq!(api_ok["http_status"], 200);
    assert!(api_ok["bytes"].as_u64().unwrap_or(0) > 100, "{api_ok}");
    assert_eq!(api_ok["lease_ref"], lease.as_str());
    assert!(
        events
            .iter()
            .any(|e| e["phase"] == "intent"
                && e["destination"] == format!("api.test.invalid:{ECHO}"))
    );
    let refused: Vec<&Value> = events
        .iter()
        .filter(|e| e["outcome"] == "rejected")
        .collect();
    assert_eq!(refused.len(), 1, "{events:#?}");
    assert_eq!(refused[0]["error_code"], "egress_destination_denied");
    assert!(refused[0]["destination"].is_null());
    assert!(refused[0]["destination_digest"].is_string());
    assert!(!journal.contains("other.test.invalid"));

    // /metrics counts them (open /metrics names no profile).
    let m = s
        .http
        .get(format!("{}/metrics", s.url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        m.contains("cube_adapter_egress_requests_total{result=\"ok\"} 3"),
        "{m}"
    );
    assert!(
        m.contains("cube_adapter_egress_requests_total{result=\"egress_destination_denied\"} 1"),
        "{m}"
    );
    assert!(m.contains("cube_adapter_egress_bytes_total{direction=\"in\"}"));

    // An operator narrows the live lease: the credentialled name goes,
    // the wildcard stays; it cannot be widened again.
    let out = s.cli(&["lease", "egress", &lease]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("api.test.invalid:{ECHO}\n*.mirror.test.invalid:{ECHO}\n")
    );
    let keep = format!("*.mirror.test.invalid:{ECHO}");
    let out = s.cli(&["lease", "egress", &lease, "--only", &keep]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), format!("{keep}\n"));
    let out = exec(&s, &lease, &fetch(&[&api, &mirror])).await;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "403 egress_destination_denied", "{out}");
    assert!(lines[1].starts_with("200 GET /simple/ "), "{out}");
    let wide = format!("api.test.invalid:{ECHO}");
    let out = s.cli(&["lease", "egress", &lease, "--only", &keep, "--only", &wide]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("can only be narrowed"),
        "{out:?}"
    );
    let narrowed = s.events("egress_narrow");
    assert_eq!(narrowed.len(), 1, "{narrowed:#?}");
    assert_eq!(narrowed[0]["destination"], keep.as_str());
    assert_eq!(narrowed[0]["lease_ref"], lease.as_str());
    let (st, v) = s.get(&s.admin, &format!("/v1/leases/{lease}/status")).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["egress"]["destinations"], json!([keep]), "{v}");
    assert_eq!(v["egress"]["narrowed"], true, "{v}");
    assert_eq!(v["egress"]["proxy"], "http://127.0.0.1:3128", "{v}");
    assert!(!v.to_string().contains(&*key.to_string_lossy()), "{v}");

    // A lease over its rate is refused with 429 (and not journaled).
    let tight = s.acquire_in("tight", "egress-tight").await;
    let many: Vec<&str> = std::iter::repeat_n(mirror.as_str(), 6).collect();
    let out = exec(&s, &tight, &fetch(&many)).await;
    assert!(out.lines().any(|l| l == "429 egress_rate_limited"), "{out}");
    assert!(out.lines().any(|l| l.starts_with("200 ")), "{out}");

    // A lease past its bytes is refused (an answer under way is cut).
    let budget = s.acquire_in("budget", "egress-budget").await;
    let many: Vec<&str> = std::iter::repeat_n(mirror.as_str(), 5).collect();
    let out = exec(&s, &budget, &fetch(&many)).await;
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("200 "), "{out}");
    assert_eq!(lines.last(), Some(&"403 egress_budget_exceeded"), "{out}");
    let over = s
        .journal()
        .lines()
        .filter(|l| l.contains("\"egress_budget_exceeded\"") && l.contains(&budget))
        .count();
    assert!(over >= 1, "no budget refusal in the journal");
}

/// The origin (`tests/egress/origin.py`) in the world's namespace, serving
/// `root` over HTTPS with `cert`; killed when dropped.
struct Origin(std::process::Child);

impl Origin {
    fn start(
        world: &World,
        at: Ipv4Addr,
        root: &std::path::Path,
        tls: &std::path::Path,
        auth: &str,
    ) -> Self {
        use std::io::BufRead;
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/egress/origin.py");
        let mut child = std::process::Command::new("ip")
            .args(["netns", "exec", world.netns(), "python3", script])
            .arg(at.to_string())
            .arg("443")
            .arg(root)
            .arg(tls.join("origin.pem"))
            .arg(tls.join("origin.key"))
            .env("ORIGIN_AUTH", auth)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("start the origin");
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert_eq!(line, "ready\n", "the origin did not start");
        // Its request lines: kept for a failure's message.
        let log = tls.join("origin.log");
        std::thread::spawn(move || {
            for l in out.lines().map_while(Result::ok) {
                let _ = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&log)
                    .and_then(|mut f| {
                        std::io::Write::write_all(&mut f, format!("{l}\n").as_bytes())
                    });
            }
        });
        Self(child)
    }
}

impl Drop for Origin {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// git over HTTPS, pip and npm in a sandbox, through the proxy to an origin
/// that wants basic authentication: the proxy ends the sandbox's TLS with
/// the egress CA (which the sandbox trusts), adds the credential and speaks
/// TLS to the origin (which the appliance trusts through `[egress]
/// upstream_ca_file`). Each request the tools make is in the journal; the
/// secret is not, nor in the sandbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn git_pip_and_npm_work_through_the_proxy_with_an_intercepted_credential() {
    let origin_at = Ipv4Addr::new(10, 79, 2, 2);
    let world = World::new(&[origin_at], &[], None, &[]);
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let out = std::process::Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/egress/fixtures.py"
        ))
        .arg(&root)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    // The origin's certificate, from a CA of the test's own.
    let tls = dir.path().join("tls");
    let ca = cube_adapter::tls::LocalCa::load_or_create(&tls).unwrap();
    let names: Vec<String> = ["git", "pypi", "npm"]
        .iter()
        .map(|n| format!("{n}.test.invalid"))
        .collect();
    let (cert, key) = ca.issue_server(&names).unwrap();
    std::fs::write(tls.join("origin.pem"), cert).unwrap();
    std::fs::write(tls.join("origin.key"), key).unwrap();
    let secret = format!("pw-intercepted-{}", std::process::id());
    let secret_file = dir.path().join("ci-password");
    std::fs::write(&secret_file, &secret).unwrap();
    use base64::Engine;
    let auth = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("ci:{secret}"))
    );
    let _origin = Origin::start(&world, origin_at, &root, &tls, &auth);

    let mut egress: ProfileEgress = toml::from_str(
        r#"destinations = ["git.test.invalid:443", "pypi.test.invalid:443", "npm.test.invalid:443"]"#,
    )
    .unwrap();
    for d in egress.destinations.clone() {
        egress.credentials.insert(
            d,
            toml::from_str(&format!(
                "secret_file = \"{}\"\nbasic_user = \"ci\"\nintercept = true",
                secret_file.display()
            ))
            .unwrap(),
        );
    }
    let (names2, ca_file) = (names.clone(), tls.join("ca.pem"));
    let s = Server::start_with(move |c| {
        for n in &names2 {
            c.egress.resolve.insert(n.clone(), origin_at.into());
        }
        c.egress.upstream_ca_file = Some(ca_file);
        c.profiles.insert(
            "builds".into(),
            Profile {
                egress: Some(egress),
                ..Profile::default()
            },
        );
    })
    .await;
    let lease = s.acquire_in("builds", "tools").await;
    // The sandbox trusts the egress CA (a template or preset would install
    // it; here the test writes it).
    let egress_ca = std::fs::read_to_string(s.state.join("egress/ca.pem")).unwrap();
    assert!(!egress_ca.contains("PRIVATE"));
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/write"),
            json!({"path": "/workspace/egress-ca.pem", "content": egress_ca}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");

    let script = "set -e; P=http://127.0.0.1:3128; CA=/workspace/egress-ca.pem; cd /workspace; \
        git -c http.proxy=$P -c http.sslCAInfo=$CA clone -q https://git.test.invalid/repo.git repo; \
        echo git: $(cat repo/README); \
        python3 -m pip download -q --no-deps --disable-pip-version-check --no-cache-dir \
          --index-url https://pypi.test.invalid/simple/ --proxy $P --cert $CA -d pip cubetestpkg; \
        echo pip: $(ls pip); \
        mkdir npmproj; cd npmproj; \
        npm install -q --no-audit --no-fund --no-update-notifier --registry https://npm.test.invalid/ \
          --proxy $P --https-proxy $P --cafile $CA cubetestpkg >/dev/null 2>&1 || { cat /root/.npm/_logs/*.log | tail -n 30; exit 1; }; \
        echo npm: $(cat node_modules/cubetestpkg/package.json)";
    let out = exec(&s, &lease, script).await;
    let log = std::fs::read_to_string(tls.join("origin.log")).unwrap_or_default();
    assert!(
        out.contains("git: cloned through the egress proxy\n"),
        "{out}\norigin:\n{log}"
    );
    assert!(
        out.contains("pip: cubetestpkg-1.0-py3-none-any.whl\n"),
        "{out}\norigin:\n{log}"
    );
    assert!(
        out.contains("npm: {\"name\": \"cubetestpkg\""),
        "{out}\norigin:\n{log}"
    );
    // Every request reached the origin with the credential.
    assert!(!log.contains("auth=no"), "{log}");
    assert!(log.contains("GET /repo.git/info/refs auth=ok"), "{log}");
    assert!(
        log.contains("GET /files/cubetestpkg-1.0-py3-none-any.whl auth=ok"),
        "{log}"
    );
    assert!(
        log.contains("GET /tarballs/cubetestpkg-1.0.0.tgz auth=ok"),
        "{log}"
    );

    // In the journal, each request the tools made, by name; never the
    // secret. In the sandbox, no secret.
    let journal = s.journal();
    assert!(!journal.contains(&secret));
    assert!(!journal.contains(auth.trim_start_matches("Basic ")));
    let outcomes: Vec<Value> = s
        .events("egress_request")
        .into_iter()
        .filter(|e| e["phase"] == "outcome")
        .collect();
    for n in &names {
        let d = format!("{n}:443");
        assert!(
            outcomes.iter().any(|e| e["destination"] == d.as_str()
                && e["http_status"] == 200
                && e["method"] == "GET"),
            "no GET to {d} in {outcomes:#?}"
        );
    }
    let (head, tail) = secret.split_at(3);
    let pattern = format!("{head}[{}]{}", &tail[..1], &tail[1..]);
    let found = exec(&s, &lease, &search(&pattern)).await;
    assert_eq!(found, "searched\n", "the secret is in the sandbox: {found}");
}

/// The proxy's network listener (`[egress] listen`), for sandboxes that
/// reach the appliance over the network (a CubeSandbox deployment's): a
/// request names its lease and that lease's token, which the appliance
/// wrote in the sandbox at acquire; without them, or with another lease's
/// name, 407. The test process stands in for such a sandbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_network_listener_wants_the_lease_and_its_token() {
    let echo_at = Ipv4Addr::new(10, 79, 3, 2);
    let mut world = World::new(&[echo_at], &[], None, &[]);
    world.serve_http_echo(SocketAddr::from((echo_at, ECHO)));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = tempfile::tempdir().unwrap();
    let secret = format!("sk-network-{}", std::process::id());
    let key = dir.path().join("token");
    std::fs::write(&key, &secret).unwrap();
    let egress: ProfileEgress = toml::from_str(&format!(
        "destinations = [\"api.test.invalid:{ECHO}\"]\n[credentials.\"api.test.invalid:{ECHO}\"]\nsecret_file = \"{}\"\n",
        key.display()
    ))
    .unwrap();
    let s = Server::start_with(move |c| {
        c.egress.listen = Some(SocketAddr::from(([127, 0, 0, 1], port)));
        c.egress
            .resolve
            .insert("api.test.invalid".into(), echo_at.into());
        c.profiles.insert(
            "net".into(),
            Profile {
                egress: Some(egress),
                ..Profile::default()
            },
        );
    })
    .await;
    let a = s.acquire_in("net", "a").await;
    let b = s.acquire_in("net", "b").await;
    let env = exec(&s, &a, "cat /run/cube-adapter/egress.env").await;
    let url = env
        .lines()
        .find_map(|l| l.strip_prefix("http_proxy="))
        .expect("an http_proxy line")
        .to_string();
    let prefix = format!("http://{a}:");
    assert!(url.starts_with(&prefix), "{url}");
    assert!(url.ends_with(&format!("@127.0.0.1:{port}")), "{url}");
    let token = url[prefix.len()..url.len() - format!("@127.0.0.1:{port}").len()].to_string();
    assert_eq!(token.len(), 64, "{url}");

    let target = format!("http://api.test.invalid:{ECHO}/net");
    let via = |proxy: &str| {
        reqwest::Client::builder()
            .proxy(reqwest::Proxy::http(proxy).unwrap())
            .build()
            .unwrap()
    };
    let r = via(&url).get(&target).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let body = r.text().await.unwrap();
    assert!(
        body.contains(&format!("authorization: Bearer {secret}\r\n")),
        "{body}"
    );
    for proxy in [
        format!("http://127.0.0.1:{port}"),
        format!("http://{b}:{token}@127.0.0.1:{port}"),
        format!("http://{a}:{}@127.0.0.1:{port}", "0".repeat(64)),
    ] {
        let r = via(&proxy).get(&target).send().await.unwrap();
        assert_eq!(
            r.status(),
            StatusCode::PROXY_AUTHENTICATION_REQUIRED,
            "{proxy}"
        );
        assert_eq!(
            r.headers()["x-cube-egress-error"],
            "egress_proxy_auth_required"
        );
        assert!(r.headers().contains_key("proxy-authenticate"));
    }
    let journal = s.journal();
    assert!(!journal.contains(&secret));
    assert!(!journal.contains(&token));
    let ok: Vec<Value> = s
        .events("egress_request")
        .into_iter()
        .filter(|e| e["phase"] == "outcome" && e["outcome"] == "ok")
        .collect();
    assert_eq!(ok.len(), 1, "{ok:#?}");
    assert_eq!(ok[0]["lease_ref"], a.as_str());
}
