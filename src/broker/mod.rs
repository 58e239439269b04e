//! The broker: the only place with policy. Transports turn requests into
//! these calls with a `Principal`; every effect on a sandbox is preceded by a
//! committed audit intent and followed by its outcome, which is written in
//! the same transaction as the state change it causes.

pub mod checkpoints;
pub mod error;
pub mod jobs;
pub mod leases;
pub mod paths;
pub mod ptys;
pub mod receipts;
pub mod tasks;
pub mod upkeep;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use hmac::{Hmac, Mac};

pub use self::error::{Error, Result};
use crate::audit::Journal;
use crate::audit::event::Event;
use crate::auth::Principal;
use crate::config::{Config, Profile};
use crate::cube::CubeClient;
use crate::store::Store;

/// What every lease response calls the executor.
pub const EXECUTOR: &str = "cubesandbox-microvm";

/// Cheap to clone.
#[derive(Clone)]
pub struct Broker {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub cfg: Arc<Config>,
    pub store: Store,
    pub journal: Journal,
    pub cube: CubeClient,
    key: Vec<u8>,
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Effects in flight (drained at shutdown).
    pub tracker: tokio_util::task::TaskTracker,
    /// The output of the PTYs this process runs.
    pub ptys: ptys::Hubs,
    /// Signs trusted tasks' receipts.
    pub receipts: receipts::Signer,
    /// Task templates' schemas, compiled once.
    pub schemas: HashMap<String, Arc<crate::config::tasks::Compiled>>,
}

/// Per-request context from the transport.
#[derive(Debug, Clone, Default)]
pub struct Ctx {
    pub request_id: String,
}

impl Broker {
    pub fn new(
        cfg: Arc<Config>,
        store: Store,
        journal: Journal,
        cube: CubeClient,
        key: Vec<u8>,
        receipts: receipts::Signer,
    ) -> Self {
        let mut schemas = HashMap::new();
        for (name, t) in &cfg.tasks {
            match t.compile() {
                Ok(c) => {
                    schemas.insert(name.clone(), Arc::new(c));
                }
                // Checked when the configuration loaded; plans of it fail.
                Err(e) => {
                    tracing::error!(task = %name, error = %e, "a task template's schema does not compile")
                }
            }
        }
        Self {
            inner: Arc::new(Inner {
                cfg,
                store,
                journal,
                cube,
                key,
                locks: Mutex::default(),
                tracker: tokio_util::task::TaskTracker::new(),
                ptys: ptys::Hubs::default(),
                receipts,
                schemas,
            }),
        }
    }

    /// Wait (at most `limit`) for effects in flight to record their outcome.
    pub async fn drain(&self, limit: std::time::Duration) -> bool {
        self.inner.tracker.close();
        tokio::time::timeout(limit, self.inner.tracker.wait())
            .await
            .is_ok()
    }

    pub fn journal(&self) -> &Journal {
        &self.inner.journal
    }

    pub fn config(&self) -> &Config {
        &self.inner.cfg
    }

    pub fn cube(&self) -> &CubeClient {
        &self.inner.cube
    }

    pub(crate) fn hmac_hex(&self, parts: &[&[u8]]) -> String {
        let Ok(mut m) = <Hmac<sha2::Sha256> as Mac>::new_from_slice(&self.inner.key) else {
            return String::new();
        };
        for (i, p) in parts.iter().enumerate() {
            if i > 0 {
                m.update(b"\0");
            }
            m.update(p);
        }
        hex::encode(m.finalize().into_bytes())
    }

    /// A named async lock (sessions, tenants, leases). Entries are dropped
    /// when nobody holds them.
    pub(crate) async fn lock(&self, name: String) -> LockGuard {
        let m = {
            let mut map = self.inner.locks.lock().unwrap_or_else(|p| p.into_inner());
            map.entry(name.clone()).or_default().clone()
        };
        let guard = m.clone().lock_owned().await;
        LockGuard {
            broker: self.clone(),
            name,
            guard: Some(guard),
            mutex: m,
        }
    }

    pub(crate) fn profile(&self, name: &str) -> Option<&Profile> {
        self.inner.cfg.profiles.get(name)
    }

    /// The base audit event for a principal's action.
    pub(crate) fn event(&self, p: &Principal, action: &str, ctx: &Ctx) -> Event {
        let j = &self.inner.journal;
        let mut ev = j.event(action);
        ev.tenant_digest = Some(j.digest("tenant", p.tenant.as_bytes()));
        ev.identity_digest = Some(j.digest(
            "identity",
            format!("{}\0{}", p.tenant, p.subject).as_bytes(),
        ));
        if !ctx.request_id.is_empty() {
            ev.request_id = Some(ctx.request_id.clone());
        }
        ev
    }

    /// Record a denied request (`rejected`) and return the error.
    pub(crate) async fn reject(&self, mut ev: Event, e: Error) -> Error {
        ev.outcome = "rejected".into();
        ev.error_code = Some(e.code.to_string());
        if let Err(a) = self.inner.journal.record(ev).await {
            return a.into();
        }
        e
    }

    /// Check an action scope; a denial is recorded.
    pub(crate) async fn authorize(&self, p: &Principal, action: &str, ev: &Event) -> Result<()> {
        if p.allows_action(action) {
            return Ok(());
        }
        Err(self
            .reject(
                ev.clone(),
                Error::new(
                    "action_denied",
                    format!("the action {action} is not allowed for this identity"),
                ),
            )
            .await)
    }
}

/// Test-only failpoints, set with `CUBE_ADAPTER_FAILPOINT=<name>`: the
/// process kills itself (SIGKILL) at the named point. `after_intent`: right
/// after an intent is committed, before the backend is called. Used by the
/// crash tests; never set it in production.
pub(crate) fn failpoint(name: &str) {
    if std::env::var("CUBE_ADAPTER_FAILPOINT").is_ok_and(|v| v == name) {
        eprintln!("failpoint {name}: killing this process");
        let _ = nix::sys::signal::kill(nix::unistd::Pid::this(), nix::sys::signal::Signal::SIGKILL);
        std::process::abort();
    }
}

pub(crate) struct LockGuard {
    broker: Broker,
    name: String,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
    mutex: Arc<tokio::sync::Mutex<()>>,
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        // Release first: the guard holds a reference of its own.
        self.guard.take();
        let mut map = self
            .broker
            .inner
            .locks
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        // Two references: the map's and ours. Nobody else waits: drop it.
        if Arc::strong_count(&self.mutex) <= 2 {
            map.remove(&self.name);
        }
    }
}
