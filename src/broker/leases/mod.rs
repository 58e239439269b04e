//! Leases and everything done on one: acquire (idempotent per tenant +
//! runtime + HMAC(session_key)), status, exec, files, artifacts, release.
//!
//! The flows live in submodules: `acquire` (acquire, idempotency,
//! quotas), `effects` (the intent → effect → outcome machinery),
//! `exec`, `files` (files and artifacts) and `lifecycle` (list, status,
//! release). This file holds the limits, the types and the helpers they
//! share.

use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use sha2::Digest;

use super::dto;
use super::paths;
use super::{Broker, Code, Ctx, Error, Result, error::backend};
use crate::audit::Intent;
use crate::audit::event::{Action, Event, Outcome, Phase};
use crate::auth::Principal;
use crate::config::RUNTIMES;
use crate::cube::wire::{CreateSandbox, Lifecycle, NetworkPolicy, VolumeMount};
use crate::cube::{ErrorKind, SandboxAddr, Secret, StartOptions};
use crate::store::{self, StoreError};

mod acquire;
mod effects;
mod exec;
mod files;
mod lifecycle;

pub use self::files::FileOp;

pub const MAX_COMMAND: usize = 16 * 1024;
pub const MAX_OUTPUT: usize = 64 * 1024;
pub const MAX_WRITE: usize = 256 * 1024;
pub const MAX_READ: usize = 64 * 1024;
pub const MAX_ARTIFACT: usize = 8 * 1024 * 1024;
pub const MAX_SESSION_KEY: usize = 512;
pub const MAX_LIST: usize = 1000;

pub use crate::store::leases::{Lease, LeaseState, LeaseVolume};

/// Who may see a lease.
pub(crate) trait Visible {
    /// Whether `p` may see and use this lease: its tenant (or an admin), and
    /// a trusted task's lease only for that task's own calls.
    fn visible_to(&self, p: &Principal) -> bool;
}

impl Visible for Lease {
    fn visible_to(&self, p: &Principal) -> bool {
        (self.tenant == p.tenant || p.is_admin()) && self.task_ref == p.task
    }
}

/// What a session's lease is made of when it must be created.
pub(crate) struct Want {
    /// Whose lease it is (a fork belongs to its source's tenant).
    pub tenant: String,
    pub runtime: String,
    pub hash: String,
    pub profile: String,
    pub prof: crate::config::Profile,
    /// Fork: the snapshot to clone and the checkpoint it belongs to.
    pub snapshot: Option<(String, String)>,
    pub task_ref: Option<String>,
    /// The backend it runs on.
    pub backend: String,
}

/// State written in an effect's outcome transaction.
pub(crate) type Persist =
    Box<dyn FnOnce(&crate::store::Wx) -> std::result::Result<(), StoreError> + Send>;

/// What an effect gives back: its value, what its outcome event records,
/// and state to write in the outcome's transaction.
/// More for an outcome event.
pub(crate) type Fill = Box<dyn FnOnce(&mut Event) + Send>;

pub(crate) struct Done<T> {
    pub value: T,
    pub exit_code: Option<i32>,
    pub bytes: Option<u64>,
    pub persist: Option<Persist>,
    /// Count as use of the lease (`last_used_at`; true unless said otherwise).
    pub touch: bool,
    /// More for the outcome event (a result's digest).
    pub fill: Option<Fill>,
}

impl<T> Done<T> {
    pub fn new(value: T) -> Self {
        Self {
            value,
            exit_code: None,
            bytes: None,
            persist: None,
            touch: true,
            fill: None,
        }
    }

    /// Add to the outcome event.
    pub fn fill(mut self, f: impl FnOnce(&mut Event) + Send + 'static) -> Self {
        self.fill = Some(Box::new(f));
        self
    }

    /// Not a use of the lease: renewals leave `last_used_at` alone, so
    /// they cannot extend themselves past `max_keepalive_seconds`.
    pub fn no_touch(mut self) -> Self {
        self.touch = false;
        self
    }

    pub fn exit_code(mut self, code: i32) -> Self {
        self.exit_code = Some(code);
        self
    }

    pub fn bytes(mut self, n: Option<u64>) -> Self {
        self.bytes = n;
        self
    }

    pub fn persist(
        mut self,
        f: impl FnOnce(&crate::store::Wx) -> std::result::Result<(), StoreError> + Send + 'static,
    ) -> Self {
        self.persist = Some(Box::new(f));
        self
    }
}

/// A call in flight on a lease (see `Inner::busy`), until dropped.
pub(crate) struct Busy {
    b: Broker,
    lease_ref: String,
}

impl Busy {
    pub(crate) fn begin(b: &Broker, lease_ref: &str) -> Self {
        if let Ok(mut m) = b.inner.busy.lock() {
            let e = m
                .entry(lease_ref.to_string())
                .or_insert((0, std::time::Instant::now()));
            if e.0 == 0 {
                e.1 = std::time::Instant::now();
            }
            e.0 += 1;
        }
        Self {
            b: b.clone(),
            lease_ref: lease_ref.to_string(),
        }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        if let Ok(mut m) = self.b.inner.busy.lock()
            && let Some(e) = m.get_mut(&self.lease_ref)
        {
            e.0 = e.0.saturating_sub(1);
            if e.0 == 0 {
                m.remove(&self.lease_ref);
            }
        }
    }
}

/// A lease's sandbox as the data plane addresses it, with the client of
/// the backend it runs on.
#[derive(Clone)]
pub(crate) struct Addr {
    pub sandbox: SandboxAddr,
    pub cube: crate::cube::CubeClient,
}

impl std::ops::Deref for Addr {
    type Target = SandboxAddr;
    fn deref(&self) -> &SandboxAddr {
        &self.sandbox
    }
}

pub(crate) fn new_ref(prefix: &str) -> String {
    format!("{prefix}_{}", crate::ids::random_hex(10))
}

use crate::store::leases::put as put_lease;
pub(crate) use crate::store::leases::session_key;

pub(crate) fn valid_ref(r: &str, prefix: &str) -> bool {
    r.strip_prefix(prefix)
        .and_then(|s| s.strip_prefix('_'))
        .is_some_and(|h| {
            h.len() == 20
                && h.bytes()
                    .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        })
}

/// `ev` with the lease's fields: runtime, profile, backend, refs, session.
pub(crate) fn with_lease(mut ev: Event, l: &Lease) -> Event {
    ev.runtime = Some(l.runtime.clone());
    ev.profile = Some(l.profile.clone());
    ev.backend = Some(l.backend.clone());
    ev.lease_ref = Some(l.lease_ref.clone());
    ev.sandbox_ref = Some(l.sandbox_ref.clone());
    ev.session_digest = Some(l.session_hash.clone());
    ev
}

impl Broker {
    pub(crate) async fn get_lease(&self, lease_ref: &str) -> Result<Option<Lease>> {
        Ok(self
            .inner
            .store
            .read_now(|txn| store::leases::get(txn, lease_ref))?)
    }

    /// The lease, if the principal may see it; otherwise exactly the answer
    /// a missing lease gets. Its profile and runtime are not checked: this is
    /// for a second look (under a lock) after [`Broker::owned_lease`].
    pub(crate) async fn visible_lease(&self, p: &Principal, lease_ref: &str) -> Result<Lease> {
        let missing = || Error::new(Code::LeaseNotFound, "no such lease");
        if !valid_ref(lease_ref, "lease") {
            return Err(missing());
        }
        match self.get_lease(lease_ref).await? {
            Some(l) if l.visible_to(p) => Ok(l),
            _ => Err(missing()),
        }
    }

    /// The lease, if the principal may see it (else exactly the answer a
    /// missing lease gets) and use it: its profile and runtime must be ones
    /// the identity's own scopes allow, whoever acquired it (403
    /// `profile_denied` / `runtime_denied`, recorded with `ev`).
    pub(crate) async fn owned_lease(
        &self,
        p: &Principal,
        lease_ref: &str,
        ev: &Event,
    ) -> Result<Lease> {
        let l = self.visible_lease(p, lease_ref).await?;
        self.usable(p, &l, ev).await?;
        Ok(l)
    }

    /// Whether `p` may use a lease it can see: a lease is shared within its
    /// tenant (as the reference has it), but never beyond the profiles and
    /// runtimes of the identity that uses it. A refusal is recorded.
    pub(crate) async fn usable(&self, p: &Principal, l: &Lease, ev: &Event) -> Result<()> {
        // The answer does not name the lease's profile or runtime (the
        // identity may not list the lease); the journal records them.
        let refused = if !p.allows_profile(&l.profile) {
            Error::new(
                Code::ProfileDenied,
                "this lease's profile is not available to this identity",
            )
        } else if !p.allows_runtime(&l.runtime) {
            Error::new(
                Code::RuntimeDenied,
                "this lease's runtime is not allowed for this identity",
            )
        } else {
            return Ok(());
        };
        let mut ev = ev.clone();
        ev.runtime = Some(l.runtime.clone());
        ev.profile = Some(l.profile.clone());
        ev.backend = Some(l.backend.clone());
        ev.lease_ref = Some(l.lease_ref.clone());
        ev.sandbox_ref = Some(l.sandbox_ref.clone());
        Err(self.reject(ev, refused).await)
    }

    /// Where the lease's sandbox is, and the client of its backend (503
    /// `backend_unavailable` while that is down: before any intent).
    pub(crate) fn addr(&self, l: &Lease) -> Result<Addr> {
        let cube = self.ready_client(&l.backend)?;
        let traffic_token = match &l.traffic_token {
            Some(s) => Some(Secret::new(
                String::from_utf8(self.inner.store.sealer.open(s)?)
                    .map_err(|_| Error::new(Code::AuditUnavailable, "corrupt sealed token"))?,
            )),
            None => None,
        };
        Ok(Addr {
            sandbox: SandboxAddr {
                id: l.sandbox_id.clone(),
                domain: l.domain.clone(),
                traffic_token,
                envd_version: l.envd_version.clone(),
            },
            cube,
        })
    }

    pub(crate) fn lease_event(&self, p: &Principal, action: Action, ctx: &Ctx, l: &Lease) -> Event {
        with_lease(self.event(p, action, ctx), l)
    }

    pub(crate) fn profile_gone(l: &Lease) -> Error {
        Error::new(
            Code::ProfileDenied,
            format!(
                "the lease's profile {} is no longer configured; release the lease",
                l.profile
            ),
        )
    }

    pub(crate) fn lease_answer(&self, l: &Lease, reused: bool, ctx: &Ctx) -> dto::LeaseAnswer {
        dto::LeaseAnswer {
            executor: self.executor(&l.backend),
            lease_ref: l.lease_ref.clone(),
            persistent_workspace: l.volume.is_some(),
            profile: l.profile.clone(),
            request_id: ctx.request_id.clone(),
            reused,
            replaced_lease_ref: l.replaced_lease_ref.clone().filter(|_| !reused),
            sandbox_ref: l.sandbox_ref.clone(),
            state: l.state.clone(),
        }
    }

    /// Apply the path policy; a denied path is recorded as `rejected`.
    pub(crate) async fn checked_path(
        &self,
        p: &Principal,
        ctx: &Ctx,
        action: &Action,
        path: &str,
    ) -> Result<String> {
        match paths::check(path) {
            Ok(norm) => Ok(norm),
            Err(e) => {
                let mut ev = self.event(p, action.clone(), ctx);
                ev.path_digest = Some(self.inner.journal.digest("path", path.as_bytes()));
                Err(self.reject(ev, e).await)
            }
        }
    }

    /// Take a lease's lock and look the lease up again: it may have been
    /// released or collected while we waited.
    pub(crate) async fn relock(
        &self,
        p: &Principal,
        l: Lease,
    ) -> Result<(Lease, super::LockGuard)> {
        let lock = self.lock(format!("lease:{}", l.lease_ref)).await?;
        let l = self.visible_lease(p, &l.lease_ref).await?;
        Ok((l, lock))
    }

    /// Check a command (size, not blank) and its working directory (path
    /// policy; default `/workspace`).
    pub(crate) async fn command_and_cwd(
        &self,
        p: &Principal,
        ctx: &Ctx,
        action: &Action,
        command: &str,
        cwd: Option<&str>,
    ) -> Result<String> {
        if command.len() > MAX_COMMAND {
            return Err(Error::new(
                Code::ValueTooLarge,
                format!("command is longer than {MAX_COMMAND} bytes"),
            ));
        }
        if command.trim().is_empty() {
            return Err(Error::new(
                Code::InvalidRequest,
                "command must not be empty",
            ));
        }
        match cwd {
            Some(c) => self.checked_path(p, ctx, action, c).await,
            None => Ok("/workspace".to_string()),
        }
    }

    /// Record a failed effect's outcome: the one its code's class says
    /// (`rejected`, `error` or `uncertain`).
    pub(crate) async fn fail(&self, intent: Intent, e: &Error) -> Result<()> {
        let code = e.code;
        self.inner
            .journal
            .outcome(
                intent,
                code.outcome(),
                |ev| ev.error_code = Some(code.as_str().to_string()),
                |_| Ok(()),
            )
            .await?;
        Ok(())
    }
}
