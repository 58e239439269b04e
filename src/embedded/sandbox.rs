//! The embedded backend's sandboxes: create (from a template or a snapshot),
//! inspect, kill, timeouts, pause/resume, snapshots, rollback. State lives in
//! the backend's state directory so that sandboxes outlive the backend and are
//! re-adopted when it starts again.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use super::cgroup::{self, Groups};
use super::egress::Egress;
use super::launch::{self, InitInfo, Isolation, LaunchSpec, Limits};
use super::procs::Tree;
use super::tree::{self, Shift};
use super::volumes::{self, VolumeBind, VolumeMeta, Volumes};
use crate::cube::wire::{
    self, CreateSandbox, CreateVolume, Sandbox, SandboxDetail, SnapshotInfo, TemplateInfo,
    VolumeMount,
};
use crate::ids::random_hex;

/// Host uid that the first sandbox's root maps to (each sandbox gets its own
/// range of 65536 ids above it, so rlimits and file ownership never mix).
pub const DEFAULT_UID_BASE: u32 = 0x4000_0000;
const IDS_PER_SANDBOX: u32 = 65536;
/// The directories of `state/` a sandbox writes (its `/workspace`, `/tmp`
/// and `/root`).
const WRITABLE: [&str; 3] = ["workspace", "tmp", "home"];
pub const HOST_TEMPLATE: &str = "host";
/// The default template: of the host's root, only programs, libraries and
/// a filtered `/etc` (`launch::MINIMAL_TOP`, `launch::MINIMAL_ETC`).
pub const MINIMAL_TEMPLATE: &str = "minimal";

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

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("sandbox {0} not found")]
    SandboxNotFound(String),
    #[error("template {0} not found")]
    TemplateNotFound(String),
    #[error("snapshot {0} not found")]
    SnapshotNotFound(String),
    #[error("volume {0} not found")]
    VolumeNotFound(String),
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    Conflict(String),
    /// Too little disk left for another sandbox (507).
    #[error("{0}")]
    StorageLow(String),
    /// What the request needs is missing on this host (501): pasta or
    /// nft for a sandbox with network access.
    #[error("{0}")]
    Unsupported(String),
    #[error("{0}")]
    Internal(String),
}

impl BackendError {
    pub fn status(&self) -> u16 {
        match self {
            Self::SandboxNotFound(_)
            | Self::TemplateNotFound(_)
            | Self::SnapshotNotFound(_)
            | Self::VolumeNotFound(_) => 404,
            Self::BadRequest(_) => 400,
            Self::Conflict(_) => 409,
            Self::StorageLow(_) => 507,
            Self::Unsupported(_) => 501,
            Self::Internal(_) => 500,
        }
    }
}

fn internal(what: &str, e: impl std::fmt::Display) -> BackendError {
    BackendError::Internal(format!("{what}: {e}"))
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
    disks: Result<(), String>,
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

pub use crate::cube::wire::valid_id;

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
        let disks = super::disk::available();
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
            id_space: super::subids::id_space(),
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
                    super::disk::release(&path);
                    let _ = tree::remove_tree(&path);
                }
                None => {
                    super::disk::release(&path);
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
        for t in super::templates::imported(&self.settings.state_dir) {
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
        if let Some(t) = super::templates::find(&self.settings.state_dir, id) {
            return Some((t.rootfs, false));
        }
        self.settings
            .templates
            .iter()
            .find(|t| t.id == id)
            .map(|t| (t.rootfs.clone(), false))
    }

    fn next_slot(&self) -> u32 {
        let used: Vec<u32> = self
            .entries
            .lock()
            .map(|m| {
                m.values()
                    .filter_map(|e| e.meta.lock().ok().map(|m| m.slot))
                    .collect()
            })
            .unwrap_or_default();
        (0..).find(|s| !used.contains(s)).unwrap_or(0)
    }

    fn ids_for_slot(&self, slot: u32) -> (u32, u32, u32) {
        if let Some((first, _)) = self.id_space
            && self.settings.isolation == Isolation::Namespaces
        {
            let base = if first == 0 {
                self.settings.uid_base
            } else {
                first
            };
            let uid = base.saturating_add(slot.saturating_mul(IDS_PER_SANDBOX));
            (uid, uid, IDS_PER_SANDBOX)
        } else {
            (
                nix::unistd::geteuid().as_raw(),
                nix::unistd::getegid().as_raw(),
                1,
            )
        }
    }

    /// `POST /sandboxes`.
    /// Refuse a new sandbox while a file system it could fill (the state
    /// directory's, the appliance's) is nearly full: one agent must not
    /// take the disk the audit journal lives on. (Not an audit sink's
    /// disk: a full one is a sink behind, not a reason to refuse work.)
    fn check_free_space(&self) -> Result<(), BackendError> {
        let want = self.settings.min_free_mb;
        if want == 0 {
            return Ok(());
        }
        for dir in std::iter::once(&self.settings.state_dir).chain(&self.settings.keep_free) {
            let Ok(st) = nix::sys::statvfs::statvfs(dir) else {
                continue;
            };
            let free_mb = st.blocks_available().saturating_mul(st.fragment_size()) / (1024 * 1024);
            if free_mb < want {
                return Err(BackendError::StorageLow(format!(
                    "the disk of {} has {free_mb} MiB free, below the {want} MiB kept free: \
                     no new sandboxes until space returns",
                    dir.display()
                )));
            }
        }
        Ok(())
    }

    /// What a new sandbox may reach: the request's `allowOut` and
    /// `denyOut`, else its snapshot's; None without any network.
    fn egress_for(
        &self,
        req: &CreateSandbox,
        internet: bool,
        snap: Option<&SnapMeta>,
    ) -> Result<Option<Egress>, BackendError> {
        if self.settings.isolation != Isolation::Namespaces {
            return Ok(None);
        }
        let net = req.network.as_ref();
        let (allow, deny) = (
            net.and_then(|n| n.allow_out.as_deref()),
            net.and_then(|n| n.deny_out.as_deref()),
        );
        let inherited = snap.and_then(|s| s.egress.as_ref());
        let egress = match (allow, deny, inherited) {
            (None, None, Some(e)) => (internet || !e.allow.is_empty()).then(|| Egress {
                default_allow: internet,
                host: super::egress::host_addresses(),
                ..e.clone()
            }),
            _ => Egress::from_request(internet, allow.unwrap_or(&[]), deny.unwrap_or(&[]))
                .map_err(BackendError::BadRequest)?,
        };
        if egress.is_some() {
            super::egress::Tools::find().map_err(BackendError::Unsupported)?;
        }
        Ok(egress)
    }

    /// The size of a new sandbox's own disk: the request's, else the
    /// backend's default; None when 0, or when this backend cannot make
    /// disks (`disks`).
    fn disk_for(&self, req: &CreateSandbox) -> Result<Option<u64>, BackendError> {
        let mb = req.disk_size_mb.unwrap_or(self.settings.disk_mb);
        if mb == 0 || self.disks.is_err() || self.settings.isolation != Isolation::Namespaces {
            return Ok(None);
        }
        if mb < super::disk::MIN_MB {
            return Err(BackendError::BadRequest(format!(
                "diskSizeMB must be 0 (none) or at least {}",
                super::disk::MIN_MB
            )));
        }
        Ok(Some(mb))
    }

    pub async fn create(self: &Arc<Self>, req: CreateSandbox) -> Result<Sandbox, BackendError> {
        self.check_free_space()?;
        validate_env(&req.env_vars)?;
        let timeout = req.timeout.or(self.settings.default_timeout);
        if let Some(t) = timeout {
            check_timeout(t)?;
        }
        let snap = self.snapshot(&req.template_id);
        let (template_id, rootfs, host_root, from_snap) = match &snap {
            Some(s) => (
                s.template_id.clone(),
                s.rootfs.clone(),
                s.rootfs == Path::new("/"),
                Some(s.clone()),
            ),
            None => {
                let (r, h) = self
                    .template_rootfs(&req.template_id)
                    .ok_or_else(|| BackendError::TemplateNotFound(req.template_id.clone()))?;
                (req.template_id.clone(), r, h, None)
            }
        };
        if !rootfs.is_dir() {
            return Err(BackendError::Conflict(format!(
                "template {} is not ready: its root directory is missing",
                req.template_id
            )));
        }
        let internet = req
            .allow_internet_access
            .unwrap_or(from_snap.as_ref().is_some_and(|s| s.internet));
        let egress = self.egress_for(&req, internet, from_snap.as_ref())?;
        let disk_mb = self.disk_for(&req)?;
        let traffic_token = match req.network.as_ref().and_then(|n| n.allow_public_traffic) {
            Some(false) => Some(random_hex(24)),
            _ => None,
        };
        let mut env_vars = from_snap
            .as_ref()
            .map(|s| s.env_vars.clone())
            .unwrap_or_default();
        env_vars.extend(req.env_vars.clone());
        let lifecycle = req.lifecycle.clone().unwrap_or_default();
        let on_timeout_pause =
            lifecycle.on_timeout.as_deref() == Some("pause") || req.auto_pause == Some(true);
        let auto_resume = lifecycle.auto_resume.unwrap_or(false);
        // A snapshot's volumes unless the create names its own.
        let mounts = match &req.volume_mounts {
            Some(v) => v.clone(),
            None => from_snap
                .as_ref()
                .map(|s| s.volumes.clone())
                .unwrap_or_default(),
        };
        let mounts = volumes::check_mounts(&mounts)?;
        if !mounts.is_empty() && self.settings.isolation != Isolation::Namespaces {
            return Err(BackendError::BadRequest(
                "volumeMounts need namespace isolation: with isolation = \"none\" a sandbox \
                 has no mount namespace to mount volumes in"
                    .into(),
            ));
        }

        let id = random_hex(16);
        let dir = self.sandbox_dir(&id);
        let slot_guard = self.snap_lock.lock().await; // serialise slot allocation
        let slot = self.next_slot();
        if let Some((_, Some(slots))) = self.id_space
            && self.settings.isolation == Isolation::Namespaces
            && slot >= slots
        {
            return Err(BackendError::Conflict(format!(
                "all {slots} id ranges for sandboxes are in use (the service's subordinate \
                 ids hold {slots} sandboxes at once): end a sandbox, or give the service \
                 more subordinate ids"
            )));
        }
        let (host_uid, host_gid, id_count) = self.ids_for_slot(slot);
        self.claim_volumes(&mounts, host_uid, host_gid, id_count)?;
        // cgroups also track an unisolated sandbox's orphans, so kill finds them.
        let groups = Groups::create(
            &self.cgroups,
            &id,
            &self.settings.limits,
            self.settings.cpus,
        )
        .map_err(|e| internal("create cgroup", e))?;
        let spec = LaunchSpec {
            id: id.clone(),
            hostname: format!("cube-{}", short(&id)),
            isolation: self.settings.isolation,
            rootfs: rootfs.clone(),
            host_root,
            minimal: template_id == MINIMAL_TEMPLATE,
            internet,
            egress: egress.clone(),
            disk_mb,
            host_uid,
            host_gid,
            id_count,
            limits: self.settings.limits.clone(),
            cgroup_memory: groups.has_memory(),
            cgroup_procs: groups.procs_files(),
            env_vars: env_vars
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            mask: self.settings.mask.clone(),
            volumes: mounts
                .iter()
                .map(|m| VolumeBind {
                    id: m.name.clone(),
                    source: self.volumes.data_path(&m.name),
                    target: PathBuf::from(&m.path),
                    read_only: m.is_read_only(),
                })
                .collect(),
            heartbeat: Some(self.settings.state_dir.join(launch::HEARTBEAT_FILE)),
            faithful: self.settings.faithful.is_some(),
            envd_version: self
                .settings
                .faithful
                .as_ref()
                .and_then(|f| f.envd_version.clone()),
        };
        // Reserve the slot before releasing the lock.
        let placeholder = Meta {
            id: id.clone(),
            template_id: template_id.clone(),
            rootfs,
            client_id: random_hex(8),
            started_at: now_rfc3339(),
            timeout_secs: timeout.filter(|t| *t >= 0),
            last_active_ms: now_ms(),
            inflight: 0,
            on_timeout_pause,
            auto_resume,
            state: State::Running,
            metadata: req.metadata.clone(),
            env_vars,
            internet,
            egress,
            disk_mb,
            traffic_token: traffic_token.clone(),
            volumes: mounts.clone(),
            slot,
            host_uid,
            host_gid,
            isolated: self.settings.isolation == Isolation::Namespaces,
            init: InitInfo {
                pid: 0,
                start_time: 0,
            },
            groups: groups.clone(),
        };
        let entry = Arc::new(Entry {
            meta: Mutex::new(placeholder),
            op: tokio::sync::Mutex::new(()),
        });
        let op = entry.op.lock().await;
        if let Ok(mut m) = self.entries.lock() {
            m.insert(id.clone(), entry.clone());
        }
        drop(slot_guard);

        let lifecycle = launch::Lifecycle {
            timeout_secs: timeout.filter(|t| *t >= 0),
            pause: on_timeout_pause,
            grace_secs: self.settings.orphan_grace_secs,
        };
        let launched = self
            .prepare_and_launch(&dir, &spec, lifecycle, from_snap.as_ref())
            .await;
        let init = match launched {
            Ok(i) => i,
            Err(e) => {
                if let Ok(mut m) = self.entries.lock() {
                    m.remove(&id);
                }
                let g = groups.clone();
                let d = dir.clone();
                let _ = tokio::task::spawn_blocking(move || {
                    g.remove();
                    super::disk::release(&d);
                    let _ = tree::remove_tree(&d);
                })
                .await;
                self.release_volumes(None, &mounts).await;
                return Err(e);
            }
        };
        let meta = {
            let mut m = entry
                .meta
                .lock()
                .map_err(|_| internal("state", "poisoned"))?;
            m.init = init;
            m.last_active_ms = now_ms();
            m.clone()
        };
        write_json_atomic(&dir.join("meta.json"), &meta)
            .map_err(|e| internal("persist sandbox", e))?;
        drop(op);
        tracing::info!(sandbox = %short(&id), template = %template_id, "sandbox created");
        Ok(Sandbox {
            template_id: req.template_id,
            sandbox_id: id,
            client_id: meta.client_id,
            envd_version: self.envd_version(),
            traffic_access_token: traffic_token,
            domain: self.settings.domain.clone(),
        })
    }

    async fn prepare_and_launch(
        &self,
        dir: &Path,
        spec: &LaunchSpec,
        lifecycle: launch::Lifecycle,
        snap: Option<&SnapMeta>,
    ) -> Result<InitInfo, BackendError> {
        let d = dir.to_path_buf();
        let spec2 = spec.clone();
        let vols = self.volumes.clone();
        let slices = self.slices();
        let snap_data = snap.map(|s| {
            (
                self.snapshot_dir(&s.id).join("data"),
                s.host_uid,
                s.host_gid,
            )
        });
        tokio::task::spawn_blocking(move || -> Result<(), BackendError> {
            std::fs::create_dir_all(d.join("run"))
                .map_err(|e| internal("create sandbox dir", e))?;
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700))
                .map_err(|e| internal("chmod", e))?;
            if let Some(mb) = spec2.disk_mb {
                super::disk::make(&d, mb).map_err(|e| internal("make the sandbox's disk", e))?;
            }
            for (sub, mode) in WRITABLE.into_iter().zip([0o755, 0o1777, 0o700]) {
                let p = d.join("state").join(sub);
                std::fs::create_dir_all(&p).map_err(|e| internal("create sandbox dir", e))?;
                std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode))
                    .map_err(|e| internal("chmod", e))?;
                std::os::unix::fs::chown(&p, Some(spec2.host_uid), Some(spec2.host_gid))
                    .map_err(|e| internal("chown", e))?;
            }
            // A clone: the snapshot's files, before any process exists.
            if let Some((src, from_uid, from_gid)) = &snap_data {
                let shift = Shift {
                    from_uid: *from_uid,
                    from_gid: *from_gid,
                    to_uid: spec2.host_uid,
                    to_gid: spec2.host_gid,
                    count: spec2.id_count,
                };
                let copy = || -> std::io::Result<()> {
                    let from = tree::open_dir(src)?;
                    let to = tree::open_dir(&d.join("state"))?;
                    for sub in WRITABLE {
                        tree::copy_sub(from.as_fd(), to.as_fd(), sub, &shift)?;
                    }
                    Ok(())
                };
                copy().map_err(|e| internal("restore snapshot", e))?;
            }
            // Its volumes: file systems mounted, files given to its ids.
            for v in &spec2.volumes {
                vols.attach(&v.id, slices)?;
            }
            lifecycle
                .write(&d)
                .map_err(|e| internal("write lifecycle", e))?;
            write_json_atomic(&d.join(launch::SPEC_FILE), &spec2)
                .map_err(|e| internal("write spec", e))
        })
        .await
        .map_err(|e| internal("prepare", e))??;

        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("sandbox.log"))
            .map_err(|e| internal("open sandbox log", e))?;
        let mut cmd = tokio::process::Command::new(&self.settings.launcher);
        cmd.arg("__sandbox-launch")
            .arg(dir)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .kill_on_drop(true);
        let status = tokio::time::timeout(Duration::from_secs(30), cmd.status())
            .await
            .map_err(|_| internal("launch sandbox", "timed out"))?
            .map_err(|e| internal("launch sandbox", e))?;
        if !status.success() {
            let log = std::fs::read_to_string(dir.join("sandbox.log")).unwrap_or_default();
            let last = log
                .lines()
                .rev()
                .find(|l| l.contains("launch failed"))
                .unwrap_or("see sandbox.log");
            // A volume's mount point the sandbox's root cannot have (in a
            // read-only directory of the template, through a link): the
            // request's doing.
            if let Some(at) = last.find(launch::VOLUME_MOUNT_FAILED) {
                return Err(BackendError::BadRequest(
                    last.get(at..).unwrap_or(last).trim().to_string(),
                ));
            }
            return Err(internal("launch sandbox", last.trim()));
        }
        let info: InitInfo = std::fs::read(dir.join(launch::INIT_FILE))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .ok_or_else(|| internal("launch sandbox", "launcher wrote no init.json"))?;
        Ok(info)
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

    /// `DELETE /sandboxes/{id}`: end every process, remove all state.
    pub async fn kill(&self, id: &str) -> Result<(), BackendError> {
        let e = self.entry(id)?;
        let _op = e.op.lock().await;
        let meta = e
            .meta
            .lock()
            .map_err(|_| internal("state", "poisoned"))?
            .clone();
        // Its volumes stay in use until its processes are gone.
        if !meta.volumes.is_empty()
            && let Ok(mut d) = self.draining.lock()
        {
            d.insert(id.to_string(), meta.volumes.clone());
        }
        if let Ok(mut m) = self.entries.lock() {
            m.remove(id);
        }
        meta.tree().terminate(meta.state == State::Paused).await;
        let dir = self.sandbox_dir(id);
        let groups = meta.groups.clone();
        let cleaned = tokio::task::spawn_blocking(move || {
            groups.remove();
            super::disk::release(&dir);
            if let Err(e) = tree::remove_tree(&dir) {
                tracing::warn!(dir = %dir.display(), error = %e, "could not remove a killed sandbox's files");
            }
        })
        .await
        .map_err(|e| internal("cleanup", e));
        self.release_volumes(Some(id), &meta.volumes).await;
        cleaned?;
        tracing::info!(sandbox = %short(id), "sandbox killed");
        Ok(())
    }

    /// The sandbox's own disk, if it has one, is mounted on its `state`
    /// here (this process may be a new one, in a mount namespace of its
    /// own: `disk::remount`), so that its files are what a snapshot or a
    /// rollback sees.
    fn disk_mounted(&self, meta: &Meta) -> Result<(), BackendError> {
        if meta.disk_mb.is_none() {
            return Ok(());
        }
        super::disk::remount(&self.sandbox_dir(&meta.id))
            .map_err(|e| internal("mount the sandbox's disk", e))
    }

    fn persist(&self, e: &Entry) -> Result<(), BackendError> {
        let m = e
            .meta
            .lock()
            .map_err(|_| internal("state", "poisoned"))?
            .clone();
        let dir = self.sandbox_dir(&m.id);
        write_json_atomic(&dir.join("meta.json"), &m)
            .map_err(|e| internal("persist sandbox", e))?;
        // What the sandbox's init times itself out by with no backend.
        launch::Lifecycle {
            timeout_secs: m.timeout_secs,
            pause: m.on_timeout_pause,
            grace_secs: self.settings.orphan_grace_secs,
        }
        .write(&dir)
        .map_err(|e| internal("persist sandbox", e))
    }

    /// `POST /sandboxes/{id}/timeout`: the idle timeout becomes `secs`
    /// (`-1`: never) and the idle clock starts again, as CubeMaster does.
    pub async fn set_timeout(&self, id: &str, secs: i64) -> Result<(), BackendError> {
        check_timeout(secs)?;
        let e = self.entry(id)?;
        let _op = e.op.lock().await;
        if let Ok(mut m) = e.meta.lock() {
            m.timeout_secs = (secs >= 0).then_some(secs);
            m.last_active_ms = now_ms();
        }
        self.persist(&e)
    }

    /// `POST /sandboxes/{id}/refreshes`: the idle timeout becomes `secs` and
    /// the clock starts again (it does not add); `secs <= 0` is refused, as
    /// CubeMaster refuses it.
    pub async fn refresh(&self, id: &str, secs: i64) -> Result<(), BackendError> {
        if !(1..=i64::from(i32::MAX)).contains(&secs) {
            return Err(BackendError::BadRequest(
                "duration must be a positive number of seconds".into(),
            ));
        }
        let e = self.entry(id)?;
        let _op = e.op.lock().await;
        if let Ok(mut m) = e.meta.lock() {
            m.timeout_secs = Some(secs);
            m.last_active_ms = now_ms();
        }
        self.persist(&e)
    }

    /// A data-plane request to the sandbox begins (`true`) or ends: its end
    /// is activity for the idle clock.
    pub fn activity(&self, id: &str, begins: bool) {
        if let Ok(e) = self.entry(id)
            && let Ok(mut m) = e.meta.lock()
        {
            if begins {
                m.inflight = m.inflight.saturating_add(1);
            } else {
                m.inflight = m.inflight.saturating_sub(1);
                m.last_active_ms = now_ms();
            }
        }
    }

    pub async fn pause(&self, id: &str) -> Result<(), BackendError> {
        self.pause_when(id, false).await.map(|_| ())
    }

    /// Pause; with `idle_only` (the timeout's pause) only if the idle
    /// timeout is still due and, unless faithful, no request is in flight,
    /// checked under the sandbox's lock. `Ok(false)`: not paused.
    async fn pause_when(&self, id: &str, idle_only: bool) -> Result<bool, BackendError> {
        let e = self.entry(id)?;
        let _op = e.op.lock().await;
        let meta = e
            .meta
            .lock()
            .map_err(|_| internal("state", "poisoned"))?
            .clone();
        if idle_only
            && (meta.idle_end_ms().is_none_or(|t| t > now_ms())
                || (self.settings.faithful.is_none() && meta.inflight > 0))
        {
            return Ok(false);
        }
        if meta.state == State::Paused {
            return Err(BackendError::Conflict(format!(
                "sandbox {id} is already paused"
            )));
        }
        if let Some(f) = &self.settings.faithful {
            tokio::time::sleep(f.pause_delay).await;
        }
        meta.tree()
            .freeze(true)
            .await
            .map_err(|e| internal("freeze", e))?;
        if let Ok(mut m) = e.meta.lock() {
            m.state = State::Paused;
        }
        self.persist(&e).map(|()| true)
    }

    /// Resume if paused (connect/resume); `timeout` resets the end time.
    pub async fn resume(
        &self,
        id: &str,
        timeout: Option<i64>,
        must_be_paused: bool,
    ) -> Result<Sandbox, BackendError> {
        if let Some(t) = timeout {
            check_timeout(t)?;
        }
        let e = self.entry(id)?;
        let _op = e.op.lock().await;
        let meta = e
            .meta
            .lock()
            .map_err(|_| internal("state", "poisoned"))?
            .clone();
        if meta.state == State::Running && must_be_paused {
            return Err(BackendError::Conflict(format!(
                "sandbox {id} is already running"
            )));
        }
        if meta.state == State::Paused {
            meta.tree()
                .freeze(false)
                .await
                .map_err(|e| internal("thaw", e))?;
        }
        if let Ok(mut m) = e.meta.lock() {
            m.state = State::Running;
            if let Some(t) = timeout {
                m.timeout_secs = (t >= 0).then_some(t);
            }
            // A resume starts the idle clock again.
            m.last_active_ms = now_ms();
        }
        self.persist(&e)?;
        Ok(Sandbox {
            template_id: meta.template_id,
            sandbox_id: meta.id,
            client_id: meta.client_id,
            envd_version: self.envd_version(),
            traffic_access_token: None,
            domain: self.settings.domain.clone(),
        })
    }

    /// `POST /sandboxes/{id}/snapshots`: copy the writable state while the
    /// sandbox is frozen.
    pub async fn create_snapshot(
        &self,
        id: &str,
        name: Option<String>,
    ) -> Result<wire::SnapshotCreated, BackendError> {
        if let Some(n) = &name
            && (n.is_empty()
                || n.len() > 128
                || !n
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.'))
        {
            return Err(BackendError::BadRequest(
                "snapshot name must be 1-128 characters of [A-Za-z0-9._-]".into(),
            ));
        }
        let e = self.entry(id)?;
        let _op = e.op.lock().await;
        let meta = e
            .meta
            .lock()
            .map_err(|_| internal("state", "poisoned"))?
            .clone();
        self.disk_mounted(&meta)?;
        let was_running = meta.state == State::Running;
        if was_running {
            meta.tree()
                .freeze(true)
                .await
                .map_err(|e| internal("freeze", e))?;
        }
        let snap_id = format!("snap-{}", random_hex(12));
        let sdir = self.snapshot_dir(&snap_id);
        let src = self.sandbox_dir(id).join("state");
        let (uid, gid) = (meta.host_uid, meta.host_gid);
        let sd = sdir.clone();
        let copied = tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            std::fs::create_dir_all(&sd)?;
            std::fs::set_permissions(&sd, std::fs::Permissions::from_mode(0o700))?;
            let data = tree::make_dir_at(tree::open_dir(&sd)?.as_fd(), "data")?;
            let from = tree::open_dir(&src)?;
            let keep = Shift::keep(uid, gid);
            for sub in WRITABLE {
                drop(tree::make_dir_at(data.as_fd(), sub)?);
                tree::copy_sub(from.as_fd(), data.as_fd(), sub, &keep)?;
            }
            Ok(())
        })
        .await
        .map_err(|e| internal("snapshot", e));
        if was_running {
            let _ = meta.tree().freeze(false).await;
        }
        let copied = copied.and_then(|r| {
            r.map_err(|e| match e.kind() {
                std::io::ErrorKind::InvalidInput => {
                    BackendError::Conflict(format!("cannot snapshot sandbox {id}: {e}"))
                }
                _ => internal("snapshot", e),
            })
        });
        if let Err(e) = copied {
            let sd = sdir.clone();
            let _ = tokio::task::spawn_blocking(move || tree::remove_tree(&sd)).await;
            return Err(e);
        }
        let names = vec![name.unwrap_or_else(|| snap_id.clone())];
        let sm = SnapMeta {
            id: snap_id.clone(),
            names: names.clone(),
            origin: id.to_string(),
            template_id: meta.template_id.clone(),
            rootfs: meta.rootfs.clone(),
            created_at: now_rfc3339(),
            host_uid: meta.host_uid,
            host_gid: meta.host_gid,
            internet: meta.internet,
            egress: meta.egress.clone(),
            env_vars: meta.env_vars.clone(),
            volumes: meta.volumes.clone(),
        };
        write_json_atomic(&sdir.join("meta.json"), &sm)
            .map_err(|e| internal("persist snapshot", e))?;
        if let Ok(mut m) = self.snapshots.lock() {
            m.insert(snap_id.clone(), sm);
        }
        tracing::info!(sandbox = %short(id), snapshot = %snap_id, "snapshot created");
        Ok(wire::SnapshotCreated {
            snapshot_id: snap_id,
            names,
        })
    }

    pub fn list_snapshots(&self, sandbox: Option<&str>) -> Vec<SnapshotInfo> {
        let mut v: Vec<SnapshotInfo> = self
            .snapshots
            .lock()
            .map(|m| {
                m.values()
                    .filter(|s| sandbox.is_none_or(|id| s.origin == id))
                    .map(|s| SnapshotInfo {
                        snapshot_id: s.id.clone(),
                        names: s.names.clone(),
                        status: "READY".into(),
                        origin_sandbox_id: Some(s.origin.clone()),
                        created_at: Some(s.created_at.clone()),
                    })
                    .collect()
            })
            .unwrap_or_default();
        v.sort_by(|a, b| {
            a.created_at
                .cmp(&b.created_at)
                .then(a.snapshot_id.cmp(&b.snapshot_id))
        });
        v
    }

    pub async fn delete_snapshot(&self, id: &str) -> Result<(), BackendError> {
        let removed = self.snapshots.lock().ok().and_then(|mut m| m.remove(id));
        if removed.is_none() {
            return Err(BackendError::SnapshotNotFound(id.to_string()));
        }
        let d = self.snapshot_dir(id);
        tokio::task::spawn_blocking(move || tree::remove_tree(&d))
            .await
            .map_err(|e| internal("delete snapshot", e))?
            .map_err(|e| internal("delete snapshot", e))
    }

    /// `POST /sandboxes/{id}/rollback`: end every process but the agent,
    /// restore the writable state from the snapshot. Same sandbox id.
    ///
    /// The snapshot is first copied into a staging directory the sandbox
    /// cannot reach; then the sandbox is held ([`Tree::hold`]: every other
    /// process killed, init and agent stopped, checked), its directories
    /// emptied and the staged entries renamed in, all by descriptor
    /// (`tree.rs`); then init and agent run again. When the sandbox cannot be
    /// held, or the copy fails, nothing of its files has changed.
    pub async fn rollback(
        &self,
        id: &str,
        snap_id: &str,
    ) -> Result<wire::RollbackDone, BackendError> {
        let e = self.entry(id)?;
        let snap = self
            .snapshot(snap_id)
            .ok_or_else(|| BackendError::SnapshotNotFound(snap_id.to_string()))?;
        let _op = e.op.lock().await;
        let meta = e
            .meta
            .lock()
            .map_err(|_| internal("state", "poisoned"))?
            .clone();
        if !meta.tree().init_alive() {
            return Err(BackendError::Conflict(format!(
                "sandbox {id} is not running"
            )));
        }
        // Emptying /workspace, /tmp or /root would take a volume's mount
        // point in it away (the kernel detaches a mount whose directory is
        // removed).
        if let Some(v) = meta
            .volumes
            .iter()
            .find(|v| volumes::under_writable(&v.path))
        {
            return Err(BackendError::Conflict(format!(
                "rollback refused, nothing restored: volume {} is mounted at {}, inside a \
                 directory a rollback replaces (mount volumes outside /workspace, /tmp and /root)",
                v.name, v.path
            )));
        }
        self.disk_mounted(&meta)?;
        let dir = self.sandbox_dir(id);
        let data = self.snapshot_dir(snap_id).join("data");
        let shift = Shift {
            from_uid: snap.host_uid,
            from_gid: snap.host_gid,
            to_uid: meta.host_uid,
            to_gid: meta.host_gid,
            count: if meta.isolated { IDS_PER_SANDBOX } else { 1 },
        };
        // On the sandbox's own disk, if it has one (the staged entries are
        // renamed into place), where the sandbox does not reach.
        let staging = dir.join("state").join(".restore");
        let st = staging.clone();
        tokio::task::spawn_blocking(move || {
            let staged = stage(&data, &st, &shift);
            if staged.is_err() {
                let _ = tree::remove_tree(&st);
            }
            staged
        })
        .await
        .map_err(|e| internal("rollback", e))?
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::InvalidInput => {
                BackendError::Conflict(format!("rollback refused, nothing restored: {e}"))
            }
            _ => internal("rollback: copying the snapshot, nothing restored", e),
        })?;
        let held = match meta.tree().hold().await {
            Ok(h) => h,
            Err(why) => {
                let st = staging.clone();
                let _ = tokio::task::spawn_blocking(move || tree::remove_tree(&st)).await;
                tracing::warn!(sandbox = %short(id), reason = %why, "rollback refused");
                return Err(BackendError::Conflict(format!(
                    "rollback refused, nothing restored: {why}; try again"
                )));
            }
        };
        let state = dir.join("state");
        let st = staging.clone();
        let swapped = tokio::task::spawn_blocking(move || swap_in(&st, &state)).await;
        held.release();
        swapped
            .map_err(|e| internal("rollback", e))?
            .map_err(|e| internal("rollback: the sandbox's files are incomplete", e))?;
        if let Ok(mut m) = e.meta.lock() {
            m.state = State::Running;
        }
        self.persist(&e)?;
        tracing::info!(sandbox = %short(id), snapshot = %snap_id, "rolled back");
        Ok(wire::RollbackDone {
            sandbox_id: id.to_string(),
            snapshot_id: snap_id.to_string(),
            operation_id: random_hex(8),
            status: "READY".into(),
        })
    }

    /// Data-plane routing; resumes a paused sandbox with auto-resume.
    pub async fn route(&self, id: &str) -> Result<Route, RouteError> {
        let e = self.entry(id).map_err(|_| RouteError::Unknown)?;
        // A lifecycle operation under way (a pause, a snapshot) ends first:
        // the state read below is then not about to change.
        drop(e.op.lock().await);
        let (state, auto, token, pid) = {
            let m = e.meta.lock().map_err(|_| RouteError::Unknown)?;
            (m.state, m.auto_resume, m.traffic_token.clone(), m.init.pid)
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
        })
    }

    /// Fire due idle timeouts (kill, or pause with `onTimeout: pause`), and
    /// forget sandboxes whose init died on its own. Unless faithful, a
    /// sandbox with a data-plane request in flight is never timed out.
    pub async fn tick(&self) {
        let now = now_ms();
        self.beat(now);
        self.sweep_ownerless(now);
        let faithful = self.settings.faithful.is_some();
        let entries: Vec<Arc<Entry>> = self
            .entries
            .lock()
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default();
        for e in entries {
            let Ok(m) = e.meta.lock().map(|m| m.clone()) else {
                continue;
            };
            if m.init.pid == 0 {
                continue;
            }
            let dead = !m.tree().init_alive();
            let due = m.idle_end_ms().is_some_and(|t| t <= now) && (faithful || m.inflight == 0);
            if dead {
                tracing::warn!(sandbox = %short(&m.id), "sandbox init exited; removing the sandbox");
                let _ = self.kill(&m.id).await;
            } else if due && m.on_timeout_pause && m.state == State::Running {
                if let Ok(true) = self.pause_when(&m.id, true).await {
                    tracing::info!(sandbox = %short(&m.id), "idle timeout: paused");
                }
            } else if due && !(m.on_timeout_pause && m.state == State::Paused) {
                tracing::info!(sandbox = %short(&m.id), "timeout: killing");
                let _ = self.kill(&m.id).await;
            }
        }
    }

    /// Tell the sandboxes' inits that a backend runs: the heartbeat file's
    /// modification time, set at most every few seconds (see
    /// `launch::Watch`).
    fn beat(&self, now: i64) {
        use std::sync::atomic::Ordering;
        let last = self.last_beat_ms.load(Ordering::Relaxed);
        if now - last < launch::HEARTBEAT_EVERY.as_millis() as i64 {
            return;
        }
        self.last_beat_ms.store(now, Ordering::Relaxed);
        if let Err(e) = launch::beat(&self.settings.state_dir) {
            tracing::warn!(error = %e, "could not write the sandboxes' heartbeat");
        }
    }

    /// Every minute (and at start), end the sandboxes on this host whose
    /// state directory is gone, paused ones included (`cgroup::end_ownerless`).
    fn sweep_ownerless(&self, now: i64) {
        use std::sync::atomic::Ordering;
        let last = self.last_sweep_ms.load(Ordering::Relaxed);
        if last != 0 && now - last < 60_000 {
            return;
        }
        self.last_sweep_ms.store(now, Ordering::Relaxed);
        let host = self.cgroups.clone();
        tokio::task::spawn_blocking(move || {
            let released = super::disk::release_dead();
            if released > 0 {
                tracing::warn!(
                    released,
                    "unmounted the disks of sandboxes that ended unattended"
                );
            }
            let s = cgroup::end_ownerless(&host);
            if s.killed > 0 || s.removed > 0 {
                tracing::warn!(
                    killed = s.killed,
                    removed_groups = s.removed,
                    "ended sandboxes whose state directory is gone"
                );
            }
        });
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

/// Volumes (`volumes.rs`): the CubeAPI calls, and what sandboxes' creates
/// and kills do with them. Whether a volume is in use, and by whom, is
/// decided under `snap_lock` from the live sandboxes (those being made
/// included: their entry exists from the slot's allocation on) and those
/// being killed (`draining`).
impl Manager {
    /// How ids move between sandboxes' slices.
    fn slices(&self) -> volumes::Slices {
        let base = match self.id_space {
            Some((first, _)) if first != 0 => first,
            _ => self.settings.uid_base,
        };
        volumes::Slices {
            base,
            count: IDS_PER_SANDBOX,
        }
    }

    /// The sandboxes that mount volume `vol`, and whether read-write.
    fn volume_holders(&self, vol: &str) -> Vec<(String, bool)> {
        let mut out: Vec<(String, bool)> = self
            .entries
            .lock()
            .map(|m| {
                m.values()
                    .filter_map(|e| {
                        e.meta
                            .lock()
                            .ok()
                            .map(|m| (m.id.clone(), m.volumes.clone()))
                    })
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default()
            .into_iter()
            .chain(
                self.draining
                    .lock()
                    .map(|d| {
                        d.iter()
                            .map(|(k, v)| (k.clone(), v.clone()))
                            .collect::<Vec<_>>()
                    })
                    .unwrap_or_default(),
            )
            .filter_map(|(id, vs)| {
                vs.iter()
                    .find(|v| v.name == vol)
                    .map(|v| (id, !v.is_read_only()))
            })
            .collect();
        out.sort();
        out
    }

    /// For a new sandbox, under `snap_lock`: every volume exists, and none
    /// it mounts read-write is mounted read-write elsewhere; the files of
    /// each go to its ids when it writes them, or nobody else uses them.
    fn claim_volumes(
        &self,
        mounts: &[VolumeMount],
        host_uid: u32,
        host_gid: u32,
        id_count: u32,
    ) -> Result<(), BackendError> {
        for m in mounts {
            if self.volumes.get(&m.name).is_none() {
                return Err(BackendError::BadRequest(format!(
                    "volumeMounts: volume {} not found",
                    m.name
                )));
            }
            let holders = self.volume_holders(&m.name);
            if !m.is_read_only()
                && let Some((other, _)) = holders.iter().find(|(_, rw)| *rw)
            {
                return Err(BackendError::Conflict(format!(
                    "volume {} is mounted read-write by sandbox {other}: one sandbox at a \
                     time writes a volume (mount it read-only, or end that sandbox first)",
                    m.name
                )));
            }
        }
        if id_count > 1 {
            for m in mounts {
                if !m.is_read_only() || self.volume_holders(&m.name).is_empty() {
                    self.volumes.want_slice(&m.name, host_uid, host_gid);
                }
            }
        }
        Ok(())
    }

    /// A sandbox that mounted `vols` is gone (killed: `draining` names it;
    /// or never made): the file systems of the volumes nobody uses now are
    /// unmounted, and their loop devices detach.
    async fn release_volumes(&self, draining: Option<&str>, vols: &[VolumeMount]) {
        if vols.is_empty() {
            return;
        }
        let _g = self.snap_lock.lock().await;
        if let Some(id) = draining
            && let Ok(mut d) = self.draining.lock()
        {
            d.remove(id);
        }
        let free: Vec<String> = vols
            .iter()
            .filter(|v| self.volume_holders(&v.name).is_empty())
            .map(|v| v.name.clone())
            .collect();
        if free.is_empty() {
            return;
        }
        let v = self.volumes.clone();
        let _ = tokio::task::spawn_blocking(move || {
            for id in free {
                v.release(&id);
            }
        })
        .await;
    }

    /// `POST /volumes`.
    pub async fn create_volume(&self, req: CreateVolume) -> Result<wire::Volume, BackendError> {
        let v = self.volumes.clone();
        let images = self.disks.clone().map_err(|_| {
            "volume sizes need the backend to run as root on the host (with mkfs.ext4 and \
             mount); create the volume without sizeMB"
                .to_string()
        });
        tokio::task::spawn_blocking(move || v.create(&req, &images))
            .await
            .map_err(|e| internal("create volume", e))?
            .map(|m| m.wire())
    }

    /// `GET /volumes/{id}`.
    pub fn get_volume(&self, id: &str) -> Result<wire::Volume, BackendError> {
        self.volumes
            .get(id)
            .map(|m| m.wire())
            .ok_or_else(|| BackendError::VolumeNotFound(id.to_string()))
    }

    /// `GET /volumes`.
    pub fn list_volumes(&self) -> Vec<wire::VolumeInfo> {
        self.volumes
            .list()
            .into_iter()
            .map(|m: VolumeMeta| wire::VolumeInfo {
                volume_id: m.id,
                name: m.name,
            })
            .collect()
    }

    /// `DELETE /volumes/{id}`: refused while a sandbox mounts it (stricter
    /// than CubeSandbox, which leaves running sandboxes their mount).
    pub async fn delete_volume(&self, id: &str) -> Result<(), BackendError> {
        let g = self.snap_lock.lock().await;
        if self.volumes.get(id).is_none() {
            return Err(BackendError::VolumeNotFound(id.to_string()));
        }
        if let Some((sb, _)) = self.volume_holders(id).first() {
            return Err(BackendError::Conflict(format!(
                "volume {id} is mounted by sandbox {sb}: kill the sandbox first"
            )));
        }
        let v = self.volumes.clone();
        let vid = id.to_string();
        let aside = tokio::task::spawn_blocking(move || v.set_aside(&vid))
            .await
            .map_err(|e| internal("delete volume", e))??;
        self.volumes.forget(id);
        drop(g);
        tokio::task::spawn_blocking(move || tree::remove_tree(&aside))
            .await
            .map_err(|e| internal("delete volume", e))?
            .map_err(|e| internal("delete volume", e))?;
        tracing::info!(volume = %id, "volume deleted");
        Ok(())
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

/// Copy a snapshot's `data/` into a fresh staging directory (the backend's
/// alone: `sandboxes/<id>/state/.restore`, never mounted in the sandbox).
fn stage(data: &Path, staging: &Path, shift: &Shift) -> std::io::Result<()> {
    tree::remove_tree(staging)?;
    std::fs::create_dir(staging)?;
    std::fs::set_permissions(staging, std::fs::Permissions::from_mode(0o700))?;
    let from = tree::open_dir(data)?;
    let to = tree::open_dir(staging)?;
    for sub in WRITABLE {
        drop(tree::make_dir_at(to.as_fd(), sub)?);
        tree::copy_sub(from.as_fd(), to.as_fd(), sub, shift)?;
    }
    Ok(())
}

/// Empty the sandbox's writable directories and move the staged entries in,
/// by descriptor; then remove the staging directory.
fn swap_in(staging: &Path, state: &Path) -> std::io::Result<()> {
    let from = tree::open_dir(staging)?;
    let to = tree::open_dir(state)?;
    for sub in WRITABLE {
        let staged = tree::open_sub(from.as_fd(), sub)?;
        let live = tree::open_sub(to.as_fd(), sub)?;
        tree::clear_fd(live.try_clone()?)?;
        tree::move_all(staged.as_fd(), live.as_fd())?;
    }
    tree::remove_tree(staging)
}
