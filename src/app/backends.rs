//! Start-up, phase 3: the backends, each watched; the embedded one served
//! on loopback with mTLS and reached with the same client as a CubeSandbox.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::Tasks;
use crate::config::Config;
use crate::cube::{BackendConfig, CubeClient, Secret};
use crate::embedded::{Backend, Limits, Settings};
use crate::tls::LocalCa;

/// Host paths no sandbox may see: the appliance's state and secrets.
fn masks(cfg: &Config, state: &Path) -> Vec<PathBuf> {
    let mut v = vec![
        state.to_path_buf(),
        PathBuf::from(crate::config::DEFAULT_STATE_DIR),
        PathBuf::from("/etc/cube-adapter"),
    ];
    if let Some(d) = &cfg.embedded.state_dir {
        v.push(d.clone());
    }
    if let Some(f) = &cfg.tokens_file {
        v.push(f.clone());
    }
    v.extend(cfg.receipts.hmac_key_file.iter().cloned());
    // The audit sinks' secrets, and the file sink's files (events are
    // redacted, but other tenants' activity is no sandbox's business): its
    // directory when it is one of the appliance's own (named
    // cube-adapter…), else the file and its rotated copies.
    for s in &cfg.audit.sinks {
        match s {
            crate::config::sinks::SinkDef::File(f) => match f.path.parent() {
                Some(d)
                    if d.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with("cube-adapter")) =>
                {
                    v.push(d.to_path_buf());
                }
                _ => {
                    v.push(f.path.clone());
                    for n in 1..=f.keep {
                        let mut p = f.path.clone().into_os_string();
                        p.push(format!(".{n}"));
                        v.push(PathBuf::from(p));
                    }
                }
            },
            crate::config::sinks::SinkDef::Http(h) => {
                v.extend(h.hmac_key_file.iter().cloned());
                v.extend(h.token_file.iter().cloned());
                v.extend(h.client_key_file.iter().cloned());
            }
            _ => {}
        }
    }
    v.extend(cfg.metrics.token_file.iter().cloned());
    if let Some(n) = &cfg.console.notify {
        v.extend(n.secret_file.iter().cloned());
    }
    // The PostgreSQL store's password, and the console's OIDC client
    // secret (issue 34, L4). CA files (`ca_file`) and client certificates
    // are public and stay visible.
    v.extend(cfg.store.password_file.iter().cloned());
    if let Some(o) = &cfg.console.oidc {
        v.push(o.client_secret_file.clone());
    }
    for def in cfg.backend_defs().values() {
        match def {
            crate::config::BackendDef::Cubesandbox(b) => {
                v.extend(b.api_key_file.iter().cloned());
                v.extend(b.client_key_file.iter().cloned());
            }
            crate::config::BackendDef::Embedded(e) => v.extend(e.state_dir.iter().cloned()),
        }
    }
    v.into_iter()
        .filter_map(|p| {
            std::fs::canonicalize(&p)
                .ok()
                .or(p.is_absolute().then_some(p))
        })
        .collect()
}

/// An unprivileged process that will run embedded sandboxes enters a user
/// namespace with its subordinate ids first (`embedded::subids`), so that
/// each sandbox gets ids of its own. Call single-threaded, before any
/// runtime. Err: it cannot go on (the namespace was entered, unmapped).
pub fn enter_subordinate_ids(
    isolation: crate::embedded::launch::Isolation,
) -> Result<(), crate::embedded::subids::EnterError> {
    use crate::embedded::subids::{self, Entered, PER_SANDBOX};
    if isolation != crate::embedded::launch::Isolation::Namespaces {
        return Ok(());
    }
    match subids::enter()? {
        Entered::Root => {}
        Entered::Mapped(ids) => tracing::info!(
            ids,
            sandboxes = ids / PER_SANDBOX - 1,
            "sandboxes get subordinate ids of their own"
        ),
        Entered::Unchanged(why) => tracing::warn!(
            reason = %why,
            "sandboxes share this process's one uid and gid (docs/security.md, \"Ids\")"
        ),
    }
    Ok(())
}

/// The embedded backend's settings from the configuration (`serve`, and
/// `sandboxes` on a stopped service's state directory).
pub fn embedded_settings(cfg: &Config, state: &Path, launcher: PathBuf) -> Settings {
    let e = &cfg.embedded;
    // `[backends.NAME] kind = "embedded"` may name its own.
    let own = cfg.embedded_backend().map(|(_, b)| b).unwrap_or_default();
    Settings {
        state_dir: own
            .state_dir
            .or_else(|| e.state_dir.clone())
            .unwrap_or_else(|| state.join("embedded")),
        isolation: e.isolation,
        templates: if own.templates.is_empty() {
            e.templates.clone()
        } else {
            own.templates
        },
        limits: Limits {
            memory_mb: e.memory_mb,
            max_processes: e.max_processes,
            ..Limits::default()
        },
        cpus: e.cpus,
        domain: "cube.local".into(),
        launcher,
        uid_base: crate::embedded::sandbox::DEFAULT_UID_BASE,
        mask: masks(cfg, state),
        keep_free: vec![state.to_path_buf()],
        default_timeout: None,
        orphan_grace_secs: i64::try_from(e.orphan_grace_seconds).unwrap_or(i64::MAX),
        min_free_mb: e.min_free_mb,
        disk_mb: e.disk_mb,
        faithful: e.faithful.then(|| crate::embedded::sandbox::Faithful {
            pause_delay: std::time::Duration::from_millis(e.faithful_pause_ms),
            envd_version: e.faithful_envd_version.clone(),
        }),
    }
}

/// The configured backends, each watched until `stop`; the embedded one
/// (if configured) started on loopback. With what `serve` prints and the
/// console shows of them: the one backend, or each.
pub(super) async fn start(
    cfg: &Config,
    state: &Path,
    ca: &LocalCa,
    launcher: &Path,
    tasks: &mut Tasks,
) -> anyhow::Result<(crate::broker::Backends, String)> {
    let mut list = vec![];
    for (name, def) in cfg.backend_defs() {
        list.push(match def {
            crate::config::BackendDef::Cubesandbox(b) => {
                crate::broker::backends::Backend::from_section(&name, &b)
                    .map_err(|e| anyhow::anyhow!("backend {name}: {e}"))?
            }
            crate::config::BackendDef::Embedded(_) => {
                embedded(cfg, &name, state, ca, launcher, tasks).await?
            }
        });
    }
    let description = match list.as_slice() {
        [one] => one.description.clone(),
        many => many
            .iter()
            .map(|b| format!("{}: {}", b.name, b.description))
            .collect::<Vec<_>>()
            .join("; "),
    };
    let backends = crate::broker::Backends::new(list);
    backends.spawn_watch(tasks.stop.clone());
    Ok((backends, description))
}

/// The embedded backend on 127.0.0.1:0, CubeAPI and CubeProxy on one
/// address, with certificates of the appliance's CA both ways; its reaper
/// and server end when `tasks.stop` is cancelled.
async fn embedded(
    cfg: &Config,
    name: &str,
    state: &Path,
    ca: &LocalCa,
    launcher: &Path,
    tasks: &mut Tasks,
) -> anyhow::Result<Arc<crate::broker::backends::Backend>> {
    let settings = embedded_settings(cfg, state, launcher.to_path_buf());
    let state_dir = settings.state_dir.clone();
    let backend =
        Backend::open(settings, None).map_err(|e| anyhow::anyhow!("embedded backend: {e}"))?;
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
    let addr = listener.local_addr()?;
    let (bcert, bkey) = ca.leaf_files("embedded-server", Some(&["127.0.0.1".to_string()]))?;
    let (ccert, ckey) = ca.leaf_files("broker-client", None)?;
    let tls = crate::tls::server_config(
        &std::fs::read(&bcert)?,
        ca.read_key(&bkey)?.as_bytes(),
        Some(ca.cert_pem.as_bytes()),
    )?;
    tasks.drained("embedded reaper", backend.spawn_reaper(tasks.stop.clone()));
    let router = backend.router();
    let stopped = tasks.stop.clone().cancelled_owned();
    tasks.drained(
        "embedded server",
        tokio::spawn(async move {
            if let Err(e) =
                crate::server::serve(listener, router, Some(Arc::new(tls)), stopped).await
            {
                tracing::error!(error = %e, "embedded backend stopped");
            }
        }),
    );
    let mut bc = BackendConfig::new(name.to_string(), format!("https://{addr}"));
    bc.proxy_url = Some(crate::cube::ProxyUrl::Url(format!("https://{addr}")));
    bc.domain = "cube.local".into();
    bc.ca_pem = Some(ca.cert_pem.as_bytes().to_vec());
    bc.client_cert_pem = Some(std::fs::read(&ccert)?);
    bc.client_key_pem = Some(Secret::new(ca.read_key(&ckey)?));
    let isolation = cfg.embedded.isolation;
    let b = crate::broker::backends::Backend::new(
        name,
        crate::broker::backends::Kind::Embedded(isolation),
        CubeClient::new(bc)?,
        format!("embedded ({isolation:?} isolation) on {addr}"),
    );
    b.set_embedded_state_dir(state_dir);
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `*_file` of the configuration that holds a secret (all but
    /// CA and client certificates, which are public) is masked in
    /// sandboxes: found by walking the configuration itself, so that a
    /// secret file set here and missing from `masks` fails the test.
    #[test]
    fn every_configured_secret_file_is_masked() {
        let text = r#"
tokens_file = "/srv/s/tokens.json"

[store]
kind = "postgres"
url = "postgres://cube@db.example/cube"
password_file = "/srv/s/pg-password"
ca_file = "/srv/s/pg-ca.pem"

[metrics]
token_file = "/srv/s/metrics.token"

[receipts]
hmac_key_file = "/srv/s/receipts.key"

[console.notify]
url = "https://hooks.example/x"
secret_file = "/srv/s/notify.secret"
ca_file = "/srv/s/notify-ca.pem"

[console.oidc]
issuer = "https://idp.example"
client_id = "console"
client_secret_file = "/srv/s/oidc-client.secret"
redirect_url = "https://cube.example/console/oidc/callback"
ca_file = "/srv/s/idp-ca.pem"

[[audit.sinks]]
kind = "http"
name = "siem"
url = "https://siem.example/in"
ca_file = "/srv/s/siem-ca.pem"
client_cert_file = "/srv/s/siem-client.pem"
client_key_file = "/srv/s/siem-client.key"
hmac_key_file = "/srv/s/siem-hmac.key"
token_file = "/srv/s/siem.token"

[backends.cube]
kind = "cubesandbox"
api_url = "https://cube.example"
api_key_file = "/srv/s/cube-api.key"
ca_file = "/srv/s/cube-ca.pem"
client_cert_file = "/srv/s/cube-client.pem"
client_key_file = "/srv/s/cube-client.key"
"#;
        let cfg: Config = toml::from_str(text).unwrap();
        let masks = masks(&cfg, Path::new("/var/lib/cube-adapter-test"));
        fn secret_files(v: &serde_json::Value, out: &mut Vec<(String, PathBuf)>) {
            match v {
                serde_json::Value::Object(m) => {
                    for (k, v) in m {
                        match v {
                            serde_json::Value::String(p)
                                if k.ends_with("_file")
                                    && k != "ca_file"
                                    && k != "client_cert_file" =>
                            {
                                out.push((k.clone(), PathBuf::from(p)));
                            }
                            _ => secret_files(v, out),
                        }
                    }
                }
                serde_json::Value::Array(a) => a.iter().for_each(|v| secret_files(v, out)),
                _ => {}
            }
        }
        let mut found = vec![];
        secret_files(&serde_json::to_value(&cfg).unwrap(), &mut found);
        assert_eq!(found.len(), 11, "{found:?}");
        for (key, path) in &found {
            assert!(
                masks.contains(path),
                "{key} = {} is not masked",
                path.display()
            );
        }
        for p in ["/srv/s/pg-password", "/srv/s/oidc-client.secret"] {
            assert!(masks.contains(&PathBuf::from(p)), "{p}: {masks:?}");
        }
        for public in ["/srv/s/pg-ca.pem", "/srv/s/cube-client.pem"] {
            assert!(!masks.contains(&PathBuf::from(public)), "{public}");
        }
    }
}
