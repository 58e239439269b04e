//! `cube-adapter embedded-backend`: the embedded CubeSandbox-compatible
//! backend on its own, for the official SDK, other clients and tests.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use crate::embedded::{Backend, Isolation, Limits, Settings, TemplateConfig};

/// Options of the standalone backend.
#[derive(Debug, Clone)]
pub struct Options {
    pub listen: SocketAddr,
    pub state_dir: PathBuf,
    pub plain_http: bool,
    pub isolation: Isolation,
    pub templates: Vec<TemplateConfig>,
    pub domain: String,
    pub api_key: Option<String>,
    pub server_names: Vec<String>,
    pub limits: Limits,
    pub cpus: f64,
    pub launcher: PathBuf,
    pub faithful: Option<crate::embedded::sandbox::Faithful>,
}

/// What a started backend tells its caller.
#[derive(Debug, Clone)]
pub struct Started {
    pub url: String,
    pub ca_file: Option<PathBuf>,
    pub client_cert: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
    pub ca_fingerprint: Option<String>,
}

/// Build the backend settings for a state directory.
pub fn settings(o: &Options) -> Settings {
    Settings {
        state_dir: o.state_dir.join("embedded"),
        isolation: o.isolation,
        templates: o.templates.clone(),
        limits: o.limits.clone(),
        cpus: o.cpus,
        domain: o.domain.clone(),
        launcher: o.launcher.clone(),
        uid_base: crate::embedded::sandbox::DEFAULT_UID_BASE,
        mask: vec![o.state_dir.clone()],
        keep_free: vec![],
        default_timeout: None,
        orphan_grace_secs: crate::embedded::launch::ORPHAN_GRACE_SECS,
        min_free_mb: 512,
        disk_mb: crate::embedded::disk::DEFAULT_MB,
        faithful: o.faithful.clone(),
    }
}

/// Bind, open and serve until `shutdown`. `on_started` is called once the
/// listener is bound.
pub async fn run(
    o: Options,
    on_started: impl FnOnce(&Started),
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    use anyhow::Context;
    if o.plain_http && !o.listen.ip().is_loopback() {
        anyhow::bail!(
            "--plain-http is only allowed on a loopback address (got {})",
            o.listen
        );
    }
    std::fs::create_dir_all(&o.state_dir)
        .with_context(|| format!("create {}", o.state_dir.display()))?;
    let mut o = o;
    o.state_dir = std::fs::canonicalize(&o.state_dir)
        .with_context(|| format!("resolve {}", o.state_dir.display()))?;
    let backend =
        Backend::open(settings(&o), o.api_key.clone()).map_err(|e| anyhow::anyhow!("{e}"))?;
    let listener = tokio::net::TcpListener::bind(o.listen)
        .await
        .with_context(|| format!("bind {}", o.listen))?;
    let addr = listener.local_addr()?;
    let (tls, started) = if o.plain_http {
        (
            None,
            Started {
                url: format!("http://{addr}"),
                ca_file: None,
                client_cert: None,
                client_key: None,
                ca_fingerprint: None,
            },
        )
    } else {
        let ca = crate::tls::LocalCa::load_or_create(&o.state_dir.join("tls"))?;
        let mut names = vec![
            "localhost".to_string(),
            addr.ip().to_string(),
            format!("*.{}", o.domain),
        ];
        names.extend(o.server_names.iter().cloned());
        let (scert, skey) = ca.leaf_files("backend-server", Some(&names))?;
        let (ccert, ckey) = ca.leaf_files("backend-client", None)?;
        let cfg = crate::tls::server_config(
            &std::fs::read(&scert)?,
            &std::fs::read(&skey)?,
            Some(ca.cert_pem.as_bytes()),
        )?;
        (
            Some(Arc::new(cfg)),
            Started {
                url: format!("https://{addr}"),
                ca_file: Some(ca.dir.join("ca.pem")),
                client_cert: Some(ccert),
                client_key: Some(ckey),
                ca_fingerprint: Some(ca.fingerprint()),
            },
        )
    };
    on_started(&started);
    let stop = tokio_util::sync::CancellationToken::new();
    let reaper = backend.spawn_reaper(stop.clone());
    let r = crate::server::serve(listener, backend.router(), tls, shutdown).await;
    stop.cancel();
    let _ = reaper.await;
    r.context("serve")
}
