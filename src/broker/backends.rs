//! The backends sandboxes run on, by name (`[backends.NAME]`): a client for
//! each, and whether it is up. A health watch asks each one's CubeAPI every
//! `HEALTH_INTERVAL` (and again at once after a call found it down); a
//! backend that is down fails its own profiles' calls before any intent,
//! with 503 `backend_unavailable`, while the others keep serving.
//!
//! A backend is down when it fails `DOWN_AFTER` health probes in a row
//! *and* its real calls are not being answered (none answered within
//! `SERVING_WINDOW`, or `cube::client::FAILED_IN_A_ROW` failed since the
//! last one): a probe that gets no answer in time behind real work on a
//! busy backend is not an outage (passive health, as Envoy's outlier
//! detection counts real calls' outcomes). One probe that answers brings
//! it back.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use crate::cube::CubeClient;

use super::{Code, Error, Result};

/// How often each backend is asked whether it is up.
pub const HEALTH_INTERVAL: Duration = Duration::from_secs(2);
/// How long one health call may take before it counts as failed.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(3);
/// Failed health probes in a row before a backend whose calls are not
/// being answered counts as down.
pub const DOWN_AFTER: u32 = 3;
/// How soon a probe follows one that failed (while the backend is up).
const RECHECK_AFTER_FAILURE: Duration = Duration::from_millis(500);
/// A backend that answered a real call this recently is serving.
pub const SERVING_WINDOW: Duration = Duration::from_secs(10);

/// What kind of backend it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    CubeSandbox,
    /// The embedded backend, with its isolation.
    Embedded(crate::embedded::Isolation),
}

/// One backend: its client and its health.
pub struct Backend {
    pub name: String,
    pub kind: Kind,
    pub client: CubeClient,
    /// What it is, for people (`status`, the console).
    pub description: String,
    up: AtomicBool,
    /// Its last health failure, if it is down.
    problem: std::sync::Mutex<Option<String>>,
    /// Ask again now (a call found it unreachable).
    recheck: tokio::sync::Notify,
    /// Health probes failed in a row.
    failed_probes: std::sync::atomic::AtomicU32,
    /// An embedded backend of this process: its state directory, where
    /// its sandboxes' egress taps are (`cube_embedded::egress_tap`).
    state_dir: std::sync::OnceLock<std::path::PathBuf>,
}

/// Why a `[backends.NAME]` section gives no client.
#[derive(Debug, thiserror::Error)]
pub enum SectionError {
    #[error("read {}: {source}", path.display())]
    Read {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Client(#[from] crate::cube::CubeError),
}

impl Backend {
    pub fn new(name: &str, kind: Kind, client: CubeClient, description: String) -> Arc<Self> {
        Arc::new(Self {
            name: name.to_string(),
            kind,
            client,
            description,
            up: AtomicBool::new(true),
            problem: std::sync::Mutex::new(None),
            recheck: tokio::sync::Notify::new(),
            failed_probes: std::sync::atomic::AtomicU32::new(0),
            state_dir: std::sync::OnceLock::new(),
        })
    }

    /// Say where this process's embedded backend keeps its sandboxes.
    pub fn set_embedded_state_dir(&self, dir: std::path::PathBuf) {
        let _ = self.state_dir.set(dir);
    }

    /// Where this process's embedded backend keeps its sandboxes; none for
    /// any other backend.
    pub fn embedded_state_dir(&self) -> Option<&std::path::Path> {
        self.state_dir.get().map(|p| p.as_path())
    }

    /// A CubeSandbox backend's client from its section (its key, CA and
    /// client certificate read from their files).
    pub fn from_section(
        name: &str,
        b: &crate::config::BackendSection,
    ) -> std::result::Result<Arc<Self>, SectionError> {
        use crate::cube::{BackendConfig, Secret};
        let read = |f: &std::path::Path| {
            std::fs::read(f).map_err(|source| SectionError::Read {
                path: f.to_path_buf(),
                source,
            })
        };
        let text = |f: &std::path::Path| {
            std::fs::read_to_string(f).map_err(|source| SectionError::Read {
                path: f.to_path_buf(),
                source,
            })
        };
        let mut bc = BackendConfig::new(name, b.api_url.clone());
        bc.proxy_url = b.proxy_url.clone();
        bc.domain = b.domain.clone();
        bc.insecure_plain_http = b.insecure_plain_http;
        if let Some(f) = &b.api_key_file {
            bc.api_key = Some(Secret::new(text(f)?.trim()));
        }
        if let Some(f) = &b.ca_file {
            bc.ca_pem = Some(read(f)?);
        }
        if let (Some(c), Some(k)) = (&b.client_cert_file, &b.client_key_file) {
            bc.client_cert_pem = Some(read(c)?);
            bc.client_key_pem = Some(Secret::new(text(k)?));
        }
        let client = CubeClient::new(bc)?;
        Ok(Self::new(
            name,
            Kind::CubeSandbox,
            client,
            format!("CubeSandbox at {}", b.api_url),
        ))
    }

    /// Up as far as the last health call knows (up until one says not).
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    /// Why it is down, if it is.
    pub fn problem(&self) -> Option<String> {
        self.problem
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn set(&self, r: std::result::Result<(), String>) {
        let was = self.up.swap(r.is_ok(), Ordering::AcqRel);
        match &r {
            Ok(()) if !was => tracing::info!(backend = %self.name, "backend is up again"),
            Err(e) if was => tracing::warn!(backend = %self.name, error = %e, "backend is down"),
            _ => {}
        }
        *self.problem.lock().unwrap_or_else(|p| p.into_inner()) = r.err();
    }

    /// Probe it now: whether it is up afterwards.
    pub async fn check(&self) -> bool {
        let r = match tokio::time::timeout(HEALTH_TIMEOUT, self.client.health()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!(
                "no answer from CubeAPI within {} s",
                HEALTH_TIMEOUT.as_secs()
            )),
        };
        match r {
            Ok(()) => {
                self.failed_probes.store(0, Ordering::Release);
                self.set(Ok(()));
            }
            Err(e) => {
                let failed = self.failed_probes.fetch_add(1, Ordering::AcqRel) + 1;
                if self.client.serving(SERVING_WINDOW) {
                    tracing::debug!(backend = %self.name, error = %e, failed,
                        "health probe failed while real calls are answered: busy, not down");
                } else if failed >= DOWN_AFTER || !self.is_up() {
                    self.set(Err(e));
                } else {
                    tracing::debug!(backend = %self.name, error = %e, failed, "health probe failed");
                }
            }
        }
        self.is_up()
    }

    /// How long until the next probe: sooner while probes fail on a
    /// backend that is still up.
    fn next_probe(&self) -> Duration {
        if self.is_up() && self.failed_probes.load(Ordering::Acquire) > 0 {
            RECHECK_AFTER_FAILURE
        } else {
            HEALTH_INTERVAL
        }
    }

    /// A call failed to reach it: have the watch ask again at once.
    pub fn suspect(&self) {
        self.recheck.notify_one();
    }

    /// 503 `backend_unavailable` unless it is up.
    pub fn ready(&self) -> Result<()> {
        if self.is_up() {
            return Ok(());
        }
        Err(unavailable(&self.name))
    }
}

pub(crate) fn unavailable(name: &str) -> Error {
    Error::new(
        Code::BackendUnavailable,
        format!("the backend '{name}' is unavailable; retry shortly"),
    )
}

/// The backends by name. Cheap to clone; a reload swaps entries.
#[derive(Clone, Default)]
pub struct Backends {
    map: Arc<RwLock<BTreeMap<String, Arc<Backend>>>>,
    /// Watches started, by backend (a replaced backend's ends with it);
    /// `None` until `spawn_watch`, and again after its stop.
    watches: Arc<std::sync::Mutex<Option<BTreeMap<String, tokio::task::AbortHandle>>>>,
}

impl Backends {
    pub fn new(list: impl IntoIterator<Item = Arc<Backend>>) -> Self {
        let b = Self::default();
        {
            let mut m = b.map.write().unwrap_or_else(|p| p.into_inner());
            for x in list {
                m.insert(x.name.clone(), x);
            }
        }
        b
    }

    /// One backend, as it is now.
    pub fn get(&self, name: &str) -> Option<Arc<Backend>> {
        self.map
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .cloned()
    }

    /// Every backend, by name.
    pub fn all(&self) -> Vec<Arc<Backend>> {
        self.map
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect()
    }

    /// Add or replace one (a reload); its watch starts if watching.
    pub fn insert(&self, b: Arc<Backend>) {
        let name = b.name.clone();
        self.map
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name.clone(), b.clone());
        // Watched like the others (an added backend too), once watching.
        if let Some(w) = self
            .watches
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_mut()
            && let Some(old) = w.insert(name, tokio::spawn(watch(b)).abort_handle())
        {
            old.abort();
        }
    }

    /// Remove one (a reload, after checking it has no leases).
    pub fn remove(&self, name: &str) {
        self.map
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(name);
        if let Some(w) = self
            .watches
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_mut()
            .and_then(|w| w.remove(name))
        {
            w.abort();
        }
    }

    /// Watch every backend's health until `stop`.
    pub fn spawn_watch(&self, stop: tokio_util::sync::CancellationToken) {
        let started: BTreeMap<String, tokio::task::AbortHandle> = self
            .all()
            .into_iter()
            .map(|b| (b.name.clone(), tokio::spawn(watch(b)).abort_handle()))
            .collect();
        *self.watches.lock().unwrap_or_else(|p| p.into_inner()) = Some(started);
        let watches = self.watches.clone();
        tokio::spawn(async move {
            stop.cancelled().await;
            let all = watches.lock().unwrap_or_else(|p| p.into_inner()).take();
            for (_, h) in all.into_iter().flatten() {
                h.abort();
            }
        });
    }
}

/// Ask one backend every `HEALTH_INTERVAL`, or at once when a call
/// suspects it.
async fn watch(b: Arc<Backend>) {
    loop {
        b.check().await;
        tokio::select! {
            _ = tokio::time::sleep(b.next_probe()) => {}
            _ = b.recheck.notified() => {}
        }
    }
}
