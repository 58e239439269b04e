//! Creating a sandbox: its slot and ids, its disk and network, its
//! template or snapshot staged, and its init launched.

use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::*;

impl Manager {
    pub(super) fn next_slot(&self) -> u32 {
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

    pub(super) fn ids_for_slot(&self, slot: u32) -> (u32, u32, u32) {
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
    pub(super) fn check_free_space(&self) -> Result<(), BackendError> {
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
    pub(super) fn egress_for(
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
                host: crate::egress::host_addresses(),
                ..e.clone()
            }),
            _ => Egress::from_request(internet, allow.unwrap_or(&[]), deny.unwrap_or(&[]))
                .map_err(|e| BackendError::BadRequest(e.to_string()))?,
        };
        if egress.is_some() {
            crate::egress::Tools::find().map_err(|e| BackendError::Unsupported(e.to_string()))?;
        }
        Ok(egress)
    }

    /// The size of a new sandbox's own disk: the request's, else the
    /// backend's default; None when 0, or when this backend cannot make
    /// disks (`disks`).
    pub(super) fn disk_for(&self, req: &CreateSandbox) -> Result<Option<u64>, BackendError> {
        let mb = req.disk_size_mb.unwrap_or(self.settings.disk_mb);
        if mb == 0 || self.disks.is_err() || self.settings.isolation != Isolation::Namespaces {
            return Ok(None);
        }
        if mb < crate::disk::MIN_MB {
            return Err(BackendError::BadRequest(format!(
                "diskSizeMB must be 0 (none) or at least {}",
                crate::disk::MIN_MB
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
        let mounts = vols::check_mounts(&mounts)?;
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
                    crate::disk::release(&d);
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

    pub(super) async fn prepare_and_launch(
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
                crate::disk::make(&d, mb).map_err(|e| internal("make the sandbox's disk", e))?;
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
}
