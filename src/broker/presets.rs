//! A profile's template preset (`config::presets`), applied at acquire once
//! the sandbox exists and before its lease is handed out: the bootstrap
//! commands, the files (their `${FILE:…}` secrets read now, on this host),
//! the commands after them, then the pre-checks. Each step runs under its
//! own intent and outcome (`preset_step`: the step's kind, a keyed digest of
//! its command or path, its exit code; never a file's content or a secret).
//! A step that fails fails the acquire (`preset_failed`, or
//! `preset_check_failed` for a pre-check), and the caller kills the sandbox.
//! A file is written through a command's stdin into a temporary file made
//! under umask 077, given its mode, then moved onto its path: it is never
//! readable by others, nor half-written where it is read.

use std::time::Duration;

use sha2::Digest;

use super::{Broker, Code, Error, Result};
use crate::audit::event::{Action, Event, Outcome, Phase};
use crate::config::Preset;
use crate::config::presets::secret_files;
use crate::cube::{CubeClient, SandboxAddr, StartOptions};

/// What a step's command may print that is kept (for the exit code only).
const STEP_OUTPUT: usize = 4096;

/// The kinds of step, as the journal names them (`release_action` holds it).
#[derive(Clone, Copy)]
enum Step {
    Bootstrap,
    File,
    After,
    Precheck,
}

impl Step {
    const fn word(self) -> &'static str {
        match self {
            Step::Bootstrap => "preset:bootstrap",
            Step::File => "preset:file",
            Step::After => "preset:after",
            Step::Precheck => "preset:precheck",
        }
    }
}

/// A preset's digest: SHA-256 of its canonical JSON (what leases record
/// beside its version).
pub fn digest(p: &Preset) -> String {
    let v = serde_json::to_value(p).unwrap_or_default();
    let canon = crate::config::tasks::canonical(&v);
    hex::encode(sha2::Sha256::digest(canon.as_bytes()))
}

/// A file's content with its `${FILE:…}` secrets read in (a trailing
/// newline of each dropped).
fn resolve(content: &str) -> std::result::Result<String, String> {
    let mut out = content.to_string();
    let paths = secret_files(content).map_err(|e| e.to_string())?;
    for p in paths {
        let v = std::fs::read_to_string(p).map_err(|e| format!("secret file {p}: {e}"))?;
        let v = v.strip_suffix('\n').unwrap_or(&v);
        out = out.replace(&format!("${{FILE:{p}}}"), v);
    }
    Ok(out)
}

impl Broker {
    /// Apply the preset `name` to a new sandbox: `NAME@VERSION` and its
    /// digest, of the one preset applied (a reload meanwhile changes
    /// neither). `base` is the
    /// acquire's event (who, which profile); each step gets its own intent.
    pub(crate) async fn apply_preset(
        &self,
        cube: &CubeClient,
        sb: &SandboxAddr,
        name: &str,
        base: &Event,
    ) -> Result<(String, String)> {
        let cfg = self.config();
        let Some(p) = cfg.presets.get(name) else {
            return Err(Error::new(
                Code::PresetFailed,
                format!("the profile's template_preset {name} is not configured"),
            ));
        };
        let timeout = Duration::from_secs(p.step_timeout_seconds);
        for c in &p.bootstrap {
            self.preset_command(cube, sb, base, Step::Bootstrap, c, timeout)
                .await?;
        }
        for f in &p.files {
            self.preset_file(cube, sb, base, &f.path, &f.content, &f.mode, timeout)
                .await?;
        }
        for c in &p.after {
            self.preset_command(cube, sb, base, Step::After, c, timeout)
                .await?;
        }
        for c in &p.prechecks {
            self.preset_command(cube, sb, base, Step::Precheck, c, timeout)
                .await?;
        }
        Ok((format!("{name}@{}", p.version), digest(p)))
    }

    /// The intent of one step.
    async fn step_intent(
        &self,
        base: &Event,
        step: Step,
        fill: impl FnOnce(&mut Event),
    ) -> Result<crate::audit::Intent> {
        let j = &self.inner.journal;
        let mut ev = j.event(Action::PresetStep);
        for (to, from) in [
            (&mut ev.tenant_digest, &base.tenant_digest),
            (&mut ev.identity_digest, &base.identity_digest),
            (&mut ev.issuer_digest, &base.issuer_digest),
            (&mut ev.runtime, &base.runtime),
            (&mut ev.profile, &base.profile),
            (&mut ev.backend, &base.backend),
            (&mut ev.request_id, &base.request_id),
            (&mut ev.session_digest, &base.session_digest),
        ] {
            to.clone_from(from);
        }
        ev.phase = Phase::Intent;
        ev.release_action = Some(step.word().to_string());
        fill(&mut ev);
        Ok(j.intent(ev).await?)
    }

    /// Run one command as root; a non-zero exit fails the acquire.
    async fn preset_command(
        &self,
        cube: &CubeClient,
        sb: &SandboxAddr,
        base: &Event,
        step: Step,
        command: &str,
        timeout: Duration,
    ) -> Result<()> {
        let digest = self.inner.journal.digest("command", command.as_bytes());
        let intent = self
            .step_intent(base, step, |e| e.command_digest = Some(digest))
            .await?;
        let mut o = StartOptions::shell(command);
        o.user = Some("root".into());
        o.timeout = Some(timeout);
        let r = cube.run(sb, &o, STEP_OUTPUT).await;
        let (code, err) = match &r {
            Ok(out) if out.exit_code == 0 && !out.timed_out => (Some(0), None),
            Ok(out) => {
                let code = if matches!(step, Step::Precheck) {
                    Code::PresetCheckFailed
                } else {
                    Code::PresetFailed
                };
                let why = if out.timed_out {
                    format!("did not finish within {} s", timeout.as_secs())
                } else {
                    format!("exited with {}", out.exit_code)
                };
                (
                    Some(out.exit_code),
                    Some(Error::new(
                        code,
                        format!(
                            "the profile's preset: a {} command {why}",
                            step.word().trim_start_matches("preset:")
                        ),
                    )),
                )
            }
            Err(e) => (
                None,
                Some(Error::new(
                    Code::PresetFailed,
                    format!(
                        "the profile's preset: a command could not run ({})",
                        e.kind.as_str()
                    ),
                )),
            ),
        };
        self.settle_step(intent, err, |e| e.exit_code = code).await
    }

    /// Write one file (its secrets read in now), then set its mode.
    #[allow(clippy::too_many_arguments)]
    async fn preset_file(
        &self,
        cube: &CubeClient,
        sb: &SandboxAddr,
        base: &Event,
        path: &str,
        content: &str,
        mode: &str,
        timeout: Duration,
    ) -> Result<()> {
        let digest = self.inner.journal.digest("path", path.as_bytes());
        let intent = self
            .step_intent(base, Step::File, |e| e.path_digest = Some(digest))
            .await?;
        let r = async {
            let text = resolve(content).map_err(|why| {
                tracing::warn!(path, error = %why, "a preset's file could not be made");
                "a secret file it names cannot be read on the appliance's host"
            })?;
            let len = text.len() as u64;
            // Through the command's stdin into a file made under umask 077
            // and given its mode before it takes the path: never readable
            // by others, never half-written where it is read.
            let q = crate::config::tasks::shell_quote;
            let dir = match path.rsplit_once('/') {
                Some(("", _)) | None => "/",
                Some((d, _)) => d,
            };
            let tmp = format!("{path}.preset-tmp");
            let mut o = StartOptions::shell(&format!(
                "umask 077 && mkdir -p {} && cat > {} && chmod {mode} {} && mv -f {} {}",
                q(dir),
                q(&tmp),
                q(&tmp),
                q(&tmp),
                q(path)
            ));
            o.user = Some("root".into());
            o.timeout = Some(timeout);
            o.stdin = true;
            let stream = cube
                .start(sb, &o)
                .await
                .map_err(|_| "the file could not be written")?;
            let pid = stream.pid;
            let sent = async {
                cube.send_stdin(sb, pid, text.as_bytes()).await?;
                cube.close_stdin(sb, pid).await
            }
            .await;
            let out = stream.collect(STEP_OUTPUT).await;
            match (sent, out) {
                (Ok(()), Ok(out)) if out.exit_code == 0 => {}
                _ => return Err("the file could not be written"),
            }
            Ok(len)
        }
        .await;
        let (bytes, err) = match r {
            Ok(n) => (Some(n), None),
            Err(why) => (
                None,
                Some(Error::new(
                    Code::PresetFailed,
                    format!("the profile's preset: {path}: {why}"),
                )),
            ),
        };
        self.settle_step(intent, err, |e| e.bytes = bytes).await
    }

    /// A step's outcome (`ok`, or `error` with the code of `err`), then
    /// `err` as the step's result.
    async fn settle_step(
        &self,
        intent: crate::audit::Intent,
        err: Option<Error>,
        fill: impl FnOnce(&mut Event),
    ) -> Result<()> {
        let outcome = if err.is_some() {
            Outcome::Error
        } else {
            Outcome::Ok
        };
        let code_word = err.as_ref().map(|e| e.code.to_string());
        self.inner
            .journal
            .outcome(
                intent,
                outcome,
                |e| {
                    fill(e);
                    e.error_code = code_word;
                },
                |_| Ok(()),
            )
            .await?;
        err.map_or(Ok(()), Err)
    }
}
