//! Snapshots: taken from a sandbox, listed, deleted, and rolled back
//! into a live sandbox.

use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use super::*;

impl Manager {
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
        if let Some(v) = meta.volumes.iter().find(|v| vols::under_writable(&v.path)) {
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
