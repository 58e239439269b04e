//! Sandboxes' networks (docs/security.md, "Network"): each sandbox has its
//! own network namespace; egress goes through pasta and a filter the
//! sandbox cannot change. The destinations are servers this test starts in
//! a network namespace of its own (`kit::world`): nothing leaves the host.

use std::net::{Ipv4Addr, SocketAddr, TcpListener};

use cube_adapter::cube::wire::{CreateSandbox, NetworkPolicy};

use crate::kit::world::{World, hello};
use crate::kit::{BIN, MB, TestBackend, sh};

const OPEN: u16 = 8081;
const OTHER: u16 = 8082;

fn v4(s: &str) -> Ipv4Addr {
    s.parse().unwrap()
}

fn at(a: &str, p: u16) -> SocketAddr {
    SocketAddr::from((v4(a), p))
}

/// A shell script that tries each `ADDR:PORT` and prints
/// `ADDR:PORT hello …` or `ADDR:PORT no: <the error>`.
fn probes(targets: &[String]) -> String {
    format!(
        "for t in {}; do \
           if out=$(timeout 5 bash -c \"exec 3<>/dev/tcp/${{t%:*}}/${{t##*:}} && head -n1 <&3\" 2>&1); \
           then echo \"$t $out\"; else echo \"$t no: ${{out##*: }}\"; fi; \
         done",
        targets.join(" ")
    )
}

/// The sandbox's own view of its network, printed after its probes.
const SANDBOX_NET: &str = "echo '-- the sandbox network:'; ip -4 -o addr 2>&1; ip -4 route 2>&1";

/// The host's side, for a failure message: the pasta processes and the
/// host's routes.
fn host_net() -> String {
    let run = |c: &str, a: &[&str]| {
        std::process::Command::new(c)
            .args(a)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_else(|e| format!("{c}: {e}"))
    };
    format!(
        "-- the host's pasta processes:\n{}-- the host's routes:\n{}",
        run("pgrep", &["-a", "pasta"]),
        run("ip", &["-4", "route"])
    )
}

fn line<'a>(out: &'a str, target: &str) -> &'a str {
    out.lines()
        .find(|l| l.starts_with(&format!("{target} ")))
        .unwrap_or_else(|| panic!("no line for {target} in:\n{out}"))
}

fn reached(out: &str, target: &str) -> bool {
    let l = line(out, target);
    if l == format!("{target} hello {target}") {
        return true;
    }
    assert!(l.starts_with(&format!("{target} no: ")), "{l}");
    false
}

fn create(internet: bool, allow: &[&str], deny: &[&str]) -> CreateSandbox {
    let list = |v: &[&str]| (!v.is_empty()).then(|| v.iter().map(|s| s.to_string()).collect());
    CreateSandbox {
        template_id: "minimal".into(),
        allow_internet_access: Some(internet),
        network: Some(NetworkPolicy {
            allow_out: list(allow),
            deny_out: list(deny),
            allow_public_traffic: None,
        }),
        ..Default::default()
    }
}

/// The backend's own policy work, on one world: allow beats deny beats the
/// default; the host's addresses and loopback are never reached, whatever
/// the policy names; names resolve through pasta to the host's resolver
/// (here the test's, through a launcher whose `/etc/resolv.conf` names it);
/// the sandbox's root can change neither the filter nor the interface.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_follows_the_policy_and_never_reaches_the_host() {
    let world = World::new(
        &[
            v4("10.77.1.2"),
            v4("10.77.1.3"),
            v4("198.51.100.2"),
            v4("198.51.100.3"),
        ],
        &[
            at("10.77.1.2", OPEN),
            at("10.77.1.2", OTHER),
            at("10.77.1.3", OPEN),
            at("198.51.100.2", OPEN),
            at("198.51.100.2", OTHER),
            at("198.51.100.3", OPEN),
        ],
        Some(v4("10.77.1.2")),
        &[("svc.cube.test", v4("198.51.100.2"))],
    );
    assert_eq!(hello(at("10.77.1.3", OPEN)), "hello 10.77.1.3:8081\n");
    // A service of the host's, on every address: reachable from the host.
    let host_svc = TcpListener::bind("0.0.0.0:0").unwrap();
    let hp = host_svc.local_addr().unwrap().port();
    let host_at = format!("{}:{hp}", world.host_addr);
    std::net::TcpStream::connect(&host_at).unwrap();

    // The launcher sees the world's name server as the host's resolver.
    let dir = tempfile::tempdir().unwrap();
    let resolv = dir.path().join("resolv.conf");
    std::fs::write(&resolv, "nameserver 10.77.1.2\n").unwrap();
    let launcher = dir.path().join("launcher");
    std::fs::write(
        &launcher,
        format!(
            "#!/bin/sh\nexec unshare --mount --propagation private sh -c \
             'mount --bind \"$0\" /etc/resolv.conf && exec \"$@\"' {} {BIN} \"$@\"\n",
            resolv.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(
        &launcher,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let t = TestBackend::start_with(|s| s.launcher = launcher.clone()).await;

    // Internet access, one address of a denied range allowed (one port),
    // one public address denied, and the host's own address "allowed".
    let sb = t
        .sandbox_with(create(
            true,
            &["10.77.1.2:8081", &format!("{}/24:{hp}", world.host_addr)],
            &["10.0.0.0/8", "198.51.100.3"],
        ))
        .await;
    let targets: Vec<String> = [
        "10.77.1.2:8081",
        "10.77.1.2:8082",
        "10.77.1.3:8081",
        "198.51.100.2:8081",
        "198.51.100.3:8081",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([host_at.clone(), format!("127.0.0.1:{hp}")])
    .collect();
    let script = format!(
        "{}; getent ahostsv4 svc.cube.test | head -n1; getent hosts nowhere.cube.test || echo unresolved",
        probes(&targets)
    );
    let out = t.client.run(&sb, &sh(&script), MB).await.unwrap();
    let out = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        reached(&out, "10.77.1.2:8081"),
        "allowed beats denied:\n{out}"
    );
    assert!(
        !reached(&out, "10.77.1.2:8082"),
        "another port is denied:\n{out}"
    );
    assert!(!reached(&out, "10.77.1.3:8081"), "denied:\n{out}");
    assert!(
        reached(&out, "198.51.100.2:8081"),
        "internet access:\n{out}"
    );
    assert!(!reached(&out, "198.51.100.3:8081"), "denied:\n{out}");
    assert_eq!(
        line(&out, "198.51.100.3:8081"),
        "198.51.100.3:8081 no: No route to host",
        "a denied connect fails at once:\n{out}"
    );
    assert!(
        !reached(&out, &host_at),
        "the host's address, whatever allow says:\n{out}"
    );
    assert!(
        !reached(&out, &format!("127.0.0.1:{hp}")),
        "loopback is the sandbox's own:\n{out}"
    );
    assert!(
        out.contains("198.51.100.2    STREAM svc.cube.test"),
        "names resolve:\n{out}"
    );
    assert!(out.contains("unresolved"), "{out}");

    // Root in the sandbox cannot open what the filter closes.
    let script = format!(
        "nft flush ruleset; echo nft=$?; ip link set lo down; echo link=$?; \
         ip route del default; echo route=$?; {}",
        probes(&[
            "198.51.100.3:8081".to_string(),
            "10.77.1.2:8081".to_string()
        ])
    );
    let out = t.client.run(&sb, &sh(&script), MB).await.unwrap();
    let out = String::from_utf8_lossy(&out.stdout).to_string();
    for refused in ["nft=1", "link=2", "route=2"] {
        assert!(out.contains(refused), "{refused}:\n{out}");
    }
    assert!(!reached(&out, "198.51.100.3:8081"), "{out}");
    assert!(reached(&out, "10.77.1.2:8081"), "{out}");

    // No internet access, one destination allowed: only that one.
    let sb = t
        .sandbox_with(create(false, &["198.51.100.2:8081"], &[]))
        .await;
    let targets: Vec<String> = [
        "198.51.100.2:8081",
        "198.51.100.2:8082",
        "198.51.100.3:8081",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    // (With the sandbox's addresses and routes after the probes, and the
    // host's pasta processes on a failure: this check failed once, every
    // probe "Network is unreachable", and was never seen again.)
    let script = format!(
        "{}; getent ahostsv4 svc.cube.test | head -n1; {SANDBOX_NET}",
        probes(&targets)
    );
    let out = t.client.run(&sb, &sh(&script), MB).await.unwrap();
    let out = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(reached(&out, "198.51.100.2:8081"), "{out}\n{}", host_net());
    assert!(!reached(&out, "198.51.100.2:8082"), "{out}");
    assert!(!reached(&out, "198.51.100.3:8081"), "{out}");
    assert!(
        out.contains("198.51.100.2    STREAM svc.cube.test"),
        "{out}"
    );

    // Nothing allowed: no interface but loopback.
    let sb = t.sandbox_with(create(false, &[], &[])).await;
    let script = format!(
        "cut -d: -f1 /proc/net/dev | tail -n +3 | tr -d ' '; {}",
        probes(&["198.51.100.2:8081".to_string()])
    );
    let out = t.client.run(&sb, &sh(&script), MB).await.unwrap();
    let out = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.lines().next(), Some("lo"), "{out}");
    assert!(!reached(&out, "198.51.100.2:8081"), "{out}");

    // Bad policies are refused with the reason.
    for (bad, says) in [
        ("example.com", "domain names are not supported"),
        ("2001:db8::/32", "IPv6"),
        ("10.0.0.0/40", "prefix"),
    ] {
        let e = t
            .client
            .create(&create(true, &[bad], &[]))
            .await
            .unwrap_err();
        assert!(e.to_string().contains(says), "{bad}: {e}");
    }
    drop(host_svc);
}

/// Profiles carry the policy to the backend: the shipped default denies
/// the private ranges to internet access, `allow_out` opens one
/// destination, and the operator's entries are checked at load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn profiles_carry_the_policy() {
    let _world = World::new(
        &[v4("10.77.2.2")],
        &[at("10.77.2.2", OPEN), at("10.77.2.2", OTHER)],
        None,
        &[],
    );
    let s = crate::kit::Server::start_with(|c| {
        let open = cube_adapter::config::Profile {
            allow_internet_access: true,
            ..Default::default()
        };
        let one = cube_adapter::config::Profile {
            network: cube_adapter::config::ProfileNetwork {
                allow_out: vec!["10.77.2.2:8081".into()],
                ..Default::default()
            },
            ..Default::default()
        };
        c.profiles.insert("open".into(), open);
        c.profiles.insert("one".into(), one);
    })
    .await;
    let targets = ["10.77.2.2:8081".to_string(), "10.77.2.2:8082".to_string()];
    let mut seen = vec![];
    for profile in ["open", "one", "offline-code"] {
        let out = s.run_in_profile(profile, &probes(&targets)).await;
        seen.push((
            profile,
            reached(&out, "10.77.2.2:8081"),
            reached(&out, "10.77.2.2:8082"),
        ));
    }
    assert_eq!(
        seen,
        [
            ("open", false, false),
            ("one", true, false),
            ("offline-code", false, false)
        ]
    );

    let bad = s.dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[profiles.x]\ntemplate = \"minimal\"\n[profiles.x.network]\nallow_out = [\"intranet.example\"]\n",
    )
    .unwrap();
    let out = std::process::Command::new(BIN)
        .args(["config", "check", "--config"])
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("profile x: network.allow_out: \"intranet.example\": domain names"),
        "{err}"
    );
}

/// `pasta` hidden from the backend (`/dev/null` bound over it wherever it
/// is looked for), for a host without Debian's `passt`: a command prefix
/// that ends by running its arguments.
const WITHOUT_PASTA: &[&str] = &[
    "unshare",
    "--mount",
    "--propagation",
    "private",
    "sh",
    "-c",
    "for p in /usr/bin/pasta /usr/sbin/pasta /bin/pasta /sbin/pasta /usr/local/bin/pasta; do \
     [ -f $p ] && mount --bind /dev/null $p; done; exec \"$@\"",
    "sh",
];

/// On a host without `pasta`, a profile with network access is named
/// before anyone acquires (`config check`, the start-up log, `status`,
/// with the package to install); its acquires answer 502
/// `network_unavailable`, the operator's problem, while other profiles
/// serve (#35).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_without_pasta_is_named_before_anyone_acquires() {
    let config = "[profiles.offline-code]\ntemplate = \"minimal\"\n\
                  [profiles.web-code]\ntemplate = \"minimal\"\nallow_internet_access = true\n";
    let dir = tempfile::tempdir().unwrap();
    let missing = "sandboxes with network access need pasta (Debian package passt) on the host";

    let file = dir.path().join("config.toml");
    std::fs::write(&file, config).unwrap();
    let out = std::process::Command::new(WITHOUT_PASTA[0])
        .args(&WITHOUT_PASTA[1..])
        .arg(BIN)
        .args(["config", "check", "--config"])
        .arg(&file)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with("configuration OK"),
        "{out:?}"
    );
    assert!(
        stderr.contains(&format!("warning: profile web-code: {missing}")),
        "{stderr}"
    );
    assert!(!stderr.contains("offline-code"), "{stderr}");

    let log = dir.path().join("serve.log");
    let (rig, p) = crate::kit::ProcRig::start_wrapped(config, WITHOUT_PASTA, &log);
    // The log is copied as it comes: wait for the line.
    let mut logged = String::new();
    for _ in 0..100 {
        logged = std::fs::read_to_string(&log).unwrap_or_default();
        if logged.contains("profile web-code") {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(
        logged.contains(&format!("profile web-code: {missing}")),
        "{logged}"
    );
    let acquire = |profile: &str| serde_json::json!({"runtime": "mcp", "session_key": profile, "profile": profile});
    let url = format!("{}/v1/leases/acquire", p.url);
    let (st, v) = rig.call(url.clone(), Some(acquire("web-code"))).await;
    assert_eq!(st, reqwest::StatusCode::BAD_GATEWAY, "{v}");
    assert_eq!(v["error"]["code"], "network_unavailable", "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("network access") && msg.contains(missing),
        "{v}"
    );
    let (st, v) = rig.call(url, Some(acquire("offline-code"))).await;
    assert_eq!(st, reqwest::StatusCode::OK, "{v}");

    let status = rig.status();
    let checks: Vec<&serde_json::Value> = status["backends"]
        .as_object()
        .unwrap()
        .values()
        .flat_map(|b| b["checklist"].as_array().unwrap())
        .filter(|c| c["check"].as_str().unwrap().starts_with("profile "))
        .collect();
    assert_eq!(checks.len(), 1, "{status}");
    assert_eq!(
        checks[0]["check"], "profile web-code: what its sandboxes' network needs (pasta, nft)",
        "{status}"
    );
    assert_eq!(checks[0]["ok"], false, "{status}");
    assert!(
        checks[0]["detail"].as_str().unwrap().starts_with(missing),
        "{status}"
    );
    let out = rig.cli(&["status"]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("[FAIL] profile web-code"),
        "{out:?}"
    );
    let (st, _) = rig
        .call(
            format!(
                "{}/v1/leases/{}/release",
                p.url,
                v["lease_ref"].as_str().unwrap()
            ),
            Some(serde_json::json!({"action": "kill"})),
        )
        .await;
    assert_eq!(st, reqwest::StatusCode::OK);
    p.stop();
}
