//! `cube-adapter config import`: the reference adapter's published
//! configuration examples (tests/fixtures/reference: its shipped and
//! trusted-execution profiles, the training and data-cleaning task
//! templates, a principals file, a production .env and the compose one)
//! come out as a configuration our own loader accepts, with the secrets in
//! 0600 files only and every variable that is not carried named.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use cube_adapter::config::{Config, Flags, TaskTemplate};
use serde_json::Value;

use crate::kit::BIN;

/// The secret values of production.env and of the principals file.
const SECRETS: &[&str] = &[
    "shared-bearer-token-0123456789abcdef",
    "session-hmac-key-0123456789abcdef0123456789",
    "receipt-hmac-key-0123456789abcdef0123456789",
    "cube-api-key-0123456789abcdef",
    "redis-password-0123",
    "ZmVybmV0LWtleS0wMTIzNDU2Nzg5YWJjZGVmMDEyMzQ1Njc=",
    "audit-http-token-0123456789",
    "principal-runtime-token-0123456789abcdef",
    "principal-task-agent-token-0123456789abcdef",
    "principal-approver-token-0123456789abcdef",
    "principal-admin-token-0123456789abcdef",
];

struct Run {
    code: i32,
    out: String,
    err: String,
}

/// `config import FLAG ref/AS --out out2`, AS being `ref/FILE` with one
/// edit.
fn import_edited(dir: &Path, flag: &str, file: &str, (from, to): (&str, &str), r#as: &str) -> Run {
    let text = std::fs::read_to_string(dir.join("ref").join(file))
        .unwrap()
        .replace(from, to);
    std::fs::write(dir.join("ref").join(r#as), text).unwrap();
    let at = format!("ref/{}", r#as);
    let out = dir.join("out2");
    run(
        &[
            "config",
            "import",
            flag,
            &at,
            "--out",
            out.to_str().unwrap(),
        ],
        dir,
    )
}

fn run(args: &[&str], cwd: &Path) -> Run {
    let out = Command::new(BIN)
        .args(args)
        .current_dir(cwd)
        // Only the env file counts: what this process has is never read.
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("CUBE_ADAPTER_PORT", "9999")
        .env("CUBE_API_URL", "http://process-env.invalid:3000")
        .output()
        .unwrap();
    Run {
        code: out.status.code().unwrap_or(-1),
        out: String::from_utf8_lossy(&out.stdout).into_owned(),
        err: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// The fixtures copied into a temporary directory, with the reference's
/// server certificate (production.env's CUBE_ADAPTER_TLS_CERT_FILE).
fn fixtures() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/reference");
    copy_dir(&src, &dir.path().join("ref"));
    let cert = rcgen::generate_simple_self_signed(vec![
        "adapter.example.internal".to_string(),
        "10.0.0.7".to_string(),
        "localhost".to_string(),
    ])
    .unwrap();
    std::fs::create_dir_all(dir.path().join("ref/tls")).unwrap();
    std::fs::write(dir.path().join("ref/tls/adapter.pem"), cert.cert.pem()).unwrap();
    dir
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let p = e.path();
        if p.is_dir() {
            copy_dir(&p, &to.join(e.file_name()));
        } else {
            std::fs::copy(&p, to.join(e.file_name())).unwrap();
        }
    }
}

fn import_production(dir: &Path) -> (Run, PathBuf) {
    let out = dir.join("out");
    let r = run(
        &[
            "config",
            "import",
            "--env",
            "ref/production.env",
            "--out",
            out.to_str().unwrap(),
        ],
        dir,
    );
    (r, out)
}

fn load(config: &Path) -> Config {
    Config::load(Some(config), &[], &Flags::default())
        .unwrap()
        .0
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

#[test]
fn production_env_imports_and_config_check_accepts_it() {
    let dir = fixtures();
    let (r, out) = import_production(dir.path());
    assert_eq!(r.code, 0, "{}\n{}", r.out, r.err);
    let config = out.join("config.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    assert!(
        text.starts_with("# Imported from the reference adapter"),
        "{text}"
    );
    assert!(text.contains("production.env"), "{text}");
    // The same check as `config check`, through the binary.
    let check = run(
        &["config", "check", "--config", config.to_str().unwrap()],
        dir.path(),
    );
    assert_eq!(check.code, 0, "{}\n{}", check.out, check.err);
    assert!(
        r.out
            .contains("Checked: the loader of `config check` accepts")
    );

    let c = load(&config);
    // The env file's, not this process's (CUBE_ADAPTER_PORT=9999).
    assert_eq!(c.listen.to_string(), "0.0.0.0:18080");
    assert_eq!(c.gc_interval_seconds, 60);
    assert_eq!(c.audit.mode, cube_adapter::audit::AuditMode::Required);
    // CUBE_ADAPTER_AUDIT_SINKS=file,http: the log file, and the collector
    // one event per POST with its token in a file.
    use cube_adapter::config::sinks::SinkDef;
    match c.audit.sinks.as_slice() {
        [SinkDef::File(f), SinkDef::Http(h)] => {
            assert_eq!(f.path, Path::new("/var/log/cube-adapter/audit.jsonl"));
            assert_eq!(h.url, "https://siem.example.internal/ingest/cube");
            assert_eq!(h.batch, 1);
            assert_eq!(h.token_file, Some(out.join("audit-http-token")));
        }
        other => panic!("sinks: {other:?}\n{text}"),
    }
    assert_eq!(c.server_names, ["adapter.example.internal", "10.0.0.7"]);
    assert_eq!(c.tokens_file, Some(out.join("principals.json")));
    assert_eq!(c.receipts.hmac_key_file, Some(out.join("receipt-hmac.key")));
    let o = &c.auth.oidc[0];
    assert_eq!(o.issuer, "https://idp.example.internal/realms/agents");
    assert_eq!(o.audience, "cube-adapter");
    assert_eq!(o.claims.roles, "groups");
    assert_eq!(o.claims.tenant, "tenant_id");
    assert!(o.jwks_url.as_deref().unwrap().ends_with("/certs"));

    let Some(cube_adapter::config::BackendDef::Cubesandbox(b)) = c.backends.get("default") else {
        panic!("no [backends.default]: {text}");
    };
    assert_eq!(b.api_url, "http://10.0.0.5:3000");
    let p = b.proxy_url.as_ref().unwrap();
    assert_eq!(
        (p.url(), p.dial()),
        ("http://cube.app", Some("10.0.0.5:80"))
    );
    assert!(b.insecure_plain_http);
    assert_eq!(b.api_key_file, Some(out.join("cube-api-key")));
    assert_eq!(b.template.as_deref(), Some("tpl-agent-code-v7"));

    // The trusted-execution profiles, defaults merged in.
    assert_eq!(
        c.profiles.keys().collect::<Vec<_>>(),
        ["trusted-data-cleaning", "trusted-training"]
    );
    let t = &c.profiles["trusted-training"];
    assert_eq!(t.template, "tpl-trusted-training");
    assert_eq!(
        (
            t.sandbox_timeout_seconds,
            t.max_command_seconds,
            t.lease_idle_ttl_seconds
        ),
        (28_800, 21_600, 28_800)
    );
    assert_eq!(
        (t.max_active_leases_per_tenant, t.max_jobs_per_lease),
        (2, 1)
    );
    assert_eq!(t.allowed_runtimes, ["mcp"]);
    assert_eq!(
        (t.lifecycle.on_timeout.as_str(), t.lifecycle.auto_resume),
        ("kill", false)
    );
    assert_eq!(
        t.workspace.mode,
        cube_adapter::config::WorkspaceMode::PerSessionVolume
    );
    assert_eq!(t.workspace.mount_path, "/workspace");
    assert!(!t.workspace.retain_on_kill);
    assert_eq!(
        c.profiles["trusted-data-cleaning"].max_command_seconds,
        7200
    );
    assert_eq!(
        c.tasks.keys().collect::<Vec<_>>(),
        ["clean-csv", "train-logistic"]
    );
}

#[test]
fn secrets_are_in_0600_files_only() {
    let dir = fixtures();
    let (r, out) = import_production(dir.path());
    assert_eq!(r.code, 0, "{}\n{}", r.out, r.err);
    let config = std::fs::read_to_string(out.join("config.toml")).unwrap();
    for s in SECRETS {
        assert!(!config.contains(s), "{s} in config.toml");
        assert!(!r.out.contains(s), "{s} on stdout");
        assert!(!r.err.contains(s), "{s} on stderr");
    }
    let read = |n: &str| std::fs::read_to_string(out.join(n)).unwrap();
    assert_eq!(read("cube-api-key").trim(), "cube-api-key-0123456789abcdef");
    assert_eq!(
        read("receipt-hmac.key").trim(),
        "receipt-hmac-key-0123456789abcdef0123456789"
    );
    assert_eq!(
        read("env"),
        "CUBE_ADAPTER_TOKEN=shared-bearer-token-0123456789abcdef\n"
    );
    // The principals, byte for byte.
    assert_eq!(
        std::fs::read(out.join("principals.json")).unwrap(),
        std::fs::read(dir.path().join("ref/config/token-principals.example.json")).unwrap()
    );
    assert_eq!(
        read("audit-http-token").trim(),
        "audit-http-token-0123456789"
    );
    for f in [
        "cube-api-key",
        "receipt-hmac.key",
        "env",
        "principals.json",
        "audit-http-token",
    ] {
        assert_eq!(mode(&out.join(f)), 0o600, "{f}");
    }
    // The HMAC key is not written anywhere.
    for e in std::fs::read_dir(&out).unwrap() {
        let body = std::fs::read_to_string(e.unwrap().path()).unwrap();
        assert!(!body.contains("session-hmac-key"));
    }
}

#[test]
fn the_report_names_every_variable_not_carried() {
    let dir = fixtures();
    let (r, _) = import_production(dir.path());
    assert_eq!(r.code, 0, "{}\n{}", r.out, r.err);
    let not = r
        .out
        .split("Not carried over:")
        .nth(1)
        .and_then(|s| s.split("\nNotes:").next())
        .unwrap_or_else(|| panic!("no list of what is not carried: {}", r.out));
    let not_carried = entries(not);
    for (var, why) in [
        ("CUBE_ADAPTER_HMAC_KEY", "pseudonyms"),
        (
            "CUBE_ADAPTER_STATE_BACKEND_URL=redis://redis.internal:6379",
            "our own store",
        ),
        ("CUBE_ADAPTER_STATE_ENCRYPTION_KEY", "Fernet"),
        ("CUBE_ADAPTER_STATE_PREFIX", "Redis"),
        ("CUBE_ADAPTER_LOCK_TTL", "locks"),
        ("CUBE_ADAPTER_READINESS_CACHE_SECONDS", "cache"),
        ("CUBE_ADAPTER_TLS_CERT_FILE", "own CA"),
        ("CUBE_ADAPTER_TLS_KEY_FILE", "own CA"),
        ("CUBE_ADAPTER_TLS_CLIENT_CA_FILE", "[auth.client_ca]"),
        ("CUBE_ADAPTER_TRUST_CLIENT_CERT_SUBJECT", "[auth.client_ca]"),
        ("CUBE_ADAPTER_AUDIT_UI", "console"),
        ("CUBE_ADAPTER_ADMIN_ENABLED", "admin"),
        ("trusted-data-cleaning.distribution_scope", "scheduling"),
    ] {
        let (_, detail) = not_carried
            .iter()
            .find(|(what, _)| what.starts_with(var) || what.ends_with(var))
            .unwrap_or_else(|| panic!("{var} is not reported as not carried:\n{not}"));
        assert!(detail.contains(why), "{var}: {detail}");
    }
    // What was carried is not in that list.
    for var in [
        "CUBE_API_URL",
        "CUBE_ADAPTER_TOKEN",
        "CUBE_ADAPTER_OIDC_ISSUER",
        "CUBE_ADAPTER_BIND",
        "CUBE_ADAPTER_AUDIT_SINKS",
        "CUBE_ADAPTER_AUDIT_HTTP_TOKEN",
    ] {
        assert!(
            !not_carried
                .iter()
                .any(|(w, _)| w.split('=').next() == Some(var)),
            "{var} in:\n{not}"
        );
    }
    let carried = entries(
        r.out
            .split("Carried over:")
            .nth(1)
            .and_then(|s| s.split("Not carried over:").next())
            .unwrap(),
    );
    for var in [
        "CUBE_API_URL",
        "CUBE_API_KEY",
        "CUBE_PROXY_NODE_IP",
        "CUBE_ADAPTER_TOKEN",
        "CUBE_ADAPTER_RECEIPT_HMAC_KEY",
        "CUBE_ADAPTER_OIDC_*",
        "CUBE_ADAPTER_GC_INTERVAL",
        "CUBE_ADAPTER_AUDIT_MODE",
        "CUBE_ADAPTER_AUDIT_SINKS",
        "CUBE_ADAPTER_AUDIT_LOG",
        "CUBE_ADAPTER_AUDIT_HTTP_URL",
        "CUBE_ADAPTER_AUDIT_HTTP_TOKEN",
        "CUBE_TEMPLATE_ID",
    ] {
        assert!(
            carried.iter().any(|(w, _)| w.contains(var)),
            "{var} not reported as carried"
        );
    }
}

/// The report's entries of one list: a line "  WHAT", then its detail
/// indented further.
fn entries(list: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = vec![];
    for line in list.lines() {
        if let Some(d) = line.strip_prefix("      ") {
            if let Some(last) = out.last_mut() {
                last.1.push_str(d.trim_start_matches("-> "));
            }
        } else if let Some(w) = line.strip_prefix("  ") {
            out.push((w.to_string(), String::new()));
        }
    }
    out
}

#[test]
fn existing_files_are_kept_without_force() {
    let dir = fixtures();
    let (r, out) = import_production(dir.path());
    assert_eq!(r.code, 0, "{}\n{}", r.out, r.err);
    let config = out.join("config.toml");
    std::fs::write(&config, "# edited by hand\n").unwrap();
    std::fs::remove_file(out.join("env")).unwrap();
    let snapshot = |d: &Path| {
        let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| {
                let p = e.unwrap().path();
                (p.display().to_string(), std::fs::read(&p).unwrap())
            })
            .collect();
        v.sort();
        v
    };
    let before = snapshot(&out);
    let (again, _) = import_production(dir.path());
    assert_eq!(again.code, 2, "{}\n{}", again.out, again.err);
    assert!(again.err.contains("--force"), "{}", again.err);
    assert!(again.err.contains("config.toml"), "{}", again.err);
    assert_eq!(snapshot(&out), before, "a refused run changed nothing");

    let forced = run(
        &[
            "config",
            "import",
            "--env",
            "ref/production.env",
            "--out",
            out.to_str().unwrap(),
            "--force",
        ],
        dir.path(),
    );
    assert_eq!(forced.code, 0, "{}\n{}", forced.out, forced.err);
    let text = std::fs::read_to_string(&config).unwrap();
    assert!(text.starts_with("# Imported from the reference adapter"));
    assert!(out.join("env").exists());
}

#[test]
fn bad_yaml_is_refused_with_its_file_and_line() {
    let dir = fixtures();
    let bad = dir.path().join("ref/bad-profiles.yaml");
    std::fs::write(
        &bad,
        "profiles:\n  offline-code:\n    allow_internet_access: false\n   network: [\n",
    )
    .unwrap();
    let out = dir.path().join("out");
    let r = run(
        &[
            "config",
            "import",
            "--env",
            "ref/compose.env",
            "--profiles",
            bad.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ],
        dir.path(),
    );
    assert_eq!(r.code, 2, "{}\n{}", r.out, r.err);
    assert!(r.err.contains("bad-profiles.yaml"), "{}", r.err);
    assert!(r.err.contains("line 4"), "{}", r.err);
    assert!(!out.exists(), "nothing is written");
    // `config import --profiles BAD [--task-templates TASKS] --out OUT`.
    let import = |tasks: Option<&Path>| {
        let mut args = vec!["config", "import", "--profiles", bad.to_str().unwrap()];
        if let Some(t) = tasks {
            args.extend(["--task-templates", t.to_str().unwrap()]);
        }
        args.extend(["--out", out.to_str().unwrap()]);
        run(&args, dir.path())
    };

    // A string where the reference wants a boolean: refused as well.
    std::fs::write(
        &bad,
        "profiles:\n  offline-code:\n    checkpoints_enabled: \"false\"\n",
    )
    .unwrap();
    let r = import(None);
    assert_eq!(r.code, 2, "{}\n{}", r.out, r.err);
    assert!(
        r.err.contains(
            "bad-profiles.yaml:3: profile offline-code: checkpoints_enabled must be a boolean"
        ),
        "the file and the key's line: {}",
        r.err
    );
    // From the defaults: their line.
    std::fs::write(
        &bad,
        "defaults:\n  checkpoints_enabled: \"no\"\nprofiles:\n  offline-code:\n    sandbox_timeout_seconds: 60\n",
    )
    .unwrap();
    let r = import(None);
    assert_eq!(r.code, 2, "{}\n{}", r.out, r.err);
    assert!(
        r.err.contains(
            "bad-profiles.yaml:2: profile offline-code: checkpoints_enabled must be a boolean"
        ),
        "{}",
        r.err
    );

    // A task naming a profile that is not defined: the line of its
    // `profile`, or of the defaults' when it has none of its own.
    std::fs::write(&bad, "profiles:\n  offline-code: {}\n").unwrap();
    let tasks = dir.path().join("ref/bad-tasks.yaml");
    for (text, line) in [
        (
            "defaults:\n  profile: offline-code\n  parameters: {type: object}\ntasks:\n  build:\n    description: Build\n    \
             command: {argv: [make]}\n  deploy:\n    description: Deploy\n    profile: prod-code\n    \
             command: {argv: [make, deploy]}\n",
            10,
        ),
        (
            "defaults:\n  profile: prod-code\n  parameters: {type: object}\ntasks:\n  build:\n    description: Build\n    \
             command: {argv: [make]}\n",
            2,
        ),
    ] {
        std::fs::write(&tasks, text).unwrap();
        let r = import(Some(&tasks));
        assert_eq!(r.code, 2, "{}\n{}", r.out, r.err);
        assert!(
            r.err.contains(&format!("bad-tasks.yaml:{line}: task "))
                && r.err.contains("profile 'prod-code' is not defined"),
            "{text}: {}",
            r.err
        );
    }
    assert!(!out.exists(), "nothing is written");
}

/// The reference's task templates with their `defaults` merged in, as our
/// `TaskTemplate`s (the reference strips descriptions).
fn reference_tasks(yaml: &Path) -> Vec<(String, TaskTemplate)> {
    let v: Value = serde_norway::from_str(&std::fs::read_to_string(yaml).unwrap()).unwrap();
    let defaults = v["defaults"].as_object().unwrap();
    v["tasks"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(name, t)| {
            let mut m = defaults.clone();
            m.extend(t.as_object().unwrap().clone());
            let d = m["description"].as_str().unwrap().trim().to_string();
            m.insert("description".into(), Value::String(d));
            (
                name.clone(),
                serde_json::from_value(Value::Object(m)).unwrap(),
            )
        })
        .collect()
}

#[test]
fn task_templates_and_shipped_profiles_keep_their_meaning() {
    let dir = fixtures();
    let out = dir.path().join("out");
    let te = dir.path().join("ref/trusted-execution");
    let r = run(
        &[
            "config",
            "import",
            "--env",
            "ref/compose.env",
            "--profiles",
            te.join("profiles.yaml").to_str().unwrap(),
            "--task-templates",
            te.join("task-templates.yaml").to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ],
        dir.path(),
    );
    assert_eq!(r.code, 0, "{}\n{}", r.out, r.err);
    let config = out.join("config.toml");
    let c = load(&config);
    let want = reference_tasks(&te.join("task-templates.yaml"));
    assert_eq!(c.tasks.len(), want.len());
    for (name, t) in &want {
        let got = &c.tasks[name];
        assert_eq!(
            serde_json::to_value(got).unwrap(),
            serde_json::to_value(t).unwrap(),
            "{name}"
        );
        assert_eq!(got.digest(name), t.digest(name), "{name}");
    }
    // Defaults and the task's own values: plan TTL, optional outputs.
    assert_eq!(c.tasks["clean-csv"].plan_ttl_seconds, 1800);
    assert_eq!(c.tasks["train-logistic"].plan_ttl_seconds, 900);
    assert!(c.tasks["train-logistic"].approval_required);
    assert!(!c.tasks["clean-csv"].outputs[1].required);
    // `config check` lists them.
    let check = run(
        &["config", "check", "--config", config.to_str().unwrap()],
        dir.path(),
    );
    assert_eq!(check.code, 0, "{}\n{}", check.out, check.err);
    assert!(
        check.out.contains("[tasks.train-logistic]"),
        "{}",
        check.out
    );
    assert!(check.out.contains("[tasks.clean-csv]"), "{}", check.out);
    // The compose .env: CubeSandbox on the docker host; the HMAC key signed
    // the reference's receipts, so it is kept for them.
    let Some(cube_adapter::config::BackendDef::Cubesandbox(b)) = c.backends.get("default") else {
        panic!("no [backends.default]");
    };
    let p = b.proxy_url.as_ref().unwrap();
    assert_eq!(p.dial(), Some("host.docker.internal:13080"));
    assert_eq!(b.api_url, "http://host.docker.internal:13000");
    assert_eq!(
        std::fs::read_to_string(out.join("receipt-hmac.key"))
            .unwrap()
            .trim(),
        "compose-hmac-key-0123456789abcdef0123456789"
    );

    // The shipped profiles, and no CUBE_API_URL: the embedded backend.
    let out2 = dir.path().join("out2");
    let r = run(
        &[
            "config",
            "import",
            "--profiles",
            "ref/config/profiles.yaml",
            "--out",
            out2.to_str().unwrap(),
        ],
        dir.path(),
    );
    assert_eq!(r.code, 0, "{}\n{}", r.out, r.err);
    assert!(r.out.contains("no CUBE_API_URL"), "{}", r.out);
    let c = load(&out2.join("config.toml"));
    assert!(c.backends.is_empty() && c.backend.is_none());
    assert_eq!(
        c.profiles.keys().collect::<Vec<_>>(),
        ["checkpoint-code", "offline-code", "persistent-code"]
    );
    let p = &c.profiles["persistent-code"];
    assert_eq!(
        p.workspace.mode,
        cube_adapter::config::WorkspaceMode::PerSessionVolume
    );
    assert!(p.workspace.retain_on_kill && !p.checkpoints_enabled);
    assert!(c.profiles["checkpoint-code"].checkpoints_enabled);
    // Not our shipped persistent-code (keepalive, a longer timeout): the
    // reference's.
    assert!(!p.keepalive_enabled);
    assert_eq!(p.sandbox_timeout_seconds, 300);
}

/// The reference's `mcp-policies.yaml` and a profile's `mcp_policy`: the
/// controlled echo becomes `[mcp_policies.controlled-echo]`, which
/// `config check` takes; a policy whose schema is open is refused with the
/// file and line.
#[test]
fn mcp_policies_and_a_profiles_mcp_policy_are_imported() {
    let dir = fixtures();
    std::fs::write(
        dir.path().join("ref/mcp-profiles.yaml"),
        "mcp-echo:\n  template: tpl-1\n  mcp_policy: controlled-echo\n",
    )
    .unwrap();
    let out = dir.path().join("out");
    let r = run(
        &[
            "config",
            "import",
            "--profiles",
            "ref/mcp-profiles.yaml",
            "--mcp-policies",
            "ref/mcp-policies.yaml",
            "--out",
            out.to_str().unwrap(),
        ],
        dir.path(),
    );
    assert_eq!(r.code, 0, "{}\n{}", r.out, r.err);
    assert!(
        r.out.contains("[mcp_policies.controlled-echo]"),
        "{}",
        r.out
    );
    let check = run(
        &[
            "config",
            "check",
            "--config",
            out.join("config.toml").to_str().unwrap(),
        ],
        dir.path(),
    );
    assert_eq!(check.code, 0, "{}\n{}", check.out, check.err);
    let cfg = load(&out.join("config.toml"));
    let p = &cfg.mcp_policies["controlled-echo"];
    assert_eq!(p.server.as_deref(), Some("github/acme/echo-mcp"));
    assert_eq!(p.command, "node /opt/echo-mcp/index.js --stdio");
    assert_eq!(p.env["LOG_LEVEL"], "warn");
    assert_eq!(p.call_timeout_seconds, 15);
    assert_eq!(
        p.tools["echo"].input_schema["properties"]["text"]["maxLength"],
        256
    );
    assert_eq!(
        cfg.profiles["mcp-echo"].mcp_policy.as_deref(),
        Some("controlled-echo")
    );

    // An open schema: refused, naming the file and the policy's line.
    let r = import_edited(
        dir.path(),
        "--mcp-policies",
        "mcp-policies.yaml",
        ("additionalProperties: false", "additionalProperties: true"),
        "open.yaml",
    );
    assert_ne!(r.code, 0);
    assert!(
        r.err.contains("open.yaml:3: policy controlled-echo")
            && r.err.contains("closed object schema"),
        "{}",
        r.err
    );
}

/// The reference's template presets file and a profile's `template_preset`:
/// `[presets.NAME]` that `config check` takes (the secret file it names is
/// a warning there, not an error); a trailing space in a provider is refused
/// with the file and the preset's line.
#[test]
fn template_presets_and_a_profiles_template_preset_are_imported() {
    let dir = fixtures();
    std::fs::write(
        dir.path().join("ref/preset-profiles.yaml"),
        "claw:\n  template: openclaw\n  template_preset: openclaw-deepseek\n",
    )
    .unwrap();
    let out = dir.path().join("out");
    let r = run(
        &[
            "config",
            "import",
            "--profiles",
            "ref/preset-profiles.yaml",
            "--presets",
            "ref/template-presets.yaml",
            "--out",
            out.to_str().unwrap(),
        ],
        dir.path(),
    );
    assert_eq!(r.code, 0, "{}\n{}", r.out, r.err);
    assert!(r.out.contains("[presets.openclaw-deepseek]"), "{}", r.out);
    let check = run(
        &[
            "config",
            "check",
            "--config",
            out.join("config.toml").to_str().unwrap(),
        ],
        dir.path(),
    );
    assert_eq!(check.code, 0, "{}\n{}", check.out, check.err);
    let cfg = load(&out.join("config.toml"));
    let p = &cfg.presets["openclaw-deepseek"];
    assert_eq!(p.template.as_deref(), Some("openclaw"));
    assert_eq!(p.after, ["systemctl restart openclaw.service || true"]);
    assert_eq!(p.prechecks, ["test -s /root/.openclaw/openclaw.json"]);
    assert_eq!(p.files[0].mode, "0600");
    assert_eq!(
        p.models.as_ref().unwrap().fallbacks,
        ["deepseek/deepseek-reasoner"]
    );
    assert_eq!(
        cfg.profiles["claw"].template_preset.as_deref(),
        Some("openclaw-deepseek")
    );

    let r = import_edited(
        dir.path(),
        "--presets",
        "template-presets.yaml",
        ("provider: deepseek", "provider: 'deepseek '"),
        "spaced.yaml",
    );
    assert_ne!(r.code, 0);
    assert!(
        r.err.contains("spaced.yaml:3: preset openclaw-deepseek")
            && r.err.contains("has a trailing space"),
        "{}",
        r.err
    );
}
