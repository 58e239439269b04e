//! Running a command in a lease's sandbox (`POST /v1/leases/{ref}/exec`).

use super::*;

impl Broker {
    /// `POST /v1/leases/{ref}/exec`.
    pub async fn exec(
        &self,
        p: &Principal,
        ctx: &Ctx,
        lease_ref: &str,
        command: &str,
        cwd: Option<&str>,
        timeout_ms: Option<u64>,
    ) -> Result<dto::ExecResponse> {
        let cwd = self
            .command_and_cwd(p, ctx, &Action::Exec, command, cwd)
            .await?;
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
                    Action::Exec,
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
                        o.envs = b.egress_env(&l);
                        o.cwd = Some(cwd.clone());
                        o.timeout = Some(Duration::from_millis(ms));
                        // Recorded when its profile says so: every piece of
                        // output as it comes, through the tap.
                        let recording = if b.records_execs(&l.profile) {
                            let (rec, record) = b
                                .begin_recording(
                                    crate::broker::recordings::RecordingKind::Exec,
                                    &l,
                                    &new_ref("exec"),
                                    (80, 24),
                                )
                                .map_err(|e| {
                                    Error::new(
                                        Code::AuditUnavailable,
                                        format!("the exec's recording cannot be written: {e}"),
                                    )
                                })?;
                            let (tx, mut rx) = tokio::sync::mpsc::channel::<(bool, Vec<u8>)>(64);
                            o.tap = Some(tx);
                            let r2 = rec.clone();
                            let fwd = tokio::spawn(async move {
                                use crate::broker::recordings::Stream;
                                while let Some((err, b)) = rx.recv().await {
                                    let s = if err { Stream::Error } else { Stream::Output };
                                    r2.data(s, &b).await;
                                }
                            });
                            Some((rec, record, fwd))
                        } else {
                            None
                        };
                        let ran = addr.cube.run(&addr, &o, MAX_OUTPUT).await;
                        drop(o);
                        let record = match recording {
                            Some((rec, record, fwd)) => {
                                let _ = fwd.await;
                                if ran.as_ref().is_ok_and(|r| r.timed_out) {
                                    rec.marker("the command was killed at its deadline").await;
                                }
                                rec.finish().await;
                                Some(record)
                            }
                            None => None,
                        };
                        // The record, once the recording is sealed (or
                        // not recorded): whatever the outcome.
                        if let Some(r) = record {
                            let _ = b
                                .inner
                                .store
                                .write(move |txn, _| {
                                    match crate::store::recordings::get(txn, &r.recording_ref)? {
                                        Some(_) => Ok(()),
                                        None => crate::store::recordings::put(txn, &r),
                                    }
                                })
                                .await;
                        }
                        let out = ran.map_err(|e| match e.kind {
                            ErrorKind::InvalidArgument => Error::new(
                                Code::InvalidPath,
                                "the working directory does not exist",
                            ),
                            ErrorKind::Denied => Error::new(
                                Code::PathDenied,
                                "permission denied in the sandbox for the working directory",
                            ),
                            _ => backend(&e),
                        })?;
                        // Killed at its deadline (with all it started): the
                        // reference's 504 `timeout`.
                        if out.timed_out {
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
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        Ok(dto::ExecResponse {
            duration_ms: u64::try_from(ms).unwrap_or(u64::MAX),
            executor: self.executor(&l.backend),
            exit_code: out.exit_code,
            request_id: ctx.request_id.clone(),
            sandbox_ref: l.sandbox_ref.clone(),
            stderr: text(&out.stderr),
            stderr_truncated: out.truncated && out.stderr.len() >= MAX_OUTPUT,
            stdout: text(&out.stdout),
            stdout_truncated: out.truncated && out.stdout.len() >= MAX_OUTPUT,
        })
    }
}
