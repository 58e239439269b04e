//! The embedded backend's sandboxes: create (from a template or a snapshot),
//! inspect, kill, timeouts, pause/resume, snapshots, rollback. State lives in
//! the backend's state directory so that sandboxes outlive the backend and are
//! re-adopted when it starts again.

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use crate::cgroup::{self, Groups};
use crate::clock::random_hex;
use crate::egress::Egress;
pub use crate::error::BackendError;
use crate::error::internal;
use crate::launch::{self, InitInfo, Isolation, LaunchSpec, Limits};
use crate::procs::Tree;
use crate::tree::{self, Shift};
use crate::volumes::{self as vols, VolumeBind, VolumeMeta, Volumes};
use crate::wire::{
    self, CreateSandbox, CreateVolume, Sandbox, SandboxDetail, SnapshotInfo, TemplateInfo,
    VolumeMount,
};

mod create;
mod lifecycle;
mod snapshot;
mod volumes;

/// Host uid that the first sandbox's root maps to (each sandbox gets its own
/// range of 65536 ids above it, so rlimits and file ownership never mix).
pub const DEFAULT_UID_BASE: u32 = 0x4000_0000;
const IDS_PER_SANDBOX: u32 = 65536;
/// The directories of `state/` a sandbox writes (its `/workspace`, `/tmp`
/// and `/root`).
const WRITABLE: [&str; 3] = ["workspace", "tmp", "home"];
pub use crate::templates::{HOST_TEMPLATE, MINIMAL_TEMPLATE};

/// A template backed by a root directory.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct TemplateConfig {
    pub id: String,
    pub rootfs: PathBuf,
}

/// Backend settings.
#[derive(Debug, Clone)]
pub struct Settings {
    pub state_dir: PathBuf,
    pub isolation: Isolation,
    pub templates: Vec<TemplateConfig>,
    pub limits: Limits,
    /// CPUs per sandbox (cgroup quota; 0 = unlimited).
    pub cpus: f64,
    pub domain: String,
    /// The `cube-adapter` binary used to launch sandboxes.
    pub launcher: PathBuf,
    pub uid_base: u32,
    /// Host paths hidden from every sandbox.
    pub mask: Vec<PathBuf>,
    /// Besides `state_dir`, directories whose disks `min_free_mb` keeps
    /// free (the appliance's state: the journal's disk).
    pub keep_free: Vec<PathBuf>,
    /// Timeout (s) for sandboxes created without one; None = never.
    pub default_timeout: Option<i64>,
    /// How long past its idle timeout, counted from the backend's last
    /// heartbeat, a sandbox's init waits before it ends the sandbox itself
    /// (`launch::Watch`).
    pub orphan_grace_secs: i64,
    /// The size of each sandbox's own disk for its writable directories
    /// (MiB; `disk.rs`) when the request names none; 0: no disk of its own.
    pub disk_mb: u64,
    /// New sandboxes are refused while the file system of the state
    /// directory, or of any masked directory (the appliance's own state),
    /// has less than this free (MiB).
    pub min_free_mb: u64,
    /// Behave as a real CubeSandbox does where this backend is otherwise
    /// kinder (see `Faithful`); `None` in production.
    pub faithful: Option<Faithful>,
}

/// The embedded backend as a faithful stand-in for a real deployment
/// (`cube-protocol.md` §9), so that the appliance's client is tested against
/// what production does rather than what this backend would prefer:
/// - an unknown template or snapshot on create is 500 "CubeMaster returned
///   error code 130404" (not 404);
/// - the idle clock counts only completed data-plane requests: a timeout can
///   fall while a long call is in flight (the kind mode never does that);
/// - `X-API-Key` is forwarded to envd on the data plane, as CubeProxy does;
/// - at a `Connect-Timeout-Ms` deadline envd kills only the direct process
///   and ends the stream with a `deadline_exceeded` end-stream;
/// - a pause takes `pause_delay`.
#[derive(Debug, Clone, Default)]
pub struct Faithful {
    pub pause_delay: std::time::Duration,
    /// Stand in for an older envd: reported as `envdVersion`, and envd
    /// refuses what that version refuses (an RPC without a user below
    /// 0.4.0, CloseStdin below 0.5.2, an octet-stream upload below 0.5.7).
    pub envd_version: Option<String>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum State {
    Running,
    Paused,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Running => "running",
            State::Paused => "paused",
        }
    }
}

/// Persistent record of one sandbox (`sandboxes/<id>/meta.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Meta {
    pub id: String,
    pub template_id: String,
    pub rootfs: PathBuf,
    pub client_id: String,
    pub started_at: String,
    /// The sandbox's idle timeout (s): it times out this long after its
    /// last activity; None = never.
    #[serde(default)]
    pub timeout_secs: Option<i64>,
    /// When the last activity ended (unix ms): a completed data-plane
    /// request, create, resume, or a timeout set. Not persisted: a restart
    /// of the backend counts as activity.
    #[serde(skip)]
    pub last_active_ms: i64,
    /// Data-plane requests in flight.
    #[serde(skip)]
    pub inflight: u32,
    pub on_timeout_pause: bool,
    pub auto_resume: bool,
    pub state: State,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    pub internet: bool,
    /// What the sandbox may reach (`egress.rs`); None: no network.
    #[serde(default)]
    pub egress: Option<Egress>,
    /// The size of its own disk (`disk.rs`); None: none.
    #[serde(default)]
    pub disk_mb: Option<u64>,
    pub traffic_token: Option<String>,
    /// Its volumes (`volumes.rs`), as mounted.
    #[serde(default)]
    pub volumes: Vec<VolumeMount>,
    pub slot: u32,
    pub host_uid: u32,
    pub host_gid: u32,
    pub isolated: bool,
    pub init: InitInfo,
    pub groups: Groups,
}

impl Meta {
    /// When the idle timeout falls (unix ms), if it has one.
    fn idle_end_ms(&self) -> Option<i64> {
        self.timeout_secs
            .map(|t| self.last_active_ms.saturating_add(t.saturating_mul(1000)))
    }

    /// The sandbox's processes.
    pub fn tree(&self) -> Tree {
        Tree {
            init: self.init.clone(),
            groups: self.groups.clone(),
            isolated: self.isolated,
        }
    }
}

/// Persistent record of one snapshot (`snapshots/<id>/meta.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapMeta {
    pub id: String,
    pub names: Vec<String>,
    pub origin: String,
    pub template_id: String,
    pub rootfs: PathBuf,
    pub created_at: String,
    pub host_uid: u32,
    pub host_gid: u32,
    pub internet: bool,
    #[serde(default)]
    pub egress: Option<Egress>,
    pub env_vars: BTreeMap<String, String>,
    /// The volumes the sandbox had mounted (their files are not in the
    /// snapshot): a sandbox made from it mounts them again unless its
    /// create names its own.
    #[serde(default)]
    pub volumes: Vec<VolumeMount>,
}

struct Entry {
    meta: Mutex<Meta>,
    /// Serialises lifecycle operations on one sandbox.
    op: tokio::sync::Mutex<()>,
}

/// Where the data plane of a sandbox is reached.
pub struct Route {
    pub socket: PathBuf,
    pub traffic_token: Option<String>,
    /// The sandbox has a network namespace of its own (namespace isolation,
    /// and no network or pasta's): only then are its ports other than
    /// envd's reached (`proxy::forward`).
    pub own_netns: bool,
}

pub enum RouteError {
    Unknown,
    Paused,
    ResumeFailed,
}

pub struct Manager {
    pub settings: Settings,
    cgroups: cgroup::Host,
    entries: Mutex<HashMap<String, Arc<Entry>>>,
    snapshots: Mutex<HashMap<String, SnapMeta>>,
    snap_lock: tokio::sync::Mutex<()>,
    /// When the heartbeat was last written (unix ms).
    last_beat_ms: std::sync::atomic::AtomicI64,
    /// When ownerless sandboxes were last looked for (unix ms; 0: never).
    last_sweep_ms: std::sync::atomic::AtomicI64,
    /// Whether sandboxes can have disks of their own (`disk::available`).
    disks: Result<(), crate::disk::Unavailable>,
    /// Where sandboxes' ids come from (`subids::id_space`): the first id of
    /// the first sandbox's slice (0: `uid_base`, under the host's root) and
    /// how many slices there are (None: no bound); None: one id for all.
    id_space: Option<(u32, Option<u32>)>,
    volumes: Arc<Volumes>,
    /// The volumes of sandboxes being killed, by sandbox: in use until
    /// their processes are gone.
    draining: Mutex<HashMap<String, Vec<VolumeMount>>>,
}

pub fn now_unix() -> i64 {
    crate::clock::system_now().unix_timestamp()
}

pub fn rfc3339(unix: i64) -> String {
    OffsetDateTime::from_unix_timestamp(unix)
        .ok()
        .and_then(|t| t.format(&Rfc3339).ok())
        .unwrap_or_default()
}

fn now_rfc3339() -> String {
    crate::clock::system_now()
        .format(&Rfc3339)
        .unwrap_or_default()
}

fn write_json_atomic<T: Serialize>(path: &Path, v: &T) -> std::io::Result<()> {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(
        &tmp,
        serde_json::to_vec_pretty(v).map_err(std::io::Error::other)?,
    )?;
    std::fs::rename(tmp, path)
}

pub use crate::wire::valid_id;

const ENV_DENY: &[&str] = &[
    "PATH",
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "LD_AUDIT",
    "PYTHONPATH",
    "PYTHONHOME",
    "NODE_PATH",
    "NODE_OPTIONS",
    "BASH_ENV",
    "ENV",
    "IFS",
    "CLASSPATH",
    "PERL5LIB",
    "RUBYLIB",
    "GCONV_PATH",
];

/// CubeAPI timeouts are int32 seconds, `-1` = never.
fn check_timeout(t: i64) -> Result<(), BackendError> {
    if (-1..=i64::from(i32::MAX)).contains(&t) {
        Ok(())
    } else {
        Err(BackendError::BadRequest(
            "timeout must be -1 (never) or 0..=2147483647 seconds".into(),
        ))
    }
}

fn now_ms() -> i64 {
    i64::try_from(crate::clock::system_now().unix_timestamp_nanos() / 1_000_000).unwrap_or(0)
}

fn validate_env(env: &BTreeMap<String, String>) -> Result<(), BackendError> {
    for (k, v) in env {
        let mut chars = k.chars();
        let ok_name = k.len() <= 256
            && chars
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !ok_name {
            return Err(BackendError::BadRequest(format!(
                "invalid environment variable name '{k}'"
            )));
        }
        if ENV_DENY.iter().any(|d| d.eq_ignore_ascii_case(k)) {
            return Err(BackendError::BadRequest(format!(
                "environment variable '{k}' is not allowed"
            )));
        }
        if v.len() > 4096 || v.chars().any(|c| c.is_control() && c != '\t') {
            return Err(BackendError::BadRequest(format!(
                "invalid value for environment variable '{k}'"
            )));
        }
    }
    Ok(())
}

impl Manager {
    /// Open the state directory and re-adopt the sandboxes still alive.
    pub fn open(settings: Settings) -> Result<Arc<Self>, BackendError> {
        for d in ["sandboxes", "snapshots"] {
            std::fs::create_dir_all(settings.state_dir.join(d))
                .map_err(|e| internal("create state dir", e))?;
        }
        let _ =
            std::fs::set_permissions(&settings.state_dir, std::fs::Permissions::from_mode(0o700));
        let volumes =
            Arc::new(Volumes::open(&settings.state_dir).map_err(|e| internal("open volumes", e))?);
        let cgroups =
            if settings.isolation == Isolation::Namespaces || nix::unistd::geteuid().is_root() {
                cgroup::Host::detect()
            } else {
                cgroup::Host::None
            };
        tracing::info!(cgroups = %cgroups.describe(), isolation = ?settings.isolation, "embedded backend");
        let disks = crate::disk::available();
        if let Err(why) = &disks
            && settings.disk_mb > 0
            && settings.isolation == Isolation::Namespaces
        {
            tracing::warn!(reason = %why, "sandboxes get no disk of their own: their files share the state directory's disk, bounded only by min_free_mb");
        }
        let m = Arc::new(Self {
            settings,
            cgroups,
            entries: Mutex::default(),
            snapshots: Mutex::default(),
            snap_lock: tokio::sync::Mutex::new(()),
            last_beat_ms: std::sync::atomic::AtomicI64::new(0),
            last_sweep_ms: std::sync::atomic::AtomicI64::new(0),
            disks,
            id_space: crate::subids::id_space(),
            volumes,
            draining: Mutex::default(),
        });
        m.beat(now_ms());
        m.adopt();
        // A volume no live sandbox uses has no file system mounted.
        for id in m.volumes.ids() {
            if m.volume_holders(&id).is_empty() {
                m.volumes.release(&id);
            }
        }
        Ok(m)
    }

    /// The envd version sandboxes report.
    fn envd_version(&self) -> String {
        self.settings
            .faithful
            .as_ref()
            .and_then(|f| f.envd_version.clone())
            .unwrap_or_else(|| wire::ENVD_VERSION.into())
    }

    fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.settings.state_dir.join("sandboxes").join(id)
    }

    fn snapshot_dir(&self, id: &str) -> PathBuf {
        self.settings.state_dir.join("snapshots").join(id)
    }

    fn adopt(&self) {
        let dir = self.settings.state_dir.join("sandboxes");
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = e.path();
            let meta: Option<Meta> = std::fs::read(path.join("meta.json"))
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok());
            match meta {
                Some(mut m) if m.tree().init_alive() => {
                    tracing::info!(sandbox = %short(&m.id), "re-adopted running sandbox");
                    m.last_active_ms = now_ms();
                    if let Ok(mut map) = self.entries.lock() {
                        map.insert(
                            m.id.clone(),
                            Arc::new(Entry {
                                meta: Mutex::new(m),
                                op: tokio::sync::Mutex::new(()),
                            }),
                        );
                    }
                }
                Some(m) => {
                    tracing::info!(sandbox = %short(&m.id), "sandbox ended while the backend was down; cleaning up");
                    m.groups.remove();
                    crate::disk::release(&path);
                    let _ = tree::remove_tree(&path);
                }
                None => {
                    crate::disk::release(&path);
                    let _ = tree::remove_tree(&path);
                }
            }
        }
        let sdir = self.settings.state_dir.join("snapshots");
        for e in std::fs::read_dir(&sdir).into_iter().flatten().flatten() {
            let meta: Option<SnapMeta> = std::fs::read(e.path().join("meta.json"))
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok());
            match meta {
                Some(s) => {
                    if let Ok(mut map) = self.snapshots.lock() {
                        map.insert(s.id.clone(), s);
                    }
                }
                None => {
                    let _ = tree::remove_tree(&e.path());
                }
            }
        }
    }

    fn entry(&self, id: &str) -> Result<Arc<Entry>, BackendError> {
        self.entries
            .lock()
            .ok()
            .and_then(|m| m.get(id).cloned())
            .ok_or_else(|| BackendError::SandboxNotFound(id.to_string()))
    }

    fn snapshot(&self, id: &str) -> Option<SnapMeta> {
        self.snapshots.lock().ok().and_then(|m| m.get(id).cloned())
    }

    pub fn templates(&self) -> Vec<TemplateInfo> {
        let mut v: Vec<TemplateInfo> = [MINIMAL_TEMPLATE, HOST_TEMPLATE]
            .into_iter()
            .map(|t| TemplateInfo {
                template_id: t.into(),
                public: false,
                status: "READY".into(),
                aliases: vec![t.into()],
                created_at: None,
            })
            .collect();
        for t in crate::templates::imported(&self.settings.state_dir) {
            v.push(TemplateInfo {
                template_id: t.id,
                public: false,
                status: "READY".into(),
                aliases: vec![],
                created_at: Some(t.imported_at),
            });
        }
        for t in &self.settings.templates {
            let ready = t.rootfs.is_dir();
            v.push(TemplateInfo {
                template_id: t.id.clone(),
                public: false,
                status: if ready {
                    "READY".into()
                } else {
                    "FAILED".into()
                },
                aliases: vec![],
                created_at: None,
            });
        }
        v
    }

    fn template_rootfs(&self, id: &str) -> Option<(PathBuf, bool)> {
        if id == HOST_TEMPLATE || id == MINIMAL_TEMPLATE {
            return Some((PathBuf::from("/"), true));
        }
        if let Some(t) = crate::templates::find(&self.settings.state_dir, id) {
            return Some((t.rootfs, false));
        }
        self.settings
            .templates
            .iter()
            .find(|t| t.id == id)
            .map(|t| (t.rootfs.clone(), false))
    }

    pub fn detail(&self, id: &str) -> Result<SandboxDetail, BackendError> {
        let e = self.entry(id)?;
        let m = e.meta.lock().map_err(|_| internal("state", "poisoned"))?;
        // A sandbox whose init died (killed, out of memory) is gone now,
        // not at the next tick that removes it.
        if m.init.pid == 0 || !m.tree().init_alive() {
            return Err(BackendError::SandboxNotFound(id.to_string()));
        }
        Ok(self.detail_of(&m))
    }

    fn detail_of(&self, m: &Meta) -> SandboxDetail {
        let mut metadata = m.metadata.clone();
        if !m.isolated {
            metadata.insert("cube-adapter.isolation".into(), "none".into());
        }
        SandboxDetail {
            template_id: m.template_id.clone(),
            sandbox_id: m.id.clone(),
            client_id: m.client_id.clone(),
            started_at: m.started_at.clone(),
            end_at: m.idle_end_ms().map(|ms| rfc3339(ms / 1000)),
            envd_version: self.envd_version(),
            domain: Some(self.settings.domain.clone()),
            cpu_count: if self.settings.cpus > 0.0 {
                self.settings.cpus.ceil() as u32
            } else {
                num_cpus()
            },
            memory_mb: self.settings.limits.memory_mb,
            disk_size_mb: 0,
            metadata,
            state: m.state.as_str().into(),
            volume_mounts: (!m.volumes.is_empty()).then(|| m.volumes.clone()),
        }
    }

    /// `GET /sandboxes` with optional metadata and state filters.
    pub fn list(
        &self,
        metadata: &[(String, String)],
        state: Option<&str>,
        limit: usize,
    ) -> Vec<SandboxDetail> {
        let entries: Vec<Arc<Entry>> = self
            .entries
            .lock()
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default();
        let mut v: Vec<SandboxDetail> = entries
            .iter()
            .filter_map(|e| e.meta.lock().ok().map(|m| m.clone()))
            .filter(|m| m.init.pid != 0 && m.tree().init_alive())
            .filter(|m| {
                metadata
                    .iter()
                    .all(|(k, val)| m.metadata.get(k) == Some(val))
            })
            .filter(|m| state.is_none_or(|s| s.split(',').any(|s| s == m.state.as_str())))
            .map(|m| {
                let mut d = self.detail_of(&m);
                d.domain = None;
                d
            })
            .collect();
        v.sort_by(|a, b| {
            a.started_at
                .cmp(&b.started_at)
                .then(a.sandbox_id.cmp(&b.sandbox_id))
        });
        v.truncate(limit);
        v
    }

    /// Data-plane routing; resumes a paused sandbox with auto-resume.
    pub async fn route(&self, id: &str) -> Result<Route, RouteError> {
        let e = self.entry(id).map_err(|_| RouteError::Unknown)?;
        // A lifecycle operation under way (a pause, a snapshot) ends first:
        // the state read below is then not about to change.
        drop(e.op.lock().await);
        let (state, auto, token, pid, own_netns) = {
            let m = e.meta.lock().map_err(|_| RouteError::Unknown)?;
            (
                m.state,
                m.auto_resume,
                m.traffic_token.clone(),
                m.init.pid,
                m.isolated && (!m.internet || m.egress.is_some()),
            )
        };
        if pid == 0 {
            return Err(RouteError::Unknown);
        }
        if state == State::Paused {
            if !auto {
                return Err(RouteError::Paused);
            }
            self.resume(id, None, false)
                .await
                .map_err(|_| RouteError::ResumeFailed)?;
        }
        Ok(Route {
            socket: self.sandbox_dir(id).join(launch::SOCKET),
            traffic_token: token,
            own_netns,
        })
    }

    /// Number of live sandboxes.
    pub fn count(&self) -> usize {
        self.entries.lock().map(|m| m.len()).unwrap_or(0)
    }

    /// The host pid of a sandbox's init (tests and diagnostics).
    pub fn init_pid(&self, id: &str) -> Option<i32> {
        self.entry(id)
            .ok()
            .and_then(|e| e.meta.lock().ok().map(|m| m.init.pid))
    }
}

pub fn short(id: &str) -> &str {
    id.get(..8).unwrap_or(id)
}

fn num_cpus() -> u32 {
    std::thread::available_parallelism()
        .map(|n| n.get() as u32)
        .unwrap_or(1)
}
