//! A sandbox's life after create: kill, timeouts, pause and resume,
//! and the periodic tick that ends the expired ones.

use std::sync::Arc;

use super::*;

impl Manager {
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
            crate::disk::release(&dir);
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
    pub(super) fn disk_mounted(&self, meta: &Meta) -> Result<(), BackendError> {
        if meta.disk_mb.is_none() {
            return Ok(());
        }
        crate::disk::remount(&self.sandbox_dir(&meta.id))
            .map_err(|e| internal("mount the sandbox's disk", e))
    }

    pub(super) fn persist(&self, e: &Entry) -> Result<(), BackendError> {
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
    pub(super) async fn pause_when(&self, id: &str, idle_only: bool) -> Result<bool, BackendError> {
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
    pub(super) fn beat(&self, now: i64) {
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
    pub(super) fn sweep_ownerless(&self, now: i64) {
        use std::sync::atomic::Ordering;
        let last = self.last_sweep_ms.load(Ordering::Relaxed);
        if last != 0 && now - last < 60_000 {
            return;
        }
        self.last_sweep_ms.store(now, Ordering::Relaxed);
        let host = self.cgroups.clone();
        tokio::task::spawn_blocking(move || {
            let released = crate::disk::release_dead();
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
}
