//! Checkpoints (reference rows 30, 31 and 33): snapshots of a lease's
//! sandbox, rolled back to, deleted, and cleaned up with the lease (by
//! release-kill and by GC, where the reference leaked them).

use super::dto;
use super::leases::{Done, Lease, Want, new_ref, valid_ref};
use super::{Broker, Code, Ctx, Error, Result, error::backend};
use crate::audit::event::Action;
use crate::auth::Principal;
use crate::cube::ErrorKind;
use crate::store::{self, StoreError};

/// Longest checkpoint name or branch, in characters (as JSON Schema's
/// `maxLength` in docs/openapi.yaml counts them).
pub const MAX_NAME: usize = 128;

pub use crate::store::checkpoints::Checkpoint;

use crate::store::checkpoints::{put, remove};

/// A lease's checkpoints, oldest first.
pub(crate) fn lease_checkpoints(
    txn: &crate::store::Rx,
    lease_ref: &str,
) -> std::result::Result<Vec<Checkpoint>, StoreError> {
    let mut out = store::checkpoints::of_lease(txn, lease_ref)?;
    out.sort_by(|a, b| a.created_at.cmp(&b.created_at));
    Ok(out)
}

/// Remove a lease's checkpoint records (their snapshots are deleted first).
pub(crate) fn delete_lease_checkpoints(
    txn: &crate::store::Wx,
    lease_ref: &str,
) -> std::result::Result<(), StoreError> {
    store::checkpoints::remove_lease(txn, lease_ref)
}

impl Broker {
    /// The profile gate for checkpoints (403 `checkpoint_denied`).
    async fn checkpoint_gate(
        &self,
        p: &Principal,
        ctx: &Ctx,
        l: &Lease,
        action: Action,
    ) -> Result<()> {
        let prof = self.profile(&l.profile);
        if prof.as_ref().is_some_and(|pr| pr.checkpoints_enabled) {
            // A snapshot holds no volume: the workspace would not come back
            // with it, so a lease with one needs the profile's say-so.
            if l.volume.is_some() && !prof.is_some_and(|pr| pr.allow_checkpoint_with_mounts) {
                return Err(self
                    .reject(
                        self.lease_event(p, action, ctx, l),
                        Error::new(
                            Code::CheckpointWithMountDenied,
                            format!(
                                "the lease has a workspace volume mounted, which checkpoints do not hold; profile {} does not allow checkpoints with mounts",
                                l.profile
                            ),
                        ),
                    )
                    .await);
            }
            return Ok(());
        }
        Err(self
            .reject(
                self.lease_event(p, action, ctx, l),
                Error::new(
                    Code::CheckpointDenied,
                    format!("checkpoints are not enabled for profile {}", l.profile),
                ),
            )
            .await)
    }

    fn owned_checkpoint(&self, l: &Lease, checkpoint_ref: &str) -> Result<Checkpoint> {
        let missing = || Error::new(Code::CheckpointNotFound, "no such checkpoint");
        // `ckpt_…`: made before schema 3.
        if !valid_ref(checkpoint_ref, "checkpoint") && !valid_ref(checkpoint_ref, "ckpt") {
            return Err(missing());
        }
        let c = self
            .inner
            .store
            .read_now(|txn| store::checkpoints::get(txn, checkpoint_ref))?;
        c.filter(|c| c.lease_ref == l.lease_ref).ok_or_else(missing)
    }

    /// `GET /v1/leases/{ref}/checkpoints`.
    pub async fn list_checkpoints(
        &self,
        p: &Principal,
        ctx: &Ctx,
        lease_ref: &str,
    ) -> Result<dto::CheckpointList> {
        let ev = self.event(p, Action::CheckpointList, ctx);
        self.authorize(p, "checkpoint:list", &ev).await?;
        let l = self.owned_lease(p, lease_ref, &ev).await?;
        Ok(dto::CheckpointList {
            checkpoints: self.checkpoints_summary(&l)?,
            executor: self.executor(&l.backend),
            request_id: ctx.request_id.clone(),
            sandbox_ref: l.sandbox_ref,
        })
    }

    /// A lease's checkpoints as listed, oldest first.
    pub(crate) fn checkpoints_summary(&self, l: &Lease) -> Result<Vec<dto::CheckpointSummary>> {
        let cs = self
            .inner
            .store
            .read_now(|txn| lease_checkpoints(txn, &l.lease_ref))?;
        let executor = self.executor(&l.backend);
        Ok(cs
            .iter()
            .map(|c| dto::CheckpointSummary::new(c, executor, &l.sandbox_ref))
            .collect())
    }

    /// `POST /v1/leases/{ref}/checkpoints` (201).
    pub async fn create_checkpoint(
        &self,
        p: &Principal,
        ctx: &Ctx,
        lease_ref: &str,
        name: Option<&str>,
    ) -> Result<dto::CheckpointCreated> {
        if let Some(n) = name
            && (n.is_empty() || n.chars().count() > MAX_NAME)
        {
            return Err(Error::new(
                Code::InvalidRequest,
                format!("name must be 1..={MAX_NAME} characters"),
            ));
        }
        let ev = self.event(p, Action::CheckpointCreate, ctx);
        self.authorize(p, "checkpoint:create", &ev).await?;
        let l = self.owned_lease(p, lease_ref, &ev).await?;
        self.checkpoint_gate(p, ctx, &l, Action::CheckpointCreate)
            .await?;
        let (l, lock) = self.relock(p, l).await?;
        let ckpt_ref = new_ref("checkpoint");
        let name = name.map(str::to_string).unwrap_or_else(|| ckpt_ref.clone());
        let tenant = l.tenant.clone();
        let cr = ckpt_ref.clone();
        let (l, c) = self
            .effect_on(
                p,
                ctx,
                l,
                Action::CheckpointCreate,
                |e| e.checkpoint_ref = Some(cr),
                Some(lock),
                move |b: Broker, l: Lease, addr| async move {
                    let snap = addr
                        .cube
                        .create_snapshot(&l.sandbox_id, None)
                        .await
                        .map_err(|e| backend(&e))?;
                    let c = Checkpoint {
                        checkpoint_ref: ckpt_ref,
                        lease_ref: l.lease_ref.clone(),
                        tenant,
                        snapshot_id: snap.snapshot_id,
                        name,
                        created_at: b.now().0,
                    };
                    let c2 = c.clone();
                    Ok(Done::new(c).persist(move |txn| put(txn, &c2)))
                },
            )
            .await?;
        Ok(dto::CheckpointCreated {
            checkpoint_ref: c.checkpoint_ref,
            created_at: c.created_at,
            executor: self.executor(&l.backend),
            name: c.name,
            request_id: ctx.request_id.clone(),
            sandbox_ref: l.sandbox_ref,
        })
    }

    /// `POST /v1/leases/{ref}/checkpoints/{ckpt}/rollback`.
    pub async fn rollback_checkpoint(
        &self,
        p: &Principal,
        ctx: &Ctx,
        lease_ref: &str,
        checkpoint_ref: &str,
    ) -> Result<dto::RollbackResponse> {
        let ev = self.event(p, Action::CheckpointRollback, ctx);
        self.authorize(p, "checkpoint:rollback", &ev).await?;
        let l = self.owned_lease(p, lease_ref, &ev).await?;
        self.checkpoint_gate(p, ctx, &l, Action::CheckpointRollback)
            .await?;
        let (l, lock) = self.relock(p, l).await?;
        let c = self.owned_checkpoint(&l, checkpoint_ref)?;
        let (l, ()) = self
            .effect_on(
                p,
                ctx,
                l,
                Action::CheckpointRollback,
                |e| e.checkpoint_ref = Some(checkpoint_ref.to_string()),
                Some(lock),
                move |_b: Broker, l: Lease, addr| async move {
                    addr.cube
                        .rollback(&l.sandbox_id, &c.snapshot_id)
                        .await
                        .map_err(|e| match e.kind {
                            ErrorKind::NotFound => Error::new(
                                Code::CheckpointNotFound,
                                "the checkpoint's snapshot is gone",
                            ),
                            _ => backend(&e),
                        })?;
                    Ok(Done::new(()))
                },
            )
            .await?;
        Ok(dto::RollbackResponse {
            checkpoint_ref: checkpoint_ref.to_string(),
            executor: self.executor(&l.backend),
            request_id: ctx.request_id.clone(),
            sandbox_ref: l.sandbox_ref,
            state: super::leases::LeaseState::Running,
        })
    }

    /// `POST /v1/leases/{ref}/checkpoints/{ckpt}/delete`.
    pub async fn delete_checkpoint(
        &self,
        p: &Principal,
        ctx: &Ctx,
        lease_ref: &str,
        checkpoint_ref: &str,
    ) -> Result<dto::CheckpointDeleted> {
        let ev = self.event(p, Action::CheckpointDelete, ctx);
        self.authorize(p, "checkpoint:delete", &ev).await?;
        let l = self.owned_lease(p, lease_ref, &ev).await?;
        let (l, lock) = self.relock(p, l).await?;
        let c = self.owned_checkpoint(&l, checkpoint_ref)?;
        let (l, ()) = self
            .effect_on(
                p,
                ctx,
                l,
                Action::CheckpointDelete,
                |e| e.checkpoint_ref = Some(checkpoint_ref.to_string()),
                Some(lock),
                move |_b: Broker, _l: Lease, addr| async move {
                    match addr.cube.delete_snapshot(&c.snapshot_id).await {
                        Ok(()) => {}
                        Err(e) if e.kind == ErrorKind::NotFound => {}
                        Err(e) => return Err(backend(&e)),
                    }
                    Ok(Done::new(()).persist(move |txn| remove(txn, &c)))
                },
            )
            .await?;
        Ok(dto::CheckpointDeleted {
            checkpoint_ref: checkpoint_ref.to_string(),
            deleted: true,
            executor: self.executor(&l.backend),
            request_id: ctx.request_id.clone(),
            sandbox_ref: l.sandbox_ref,
        })
    }

    /// `POST /v1/leases/{ref}/checkpoints/{ckpt}/fork` (201): a new lease
    /// whose sandbox starts from the checkpoint, for the same tenant,
    /// runtime and profile. Idempotent per source session and branch: the
    /// same branch gives the same fork (`reused`) while it lives.
    pub async fn fork_checkpoint(
        &self,
        p: &Principal,
        ctx: &Ctx,
        lease_ref: &str,
        checkpoint_ref: &str,
        branch: Option<&str>,
    ) -> Result<dto::ForkResponse> {
        if let Some(b) = branch
            && (b.trim().is_empty() || b.chars().count() > MAX_NAME || b.contains('\0'))
        {
            return Err(Error::new(
                Code::InvalidBranch,
                format!("branch must be 1..={MAX_NAME} characters, not blank"),
            ));
        }
        let ev = self.event(p, Action::CheckpointFork, ctx);
        self.authorize(p, "checkpoint:fork", &ev).await?;
        let l = self.owned_lease(p, lease_ref, &ev).await?;
        self.checkpoint_gate(p, ctx, &l, Action::CheckpointFork)
            .await?;
        let c = self.owned_checkpoint(&l, checkpoint_ref)?;
        let mut ev = self.lease_event(p, Action::CheckpointFork, ctx, &l);
        ev.checkpoint_ref = Some(c.checkpoint_ref.clone());
        // The profile as it is configured now, and still the caller's.
        let prof = match self.profile(&l.profile) {
            Some(pr)
                if p.allows_profile(&l.profile)
                    && p.allows_runtime(&l.runtime)
                    && pr.allowed_runtimes.contains(&l.runtime) =>
            {
                pr.clone()
            }
            _ => {
                return Err(self
                    .reject(
                        ev,
                        Error::new(
                            Code::ProfileDenied,
                            format!("profile {} is not available to this identity", l.profile),
                        ),
                    )
                    .await);
            }
        };
        let branch = branch
            .map(str::to_string)
            .unwrap_or_else(|| new_ref("branch"));
        let hash: String = self
            .hmac_hex(&[l.session_hash.as_bytes(), b"fork", branch.as_bytes()])
            .chars()
            .take(24)
            .collect();
        let want = Want {
            tenant: l.tenant.clone(),
            runtime: l.runtime.clone(),
            hash,
            profile: l.profile.clone(),
            prof,
            snapshot: Some((c.snapshot_id.clone(), c.checkpoint_ref.clone())),
            task_ref: None,
            // The snapshot lives on the source's backend.
            backend: l.backend.clone(),
        };
        let (fork, reused) = self.lease_for_session(p, ctx, ev, want).await?;
        let a = self.lease_answer(&fork, reused, ctx);
        Ok(dto::ForkResponse {
            branch,
            checkpoint_ref: c.checkpoint_ref,
            executor: a.executor,
            lease_ref: a.lease_ref,
            persistent_workspace: a.persistent_workspace,
            profile: a.profile,
            request_id: a.request_id,
            reused: a.reused,
            sandbox_ref: a.sandbox_ref,
            source_lease_ref: l.lease_ref,
            state: a.state,
        })
    }

    /// Delete every snapshot of a lease at the backend (before the lease's
    /// records go). An error leaves the records, so the caller can retry.
    pub(crate) async fn delete_lease_snapshots(
        &self,
        lease_ref: &str,
        backend: &str,
    ) -> Result<()> {
        let cs = self
            .inner
            .store
            .read_now(|txn| lease_checkpoints(txn, lease_ref))?;
        for c in cs {
            match self.client(backend)?.delete_snapshot(&c.snapshot_id).await {
                Ok(()) => {}
                Err(e) if e.kind == ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(lease = %lease_ref, checkpoint = %c.checkpoint_ref, error = %e, "could not delete a checkpoint's snapshot");
                    return Err(Error::new(
                        Code::CheckpointCleanupFailed,
                        "the sandbox is gone but a checkpoint could not be deleted; retry the release",
                    ));
                }
            }
        }
        Ok(())
    }
}
