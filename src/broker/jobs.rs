//! Durable jobs (reference rows 19–23): a command that outlives the request.
//!
//! A job lives in its sandbox, not in the appliance: a runner started with
//! `setsid` writes the command's output to `/tmp/cube-adapter-jobs/<job>/`
//! (`stdout`, `stderr`), then its exit code (`exit-code`, renamed into place).
//! A watchdog ends the job's process group at the profile's
//! `max_command_seconds` and leaves `timed-out`; cancel leaves `cancelled`.
//! The appliance keeps only the record (`jobs_v1`), so output survives client
//! disconnects and appliance restarts, and byte offsets into each stream
//! never shift while the job runs. Nothing is ever re-run: a job whose runner
//! or sandbox is gone becomes `lost`.

use std::collections::BTreeMap;
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use serde_json::Value;

use super::dto::{self, JobAnswer, OutputEncoding};
use super::leases::{Done, Lease, Visible, new_ref, valid_ref};
use super::recordings::{Recorder, RecordingKind, Stream};
use super::{Broker, Code, Ctx, Error, Result, error::backend};
use crate::audit::event::Action;
use crate::auth::Principal;
use crate::cube::wire::ProcessEvent;
use crate::cube::{ErrorKind, StartOptions};
use crate::store::{self, StoreError};

/// Where jobs keep their files inside the sandbox.
pub const JOBS_DIR: &str = "/tmp/cube-adapter-jobs";
/// Largest chunk one output call returns per stream.
pub const MAX_CHUNK: usize = 1024 * 1024;
/// Default chunk per stream.
pub const DEFAULT_CHUNK: usize = 64 * 1024;
/// Finished jobs a lease keeps (records and files); older ones are removed
/// when a new job starts.
pub const KEEP_FINISHED: usize = 64;
/// The reference's paging reads each stream up to this much.
const COMPAT_LIMIT: usize = 1024 * 1024;

/// Starts the runner in a session of its own and prints its pid. Inputs
/// come as environment variables, so nothing is quoted into a script.
const LAUNCH: &str = r#"set -e
d="/tmp/cube-adapter-jobs/$CUBE_ADAPTER_JOB_REF"
mkdir -p -m 700 /tmp/cube-adapter-jobs "$d"
cd "$d"
printf '%s' "$CUBE_ADAPTER_JOB_COMMAND" > command.sh
printf '%s' "$CUBE_ADAPTER_JOB_RUNNER" > run.sh
: > stdout
: > stderr
c="$CUBE_ADAPTER_JOB_CWD"
m="$CUBE_ADAPTER_JOB_SECONDS"
unset CUBE_ADAPTER_JOB_REF CUBE_ADAPTER_JOB_COMMAND CUBE_ADAPTER_JOB_RUNNER CUBE_ADAPTER_JOB_CWD CUBE_ADAPTER_JOB_SECONDS
setsid /bin/bash "$d/run.sh" "$d" "$c" "$m" </dev/null >/dev/null 2>&1 &
r=$!
# Until the runner runs (its command line names the job, which is how the
# reader knows it alive): a reader right after this answers must not take
# a child that has not exec'd yet for a dead runner.
i=0
while [ ! -e started ] && [ "$i" -lt 200 ]; do sleep 0.05 2>/dev/null || sleep 1; i=$((i + 1)); done
printf '%s' "$r" > runner
echo "$r"
"#;

/// After a crash between a job's start and its outcome (`recovery`): the
/// runner's pid if the job was started (`pid N`), `none` if nothing of it
/// is there, `partial` otherwise.
pub(crate) const ADOPT: &str = r#"d="/tmp/cube-adapter-jobs/$J"
if [ ! -e "$d" ]; then echo none; exit 0; fi
r=$(cat "$d/runner" 2>/dev/null)
case "$r" in ''|*[!0-9]*) echo partial;; *) echo "pid $r";; esac
"#;

/// The runner: the command in a session (process group) of its own and,
/// where the sandbox allows it, a pid namespace of its own, so that
/// everything it starts (daemons and `setsid` included) ends with it; a
/// watchdog for the time limit; the exit code written last (atomically),
/// once nothing of the job is left to write output.
const RUNNER: &str = r#"d="$1"; cwd="$2"; max="$3"
: > "$d/started"
fin() { printf '%s' "$1" > "$d/exit-code.tmp"; mv -f "$d/exit-code.tmp" "$d/exit-code"; }
if ! cd -- "$cwd" 2>/dev/null; then
  printf 'cube-adapter: cannot enter %s\n' "$cwd" >> "$d/stderr"
  : > "$d/ended"
  fin 1
  exit 0
fi
wrap=
if unshare --pid --fork --kill-child --mount-proc /bin/true 2>/dev/null; then
  wrap="unshare --pid --fork --kill-child --mount-proc"
elif unshare --pid --fork --kill-child /bin/true 2>/dev/null; then
  wrap="unshare --pid --fork --kill-child"
fi
setsid $wrap /bin/bash "$d/command.sh" </dev/null >>"$d/stdout" 2>>"$d/stderr" &
c=$!
printf '%s' "$c" > "$d/pgid"
[ -e "$d/cancelled" ] && kill -TERM -- "-$c" 2>/dev/null
setsid /bin/bash -c 'sleep "$1" || exit 0; [ -e "$2/ended" ] && exit 0; : > "$2/timed-out"; kill -TERM -- "-$3" 2>/dev/null; sleep 5; kill -KILL -- "-$3" 2>/dev/null' cube-adapter-watchdog "$max" "$d" "$c" </dev/null >/dev/null 2>&1 &
w=$!
wait "$c"
rc=$?
: > "$d/ended"
kill -KILL -- "-$c" 2>/dev/null
i=0
while kill -0 -- "-$c" 2>/dev/null && [ "$i" -lt 50 ]; do sleep 0.1; i=$((i + 1)); done
kill -KILL -- "-$w" 2>/dev/null
fin "$rc"
"#;

/// Reports the job's state and file sizes on one line, then the requested
/// stdout range on stdout and stderr range on stderr. While the runner lives
/// the job is running, whatever the files say (the command can write them);
/// once it is gone, `exit-code` is the one it wrote last. Everything the
/// sandbox can write is checked to be a number before it is printed, and
/// the reader's own diagnostics go nowhere, so nothing can forge the status
/// line or leak into the output. With `$TAIL` (a number) the ranges are the
/// last `$TAIL` bytes of each stream, from the sizes just read.
const READER: &str = r#"exec 3>&2 2>/dev/null
cd "/tmp/cube-adapter-jobs/$J" || { printf 'cube-adapter-job gone - 0 0 0 0\n'; exit 0; }
num() { case "$1" in ''|*[!0-9]*) return 1;; esac; return 0; }
alive() { kill -0 "$R" && grep -q "$J" "/proc/$R/cmdline"; }
rc=-
if alive; then k=running
elif [ -e exit-code ]; then k=exit
else k=dead; fi
if [ "$k" = exit ]; then read -r rc < exit-code; num "$rc" || rc=-; fi
so=$(stat -c %s stdout); num "$so" || so=0
se=$(stat -c %s stderr); num "$se" || se=0
t=0; [ -e timed-out ] && t=1
x=0; [ -e cancelled ] && x=1
printf 'cube-adapter-job %s %s %s %s %s %s\n' "$k" "$rc" "$so" "$se" "$t" "$x"
if num "$TAIL"; then
  OM=$TAIL; EM=$TAIL; OO=0; EO=0
  if [ "$so" -gt "$TAIL" ]; then OO=$((so - TAIL)); fi
  if [ "$se" -gt "$TAIL" ]; then EO=$((se - TAIL)); fi
fi
if [ "$OM" -gt 0 ]; then tail -c +$((OO + 1)) stdout | head -c "$OM"; fi
if [ "$EM" -gt 0 ]; then tail -c +$((EO + 1)) stderr | head -c "$EM" >&3; fi
exit 0
"#;

/// Ends the job's process group: TERM, then KILL after two seconds. Exit 0:
/// signalled; 2: it had already ended; 3: no such job; 4: nothing to
/// signal yet (the runner sees `cancelled` as it starts the command).
const CANCEL: &str = r#"cd "/tmp/cube-adapter-jobs/$J" 2>/dev/null || exit 3
[ -e ended ] && exit 2
: > cancelled
i=0
while [ ! -e pgid ] && [ "$i" -lt 20 ]; do sleep 0.1; i=$((i + 1)); done
read -r c < pgid 2>/dev/null
case "$c" in ''|*[!0-9]*|0|1) exit 4;; esac
kill -TERM -- "-$c" 2>/dev/null || exit 4
i=0
while kill -0 -- "-$c" 2>/dev/null && [ "$i" -lt 20 ]; do sleep 0.1; i=$((i + 1)); done
kill -KILL -- "-$c" 2>/dev/null
exit 0
"#;

/// Wakes a job's recording when there is output to read: ends (0) at the
/// first byte written to stdout or stderr past the offsets already
/// recorded (`OO`, `EO`), or (10) when the runner (`R`) has ended without
/// one. The bytes themselves are read as files (`GET /files` with a
/// `Range`), not through this process. Without GNU `tail`'s `--pid`, or
/// `mkfifo`, it ends (4) at once and the recording polls.
const WAKE: &str = r#"cd "/tmp/cube-adapter-jobs/$J" 2>/dev/null || exit 3
tail --pid="$R" -c 0 /dev/null >/dev/null 2>&1 || exit 4
f=".wake.$$"
rm -f "$f"
mkfifo -m 600 "$f" 2>/dev/null || exit 4
# The job's own processes come first.
n=; command -v nice >/dev/null 2>&1 && n="nice -n 19"
$n tail -c +"$((OO + 1))" -s 0.2 --pid="$R" -F stdout >"$f" 2>/dev/null &
a=$!
$n tail -c +"$((EO + 1))" -s 0.2 --pid="$R" -F stderr >"$f" 2>/dev/null &
b=$!
w=$(head -c 1 <"$f" | wc -c)
kill "$a" "$b" 2>/dev/null
rm -f "$f"
[ "$w" -gt 0 ] || exit 10
"#;

pub use crate::store::jobs::{Job, JobState};

use crate::store::jobs::put as put_job;

/// Save what a look at a job found, against the record as it is now: an
/// ended job never goes back to `running`, a cancel is never forgotten, and
/// a job whose lease is gone is not re-created.
fn save_job(txn: &crate::store::Wx, seen: &Job) -> std::result::Result<(), StoreError> {
    let Some(current) = store::jobs::get(txn, &seen.job_ref)? else {
        return Ok(());
    };
    let mut j = seen.clone();
    if current.is_terminal() && !j.is_terminal() {
        j.state = current.state;
        j.exit_code = current.exit_code;
    }
    j.cancelled |= current.cancelled;
    put_job(txn, &j)
}

use crate::store::jobs::remove as delete_job;

/// Remove a lease's jobs (when the lease is killed).
pub(crate) fn delete_lease_jobs(
    txn: &crate::store::Wx,
    lease_ref: &str,
) -> std::result::Result<(), StoreError> {
    store::jobs::remove_lease(txn, lease_ref)
}

/// A lease's jobs, oldest first.
pub(crate) fn lease_jobs(
    txn: &crate::store::Rx,
    lease_ref: &str,
) -> std::result::Result<Vec<Job>, StoreError> {
    let mut out = store::jobs::of_lease(txn, lease_ref)?;
    out.sort_by(|a, b| a.created_at.cmp(&b.created_at));
    Ok(out)
}

/// What the reader saw.
#[derive(Debug, Default)]
struct Probe {
    /// `exit`, `running`, `dead` (runner gone, no exit code) or `gone`.
    kind: String,
    rc: Option<i32>,
    out_size: u64,
    err_size: u64,
    timed_out: bool,
    cancelled: bool,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

impl Probe {
    /// The state this probe shows for `job`. The runner's markers decide
    /// how it ended (the time limit, a cancel), whatever the exit code.
    fn state(&self, job: &Job) -> (JobState, Option<i32>) {
        match (self.kind.as_str(), self.rc) {
            ("exit", Some(rc)) => {
                let s = if self.timed_out {
                    JobState::TimedOut
                } else if self.cancelled || job.cancelled {
                    JobState::Cancelled
                } else if rc == 0 {
                    JobState::Succeeded
                } else {
                    JobState::Failed
                };
                (s, Some(rc))
            }
            ("running", _) => (JobState::Running, None),
            _ => (JobState::Lost, job.exit_code),
        }
    }
}

impl Probe {
    /// Bring `job` up to what this probe saw; true if anything changed.
    fn apply(&self, job: &mut Job, clock: &crate::clock::Clock) -> bool {
        let (state, rc) = self.state(job);
        if state == job.state && rc == job.exit_code {
            return false;
        }
        job.state = state;
        job.exit_code = rc;
        job.updated_at = clock.text();
        true
    }
}

/// One read of a job: state, sizes and the asked ranges
/// (`(offset, max)` per stream; max 0 reads nothing).
/// How long a job's recording polls its files before it waits for the waker.
const FOLLOW_QUIET: Duration = Duration::from_millis(500);
/// The recording's poll while a job's output flows or has just paused.
const FOLLOW_POLL: Duration = Duration::from_millis(50);
/// The poll where there is no waker (no GNU `tail`).
const FOLLOW_SLOW_POLL: Duration = Duration::from_secs(1);
/// What one read of a job's file for its recording takes at most.
const FOLLOW_READ: usize = 1024 * 1024;

/// Record what a job wrote past `at` (bytes of stdout and stderr already
/// recorded), up to `FOLLOW_READ` of each, piece by piece as it comes (the
/// recording's queue bounds what is held): whether there was any.
async fn read_new(
    addr: &super::leases::Addr,
    job: &Job,
    at: &mut (u64, u64),
    rec: &Recorder,
) -> crate::cube::Result<bool> {
    let mut any = false;
    for (name, stream) in [("stdout", Stream::Output), ("stderr", Stream::Error)] {
        let path = format!("{JOBS_DIR}/{}/{name}", job.job_ref);
        let offset = if name == "stdout" {
            &mut at.0
        } else {
            &mut at.1
        };
        let Some(mut body) = addr
            .cube
            .download_range(addr, &path, *offset, FOLLOW_READ)
            .await?
        else {
            continue;
        };
        while let Some(piece) = body.next().await? {
            *offset += piece.len() as u64;
            any = true;
            rec.data(stream, &piece).await;
        }
    }
    Ok(any)
}

/// One of the job scripts above, run by `/bin/sh` with its inputs in the
/// environment (nothing is quoted into the script).
fn job_script<const N: usize>(script: &str, envs: [(&str, String); N]) -> StartOptions {
    StartOptions {
        cmd: "/bin/sh".into(),
        args: vec!["-c".into(), script.into()],
        envs: envs.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        ..Default::default()
    }
}

/// Wait in the sandbox (`WAKE`) until the job writes past `at` or its
/// runner ends: the waker's exit code, `None` when it could not be asked.
async fn wake(addr: &super::leases::Addr, job: &Job, at: (u64, u64)) -> Option<i32> {
    let o = job_script(
        WAKE,
        [
            ("J", job.job_ref.clone()),
            ("R", job.runner_pid.to_string()),
            ("OO", at.0.to_string()),
            ("EO", at.1.to_string()),
        ],
    );
    let mut s = addr.cube.start(addr, &o).await.ok()?;
    loop {
        match s.next().await {
            Ok(Some(ProcessEvent::End(e))) => return e.exit_code,
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => return None,
        }
    }
}

async fn probe(
    b: &Broker,
    addr: &super::leases::Addr,
    job: &Job,
    out: (u64, usize),
    err: (u64, usize),
) -> Result<Probe> {
    read_job(b, addr, job, out, err, None).await
}

/// One read of a job: state, sizes and the last `max` bytes of each stream
/// (which start at `size - max`, or 0).
async fn probe_tail(
    b: &Broker,
    addr: &super::leases::Addr,
    job: &Job,
    max: usize,
) -> Result<Probe> {
    read_job(b, addr, job, (0, max), (0, max), Some(max)).await
}

async fn read_job(
    _b: &Broker,
    addr: &super::leases::Addr,
    job: &Job,
    out: (u64, usize),
    err: (u64, usize),
    tail: Option<usize>,
) -> Result<Probe> {
    let o = StartOptions {
        timeout: Some(Duration::from_secs(30)),
        ..job_script(
            READER,
            [
                ("J", job.job_ref.clone()),
                ("TAIL", tail.map(|n| n.to_string()).unwrap_or_default()),
                ("R", job.runner_pid.to_string()),
                ("OO", out.0.to_string()),
                ("OM", out.1.to_string()),
                ("EO", err.0.to_string()),
                ("EM", err.1.to_string()),
            ],
        )
    };
    let limit = out.1.max(err.1) + 256;
    let gone = || Probe {
        kind: "gone".into(),
        ..Default::default()
    };
    let r = match addr.cube.run(addr, &o, limit).await {
        Ok(r) => r,
        Err(e) if e.kind == ErrorKind::NotFound => return Ok(gone()),
        // The data plane cannot tell a missing sandbox from a hiccup (a
        // proxy answers 502 for both): ask the control plane.
        Err(e) => {
            return match addr.cube.get(&addr.id).await {
                Err(g) if g.kind == ErrorKind::NotFound => Ok(gone()),
                _ => Err(backend(&e)),
            };
        }
    };
    let nl =
        r.stdout.iter().position(|&c| c == b'\n').ok_or_else(|| {
            Error::new(Code::ExecutionFailed, "the job reader gave no status line")
        })?;
    let (head, rest) = r.stdout.split_at(nl);
    let head = String::from_utf8_lossy(head);
    let t: Vec<&str> = head.split(' ').collect();
    let bad = || {
        Error::new(
            Code::ExecutionFailed,
            "the job reader's status line is malformed",
        )
    };
    let known = ["exit", "running", "dead", "gone"];
    if t.len() != 7
        || t.first() != Some(&"cube-adapter-job")
        || !t.get(1).is_some_and(|k| known.contains(k))
        || !t
            .get(2)
            .is_some_and(|r| *r == "-" || r.parse::<u32>().is_ok())
        || !t
            .get(5..)
            .is_some_and(|f| f.iter().all(|x| *x == "0" || *x == "1"))
    {
        return Err(bad());
    }
    let field = |i: usize| t.get(i).copied().unwrap_or_default();
    let pr = Probe {
        kind: field(1).to_string(),
        rc: field(2).parse().ok(),
        out_size: field(3).parse().map_err(|_| bad())?,
        err_size: field(4).parse().map_err(|_| bad())?,
        timed_out: field(5) == "1",
        cancelled: field(6) == "1",
        stdout: rest.get(1..).unwrap_or_default().to_vec(),
        stderr: r.stderr,
    };
    // A cursor past the end of its stream was never handed out.
    if out.0 > pr.out_size || err.0 > pr.err_size {
        return Err(Error::new(
            Code::InvalidOffset,
            format!(
                "the offset is past the end of the output (stdout has {} bytes, stderr {})",
                pr.out_size, pr.err_size
            ),
        ));
    }
    Ok(pr)
}

/// The end of a job's output (`Broker::job_tail`).
#[derive(Debug, Clone)]
pub struct JobTail {
    pub job: JobAnswer,
    pub tenant: String,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// Where each tail starts in its stream.
    pub stdout_from: u64,
    pub stderr_from: u64,
    /// Each stream's size when it was read.
    pub stdout_size: u64,
    pub stderr_size: u64,
}

/// Output read by per-stream cursors.
#[derive(Debug, Clone, Copy)]
pub struct Cursors {
    pub stdout_offset: u64,
    pub stderr_offset: u64,
    pub max_bytes: usize,
}

/// Which output paging the caller asked for.
#[derive(Debug, Clone, Copy)]
pub enum OutputRequest {
    /// The reference's: one JSON fragment of both streams, sliced by bytes.
    Fragment { offset: u64, max_bytes: usize },
    /// Ours: a cursor per stream, base64 chunks, offsets that never shift.
    Cursors(Cursors),
}

impl Broker {
    async fn get_job(&self, job_ref: &str) -> Result<Option<Job>> {
        Ok(self
            .inner
            .store
            .read_now(|txn| store::jobs::get(txn, job_ref))?)
    }

    /// The job and its lease, if the principal may see them; otherwise
    /// exactly what a missing job answers.
    /// Its lease's profile and runtime must be the identity's too
    /// ([`Broker::usable`]; a refusal is recorded with `ev`).
    async fn owned_job(
        &self,
        p: &Principal,
        job_ref: &str,
        ev: &crate::audit::event::Event,
    ) -> Result<(Job, Lease)> {
        let missing = || Error::new(Code::JobNotFound, "no such job");
        if !valid_ref(job_ref, "job") {
            return Err(missing());
        }
        // Whose it is follows the lease it runs on.
        let job = self.get_job(job_ref).await?.ok_or_else(missing)?;
        let lease = self
            .get_lease(&job.lease_ref)
            .await?
            .filter(|l| l.visible_to(p))
            .ok_or_else(missing)?;
        self.usable(p, &lease, ev).await?;
        Ok((job, lease))
    }

    /// How many of a lease's jobs are running; those that have ended since
    /// they were last looked at are brought up to date first.
    pub(crate) async fn running_jobs(
        &self,
        addr: &super::leases::Addr,
        lease_ref: &str,
    ) -> Result<u32> {
        let jobs = self
            .inner
            .store
            .read_now(|txn| lease_jobs(txn, lease_ref))?;
        let mut running = 0u32;
        let mut updated = vec![];
        for mut j in jobs.into_iter().filter(|j| !j.is_terminal()) {
            let pr = probe(self, addr, &j, (0, 0), (0, 0)).await?;
            if pr.apply(&mut j, self.clock()) {
                updated.push(j);
            } else {
                running += 1;
            }
        }
        if !updated.is_empty() {
            self.inner
                .store
                .write(move |txn, _| {
                    for j in &updated {
                        save_job(txn, j)?;
                    }
                    Ok(())
                })
                .await?;
        }
        Ok(running)
    }

    /// `POST /v1/leases/{ref}/jobs`: start a job (202).
    pub async fn start_job(
        &self,
        p: &Principal,
        ctx: &Ctx,
        lease_ref: &str,
        command: &str,
        cwd: Option<&str>,
    ) -> Result<dto::JobStarted> {
        let cwd = self
            .command_and_cwd(p, ctx, &Action::JobStart, command, cwd)
            .await?;
        let ev = self.event(p, Action::JobStart, ctx);
        self.authorize(p, "job:start", &ev).await?;
        let l = self.owned_lease(p, lease_ref, &ev).await?;
        // One start at a time per lease: the quota check and the record are
        // under the lease's lock until the outcome is committed.
        let (l, lock) = self.relock(p, l).await?;
        let prof = self.profile(&l.profile).unwrap_or_default();
        let digest = self.inner.journal.digest("command", command.as_bytes());
        let job_ref = new_ref("job");
        let command = command.to_string();
        let tenant = l.tenant.clone();
        let jr = job_ref.clone();
        let d2 = digest.clone();
        let (l, job) = self
            .effect_on(
                p,
                ctx,
                l,
                Action::JobStart,
                |e| {
                    e.command_digest = Some(digest);
                    e.job_ref = Some(jr);
                },
                Some(lock),
                move |b: Broker, l: Lease, addr| async move {
                    // Running jobs and PTYs count against the quota.
                    let running =
                        b.running_jobs(&addr, &l.lease_ref).await? + b.running_ptys(&l.lease_ref)?;
                    if running >= prof.max_jobs_per_lease {
                        return Err(Error::new(
                            Code::JobQuotaExceeded,
                            format!(
                                "this lease already runs {running} jobs or PTYs (the profile allows {})",
                                prof.max_jobs_per_lease
                            ),
                        ));
                    }
                    // Keep the newest finished jobs; remove the others'
                    // files and records (under this start's intent).
                    let mut finished: Vec<Job> = b
                        .inner
                        .store
                        .read_now(|txn| lease_jobs(txn, &l.lease_ref))?
                        .into_iter()
                        .filter(Job::is_terminal)
                        .collect();
                    let drop_n = finished.len().saturating_sub(KEEP_FINISHED - 1);
                    finished.truncate(drop_n);
                    if !finished.is_empty() {
                        let mut o = StartOptions {
                            cmd: "/bin/rm".into(),
                            args: vec!["-rf".into(), "--".into()],
                            timeout: Some(Duration::from_secs(30)),
                            ..Default::default()
                        };
                        o.args
                            .extend(finished.iter().map(|j| format!("{JOBS_DIR}/{}", j.job_ref)));
                        addr.cube.run(&addr, &o, 4096).await.map_err(|e| backend(&e))?;
                    }
                    let envs: BTreeMap<String, String> = [
                        ("CUBE_ADAPTER_JOB_REF", job_ref.clone()),
                        ("CUBE_ADAPTER_JOB_COMMAND", command),
                        ("CUBE_ADAPTER_JOB_RUNNER", RUNNER.to_string()),
                        ("CUBE_ADAPTER_JOB_CWD", cwd),
                        (
                            "CUBE_ADAPTER_JOB_SECONDS",
                            prof.max_command_seconds.max(1).to_string(),
                        ),
                    ]
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v))
                    .collect();
                    let mut o = StartOptions::shell(LAUNCH);
                    o.envs = b.egress_env(&l);
                    o.envs.extend(envs);
                    o.timeout = Some(Duration::from_secs(30));
                    let out = addr.cube.run(&addr, &o, 4096).await.map_err(|e| backend(&e))?;
                    let pid: u32 = String::from_utf8_lossy(&out.stdout)
                        .trim()
                        .lines()
                        .last()
                        .and_then(|s| s.trim().parse().ok())
                        .filter(|_| out.exit_code == 0)
                        .ok_or_else(|| {
                            Error::new(
                                Code::ExecutionFailed,
                                format!(
                                    "the job could not be started (exit {}): {}",
                                    out.exit_code,
                                    String::from_utf8_lossy(&out.stderr).trim()
                                ),
                            )
                        })?;
                    let (ts, _) = b.now();
                    let job = Job {
                        job_ref,
                        lease_ref: l.lease_ref.clone(),
                        tenant,
                        command_digest: d2,
                        runner_pid: pid,
                        state: JobState::Running,
                        exit_code: None,
                        cancelled: false,
                        created_at: ts.clone(),
                        updated_at: ts,
                        max_seconds: prof.max_command_seconds,
                    };
                    let record = if b.records(&l.profile) {
                        let (rec, record) = b
                            .begin_recording(RecordingKind::Job, &l, &job.job_ref, (80, 24))
                            .map_err(|e| {
                                Error::new(
                                    Code::AuditUnavailable,
                                    format!("the job's recording cannot be written: {e}"),
                                )
                            })?;
                        b.follow_job(l.clone(), job.clone(), rec, (0, 0));
                        Some(record)
                    } else {
                        None
                    };
                    let j2 = job.clone();
                    Ok(Done::new(job).persist(move |txn| {
                        for old in &finished {
                            delete_job(txn, old)?;
                        }
                        put_job(txn, &j2)?;
                        match &record {
                            Some(r) => crate::store::recordings::put(txn, r),
                            None => Ok(()),
                        }
                    }))
                },
            )
            .await?;
        Ok(dto::JobStarted {
            executor: self.executor(&l.backend),
            job_ref: job.job_ref,
            lease_ref: job.lease_ref,
            request_id: ctx.request_id.clone(),
            sandbox_ref: l.sandbox_ref,
            state: job.state,
        })
    }

    /// One audited read of a job (status and output), saving a changed state.
    async fn job_read(
        &self,
        p: &Principal,
        ctx: &Ctx,
        job_ref: &str,
        action: Action,
        out: (u64, usize),
        err: (u64, usize),
    ) -> Result<(Job, Lease, Probe)> {
        // Status reads need `job:status`; output reads `job:output`.
        let scope = match action {
            Action::JobOutput | Action::JobEvents => "job:output",
            _ => "job:status",
        };
        let ev = self.event(p, action.clone(), ctx);
        self.authorize(p, scope, &ev).await?;
        let (job, lease) = self.owned_job(p, job_ref, &ev).await?;
        let jr = job.job_ref.clone();
        let (lease, (job, pr)) = self
            .effect_on(
                p,
                ctx,
                lease,
                action,
                |e| e.job_ref = Some(jr),
                None,
                move |b: Broker, _l: Lease, addr| async move {
                    let mut job = job;
                    let pr = probe(&b, &addr, &job, out, err).await?;
                    let bytes = (pr.stdout.len() + pr.stderr.len()) as u64;
                    let mut done = Done::new(());
                    if pr.apply(&mut job, b.clock()) {
                        let j2 = job.clone();
                        done = done.persist(move |txn| save_job(txn, &j2));
                    }
                    let Done { persist, .. } = done;
                    Ok(Done {
                        value: (job, pr),
                        exit_code: None,
                        bytes: Some(bytes),
                        persist,
                        touch: true,
                        fill: None,
                    })
                },
            )
            .await?;
        Ok((job, lease, pr))
    }

    /// The console's read-only tail of a job's output
    /// (`/console/jobs/{ref}`): the last `max` bytes of each stream. The
    /// same policy and event as `POST /v1/jobs/{ref}/output` (`job:output`,
    /// one `job_output` intent and outcome), but a person looking is not a
    /// use of the lease: it does not extend its idle time.
    pub async fn job_tail(
        &self,
        p: &Principal,
        ctx: &Ctx,
        job_ref: &str,
        max: usize,
    ) -> Result<JobTail> {
        let max = max.min(MAX_CHUNK);
        let ev = self.event(p, Action::JobOutput, ctx);
        self.authorize(p, "job:output", &ev).await?;
        let (job, lease) = self.owned_job(p, job_ref, &ev).await?;
        let jr = job.job_ref.clone();
        let (lease, (job, pr, from)) = self
            .effect_on(
                p,
                ctx,
                lease,
                Action::JobOutput,
                |e| e.job_ref = Some(jr),
                None,
                move |b: Broker, _l: Lease, addr| async move {
                    let mut job = job;
                    // One read: the sizes and the last `max` bytes of each.
                    let pr = probe_tail(&b, &addr, &job, max).await?;
                    let from = (
                        pr.out_size.saturating_sub(max as u64),
                        pr.err_size.saturating_sub(max as u64),
                    );
                    let bytes = (pr.stdout.len() + pr.stderr.len()) as u64;
                    let changed = pr.apply(&mut job, b.clock());
                    let j2 = job.clone();
                    let mut done = Done::new((job, pr, from)).no_touch().bytes(Some(bytes));
                    if changed {
                        done = done.persist(move |txn| save_job(txn, &j2));
                    }
                    Ok(done)
                },
            )
            .await?;
        Ok(JobTail {
            job: JobAnswer::new(
                &job,
                self.executor(&lease.backend),
                &lease.sandbox_ref,
                &ctx.request_id,
            ),
            tenant: lease.tenant,
            stdout: pr.stdout,
            stderr: pr.stderr,
            stdout_from: from.0,
            stderr_from: from.1,
            stdout_size: pr.out_size,
            stderr_size: pr.err_size,
        })
    }

    /// `GET|POST /v1/jobs/{ref}/status`.
    pub async fn job_status(&self, p: &Principal, ctx: &Ctx, job_ref: &str) -> Result<JobAnswer> {
        let (job, lease, _) = self
            .job_read(p, ctx, job_ref, Action::JobStatus, (0, 0), (0, 0))
            .await?;
        Ok(JobAnswer::new(
            &job,
            self.executor(&lease.backend),
            &lease.sandbox_ref,
            &ctx.request_id,
        ))
    }

    /// `POST /v1/jobs/{ref}/output`: the reference's fragment paging, or
    /// per-stream cursors.
    pub async fn job_output(
        &self,
        p: &Principal,
        ctx: &Ctx,
        job_ref: &str,
        req: OutputRequest,
    ) -> Result<dto::JobOutput> {
        match req {
            OutputRequest::Fragment { offset, max_bytes } => {
                let (job, lease, pr) = self
                    .job_read(
                        p,
                        ctx,
                        job_ref,
                        Action::JobOutput,
                        (0, COMPAT_LIMIT),
                        (0, COMPAT_LIMIT),
                    )
                    .await?;
                let fragment = format!(
                    "{{\"stdout\":{},\"stderr\":{}}}",
                    Value::String(String::from_utf8_lossy(&pr.stdout).into_owned()),
                    Value::String(String::from_utf8_lossy(&pr.stderr).into_owned()),
                );
                let bytes = fragment.as_bytes();
                let start = usize::try_from(offset)
                    .unwrap_or(usize::MAX)
                    .min(bytes.len());
                let end = start.saturating_add(max_bytes).min(bytes.len());
                let chunk = bytes.get(start..end).unwrap_or_default();
                // As in the reference, the fragment holds the first MiB of
                // each stream; say so when there is more (use the cursors).
                let limit = COMPAT_LIMIT as u64;
                let a = JobAnswer::new(
                    &job,
                    self.executor(&lease.backend),
                    &lease.sandbox_ref,
                    &ctx.request_id,
                );
                Ok(dto::JobOutput::Fragment(dto::JobOutputFragment {
                    cancelled: a.cancelled,
                    created_at: a.created_at,
                    data: String::from_utf8_lossy(chunk).into_owned(),
                    encoding: OutputEncoding::JsonFragment,
                    eof: end >= bytes.len() && job.is_terminal(),
                    executor: a.executor,
                    exit_code: a.exit_code,
                    job_ref: a.job_ref,
                    lease_ref: a.lease_ref,
                    next_offset: end as u64,
                    offset,
                    request_id: a.request_id,
                    sandbox_ref: a.sandbox_ref,
                    state: a.state,
                    timed_out: a.timed_out,
                    truncated: pr.out_size > limit || pr.err_size > limit,
                    updated_at: a.updated_at,
                }))
            }
            OutputRequest::Cursors(c) => {
                let (job, lease, pr) = self
                    .job_read(
                        p,
                        ctx,
                        job_ref,
                        Action::JobOutput,
                        (c.stdout_offset, c.max_bytes),
                        (c.stderr_offset, c.max_bytes),
                    )
                    .await?;
                let (on, en) = (
                    c.stdout_offset + pr.stdout.len() as u64,
                    c.stderr_offset + pr.stderr.len() as u64,
                );
                // The state was read before the ranges: a job that had ended
                // then has all its output in the files.
                let eof = job.is_terminal() && on >= pr.out_size && en >= pr.err_size;
                let a = JobAnswer::new(
                    &job,
                    self.executor(&lease.backend),
                    &lease.sandbox_ref,
                    &ctx.request_id,
                );
                Ok(dto::JobOutput::Cursors(dto::JobOutputCursors {
                    cancelled: a.cancelled,
                    created_at: a.created_at,
                    eof,
                    executor: a.executor,
                    exit_code: a.exit_code,
                    job_ref: a.job_ref,
                    lease_ref: a.lease_ref,
                    request_id: a.request_id,
                    sandbox_ref: a.sandbox_ref,
                    state: a.state,
                    stderr_base64: B64.encode(&pr.stderr),
                    stderr_next_offset: en,
                    stderr_offset: c.stderr_offset,
                    stdout_base64: B64.encode(&pr.stdout),
                    stdout_next_offset: on,
                    stdout_offset: c.stdout_offset,
                    timed_out: a.timed_out,
                    updated_at: a.updated_at,
                }))
            }
        }
    }

    /// `POST /v1/jobs/{ref}/cancel`: end the job's process group.
    pub async fn cancel_job(&self, p: &Principal, ctx: &Ctx, job_ref: &str) -> Result<JobAnswer> {
        let ev = self.event(p, Action::JobCancel, ctx);
        self.authorize(p, "job:cancel", &ev).await?;
        let (job, lease) = self.owned_job(p, job_ref, &ev).await?;
        let jr = job.job_ref.clone();
        let (lease, job) = self
            .effect_on(
                p,
                ctx,
                lease,
                Action::JobCancel,
                |e| e.job_ref = Some(jr),
                None,
                move |b: Broker, _l: Lease, addr| async move {
                    let mut job = job;
                    if !job.is_terminal() {
                        // bash: its `kill` takes `--` before a process group.
                        let mut o = StartOptions {
                            cmd: "/bin/bash".into(),
                            args: vec!["-c".into(), CANCEL.into()],
                            timeout: Some(Duration::from_secs(30)),
                            ..Default::default()
                        };
                        o.envs.insert("J".into(), job.job_ref.clone());
                        match addr.cube.run(&addr, &o, 4096).await {
                            // Signalled, or to be by the runner as it starts.
                            Ok(r) if r.exit_code == 0 || r.exit_code == 4 => job.cancelled = true,
                            Ok(_) => {}
                            Err(e) if e.kind == ErrorKind::NotFound => {}
                            Err(e) => return Err(backend(&e)),
                        }
                        // Wait (briefly) for the runner to record the end.
                        for _ in 0..30 {
                            let pr = probe(&b, &addr, &job, (0, 0), (0, 0)).await?;
                            pr.apply(&mut job, b.clock());
                            if job.is_terminal() {
                                break;
                            }
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                        job.updated_at = b.now().0;
                    }
                    let j2 = job.clone();
                    Ok(Done::new(job).persist(move |txn| save_job(txn, &j2)))
                },
            )
            .await?;
        Ok(JobAnswer::new(
            &job,
            self.executor(&lease.backend),
            &lease.sandbox_ref,
            &ctx.request_id,
        ))
    }

    /// `GET /v1/jobs/{ref}/recover`: where the job is and what state it is
    /// in, after a restart or a lost connection.
    pub async fn recover_job(
        &self,
        p: &Principal,
        ctx: &Ctx,
        job_ref: &str,
    ) -> Result<dto::JobRecovery> {
        let (job, lease, pr) = self
            .job_read(p, ctx, job_ref, Action::JobRecover, (0, 0), (0, 0))
            .await?;
        let a = JobAnswer::new(
            &job,
            self.executor(&lease.backend),
            &lease.sandbox_ref,
            &ctx.request_id,
        );
        Ok(dto::JobRecovery {
            cancelled: a.cancelled,
            created_at: a.created_at,
            executor: a.executor,
            exit_code: a.exit_code,
            job_ref: a.job_ref,
            lease_ref: a.lease_ref,
            recoverable: job.state != JobState::Lost,
            request_id: a.request_id,
            sandbox_ref: a.sandbox_ref,
            state: a.state,
            stderr_bytes: pr.err_size,
            stdout_bytes: pr.out_size,
            timed_out: a.timed_out,
            updated_at: a.updated_at,
        })
    }

    /// The jobs of a lease as status shows them (stored states).
    pub(crate) fn jobs_summary(&self, lease_ref: &str) -> Result<Vec<dto::JobSummary>> {
        let jobs = self
            .inner
            .store
            .read_now(|txn| lease_jobs(txn, lease_ref))?;
        Ok(jobs.iter().map(dto::JobSummary::from).collect())
    }

    /// One poll for the event stream: the job and the new output from the
    /// cursors (not audited on its own: the stream's opening is).
    pub(crate) async fn job_poll(
        &self,
        job_ref: &str,
        c: Cursors,
    ) -> Result<(Job, String, Vec<u8>, Vec<u8>, bool)> {
        let job = self
            .get_job(job_ref)
            .await?
            .ok_or_else(|| Error::new(Code::JobNotFound, "no such job"))?;
        let lease = self
            .get_lease(&job.lease_ref)
            .await?
            .ok_or_else(|| Error::new(Code::JobNotFound, "no such job"))?;
        let addr = self.addr(&lease)?;
        let mut job = job;
        let pr = probe(
            self,
            &addr,
            &job,
            (c.stdout_offset, c.max_bytes),
            (c.stderr_offset, c.max_bytes),
        )
        .await?;
        if pr.apply(&mut job, self.clock()) {
            let j2 = job.clone();
            self.inner
                .store
                .write(move |txn, _| save_job(txn, &j2))
                .await?;
        }
        let on = c.stdout_offset + pr.stdout.len() as u64;
        let en = c.stderr_offset + pr.stderr.len() as u64;
        let drained = on >= pr.out_size && en >= pr.err_size;
        Ok((job, lease.sandbox_ref, pr.stdout, pr.stderr, drained))
    }

    /// At start: go on with the recordings of jobs the previous run was
    /// recording (a job still running is followed again; one that ended
    /// is caught up with and sealed). Output written while the appliance
    /// was down is recorded when it is read, each stream in order.
    pub(crate) async fn resume_job_recordings(&self) {
        for rec in self.open_recordings() {
            if rec.kind != RecordingKind::Job {
                continue;
            }
            let lease = self.get_lease(&rec.lease_ref).await.ok().flatten();
            let job = self.get_job(&rec.subject).await.ok().flatten();
            let path = self.inner.recordings.path(&rec);
            let id = rec.recording_ref.clone();
            let r = match self.reopen_recording(rec, lease.as_ref()).await {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!(recording = %id, error = %e, "cannot reopen a job's recording");
                    continue;
                }
            };
            let n = path
                .and_then(|p| std::fs::read(p).ok())
                .map(|f| super::recordings::stream_bytes(&f))
                .unwrap_or_default();
            r.marker("the appliance restarted; what the job wrote while it was down follows, each stream in order")
                .await;
            match (lease, job) {
                (Some(l), Some(j)) => self.follow_job(l, j, r, (n[0], n[1])),
                _ => {
                    r.finish().await;
                }
            }
        }
    }

    /// Record a job's output as it is written, from `from` (bytes of
    /// stdout and stderr already recorded): its two files are read past
    /// what is recorded (`GET /files` with a `Range`: raw bytes, no process
    /// in the sandbox) every `FOLLOW_POLL` while output flows; after
    /// `FOLLOW_QUIET` without any, a waker in the sandbox (`WAKE`) waits
    /// for the next write or the runner's end. Once the runner has ended,
    /// what is left is read and the recording sealed. At a shutdown the
    /// recording stays open (the next start goes on with it).
    pub(crate) fn follow_job(&self, l: Lease, job: Job, rec: Recorder, from: (u64, u64)) {
        let b = self.clone();
        tokio::spawn(async move {
            let mut at = from;
            let (mut wake_fails, mut read_fails) = (0u32, 0u32);
            'follow: loop {
                if b.inner.tracker.is_closed() {
                    return;
                }
                let Ok(addr) = b.addr(&l) else {
                    break;
                };
                // Read while there is output; a short quiet spell is waited
                // out by polling, a longer one by the waker (if there is one).
                let no_waker = wake_fails >= 3;
                let mut quiet = Duration::ZERO;
                loop {
                    match read_new(&addr, &job, &mut at, &rec).await {
                        Ok(true) => quiet = Duration::ZERO,
                        Ok(false) if no_waker || quiet >= FOLLOW_QUIET => break,
                        Ok(false) => {
                            tokio::time::sleep(FOLLOW_POLL).await;
                            quiet += FOLLOW_POLL;
                        }
                        Err(e) => {
                            // The sandbox gone, or its files unreadable:
                            // while the job runs, try again for a while.
                            tokio::time::sleep(FOLLOW_SLOW_POLL).await;
                            let running = probe(&b, &addr, &job, (at.0, 0), (at.1, 0))
                                .await
                                .is_ok_and(|p| p.kind == "running");
                            if !running {
                                break 'follow;
                            }
                            read_fails += 1;
                            if read_fails > 30 {
                                tracing::warn!(job = %job.job_ref, error = %e, "a job's recording cannot read its output");
                                rec.marker(&format!(
                                    "the job's output could not be read from here on: {e}"
                                ))
                                .await;
                                rec.finish().await;
                                return;
                            }
                            break;
                        }
                    }
                    read_fails = 0;
                    if b.inner.tracker.is_closed() {
                        return;
                    }
                }
                if no_waker {
                    // No waker here (busybox): poll, and ask whether the
                    // job still runs at each quiet spell.
                    let running = probe(&b, &addr, &job, (at.0, 0), (at.1, 0))
                        .await
                        .is_ok_and(|p| p.kind == "running");
                    if !running {
                        break;
                    }
                    tokio::time::sleep(FOLLOW_SLOW_POLL).await;
                    continue;
                }
                match wake(&addr, &job, at).await {
                    Some(0) => wake_fails = 0,
                    Some(3 | 10) => break,
                    _ => {
                        wake_fails += 1;
                        if b.inner.tracker.is_closed() {
                            return;
                        }
                        tokio::time::sleep(FOLLOW_POLL).await;
                    }
                }
            }
            // The runner has ended: read what is left, each stream in order.
            if let Ok(addr) = b.addr(&l) {
                while let Ok(true) = read_new(&addr, &job, &mut at, &rec).await {}
            }
            rec.finish().await;
        });
    }

    /// Open a job's event stream: authorize and audit once.
    pub async fn open_job_events(&self, p: &Principal, ctx: &Ctx, job_ref: &str) -> Result<Job> {
        let (job, _, _) = self
            .job_read(p, ctx, job_ref, Action::JobEvents, (0, 0), (0, 0))
            .await?;
        Ok(job)
    }
}
