//! Leases and everything done on one: acquire (idempotent per tenant +
//! runtime + HMAC(session_key)), status, exec, files, artifacts, release.

use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use redb::WriteTransaction;
use serde_json::{Value, json};
use sha2::Digest;

use super::paths;
use super::{Broker, Code, Ctx, EXECUTOR, Error, Result, error::backend};
use crate::audit::Intent;
use crate::audit::event::Event;
use crate::auth::Principal;
use crate::config::RUNTIMES;
use crate::cube::wire::{CreateSandbox, Lifecycle, NetworkPolicy};
use crate::cube::{ErrorKind, SandboxAddr, Secret, StartOptions};
use crate::store::{self, StoreError};

pub const MAX_COMMAND: usize = 16 * 1024;
pub const MAX_OUTPUT: usize = 64 * 1024;
pub const MAX_WRITE: usize = 256 * 1024;
pub const MAX_READ: usize = 64 * 1024;
pub const MAX_ARTIFACT: usize = 8 * 1024 * 1024;
pub const MAX_SESSION_KEY: usize = 512;
pub const MAX_LIST: usize = 1000;

pub use crate::store::leases::{Lease, LeaseState};

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
}

/// State written in an effect's outcome transaction.
pub(crate) type Persist =
    Box<dyn FnOnce(&WriteTransaction) -> std::result::Result<(), StoreError> + Send>;

/// What an effect gives back: its value, what its outcome event records,
/// and state to write in the outcome's transaction.
pub(crate) struct Done<T> {
    pub value: T,
    pub exit_code: Option<i32>,
    pub bytes: Option<u64>,
    pub persist: Option<Persist>,
    /// Count as use of the lease (`last_used_at`; true unless said otherwise).
    pub touch: bool,
}

impl<T> Done<T> {
    pub fn new(value: T) -> Self {
        Self {
            value,
            exit_code: None,
            bytes: None,
            persist: None,
            touch: true,
        }
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
        f: impl FnOnce(&WriteTransaction) -> std::result::Result<(), StoreError> + Send + 'static,
    ) -> Self {
        self.persist = Some(Box::new(f));
        self
    }
}

pub(crate) fn new_ref(prefix: &str) -> String {
    let h: String = (0..10)
        .map(|_| format!("{:02x}", rand::random::<u8>()))
        .collect();
    format!("{prefix}_{h}")
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

impl Broker {
    pub(crate) async fn get_lease(&self, lease_ref: &str) -> Result<Option<Lease>> {
        Ok(self
            .inner
            .store
            .read_now(|txn| store::leases::get(txn, lease_ref))?)
    }

    /// The lease, if the principal may see it; otherwise exactly the answer
    /// a missing lease gets.
    pub(crate) async fn owned_lease(&self, p: &Principal, lease_ref: &str) -> Result<Lease> {
        let missing = || Error::new(Code::LeaseNotFound, "no such lease");
        if !valid_ref(lease_ref, "lease") {
            return Err(missing());
        }
        match self.get_lease(lease_ref).await? {
            Some(l) if l.visible_to(p) => Ok(l),
            _ => Err(missing()),
        }
    }

    pub(crate) fn addr(&self, l: &Lease) -> Result<SandboxAddr> {
        let traffic_token = match &l.traffic_token {
            Some(s) => Some(Secret::new(
                String::from_utf8(self.inner.store.sealer.open(s)?)
                    .map_err(|_| Error::new(Code::AuditUnavailable, "corrupt sealed token"))?,
            )),
            None => None,
        };
        Ok(SandboxAddr {
            id: l.sandbox_id.clone(),
            domain: l.domain.clone(),
            traffic_token,
        })
    }

    pub(crate) fn lease_event(&self, p: &Principal, action: &str, ctx: &Ctx, l: &Lease) -> Event {
        let mut ev = self.event(p, action, ctx);
        ev.runtime = Some(l.runtime.clone());
        ev.profile = Some(l.profile.clone());
        ev.lease_ref = Some(l.lease_ref.clone());
        ev.sandbox_ref = Some(l.sandbox_ref.clone());
        ev.session_digest = Some(l.session_hash.clone());
        ev
    }

    pub(crate) fn base(&self, l: &Lease, ctx: &Ctx) -> serde_json::Map<String, Value> {
        let mut m = serde_json::Map::new();
        m.insert("executor".into(), json!(EXECUTOR));
        m.insert("sandbox_ref".into(), json!(l.sandbox_ref));
        m.insert("request_id".into(), json!(ctx.request_id));
        m
    }

    /// `POST /v1/leases/acquire`.
    pub async fn acquire(
        &self,
        p: &Principal,
        ctx: &Ctx,
        runtime: &str,
        session: &str,
        profile: Option<&str>,
    ) -> Result<Value> {
        let (l, reused) = self
            .acquire_lease(p, ctx, runtime, session, profile, None)
            .await?;
        Ok(self.lease_answer(&l, reused, ctx))
    }

    /// Acquire with every check of `POST /v1/leases/acquire`; `task_ref`
    /// marks a lease that belongs to a trusted task.
    pub(crate) async fn acquire_lease(
        &self,
        p: &Principal,
        ctx: &Ctx,
        runtime: &str,
        session: &str,
        profile: Option<&str>,
        task_ref: Option<&str>,
    ) -> Result<(Lease, bool)> {
        let profile_name = profile.unwrap_or("offline-code").to_string();
        let mut ev = self.event(p, "acquire", ctx);
        ev.runtime = Some(runtime.to_string());
        ev.profile = Some(profile_name.clone());
        ev.task_ref = task_ref.map(str::to_string);
        self.authorize(p, "lease:acquire", &ev).await?;
        if !RUNTIMES.contains(&runtime) {
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        Code::InvalidRuntime,
                        format!("runtime must be one of {}", RUNTIMES.join(", ")),
                    ),
                )
                .await);
        }
        if !p.allows_runtime(runtime) {
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        Code::RuntimeDenied,
                        format!("runtime {runtime} is not allowed for this identity"),
                    ),
                )
                .await);
        }
        if session.len() > MAX_SESSION_KEY {
            return Err(Error::new(
                Code::ValueTooLarge,
                format!("session_key is longer than {MAX_SESSION_KEY} bytes"),
            ));
        }
        if session.trim().is_empty() {
            return Err(Error::new(
                Code::InvalidRequest,
                "session_key must not be empty",
            ));
        }
        let denied = || {
            Error::new(
                Code::ProfileDenied,
                format!("profile {profile_name} is not available to this identity"),
            )
        };
        let Some(prof) = self.profile(&profile_name) else {
            return Err(self.reject(ev, denied()).await);
        };
        if !p.allows_profile(&profile_name) || !prof.allowed_runtimes.iter().any(|r| r == runtime) {
            return Err(self.reject(ev, denied()).await);
        }
        let hash: String = self
            .hmac_hex(&[p.tenant.as_bytes(), session.as_bytes()])
            .chars()
            .take(24)
            .collect();
        let want = Want {
            tenant: p.tenant.clone(),
            runtime: runtime.to_string(),
            hash,
            profile: profile_name,
            prof,
            snapshot: None,
            task_ref: task_ref.map(str::to_string),
        };
        self.lease_for_session(p, ctx, ev, want).await
    }

    /// The session's lease, or a new one (quota permitting) created under
    /// an audit intent and recorded with the session index in its outcome.
    pub(crate) async fn lease_for_session(
        &self,
        p: &Principal,
        ctx: &Ctx,
        mut ev: Event,
        want: Want,
    ) -> Result<(Lease, bool)> {
        let Want {
            tenant,
            runtime,
            hash,
            profile: profile_name,
            prof,
            snapshot,
            task_ref,
        } = want;
        ev.session_digest = Some(hash.clone());
        let skey = session_key(&tenant, &runtime, &hash);
        let _session_lock = self.lock(format!("session:{skey}")).await;

        // Reuse.
        let sk = skey.clone();
        let existing: Option<Lease> = self
            .inner
            .store
            .read(move |txn| store::leases::by_session(txn, &sk))
            .await?;
        if let Some(mut l) = existing {
            if let Some((_, ckpt)) = &snapshot
                && l.forked_from.as_ref() != Some(ckpt)
            {
                return Err(self
                    .reject(
                        ev,
                        Error::new(
                            Code::ForkConflict,
                            "this branch is a fork of another checkpoint; name another branch",
                        ),
                    )
                    .await);
            }
            if l.task_ref != task_ref {
                return Err(self
                    .reject(
                        ev,
                        Error::new(
                            Code::ProfileConflict,
                            "this session key belongs to a trusted task's sandbox; use another",
                        ),
                    )
                    .await);
            }
            if l.profile != profile_name {
                return Err(self
                    .reject(
                        ev,
                        Error::new(
                            Code::ProfileConflict,
                            format!("this session already has a lease with profile {}; release it first to use {profile_name}", l.profile),
                        ),
                    )
                    .await);
            }
            let (ts, unix) = self.now();
            l.last_used_at = ts;
            l.last_used_unix = unix;
            let action = ev.action.clone();
            let mut ev2 = self.lease_event(p, &action, ctx, &l);
            ev2.outcome = "ok".into();
            ev2.reused = Some(true);
            ev2.phase = "event".into();
            ev2.checkpoint_ref = ev.checkpoint_ref.clone();
            ev2.task_ref = ev.task_ref.clone();
            let l2 = l.clone();
            self.inner
                .store
                .write(move |txn, chain| {
                    put_lease(txn, &l2)?;
                    chain.append(txn, ev2)?;
                    Ok(())
                })
                .await?;
            return Ok((l, true));
        }

        // Quota, across the tenant's leases.
        let _tenant_lock = self.lock(format!("tenant:{tenant}")).await;
        let t2 = tenant.clone();
        let active = self
            .inner
            .store
            .read(move |txn| {
                let n = store::leases::all(txn)?
                    .iter()
                    .filter(|l| l.tenant == t2)
                    .count();
                Ok(u32::try_from(n).unwrap_or(u32::MAX))
            })
            .await?;
        if active >= prof.max_active_leases_per_tenant {
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        Code::LeaseQuotaExceeded,
                        format!(
                            "the tenant already has {active} active leases (limit {})",
                            prof.max_active_leases_per_tenant
                        ),
                    ),
                )
                .await);
        }

        let intent = self.inner.journal.intent(ev).await?;
        // From here the effect runs to its recorded outcome even if the
        // client goes away (the task is drained at shutdown).
        let b = self.clone();
        let task = self.inner.tracker.spawn(async move {
            let this = &b;
            let p_tenant = tenant;
            let purpose = if snapshot.is_some() {
                "agent-adapter-fork"
            } else {
                "agent-adapter"
            };
            let mut metadata: std::collections::BTreeMap<String, String> = [
                ("runtime".to_string(), runtime.to_string()),
                ("purpose".to_string(), purpose.to_string()),
                (
                    "tenant".to_string(),
                    this.inner.journal.digest("tenant", p_tenant.as_bytes()),
                ),
                ("session".to_string(), hash.clone()),
                ("policy".to_string(), profile_name.clone()),
            ]
            .into();
            if let Some((_, ckpt)) = &snapshot {
                metadata.insert("checkpoint".into(), ckpt.clone());
            }
            let req = CreateSandbox {
                template_id: prof.template.clone(),
                timeout: Some(i64::try_from(prof.sandbox_timeout_seconds).unwrap_or(i64::MAX)),
                lifecycle: Some(Lifecycle {
                    on_timeout: Some(prof.lifecycle.on_timeout.clone()),
                    auto_resume: Some(prof.lifecycle.auto_resume),
                }),
                allow_internet_access: Some(prof.allow_internet_access),
                network: Some(NetworkPolicy {
                    allow_public_traffic: Some(false),
                    ..Default::default()
                }),
                metadata: metadata.into_iter().collect(),
                ..Default::default()
            };
            let created = match &snapshot {
                None => this.inner.cube.create(&req).await,
                Some((snap, _)) => this.inner.cube.create_from_snapshot(snap, req).await,
            };
            let created = match created {
                Ok(s) => s,
                Err(e) => {
                    let err = match e.kind {
                        ErrorKind::NotFound if snapshot.is_some() => Error::new(
                            Code::CheckpointNotFound,
                            "the checkpoint's snapshot is gone",
                        ),
                        _ => backend(&e),
                    };
                    this.fail(intent, &err).await?;
                    return Err(err);
                }
            };
            let (ts, unix) = this.now();
            let sealed = match &created.traffic_access_token {
                Some(t) => match this.inner.store.sealer.seal(t.as_bytes()) {
                    Ok(s) => Some(s),
                    Err(e) => {
                        // Cannot keep the token: do not keep the sandbox.
                        tracing::error!(error = %e, "sealing a traffic token failed");
                        let _ = this.inner.cube.kill(&created.sandbox_id).await;
                        let err =
                            Error::new(Code::ExecutionFailed, "the sandbox could not be recorded");
                        this.fail(intent, &err).await?;
                        return Err(err);
                    }
                },
                None => None,
            };
            let lease = Lease {
                lease_ref: new_ref("lease"),
                tenant: p_tenant.clone(),
                runtime: runtime.to_string(),
                session_hash: hash,
                profile: profile_name,
                sandbox_ref: created.sandbox_id.chars().take(8).collect(),
                sandbox_id: created.sandbox_id.clone(),
                domain: created.domain.clone(),
                traffic_token: sealed,
                state: LeaseState::Running,
                created_at: ts.clone(),
                last_used_at: ts,
                last_used_unix: unix,
                task_ref,
                forked_from: snapshot.as_ref().map(|(_, c)| c.clone()),
            };
            let l2 = lease.clone();
            let lref = lease.lease_ref.clone();
            let sref = lease.sandbox_ref.clone();
            let forked = snapshot.is_some();
            let stored = this
                .inner
                .journal
                .outcome(
                    intent,
                    "ok",
                    |e| {
                        // A fork's event keeps its source lease.
                        if forked {
                            e.fork_lease_ref = Some(lref);
                        } else {
                            e.lease_ref = Some(lref);
                            e.sandbox_ref = Some(sref);
                        }
                        e.reused = Some(false);
                    },
                    move |txn| {
                        put_lease(txn, &l2)?;
                        store::leases::put_session(txn, &skey, &l2.lease_ref)
                    },
                )
                .await;
            if let Err(e) = stored {
                // Not recorded: do not leave an untracked sandbox behind.
                let _ = this.inner.cube.kill(&created.sandbox_id).await;
                return Err(e.into());
            }
            Ok::<Lease, Error>(lease)
        });
        let lease = task
            .await
            .map_err(|_| Error::new(Code::ExecutionFailed, "the operation was interrupted"))??;
        Ok((lease, false))
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

    pub(crate) fn lease_answer(&self, l: &Lease, reused: bool, ctx: &Ctx) -> Value {
        json!({
            "executor": EXECUTOR,
            "lease_ref": l.lease_ref,
            "sandbox_ref": l.sandbox_ref,
            "profile": l.profile,
            "reused": reused,
            "state": l.state,
            "persistent_workspace": false,
            "request_id": ctx.request_id,
        })
    }

    /// Apply the path policy; a denied path is recorded as `rejected`.
    pub(crate) async fn checked_path(
        &self,
        p: &Principal,
        ctx: &Ctx,
        action: &str,
        path: &str,
    ) -> Result<String> {
        match paths::check(path) {
            Ok(norm) => Ok(norm),
            Err(e) => {
                let mut ev = self.event(p, action, ctx);
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
        let lock = self.lock(format!("lease:{}", l.lease_ref)).await;
        let l = self.owned_lease(p, &l.lease_ref).await?;
        Ok((l, lock))
    }

    /// Check a command (size, not blank) and its working directory (path
    /// policy; default `/workspace`).
    pub(crate) async fn command_and_cwd(
        &self,
        p: &Principal,
        ctx: &Ctx,
        action: &str,
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
                code.outcome().as_str(),
                |ev| ev.error_code = Some(code.as_str().to_string()),
                |_| Ok(()),
            )
            .await?;
        Ok(())
    }

    /// `GET /v1/leases`.
    pub async fn list_leases(&self, p: &Principal, ctx: &Ctx) -> Result<Value> {
        let ev = self.event(p, "lease_list", ctx);
        self.authorize(p, "lease:list", &ev).await?;
        let tenant = p.tenant.clone();
        let admin = p.is_admin();
        let mut leases: Vec<Lease> = self
            .inner
            .store
            .read(move |txn| {
                let mut v = store::leases::all(txn)?;
                // A trusted task's lease is the task's, not the agent's.
                v.retain(|l| admin || (l.tenant == tenant && l.task_ref.is_none()));
                Ok(v)
            })
            .await?;
        leases.sort_by(|a, b| {
            b.created_at
                .cmp(&a.created_at)
                .then(b.lease_ref.cmp(&a.lease_ref))
        });
        let items: Vec<Value> = leases
            .iter()
            .map(|l| {
                json!({
                    "lease_ref": l.lease_ref, "sandbox_ref": l.sandbox_ref,
                    "tenant": if admin { Value::String(l.tenant.clone()) } else { Value::Null },
                    "runtime": l.runtime, "profile": l.profile, "state": l.state,
                    "created_at": l.created_at, "last_used_at": l.last_used_at,
                })
            })
            .collect();
        Ok(json!({ "leases": items }))
    }

    /// `GET|POST /v1/leases/{ref}/status`.
    pub async fn lease_status(
        &self,
        p: &Principal,
        ctx: &Ctx,
        lease_ref: &str,
        refresh: bool,
    ) -> Result<Value> {
        let ev = self.event(p, "status", ctx);
        self.authorize(p, "lease:status", &ev).await?;
        let mut l = self.owned_lease(p, lease_ref).await?;
        if refresh {
            self.inner.journal.check()?;
            match self.inner.cube.get(&l.sandbox_id).await {
                Ok(d) => l.state = LeaseState::from(d.state),
                Err(e) if e.kind == ErrorKind::NotFound => l.state = LeaseState::Gone,
                Err(e) => return Err(backend(&e)),
            }
            let (ts, unix) = self.now();
            l.last_used_at = ts;
            l.last_used_unix = unix;
            let l2 = l.clone();
            self.inner
                .store
                .write(move |txn, _| put_lease(txn, &l2))
                .await?;
        }
        let prof = self.profile(&l.profile).unwrap_or_default();
        let idle = self.now().1 - l.last_used_unix;
        let expires = i64::try_from(prof.lease_idle_ttl_seconds)
            .unwrap_or(i64::MAX)
            .saturating_sub(idle)
            .max(0);
        let mut m = self.base(&l, ctx);
        for (k, v) in [
            ("lease_ref", json!(l.lease_ref)),
            ("runtime", json!(l.runtime)),
            ("profile", json!(l.profile)),
            ("state", json!(l.state)),
            ("created_at", json!(l.created_at)),
            ("last_used_at", json!(l.last_used_at)),
            ("expires_in_seconds", json!(expires)),
            ("volume_attached", json!(false)),
            ("jobs", json!(self.jobs_summary(&l.lease_ref)?)),
            (
                "checkpoints",
                json!(self.checkpoints_summary(&l.lease_ref)?),
            ),
            ("recoverable", json!(true)),
        ] {
            m.insert(k.into(), v);
        }
        Ok(Value::Object(m))
    }

    /// Run one effect on a lease's sandbox under intent/outcome.
    ///
    /// Once the intent is committed, the effect and its outcome run in a
    /// task of their own: a client that disconnects, or a shutdown (which
    /// drains these tasks), never leaves an intent without its outcome.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn effect<T, F, Fut>(
        &self,
        p: &Principal,
        ctx: &Ctx,
        lease_ref: &str,
        action: &str,
        scope: &str,
        fill: impl FnOnce(&mut Event),
        run: F,
    ) -> Result<(Lease, T)>
    where
        T: Send + 'static,
        F: FnOnce(Broker, Lease, SandboxAddr) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<Done<T>>> + Send + 'static,
    {
        let ev = self.event(p, action, ctx);
        self.authorize(p, scope, &ev).await?;
        let l = self.owned_lease(p, lease_ref).await?;
        self.effect_on(p, ctx, l, action, fill, None, run).await
    }

    /// As `effect`, on a lease already looked up (and authorized), holding
    /// `hold` (a lock) until the outcome is committed.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn effect_on<T, F, Fut>(
        &self,
        p: &Principal,
        ctx: &Ctx,
        l: Lease,
        action: &str,
        fill: impl FnOnce(&mut Event),
        hold: Option<super::LockGuard>,
        run: F,
    ) -> Result<(Lease, T)>
    where
        T: Send + 'static,
        F: FnOnce(Broker, Lease, SandboxAddr) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<Done<T>>> + Send + 'static,
    {
        let mut ev = self.lease_event(p, action, ctx, &l);
        // A profile a reload removed does not fall back to defaults (which
        // could be looser): its leases only release.
        if self.profile(&l.profile).is_none() {
            return Err(self.reject(ev, Self::profile_gone(&l)).await);
        }
        fill(&mut ev);
        let addr = self.addr(&l)?;
        let intent = self.inner.journal.intent(ev).await?;
        super::failpoint("after_intent");
        let b = self.clone();
        let task = self.inner.tracker.spawn(async move {
            let r = run(b.clone(), l.clone(), addr).await;
            let r = b.finish(intent, l, r).await;
            drop(hold);
            r
        });
        task.await
            .map_err(|_| Error::new(Code::ExecutionFailed, "the operation was interrupted"))?
    }

    /// Record an effect's outcome; on success, touch the lease in the same
    /// transaction (if it still exists: a concurrent kill wins).
    async fn finish<T>(
        &self,
        intent: Intent,
        mut l: Lease,
        r: Result<Done<T>>,
    ) -> Result<(Lease, T)> {
        match r {
            Ok(Done {
                value: t,
                exit_code: exit,
                bytes,
                persist,
                touch,
            }) => {
                if touch {
                    let (ts, unix) = self.now();
                    l.last_used_at = ts;
                    l.last_used_unix = unix;
                    l.state = LeaseState::Running;
                }
                let l2 = l.clone();
                self.inner
                    .journal
                    .outcome(
                        intent,
                        "ok",
                        |e| {
                            e.exit_code = exit;
                            e.bytes = bytes;
                        },
                        move |txn| {
                            let exists = store::leases::exists(txn, &l2.lease_ref)?;
                            if exists && touch {
                                put_lease(txn, &l2)?;
                            }
                            // Nothing is recorded under a lease that is gone.
                            match persist {
                                Some(f) if exists => f(txn),
                                _ => Ok(()),
                            }
                        },
                    )
                    .await?;
                Ok((l, t))
            }
            Err(e) => {
                self.fail(intent, &e).await?;
                Err(e)
            }
        }
    }

    /// `POST /v1/leases/{ref}/exec`.
    pub async fn exec(
        &self,
        p: &Principal,
        ctx: &Ctx,
        lease_ref: &str,
        command: &str,
        cwd: Option<&str>,
        timeout_ms: Option<u64>,
    ) -> Result<Value> {
        let cwd = self.command_and_cwd(p, ctx, "exec", command, cwd).await?;
        if timeout_ms == Some(0) {
            return Err(Error::new(
                Code::InvalidTimeout,
                "timeout_ms must be at least 1",
            ));
        }
        let cmd_digest = self.inner.journal.digest("command", command.as_bytes());
        let command = command.to_string();
        let ((l, out), ms) = {
            let started = std::time::Instant::now();
            let r = self
                .effect(
                    p,
                    ctx,
                    lease_ref,
                    "exec",
                    "exec:run",
                    |e| e.command_digest = Some(cmd_digest),
                    move |b: Broker, l: Lease, addr| async move {
                        let cap = b
                            .profile(&l.profile)
                            .map(|p| p.max_command_seconds)
                            .unwrap_or(120)
                            * 1000;
                        let ms = timeout_ms.unwrap_or(60_000).min(cap);
                        let mut o = StartOptions::shell(&command);
                        o.cwd = Some(cwd.clone());
                        o.timeout = Some(Duration::from_millis(ms));
                        let started = std::time::Instant::now();
                        let out =
                            b.inner.cube.run(&addr, &o, MAX_OUTPUT).await.map_err(|e| {
                                match e.kind {
                                    ErrorKind::InvalidArgument => Error::new(
                                        Code::InvalidPath,
                                        "the working directory does not exist",
                                    ),
                                    _ => backend(&e),
                                }
                            })?;
                        // Killed at its deadline: the reference's 504 `timeout`.
                        if out.status == "signal: killed"
                            && started.elapsed() >= Duration::from_millis(ms)
                        {
                            return Err(Error::new(
                                Code::Timeout,
                                format!("the command did not finish within {ms} ms"),
                            ));
                        }
                        let code = out.exit_code;
                        Ok(Done::new(out).exit_code(code))
                    },
                )
                .await?;
            (r, started.elapsed().as_millis())
        };
        let mut m = self.base(&l, ctx);
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        m.insert("exit_code".into(), json!(out.exit_code));
        m.insert("stdout".into(), json!(text(&out.stdout)));
        m.insert("stderr".into(), json!(text(&out.stderr)));
        let (so, se) = (
            out.truncated && out.stdout.len() >= MAX_OUTPUT,
            out.truncated && out.stderr.len() >= MAX_OUTPUT,
        );
        m.insert("stdout_truncated".into(), json!(so));
        m.insert("stderr_truncated".into(), json!(se));
        m.insert(
            "duration_ms".into(),
            json!(u64::try_from(ms).unwrap_or(u64::MAX)),
        );
        Ok(Value::Object(m))
    }

    /// File operations: read, write, list, stat, mkdir, remove, move.
    pub async fn file_op(
        &self,
        p: &Principal,
        ctx: &Ctx,
        lease_ref: &str,
        op: FileOp,
    ) -> Result<Value> {
        let (action, scope, path) = match &op {
            FileOp::Read { path } => ("read", "file:read", path),
            FileOp::Write { path, .. } => ("write", "file:write", path),
            FileOp::List { path } => ("list", "file:list", path),
            FileOp::Stat { path } => ("stat", "file:stat", path),
            FileOp::Mkdir { path } => ("mkdir", "file:mkdir", path),
            FileOp::Remove { path } => ("remove", "file:remove", path),
            FileOp::Move { path, .. } => ("move", "file:move", path),
            FileOp::Upload { path, .. } => ("artifact_upload", "artifact:upload", path),
            FileOp::Download { path } => ("artifact_download", "artifact:download", path),
        };
        let path = self.checked_path(p, ctx, action, path).await?;
        let dest = match &op {
            FileOp::Move { destination, .. } => {
                Some(self.checked_path(p, ctx, action, destination).await?)
            }
            _ => None,
        };
        if let FileOp::Write { content, .. } = &op
            && content.len() > MAX_WRITE
        {
            return Err(Error::new(
                Code::ValueTooLarge,
                format!("content is larger than {MAX_WRITE} bytes"),
            ));
        }
        let upload = match &op {
            FileOp::Upload { content_base64, .. } => {
                if content_base64.len() > MAX_ARTIFACT / 3 * 4 + 16 {
                    return Err(Error::new(
                        Code::ArtifactTooLarge,
                        format!("artifacts are limited to {MAX_ARTIFACT} bytes"),
                    ));
                }
                let b = B64.decode(content_base64.as_bytes()).map_err(|_| {
                    Error::new(Code::InvalidBase64, "content_base64 is not valid base64")
                })?;
                if b.len() > MAX_ARTIFACT {
                    return Err(Error::new(
                        Code::ArtifactTooLarge,
                        format!("artifacts are limited to {MAX_ARTIFACT} bytes"),
                    ));
                }
                Some(b)
            }
            _ => None,
        };
        let j = &self.inner.journal;
        let pd = j.digest("path", path.as_bytes());
        let dd = dest.as_ref().map(|d| j.digest("path", d.as_bytes()));
        let content_sha = match (&op, &upload) {
            (FileOp::Write { content, .. }, _) => {
                Some(hex::encode(sha2::Sha256::digest(content.as_bytes())))
            }
            (_, Some(b)) => Some(hex::encode(sha2::Sha256::digest(b))),
            _ => None,
        };
        let path2 = path.clone();
        let dest2 = dest.clone();
        let (l, (result, _)) = self
            .effect(
                p,
                ctx,
                lease_ref,
                action,
                scope,
                |e| {
                    e.path_digest = Some(pd);
                    e.destination_digest = dd;
                    e.content_sha256 = content_sha;
                },
                move |b: Broker, _l: Lease, addr| async move {
                    let c = &b.inner.cube;
                    let nf = |e: crate::cube::CubeError, code: Code| match e.kind {
                        ErrorKind::NotFound => Error::new(code, "no such file or directory"),
                        ErrorKind::InvalidArgument => Error::new(Code::InvalidPath, "the path is not usable for this operation"),
                        ErrorKind::Conflict => Error::new(Code::AlreadyExists, "the path already exists"),
                        _ => backend(&e),
                    };
                    let r: (Value, Option<u64>) = match op {
                        FileOp::Read { .. } => {
                            let st = c.stat(&addr, &path2).await.map_err(|e| nf(e, Code::PathNotFound))?;
                            if st.is_dir() {
                                return Err(Error::new(Code::InvalidPath, "the path is a directory"));
                            }
                            // Only the first MAX_READ bytes are fetched, however large the file.
                            let (data, truncated) = c.download_prefix(&addr, &path2, MAX_READ).await.map_err(|e| nf(e, Code::PathNotFound))?;
                            let n = data.len() as u64;
                            (json!({"path": path2, "content": String::from_utf8_lossy(&data), "truncated": truncated}), Some(n))
                        }
                        FileOp::Write { content, .. } => {
                            let n = content.len();
                            c.upload(&addr, &path2, content.into_bytes()).await.map_err(|e| nf(e, Code::PathNotFound))?;
                            (json!({"path": path2, "bytes": n}), Some(n as u64))
                        }
                        FileOp::List { .. } => {
                            let entries = c.list_dir(&addr, &path2, 1).await.map_err(|e| nf(e, Code::PathNotFound))?;
                            let v: Vec<Value> = entries.iter().take(MAX_LIST).map(entry_json).collect();
                            (json!({"path": path2, "entries": v}), None)
                        }
                        FileOp::Stat { .. } => {
                            let e = c.stat(&addr, &path2).await.map_err(|e| nf(e, Code::PathNotFound))?;
                            (json!({"path": path2, "entry": entry_json(&e)}), None)
                        }
                        FileOp::Mkdir { .. } => {
                            let e = c.make_dir(&addr, &path2).await.map_err(|e| nf(e, Code::PathNotFound))?;
                            (json!({"path": path2, "entry": entry_json(&e)}), None)
                        }
                        FileOp::Remove { .. } => {
                            c.remove(&addr, &path2).await.map_err(|e| nf(e, Code::PathNotFound))?;
                            (json!({"path": path2, "removed": true}), None)
                        }
                        FileOp::Move { .. } => {
                            let d = dest2.unwrap_or_default();
                            let e = c.rename(&addr, &path2, &d).await.map_err(|e| nf(e, Code::PathNotFound))?;
                            (json!({"path": path2, "destination": d, "entry": entry_json(&e)}), None)
                        }
                        FileOp::Upload { .. } => {
                            let data = upload.unwrap_or_default();
                            let n = data.len();
                            let sha = hex::encode(sha2::Sha256::digest(&data));
                            c.upload(&addr, &path2, data).await.map_err(|e| nf(e, Code::PathNotFound))?;
                            (json!({"path": path2, "bytes": n, "sha256": sha}), Some(n as u64))
                        }
                        FileOp::Download { .. } => {
                            let data = c.download(&addr, &path2, MAX_ARTIFACT).await.map_err(|e| match e.kind {
                                ErrorKind::TooLarge => Error::new(Code::ArtifactTooLarge, format!("artifacts are limited to {MAX_ARTIFACT} bytes")),
                                _ => nf(e, Code::ArtifactNotFound),
                            })?;
                            let sha = hex::encode(sha2::Sha256::digest(&data));
                            (json!({"path": path2, "bytes": data.len(), "sha256": sha, "content_base64": B64.encode(&data)}), Some(data.len() as u64))
                        }
                    };
                    let bytes = r.1;
                    Ok(Done::new(r).bytes(bytes))
                },
            )
            .await?;
        let mut m = self.base(&l, ctx);
        if let Value::Object(extra) = result {
            m.extend(extra);
        }
        Ok(Value::Object(m))
    }

    /// `POST /v1/leases/{ref}/release` (`pause` or `kill`).
    pub async fn release(
        &self,
        p: &Principal,
        ctx: &Ctx,
        lease_ref: &str,
        action: &str,
    ) -> Result<Value> {
        if action != "pause" && action != "kill" {
            return Err(Error::new(
                Code::InvalidAction,
                "action must be pause or kill",
            ));
        }
        let ev = self.event(p, "release", ctx);
        self.authorize(p, "lease:release", &ev).await?;
        let l = self.owned_lease(p, lease_ref).await?;
        let lock = self.lock(format!("lease:{}", l.lease_ref)).await;
        // Looked up again under the lock: a concurrent release may have won.
        let l = self.owned_lease(p, &l.lease_ref).await?;
        let mut ev = self.lease_event(p, "release", ctx, &l);
        ev.release_action = Some(action.to_string());
        let intent = self.inner.journal.intent(ev).await?;
        // From here the release runs to its recorded outcome even if the
        // client goes away (drained at shutdown).
        let b = self.clone();
        let kill = action == "kill";
        let l2 = l.clone();
        let task = self.inner.tracker.spawn(async move {
            let _lock = lock;
            b.release_effect(intent, l2, kill).await
        });
        task.await
            .map_err(|_| Error::new(Code::ExecutionFailed, "the operation was interrupted"))??;
        let mut m = self.base(&l, ctx);
        m.insert("action".into(), json!(action));
        Ok(Value::Object(m))
    }

    /// The effect of a release, after its intent: pause or kill, the
    /// checkpoints' snapshots, and the outcome with the lease's new state.
    async fn release_effect(&self, intent: Intent, l: Lease, kill: bool) -> Result<()> {
        let r = if !kill {
            match self.inner.cube.pause(&l.sandbox_id).await {
                Ok(()) => Ok(()),
                Err(e) if e.kind == ErrorKind::Conflict => Ok(()), // already paused
                Err(e) => Err(backend(&e)),
            }
        } else {
            match self.inner.cube.kill(&l.sandbox_id).await {
                Ok(()) => Ok(()),
                Err(e) if e.kind == ErrorKind::NotFound => Ok(()), // already gone
                Err(e) => Err(backend(&e)),
            }
        };
        // Killed: its checkpoints go too. If one cannot be deleted, the lease
        // stays (as `released`) so that the release can be retried.
        let r = match r {
            Ok(()) if kill => match self.delete_lease_snapshots(&l.lease_ref).await {
                Err(e) => {
                    let mut l2 = l.clone();
                    l2.state = LeaseState::Released;
                    self.inner
                        .journal
                        .outcome(
                            intent,
                            "error",
                            |ev| ev.error_code = Some(e.code.to_string()),
                            move |txn| put_lease(txn, &l2),
                        )
                        .await?;
                    return Err(e);
                }
                Ok(()) => Ok(()),
            },
            other => other,
        };
        if let Err(e) = r {
            self.fail(intent, &e).await?;
            return Err(e);
        }
        let mut l2 = l.clone();
        self.inner
            .journal
            .outcome(
                intent,
                "ok",
                |_| {},
                move |txn| {
                    if kill {
                        super::upkeep::remove_lease_state(txn, &l2)?;
                    } else {
                        l2.state = LeaseState::Paused;
                        put_lease(txn, &l2)?;
                    }
                    Ok(())
                },
            )
            .await?;
        Ok(())
    }
}

/// A file operation.
#[derive(Debug, Clone)]
pub enum FileOp {
    Read {
        path: String,
    },
    Write {
        path: String,
        content: String,
    },
    List {
        path: String,
    },
    Stat {
        path: String,
    },
    Mkdir {
        path: String,
    },
    Remove {
        path: String,
    },
    Move {
        path: String,
        destination: String,
    },
    Upload {
        path: String,
        content_base64: String,
    },
    Download {
        path: String,
    },
}

/// The listing fields the reference exposes (nothing else).
fn entry_json(e: &crate::cube::wire::EntryInfo) -> Value {
    let kind = match e.kind.as_str() {
        "FILE_TYPE_DIRECTORY" => "dir",
        "FILE_TYPE_FILE" => "file",
        _ => "other",
    };
    json!({
        "name": e.name, "path": e.path, "type": kind, "size": e.size, "mode": e.mode,
        "permissions": e.permissions, "modified_time": e.modified_time, "is_dir": e.is_dir(),
    })
}
