//! The standalone embedded backend in-process: served over mTLS on
//! 127.0.0.1:0, with a `CubeClient` configured with the generated CA and
//! client certificate; and helpers to look at host processes.

use std::path::PathBuf;
use std::sync::Arc;

use cube_adapter::cube::wire::CreateSandbox;
use cube_adapter::cube::{BackendConfig, CubeClient, SandboxAddr, Secret};
use cube_adapter::embedded::{Backend, Isolation, Limits, Settings};
use tempfile::TempDir;

use super::BIN;

pub struct TestBackend {
    pub dir: TempDir,
    pub url: String,
    pub backend: Backend,
    pub client: CubeClient,
    pub ca_pem: Vec<u8>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    reaper: tokio::task::JoinHandle<()>,
    /// The backend's `sandboxes` directory (under the state directory the
    /// test configured), ended on drop.
    sandboxes: PathBuf,
}

pub fn settings(dir: &std::path::Path) -> Settings {
    Settings {
        state_dir: dir.join("embedded"),
        isolation: Isolation::Namespaces,
        templates: vec![],
        limits: Limits::default(),
        cpus: 1.0,
        domain: "cube.test".into(),
        launcher: PathBuf::from(BIN),
        uid_base: cube_adapter::embedded::sandbox::DEFAULT_UID_BASE,
        mask: vec![dir.to_path_buf()],
        keep_free: vec![],
        default_timeout: None,
        orphan_grace_secs: cube_adapter::embedded::launch::ORPHAN_GRACE_SECS,
        min_free_mb: 0,
        // No disk of its own unless a test asks (escape::, appliance tests
        // get the configured default).
        disk_mb: 0,
        // A faithful stand-in for a real CubeSandbox, as in every test.
        faithful: Some(cube_adapter::embedded::sandbox::Faithful::default()),
    }
}

impl TestBackend {
    pub async fn start() -> Self {
        Self::start_with(|_| {}).await
    }

    pub async fn start_with(tweak: impl FnOnce(&mut Settings)) -> Self {
        cube_adapter::tls::install_default_provider();
        let dir = tempfile::tempdir().unwrap();
        let mut s = settings(dir.path());
        tweak(&mut s);
        let sandboxes = s.state_dir.join("sandboxes");
        let backend = Backend::open(s, None).unwrap();
        let ca = cube_adapter::tls::LocalCa::load_or_create(&dir.path().join("tls")).unwrap();
        let names = vec!["localhost".to_string(), "127.0.0.1".to_string()];
        let (scert, skey) = ca.leaf_files("server", Some(&names)).unwrap();
        let (ccert, ckey) = ca.leaf_files("client", None).unwrap();
        let tls = cube_adapter::tls::server_config(
            &std::fs::read(scert).unwrap(),
            &std::fs::read(skey).unwrap(),
            Some(ca.cert_pem.as_bytes()),
        )
        .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}", listener.local_addr().unwrap());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let app = backend.router();
        tokio::spawn(cube_adapter::server::serve(
            listener,
            app,
            Some(Arc::new(tls)),
            async move {
                let _ = rx.await;
            },
        ));
        let reaper = backend.spawn_reaper(tokio_util::sync::CancellationToken::new());
        let mut cfg = BackendConfig::new("test", url.clone());
        cfg.domain = "cube.test".into();
        cfg.ca_pem = Some(ca.cert_pem.as_bytes().to_vec());
        cfg.client_cert_pem = Some(std::fs::read(ccert).unwrap());
        cfg.client_key_pem = Some(Secret::new(std::fs::read_to_string(ckey).unwrap()));
        let client = CubeClient::new(cfg).unwrap();
        Self {
            dir,
            url,
            backend,
            client,
            ca_pem: ca.cert_pem.into_bytes(),
            shutdown: Some(tx),
            reaper,
            sandboxes,
        }
    }

    /// Create a sandbox from the `host` template.
    pub async fn sandbox(&self) -> SandboxAddr {
        self.sandbox_with(CreateSandbox {
            template_id: "host".into(),
            ..Default::default()
        })
        .await
    }

    /// Stop the backend's upkeep (timeouts, heartbeat) while it keeps
    /// serving: to its sandboxes' inits, the backend is gone.
    pub fn stop_upkeep(&self) {
        self.reaper.abort();
    }

    pub async fn sandbox_with(&self, req: CreateSandbox) -> SandboxAddr {
        let s = self.client.create(&req).await.unwrap();
        self.client.addr(&s)
    }
}

impl Drop for TestBackend {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.reaper.abort();
        // Sandboxes outlive the backend by design: end the ones a test left.
        super::end_sandboxes(&self.sandboxes);
    }
}

/// Whether a host process is a zombie (dead, waiting for its parent).
pub fn is_zombie(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit_once(") ")
                .is_some_and(|(_, r)| r.starts_with('Z') || r.starts_with('X'))
        })
        .unwrap_or(true)
}

/// Every live (non-zombie) host pid whose pid namespace is `ns`.
pub fn pids_in_ns(ns: &std::path::Path) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()))
        .filter(|p| {
            std::fs::read_link(format!("/proc/{p}/ns/pid"))
                .ok()
                .as_deref()
                == Some(ns)
        })
        .filter(|p| !is_zombie(*p))
        .collect()
}
