//! Acquiring a lease: idempotent per tenant + runtime + HMAC(session_key),
//! within the tenant's quotas, creating the sandbox when none is reusable.

use super::*;

impl Broker {
    /// `POST /v1/leases/acquire`.
    pub async fn acquire(
        &self,
        p: &Principal,
        ctx: &Ctx,
        runtime: &str,
        session: &str,
        profile: Option<&str>,
    ) -> Result<dto::LeaseAnswer> {
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
        // The request's names reach the journal only once their shape is
        // known: a runtime we have, a profile that is configured; anything
        // else is recorded as its digest and length (`event::unshaped`).
        let known_runtime = RUNTIMES.contains(&runtime);
        let prof = self.profile(&profile_name);
        let mut ev = self.event(p, Action::Acquire, ctx);
        ev.runtime = Some(if known_runtime {
            runtime.to_string()
        } else {
            crate::audit::event::unshaped(runtime)
        });
        ev.profile = Some(if prof.is_some() {
            profile_name.clone()
        } else {
            crate::audit::event::unshaped(&profile_name)
        });
        ev.task_ref = task_ref.map(str::to_string);
        self.authorize(p, "lease:acquire", &ev).await?;
        if !known_runtime {
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
            let shown = if crate::config::valid_profile_name(&profile_name) {
                profile_name.as_str()
            } else {
                "(not a profile name)"
            };
            Error::new(
                Code::ProfileDenied,
                format!("profile {shown} is not available to this identity"),
            )
        };
        let Some(prof) = prof else {
            return Err(self.reject(ev, denied()).await);
        };
        if !p.allows_profile(&profile_name) || !prof.allowed_runtimes.iter().any(|r| r == runtime) {
            return Err(self.reject(ev, denied()).await);
        }
        // A trusted task's sandbox never mounts a volume other leases
        // mount (refused at load too: `Config::validate`).
        if task_ref.is_some() && prof.workspace.is_shared() {
            return Err(self
                .reject(
                    ev,
                    Error::new(
                        Code::ProfileDenied,
                        format!(
                            "profile {profile_name} shares its workspace volume with other sandboxes; trusted tasks need a workspace of their own"
                        ),
                    ),
                )
                .await);
        }
        let cfg = self.config();
        let Some(backend_name) = cfg.profile_backend(&prof).map(str::to_string) else {
            return Err(self.reject(ev, denied()).await);
        };
        ev.backend = Some(backend_name.clone());
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
            backend: backend_name,
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
            backend: backend_name,
        } = want;
        ev.session_digest = Some(hash.clone());
        ev.backend = Some(backend_name.clone());
        // A backend that is down fails its profiles here: before any
        // intent, and before the session's lease is looked at.
        let cube = match self.ready_client(&backend_name) {
            Ok(c) => c,
            Err(e) => return Err(self.reject(ev, e).await),
        };
        let skey = session_key(&tenant, &runtime, &hash, &backend_name);
        let _session_lock = self.lock(format!("session:{skey}")).await?;

        // Reuse.
        let mut replaced: Option<String> = None;
        let sk = skey.clone();
        let existing: Option<Lease> = self
            .inner
            .store
            .read(move |txn| store::leases::by_session(txn, &sk))
            .await?;
        if let Some(l) = existing {
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
            if l.state == LeaseState::Gone || self.sandbox_gone(&l).await {
                // A dead sandbox is not handed out again: its lease ends
                // (audited as a release, `gone`) and a new one takes its
                // place below, the answer naming the old one.
                replaced = Some(l.lease_ref.clone());
                self.retire_gone(p, ctx, l).await?;
            } else {
                return self.reuse(p, ctx, &ev, l).await;
            }
        }

        // Quota, across the tenant's leases.
        let _tenant_lock = self.lock(format!("tenant:{tenant}")).await?;
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

        let ev_base = ev.clone();
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
            // Names this one create: a create that fails or times out may
            // still finish on the backend, and is found again by it.
            let attempt = new_ref("create");
            metadata.insert("attempt".into(), attempt.clone());
            // Names this appliance: GC kills what it made and lost track of.
            metadata.insert("appliance".into(), this.appliance_id());
            // The workspace volume: found or made before the sandbox.
            let volume = match this
                .workspace_volume(&cube, &prof, &p_tenant, &hash, &runtime)
                .await
            {
                Ok(v) => v,
                Err(err) => {
                    this.fail(intent, &err).await?;
                    return Err(err);
                }
            };
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
                    allow_out: Some(prof.network.allow_out.clone()).filter(|v| !v.is_empty()),
                    deny_out: Some(prof.network.deny_out.clone()).filter(|v| !v.is_empty()),
                }),
                disk_size_mb: (prof.disk_mb > 0).then_some(prof.disk_mb),
                metadata: metadata.into_iter().collect(),
                volume_mounts: volume.as_ref().map(|v| {
                    vec![VolumeMount {
                        name: v.volume_id.clone(),
                        path: v.mount_path.clone(),
                        read_only: Some(v.read_only),
                    }]
                }),
                ..Default::default()
            };
            let created = match &snapshot {
                None => cube.create(&req).await,
                Some((snap, _)) => cube.create_from_snapshot(snap, req).await,
            };
            let created = match created {
                Ok(s) => s,
                Err(e) => {
                    let err = match e.kind {
                        ErrorKind::NotFound if snapshot.is_some() => Error::new(
                            Code::CheckpointNotFound,
                            "the checkpoint's snapshot is gone",
                        ),
                        ErrorKind::TooLarge => Error::new(
                            Code::StorageLow,
                            "the backend's disk is nearly full: no new sandboxes until space returns",
                        ),
                        ErrorKind::NotFound => Error::new(
                            Code::TemplateNotFound,
                            format!(
                                "the profile's template {} does not exist on the backend",
                                prof.template
                            ),
                        ),
                        ErrorKind::Unsupported if prof.network_access() => Error::new(
                            Code::NetworkUnavailable,
                            format!(
                                "the profile gives sandboxes network access, which the backend's host cannot provide ({}): ask the operator",
                                e.message
                            ),
                        ),
                        ErrorKind::Conflict if volume.is_some() => Error::new(
                            Code::ProfileConflict,
                            "the workspace volume is mounted read-write by another sandbox",
                        ),
                        _ => backend(&e),
                    };
                    this.suspect(&backend_name, &e);
                    if let Some(v) = &volume
                        && v.owned
                        && !v.retain
                        && let Err(e) = cube.delete_volume(&v.volume_id).await
                        && e.kind != ErrorKind::NotFound
                    {
                        tracing::warn!(error = %e, "could not destroy the workspace volume of a failed create");
                    }
                    this.fail(intent, &err).await?;
                    if matches!(
                        e.kind,
                        ErrorKind::Timeout
                            | ErrorKind::Internal
                            | ErrorKind::Unavailable
                            | ErrorKind::Protocol
                    ) {
                        this.reap_orphaned_create(backend_name, cube, attempt, ev_base);
                    }
                    return Err(err);
                }
            };
            // The stock CubeSandbox image has no /workspace, where commands
            // run by default: make it (one that exists is fine).
            let addr = cube.addr(&created);
            match cube.make_dir(&addr, "/workspace").await {
                Ok(_) => {}
                Err(e) if e.kind == ErrorKind::Conflict => {}
                Err(e) => tracing::warn!(error = %e, "could not make /workspace in a new sandbox"),
            }
            // The profile's governed MCP server, behind the sandbox's
            // gateway: a sandbox whose gateway does not start is not kept.
            let mcp_token = match &prof.mcp_policy {
                None => None,
                Some(policy) => {
                    match this
                        .start_gateway(&cube, &addr, &backend_name, policy)
                        .await
                    {
                        Ok(sealed) => Some(sealed),
                        Err(err) => {
                            let _ = cube.kill(&created.sandbox_id).await;
                            this.fail(intent, &err).await?;
                            return Err(err);
                        }
                    }
                }
            };
            // With the proxy's network listener, the sandbox's way to it.
            let lease_ref = new_ref("lease");
            let egress_token = match (&prof.egress, this.config().egress.advertised()) {
                (Some(_), Some(at)) => match this.write_egress_env(&cube, &addr, &lease_ref, &at).await {
                    Ok(sealed) => Some(sealed),
                    Err(err) => {
                        let _ = cube.kill(&created.sandbox_id).await;
                        this.fail(intent, &err).await?;
                        return Err(err);
                    }
                },
                _ => None,
            };
            // The profile's template preset, before anyone gets the lease.
            let preset = match &prof.template_preset {
                None => None,
                Some(name) => match this.apply_preset(&cube, &addr, name, &ev_base).await {
                    Ok(applied) => Some(applied),
                    Err(err) => {
                        let _ = cube.kill(&created.sandbox_id).await;
                        this.fail(intent, &err).await?;
                        return Err(err);
                    }
                },
            };
            let (ts, unix) = this.now();
            let sealed = match &created.traffic_access_token {
                Some(t) => match this.inner.store.sealer.seal(t.as_bytes()) {
                    Ok(s) => Some(s),
                    Err(e) => {
                        // Cannot keep the token: do not keep the sandbox.
                        tracing::error!(error = %e, "sealing a traffic token failed");
                        let _ = cube.kill(&created.sandbox_id).await;
                        let err =
                            Error::new(Code::ExecutionFailed, "the sandbox could not be recorded");
                        this.fail(intent, &err).await?;
                        return Err(err);
                    }
                },
                None => None,
            };
            let lease = Lease {
                lease_ref,
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
                envd_version: Some(created.envd_version.clone()).filter(|v| !v.is_empty()),
                ttl_seconds: None,
                replaced_lease_ref: replaced,
                backend: backend_name,
                volume,
                mcp_policy: mcp_token.as_ref().and(prof.mcp_policy.clone()),
                mcp_token,
                held_by: None,
                preset_digest: preset.as_ref().map(|(_, d)| d.clone()),
                egress_only: None,
                egress_token,
                preset: preset.map(|(n, _)| n),
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
                    Outcome::Ok,
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
                let _ = cube.kill(&created.sandbox_id).await;
                return Err(e.into());
            }
            if prof.egress.is_some() {
                // Its sandbox's egress tap, now rather than at the next pass.
                this.egress_watch_pass();
            }
            Ok::<Lease, Error>(lease)
        });
        let lease = task
            .await
            .map_err(|_| Error::new(Code::ExecutionFailed, "the operation was interrupted"))??;
        Ok((lease, false))
    }

    /// Hand out the session's existing lease again (touched, recorded).
    async fn reuse(
        &self,
        p: &Principal,
        ctx: &Ctx,
        ev: &Event,
        mut l: Lease,
    ) -> Result<(Lease, bool)> {
        let (ts, unix) = self.now();
        l.last_used_at = ts;
        l.last_used_unix = unix;
        let mut ev2 = self.lease_event(p, ev.action.clone(), ctx, &l);
        ev2.outcome = Outcome::Ok;
        ev2.reused = Some(true);
        ev2.phase = Phase::Event;
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
        Ok((l, true))
    }

    /// Whether the backend says the lease's sandbox no longer exists. Any
    /// other answer (running, paused, or no answer at all) is not "gone".
    pub(crate) async fn sandbox_gone(&self, l: &Lease) -> bool {
        let Ok(cube) = self.client(&l.backend) else {
            return false;
        };
        matches!(
            cube.get(&l.sandbox_id).await,
            Err(e) if e.kind == ErrorKind::NotFound
        )
    }

    /// End a lease whose sandbox is gone, as a kill would (its checkpoints'
    /// snapshots too), audited as `release` with `release_action: gone`.
    async fn retire_gone(&self, p: &Principal, ctx: &Ctx, l: Lease) -> Result<()> {
        let mut ev = self.lease_event(p, Action::Release, ctx, &l);
        ev.release_action = Some("gone".to_string());
        let intent = self.inner.journal.intent(ev).await?;
        let b = self.clone();
        self.inner
            .tracker
            .spawn(async move { b.release_effect(intent, l, true).await })
            .await
            .map_err(|_| Error::new(Code::ExecutionFailed, "the operation was interrupted"))?
    }

    /// This appliance's mark on the sandboxes it creates (a keyed digest:
    /// stable across restarts, different for every state directory).
    pub(crate) fn appliance_id(&self) -> String {
        self.hmac_hex(&[b"appliance"]).chars().take(16).collect()
    }

    /// A create that failed or timed out may still finish on the backend
    /// (CubeAPI answers 408 after 30 s while CubeMaster goes on): look for
    /// a sandbox made by that attempt, now and twice more within a minute,
    /// and kill what turns up, each kill under its own audit intent
    /// (`orphan_kill`, by the appliance, for the requester's tenant).
    fn reap_orphaned_create(
        &self,
        backend_name: String,
        cube: crate::cube::CubeClient,
        attempt: String,
        base: Event,
    ) {
        let b = self.clone();
        tokio::spawn(async move {
            let filter: std::collections::BTreeMap<String, String> =
                [("attempt".to_string(), attempt)].into();
            for wait in [0u64, 10, 50] {
                tokio::time::sleep(std::time::Duration::from_secs(wait)).await;
                let found = match cube.list(&filter, None).await {
                    Ok(f) => f,
                    Err(e) => {
                        tracing::warn!(error = %e, "could not look for an orphaned sandbox");
                        continue;
                    }
                };
                for s in found {
                    if let Err(e) = b
                        .kill_orphan(&backend_name, &s.sandbox_id, Some(&base))
                        .await
                    {
                        tracing::warn!(code = e.code.as_str(), error = %e.message, "could not kill a sandbox left by a failed create");
                    }
                }
            }
        });
    }

    /// The volume a profile's workspace mounts, found or made on the
    /// backend (none for `ephemeral`). `per-session-volume`: named for the
    /// tenant, session and runtime (or the profile's `volume_name`), made
    /// once and found again by the next acquire while it is retained;
    /// `existing-volume`: the operator's, which must exist.
    async fn workspace_volume(
        &self,
        cube: &crate::cube::CubeClient,
        prof: &crate::config::Profile,
        tenant: &str,
        hash: &str,
        runtime: &str,
    ) -> Result<Option<LeaseVolume>> {
        use crate::config::WorkspaceMode;
        let w = &prof.workspace;
        let (id, owned) = match w.mode {
            WorkspaceMode::Ephemeral => return Ok(None),
            WorkspaceMode::ExistingVolume => {
                let id = w.volume_id.clone().unwrap_or_default();
                match cube.get_volume(&id).await {
                    Ok(_) => {}
                    Err(e) if e.kind == ErrorKind::NotFound => {
                        return Err(Error::new(
                            Code::ExecutionFailed,
                            format!(
                                "the profile's workspace volume {id} does not exist on the backend"
                            ),
                        ));
                    }
                    Err(e) => return Err(backend(&e)),
                }
                (id, false)
            }
            WorkspaceMode::PerSessionVolume => {
                let name = w
                    .volume_name
                    .clone()
                    .unwrap_or_else(|| per_session_volume_name(tenant, hash, runtime));
                match cube.get_volume(&name).await {
                    Ok(v) => (v.volume_id, true),
                    Err(e) if e.kind == ErrorKind::NotFound => {
                        let req = crate::cube::wire::CreateVolume {
                            name: name.clone(),
                            driver: w.driver.clone(),
                            size_mb: (w.size_mb > 0).then_some(w.size_mb),
                        };
                        match cube.create_volume(&req).await {
                            Ok(v) => (v.volume_id, true),
                            // Made meanwhile by a create of the same name.
                            Err(e) if e.kind == ErrorKind::Conflict => (name, true),
                            Err(e) => return Err(backend(&e)),
                        }
                    }
                    Err(e) => return Err(backend(&e)),
                }
            }
        };
        Ok(Some(LeaseVolume {
            volume_id: id,
            mount_path: w.mount_path.clone(),
            read_only: w.read_only,
            owned,
            retain: w.retain_on_kill,
        }))
    }
}

/// A per-session workspace volume's name: `cwa-<sha256(tenant)[:12]>-
/// <session_hash[:20]>-<runtime>` (the reference's, with the runtime: our
/// session index keeps runtimes apart, so their volumes are too).
pub(crate) fn per_session_volume_name(tenant: &str, hash: &str, runtime: &str) -> String {
    use sha2::Digest;
    let t = hex::encode(sha2::Sha256::digest(tenant.as_bytes()));
    let h: String = hash.chars().take(20).collect();
    format!("cwa-{}-{h}-{runtime}", t.get(..12).unwrap_or_default())
}
