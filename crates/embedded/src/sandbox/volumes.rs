//! Volumes as sandboxes use them.

use super::*;

/// Volumes (`volumes.rs`): the CubeAPI calls, and what sandboxes' creates
/// and kills do with them. Whether a volume is in use, and by whom, is
/// decided under `snap_lock` from the live sandboxes (those being made
/// included: their entry exists from the slot's allocation on) and those
/// being killed (`draining`).
impl Manager {
    /// How ids move between sandboxes' slices.
    pub(super) fn slices(&self) -> vols::Slices {
        let base = match self.id_space {
            Some((first, _)) if first != 0 => first,
            _ => self.settings.uid_base,
        };
        vols::Slices {
            base,
            count: IDS_PER_SANDBOX,
        }
    }

    /// The sandboxes that mount volume `vol`, and whether read-write.
    pub(super) fn volume_holders(&self, vol: &str) -> Vec<(String, bool)> {
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
    pub(super) fn claim_volumes(
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
    pub(super) async fn release_volumes(&self, draining: Option<&str>, vols: &[VolumeMount]) {
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
        let images = self.disks.clone();
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
