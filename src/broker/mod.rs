//! The broker: the only place with policy. Transports turn requests into
//! these calls with a `Principal`; every effect on a sandbox is preceded by a
//! committed audit intent and followed by its outcome, which is written in
//! the same transaction as the state change it causes.

pub(crate) mod backends;
pub(crate) mod checkpoints;
pub(crate) mod code;
pub(crate) mod dto;
pub(crate) mod egress;
pub(crate) mod error;
pub(crate) mod gauges;
pub(crate) mod jobs;
pub(crate) mod leases;
pub(crate) mod mcp;
pub(crate) mod paths;
pub(crate) mod presets;
pub(crate) mod ptys;
pub mod receipts;
pub mod recordings;
pub(crate) mod recovery;
pub mod tasks;
pub(crate) mod upkeep;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use hmac::{Hmac, Mac};

pub use self::backends::Backends;
pub use self::code::{Code, Outcome};
pub use self::error::{Error, Result};
use crate::audit::Journal;
use crate::audit::event::{Action, Event};
use crate::auth::Principal;
use crate::config::{Config, Profile};
use crate::cube::CubeClient;
use crate::store::Store;

/// Cheap to clone.
#[derive(Clone)]
pub struct Broker {
    pub(crate) inner: Arc<Inner>,
}

/// The operator's policy as it is now: swapped whole by a reload (SIGHUP),
/// never changed in place.
pub(crate) struct Policy {
    pub cfg: Arc<Config>,
    /// Task templates' schemas, compiled once per configuration.
    pub schemas: HashMap<String, Arc<crate::config::tasks::Compiled>>,
    /// MCP policies' tool schemas by (policy, tool), compiled once per
    /// configuration (checked when it loaded: one that does not compile
    /// is absent, and its tool refused).
    pub mcp_tools: HashMap<(String, String), Arc<jsonschema::Validator>>,
}

/// A task template whose schemas or risk patterns do not compile.
#[derive(Debug, thiserror::Error)]
#[error("task {task}: {source}")]
pub struct PolicyError {
    pub task: String,
    #[source]
    pub source: crate::config::tasks::CompileError,
}

/// Compile every template's schemas (they were checked when the
/// configuration loaded).
fn compile_policy(cfg: Arc<Config>) -> std::result::Result<Policy, PolicyError> {
    let mut schemas = HashMap::new();
    for (name, t) in &cfg.tasks {
        let c = t.compile().map_err(|source| PolicyError {
            task: name.clone(),
            source,
        })?;
        schemas.insert(name.clone(), Arc::new(c));
    }
    let mut mcp_tools = HashMap::new();
    for (policy, p) in &cfg.mcp_policies {
        for (tool, t) in &p.tools {
            if let Ok(v) = crate::config::tasks::check_schema(&t.input_schema, "input_schema") {
                mcp_tools.insert((policy.clone(), tool.clone()), Arc::new(v));
            }
        }
    }
    Ok(Policy {
        cfg,
        schemas,
        mcp_tools,
    })
}

pub(crate) struct Inner {
    policy: std::sync::RwLock<Arc<Policy>>,
    pub store: Store,
    pub journal: Journal,
    /// The backends sandboxes run on, by name.
    pub backends: Backends,
    key: Vec<u8>,
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Effects in flight (drained at shutdown).
    pub tracker: tokio_util::task::TaskTracker,
    /// Leases with calls in flight: how many, and since when (the keepalive
    /// renews a sandbox under a long call, whose stream a real CubeProxy
    /// does not count as activity until it ends).
    pub busy: Mutex<HashMap<String, (u32, std::time::Instant)>>,
    /// The output of the PTYs this process runs.
    pub ptys: ptys::Hubs,
    /// Signs trusted tasks' receipts.
    pub receipts: receipts::Signer,
    /// Wall-clock time: expiry, idle TTLs, budgets, timestamps.
    pub clock: crate::clock::Clock,
    /// Told when a plan needs approval (`console::notify`); set once at
    /// start, if `[console.notify]` is configured.
    pub plan_listener: std::sync::OnceLock<Arc<dyn PlanListener>>,
    /// GC passes and what they collected, for `/metrics`.
    pub gc: crate::metrics::Gc,
    /// The egress proxy's per-lease state and its instruments.
    pub egress: egress::Egress,
    /// The session recordings this process writes.
    pub recordings: recordings::Recordings,
}

/// A plan that needs approval, as a listener is told of it: names and
/// times only, never a parameter value or the command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanNeedsApproval {
    pub plan_ref: String,
    pub tenant: String,
    pub template: String,
    pub profile: String,
    /// RFC 3339.
    pub expires_at: String,
    /// Who asked (the identity's subject).
    pub requester: String,
    /// The template's risk rules its values matched: `parameter: note`
    /// (never the values).
    pub risks: Vec<String>,
}

/// Told when a plan needs approval. Called on the planning path: it must
/// not block (queue the work and return).
pub trait PlanListener: Send + Sync {
    fn plan_needs_approval(&self, n: PlanNeedsApproval);
}

/// A lease as the console's live list shows it: no traffic token, no
/// backend id.
#[derive(Debug, Clone)]
pub struct LiveLease {
    pub lease_ref: String,
    pub tenant: String,
    pub runtime: String,
    pub profile: String,
    pub sandbox_ref: String,
    pub state: leases::LeaseState,
    pub created_at: String,
    pub last_used_unix: i64,
    /// A trusted task's lease (it releases with its task).
    pub task_ref: Option<String>,
    /// The template preset applied to its sandbox: `NAME@VERSION` and the
    /// preset's SHA-256 (hex).
    pub preset: Option<(String, String)>,
    /// Its brokered egress, when its profile has some.
    pub egress: Option<dto::LeaseEgress>,
    /// Its newest jobs (stored states), at most `LIVE_PROCS`.
    pub jobs: Vec<jobs::Job>,
    /// How many jobs it has in all.
    pub jobs_total: usize,
    /// Its newest PTYs (stored states), at most `LIVE_PROCS`.
    pub ptys: Vec<ptys::Pty>,
    /// How many PTYs it has in all.
    pub ptys_total: usize,
}

/// Jobs, and PTYs, of one lease the live list shows at most.
pub const LIVE_PROCS: usize = 50;

/// A policy checked and compiled, ready to swap in.
pub struct PreparedPolicy(Policy);

/// Per-request context from the transport.
#[derive(Debug, Clone, Default)]
pub struct Ctx {
    pub request_id: String,
    /// What the client said it is (an MCP host's client info, an HTTP
    /// client's `User-Agent`): printable ASCII, at most 128 bytes.
    pub agent: Option<String>,
    /// The console session the request came through (its store key, a
    /// digest): decisions there are recorded as runtime `console`.
    pub console_session: Option<String>,
}

impl Ctx {
    /// A client's description of itself as it may be kept: printable
    /// ASCII (anything else becomes `?`), at most 128 bytes; empty is none.
    pub fn agent_from(s: &str) -> Option<String> {
        let t: String = s
            .trim()
            .chars()
            .map(|c| {
                if c == ' ' || c.is_ascii_graphic() {
                    c
                } else {
                    '?'
                }
            })
            .take(128)
            .collect();
        Some(t).filter(|t| !t.is_empty())
    }
}

impl Broker {
    pub fn new(
        cfg: Arc<Config>,
        store: Store,
        journal: Journal,
        backends: Backends,
        key: Vec<u8>,
        receipts: receipts::Signer,
        clock: crate::clock::Clock,
    ) -> Self {
        let policy = compile_policy(cfg.clone()).unwrap_or_else(|e| {
            // Checked when the configuration loaded; plans of it fail.
            tracing::error!(error = %e, "a task template's schema does not compile");
            Policy {
                cfg,
                schemas: HashMap::new(),
                mcp_tools: HashMap::new(),
            }
        });
        Self {
            inner: Arc::new(Inner {
                policy: std::sync::RwLock::new(Arc::new(policy)),
                store,
                journal,
                backends,
                key,
                locks: Mutex::default(),
                tracker: tokio_util::task::TaskTracker::new(),
                busy: Mutex::default(),
                ptys: ptys::Hubs::default(),
                receipts,
                clock,
                plan_listener: std::sync::OnceLock::new(),
                gc: crate::metrics::Gc::default(),
                egress: egress::Egress::default(),
                recordings: recordings::Recordings::default(),
            }),
        }
    }

    /// The session recordings this process writes.
    pub fn recordings(&self) -> &recordings::Recordings {
        &self.inner.recordings
    }

    /// GC's instruments (passes, and what they collected).
    pub fn gc_metrics(&self) -> &crate::metrics::Gc {
        &self.inner.gc
    }

    /// The broker's clock.
    pub fn clock(&self) -> &crate::clock::Clock {
        &self.inner.clock
    }

    /// Now, as text and as Unix seconds (the broker's clock).
    pub(crate) fn now(&self) -> (String, i64) {
        self.inner.clock.stamp()
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

    /// What runs a backend's sandboxes (`executor` in every lease answer):
    /// a CubeSandbox, or the embedded backend.
    pub fn executor(&self, backend: &str) -> dto::Executor {
        use self::backends::Kind;
        let kind = match self.inner.backends.get(backend) {
            Some(b) => b.kind,
            None => match self.config().backend_defs().get(backend) {
                Some(crate::config::BackendDef::Embedded(_)) => {
                    Kind::Embedded(self.config().embedded.isolation)
                }
                _ => Kind::CubeSandbox,
            },
        };
        match kind {
            Kind::CubeSandbox => dto::Executor::CubesandboxMicrovm,
            Kind::Embedded(crate::embedded::Isolation::Namespaces) => {
                dto::Executor::EmbeddedNamespaces
            }
            Kind::Embedded(crate::embedded::Isolation::None) => dto::Executor::EmbeddedProcesses,
        }
    }

    /// What runs a lease's sandbox (a lease gone: its backend's default).
    pub fn lease_executor(&self, lease_ref: &str) -> dto::Executor {
        let backend = self
            .inner
            .store
            .read_now(|txn| crate::store::leases::get(txn, lease_ref))
            .ok()
            .flatten()
            .map(|l| l.backend)
            .unwrap_or_else(|| crate::config::DEFAULT_BACKEND.to_string());
        self.executor(&backend)
    }

    /// The configuration as it is now (a reload may replace it).
    pub fn config(&self) -> Arc<Config> {
        self.policy().cfg.clone()
    }

    pub(crate) fn policy(&self) -> Arc<Policy> {
        self.inner
            .policy
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Check what a reload would apply (profiles, task templates, plan
    /// retention): `Err` says why it cannot be, and nothing changes.
    pub fn prepare_reload(&self, cfg: &Config) -> std::result::Result<PreparedPolicy, PolicyError> {
        compile_policy(Arc::new(cfg.clone())).map(PreparedPolicy)
    }

    /// Swap in a prepared policy. Calls in progress finish under the one
    /// they started with; plans made under a changed template or profile
    /// are refused from now on (`task_template_changed`).
    pub fn apply_reload(&self, p: PreparedPolicy) {
        *self.inner.policy.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(p.0);
    }

    /// Set the listener told of plans that need approval (once; false if
    /// one was set already).
    pub fn set_plan_listener(&self, l: Arc<dyn PlanListener>) -> bool {
        self.inner.plan_listener.set(l).is_ok()
    }

    /// Tell the listener, if any, that a plan needs approval.
    pub(crate) fn tell_plan_needs_approval(&self, n: PlanNeedsApproval) {
        if let Some(l) = self.inner.plan_listener.get() {
            l.plan_needs_approval(n);
        }
    }

    /// The backends, by name.
    pub fn backends(&self) -> &Backends {
        &self.inner.backends
    }

    /// A backend's client; 503 `backend_unavailable` if it is not
    /// configured (any more).
    pub(crate) fn client(&self, backend: &str) -> Result<CubeClient> {
        match self.inner.backends.get(backend) {
            Some(b) => Ok(b.client.clone()),
            None => Err(backends::unavailable(backend)),
        }
    }

    /// A backend's client, and 503 `backend_unavailable` unless its health
    /// watch finds it up: checked before any intent.
    pub(crate) fn ready_client(&self, backend: &str) -> Result<CubeClient> {
        match self.inner.backends.get(backend) {
            Some(b) => {
                b.ready()?;
                Ok(b.client.clone())
            }
            None => Err(backends::unavailable(backend)),
        }
    }

    /// A backend call failed to reach it: its watch asks again now.
    pub(crate) fn suspect(&self, backend: &str, e: &crate::cube::CubeError) {
        use crate::cube::ErrorKind as K;
        if matches!(e.kind, K::Unavailable | K::Timeout)
            && let Some(b) = self.inner.backends.get(backend)
        {
            b.suspect();
        }
    }

    /// Live leases by backend.
    pub fn lease_counts(&self) -> Result<std::collections::BTreeMap<String, usize>> {
        let all = self.inner.store.read_now(crate::store::leases::all)?;
        let mut m = std::collections::BTreeMap::new();
        for l in all {
            *m.entry(l.backend).or_insert(0) += 1;
        }
        Ok(m)
    }

    /// Whether a backend is configured and up (upkeep skips the leases of
    /// one that is down).
    pub(crate) fn backend_up(&self, backend: &str) -> bool {
        self.inner.backends.get(backend).is_some_and(|b| b.is_up())
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
    /// when nobody holds them. With a PostgreSQL store the lock holds
    /// across replicas too: a session advisory lock of the database, taken
    /// once this process's own lock is held (so a replica waits on the
    /// database with one task per name at most). It fails
    /// (`audit_unavailable`) when the database cannot be reached: nothing
    /// may go on unlocked.
    pub(crate) async fn lock(&self, name: String) -> Result<LockGuard> {
        let m = {
            let mut map = self.inner.locks.lock().unwrap_or_else(|p| p.into_inner());
            map.entry(name.clone()).or_default().clone()
        };
        let guard = m.clone().lock_owned().await;
        let mut held = LockGuard {
            broker: self.clone(),
            name,
            guard: Some(guard),
            mutex: m,
            shared: None,
        };
        if let Some(pg) = self.inner.store.postgres() {
            let key = crate::store::pg::lock_key(&held.name);
            held.shared = Some(pg.lock(key).await?);
        }
        Ok(held)
    }

    pub(crate) fn profile(&self, name: &str) -> Option<Profile> {
        self.policy().cfg.profiles.get(name).cloned()
    }

    /// The base audit event for a principal's action.
    pub(crate) fn event(&self, p: &Principal, action: Action, ctx: &Ctx) -> Event {
        let j = &self.inner.journal;
        let mut ev = j.event(action);
        ev.tenant_digest = Some(j.digest("tenant", p.tenant.as_bytes()));
        ev.issuer_digest = p.issuer.as_ref().map(|i| j.digest("issuer", i.as_bytes()));
        ev.identity_digest = Some(j.digest("identity", p.identity_key().as_bytes()));
        if !ctx.request_id.is_empty() {
            ev.request_id = Some(ctx.request_id.clone());
        }
        ev
    }

    /// Record a denied request (`rejected`) and return the error.
    pub(crate) async fn reject(&self, mut ev: Event, e: Error) -> Error {
        ev.outcome = Outcome::Rejected;
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
                    Code::ActionDenied,
                    format!("the action {action} is not allowed for this identity"),
                ),
            )
            .await)
    }
}

/// Test-only failpoints, set with `CUBE_ADAPTER_FAILPOINT=<name>` (read
/// once, at the first failpoint reached): the process kills itself
/// (SIGKILL) at the named point. `after_intent`: right after an intent is
/// committed, before the backend is called; `before_outcome:ACTION` (see
/// `failpoint_for`). Used by the crash tests; never
/// set it in production.
///
/// Compiled in with the `failpoints` feature, and in debug builds (the
/// binary `cargo test` builds and the integration tests run: the default
/// `cargo test --locked` needs no flag). Release builds without the feature
/// have an empty function and never read `CUBE_ADAPTER_FAILPOINT`.
#[cfg(any(feature = "failpoints", debug_assertions))]
pub(crate) fn failpoint(name: &str) {
    static SET: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let set = SET.get_or_init(|| std::env::var("CUBE_ADAPTER_FAILPOINT").ok());
    if set.as_deref() == Some(name) {
        eprintln!("failpoint {name}: killing this process");
        let _ = nix::sys::signal::kill(nix::unistd::Pid::this(), nix::sys::signal::Signal::SIGKILL);
        std::process::abort();
    }
}

/// Without failpoints: nothing.
#[cfg(not(any(feature = "failpoints", debug_assertions)))]
#[inline(always)]
pub(crate) fn failpoint(_name: &str) {}

/// A failpoint for one action: `CUBE_ADAPTER_FAILPOINT=POINT:ACTION`
/// (`before_outcome:job_start`: the effect done, its outcome not yet
/// committed).
#[cfg(any(feature = "failpoints", debug_assertions))]
pub(crate) fn failpoint_for(point: &str, action: &Action) {
    failpoint(&format!("{point}:{action}"));
}

#[cfg(not(any(feature = "failpoints", debug_assertions)))]
#[inline(always)]
pub(crate) fn failpoint_for(_point: &str, _action: &Action) {}

pub(crate) struct LockGuard {
    broker: Broker,
    name: String,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
    mutex: Arc<tokio::sync::Mutex<()>>,
    /// The database's lock of the same name (a PostgreSQL store).
    shared: Option<crate::store::pg::AdvisoryLock>,
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        // The other replicas' turn first, then this process's.
        self.shared.take();
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
