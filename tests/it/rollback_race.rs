//! A checkpoint rollback raced by the sandbox it restores.
//!
//! Rollback ends the sandbox's processes, clears its `/workspace`, `/tmp`
//! and `/root` on the host and copies the snapshot back into them, as root.
//! A sandbox process that survives the kill, and swaps a directory the
//! restore is filling for a symbolic link to a host directory, must not be
//! able to make the appliance create, chmod or chown anything there: link
//! targets are plain strings, so a sandbox can point one at any host path
//! even though it cannot write there itself.
//!
//! How the attack is built, and why:
//! - The backend runs as a separate process (`cube-adapter embedded-backend`
//!   on loopback, plain HTTP) so that it alone can be slowed: once the
//!   sandbox and its snapshot are made, the backend's pid goes into a cgroup
//!   of its own with a CPU quota of 2 ms every 10 ms (short periods: it
//!   stalls often, mid-operation). Sandboxes sit in their own cgroups and
//!   are started without a CPU limit, so the attacker runs at full speed
//!   while the appliance crawls. Without a writable cpu controller the test
//!   runs unslowed and says so.
//! - The attacker is a population of fork-and-exit chains: each generation
//!   does its swap work, forks its successor and exits, so a kill loop that
//!   lists the sandbox's processes and then signals them is a generation
//!   behind. Below a population of 200 a generation forks two, so chains a
//!   sweep did end are replaced by surviving siblings; the more processes
//!   there are, the longer each sweep takes and the more forks happen behind
//!   it. The chains are perl (a fork is a fraction of a millisecond, and
//!   `renameat2` and `symlink` are system calls, not programs); a slower bash
//!   version stands in on hosts without perl.
//! - The swap: every `/workspace/dNN` (and `dNN/sub`) that is a real
//!   directory is exchanged atomically (`RENAME_EXCHANGE`) with a fresh link
//!   to `outside`, a directory this test made on the host. Only real
//!   directories are swapped, never a missing name, so the restore gets to
//!   create them and is raced while it fills them; the name never goes
//!   missing, so a restore that follows links does not stop on ENOENT.
//! - `outside` (root-owned, mode 0755) holds files named like the
//!   snapshot's, as `/etc` would hold a `passwd` a snapshot also holds: a
//!   chmod or chown that follows a swapped link changes one of them, and a
//!   create through it adds a file. The snapshot has 12 directories of mode
//!   0777 with 32 files and a nested directory each, plus a symlink.
//! - Every attempt starts a fresh attacker, waits a varying 0-40 ms so the
//!   chains are mid-flight, and rolls back. After every attempt, `outside`
//!   must be exactly as it was (names, types, modes, owners, contents, link
//!   targets; walked without following links). A rollback that answers OK
//!   must have left only the sandbox's init and agent running and restored
//!   the workspace exactly; one that fails must fail as an API error (an
//!   HTTP status with a message: the raw endpoint is called so the status is
//!   seen as is, and a transport failure fails the test), and the sandbox
//!   must still run commands.
//! - Bounded: at most 200 attempts or 90 s of attempts, whichever comes
//!   first; at least 20 attempts (the code before the fix escaped in about
//!   one attempt in four: 20 clean ones by chance is 0.4%; an unloaded
//!   machine makes 100 or more) and one successful rollback are required,
//!   so neither a hang nor a rollback that always refuses passes.

use std::collections::BTreeMap;
use std::io::{BufRead, Read};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cube_adapter::cube::wire::CreateSandbox;
use cube_adapter::cube::{BackendConfig, CubeClient, SandboxAddr, StartOptions};
use tempfile::TempDir;

use crate::kit::{BIN, pids_in_ns};

const MB: usize = 1024 * 1024;
/// Directories in the snapshot's workspace, `d00` …
const DIRS: usize = 12;
/// Files in each of them (plus `sub/` with `SUB_FILES`).
const FILES: usize = 32;
const SUB_FILES: usize = 4;
/// Fork-and-exit chains each attacker starts with.
const CHAINS: usize = 16;
/// Processes the chains grow to (they branch below it): the more there are,
/// the longer a kill sweep takes, the more chains fork behind it.
const POPULATION: usize = 200;
/// The sandbox's process limit (killed processes count until reaped).
const MAX_PROCS: usize = 4096;
const MAX_ATTEMPTS: usize = 200;
/// Rollback attempts start within this much time, and go on past it
/// until `MIN_ATTEMPTS` have run (a loaded machine is slower, not a
/// reason to fail), up to `HARD_CAP`.
const BUDGET: Duration = Duration::from_secs(90);
const HARD_CAP: Duration = Duration::from_secs(300);
const MIN_ATTEMPTS: usize = 20;
/// The backend's CPU: `QUOTA_US` every `PERIOD_US`.
const QUOTA_US: u64 = 2_000;
const PERIOD_US: u64 = 10_000;
/// Longest a single rollback may take to answer.
const CALL_TIMEOUT: Duration = Duration::from_secs(45);
const DOMAIN: &str = "cube.test";

/// One fork-and-exit chain, in perl. `OUTSIDE` is the host directory to
/// point links at, `NDIRS` the number of `/workspace/dNN` directories,
/// `RENAMEAT2` the system call number for an atomic exchange (0: rename,
/// then link). Each generation swaps what it finds, forks its successor and
/// exits. While the host has fewer than `LIMIT` processes (the link count
/// of `/proc`, one cheap call; zombies count too) it forks two, so the
/// chains grow to a population and chains a kill sweep ended are replaced
/// by their surviving siblings.
const CHAIN_PERL: &str = r#"
my ($out, $n, $limit, $nr, $k) = ($ENV{OUTSIDE}, $ENV{NDIRS}, $ENV{LIMIT}, $ENV{RENAMEAT2}, 0);
my @d = map { sprintf "/workspace/d%02d", $_ } 0 .. $n - 1;
sub swap {
    my ($p, $aside) = @_;
    if ($nr) {
        # renameat2(AT_FDCWD, aside, AT_FDCWD, p, RENAME_EXCHANGE): p is
        # never missing, so the restore never stops on ENOENT.
        symlink($out, $aside) or return;
        syscall($nr, -100, $aside, -100, $p, 2) == 0 or unlink $aside;
    } else {
        rename($p, $aside) and symlink($out, $p);
    }
}
for (;;) {
    for my $d (@d) {
        next unless lstat($d) && -d _;
        swap("$d/sub", "$d/.y$$." . $k++) if lstat("$d/sub") && -d _;
        swap($d, "/workspace/.x$$." . $k++);
    }
    my $kids = 0;
    for (1 .. ((stat "/proc")[3] < $limit ? 2 : 1)) {
        my $p = fork;
        if (defined $p && $p == 0) { $kids = -1; last }
        $kids++ if defined $p;
    }
    exit 0 if $kids > 0;
}
"#;

/// The same chain in bash, for hosts without perl.
const CHAIN_BASH: &str = r#"
f() {
    local d
    for d in $(eval echo /workspace/d{00..$((NDIRS - 1))}); do
        [[ -d $d && ! -L $d ]] || continue
        if [[ -d $d/sub && ! -L $d/sub ]]; then
            mv -T "$d/sub" "$d/.y$BASHPID.$RANDOM" 2>/dev/null && ln -sfT "$OUTSIDE" "$d/sub" 2>/dev/null
        fi
        mv -T "$d" "/workspace/.x$BASHPID.$RANDOM" 2>/dev/null && ln -sfT "$OUTSIDE" "$d" 2>/dev/null
    done
    (($(stat -c %h /proc) < LIMIT)) && f &
    f &
}
f
"#;

/// What one walk saw at a path (never following links).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    Dir,
    File(Vec<u8>),
    Link(PathBuf),
    Other(u32),
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    kind: Kind,
    mode: u32,
    uid: u32,
    gid: u32,
}

/// Relative path ("" for the root itself) to what is there.
type Tree = BTreeMap<PathBuf, Entry>;

/// Walk `root` with `lstat`, never following a link; files are opened with
/// `O_NOFOLLOW | O_NONBLOCK` and checked to be the file that was listed.
fn walk(root: &Path) -> std::io::Result<Tree> {
    let mut out = Tree::new();
    let mut todo = vec![PathBuf::new()];
    while let Some(rel) = todo.pop() {
        let path = if rel.as_os_str().is_empty() {
            root.to_path_buf()
        } else {
            root.join(&rel)
        };
        let md = std::fs::symlink_metadata(&path)?;
        let ft = md.file_type();
        let kind = if ft.is_symlink() {
            Kind::Link(std::fs::read_link(&path)?)
        } else if ft.is_dir() {
            for e in std::fs::read_dir(&path)? {
                todo.push(rel.join(e?.file_name()));
            }
            Kind::Dir
        } else if ft.is_file() {
            let mut f = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(
                    (nix::fcntl::OFlag::O_NOFOLLOW | nix::fcntl::OFlag::O_NONBLOCK).bits(),
                )
                .open(&path)?;
            let fmd = f.metadata()?;
            if (fmd.dev(), fmd.ino()) != (md.dev(), md.ino()) {
                return Err(std::io::Error::other(format!(
                    "{} changed while walking",
                    path.display()
                )));
            }
            let mut b = vec![];
            f.read_to_end(&mut b)?;
            Kind::File(b)
        } else {
            Kind::Other(md.mode() & 0o170000)
        };
        out.insert(
            rel,
            Entry {
                kind,
                mode: md.mode() & 0o7777,
                uid: md.uid(),
                gid: md.gid(),
            },
        );
    }
    Ok(out)
}

/// A short, readable account of how `now` differs from `want`.
fn diff(want: &Tree, now: &Tree) -> String {
    let show = |e: &Entry| {
        let k = match &e.kind {
            Kind::Dir => "dir".to_string(),
            Kind::File(b) => format!("file({} bytes)", b.len()),
            Kind::Link(t) => format!("link->{}", t.display()),
            Kind::Other(t) => format!("other({t:o})"),
        };
        format!("{k} mode {:o} owner {}:{}", e.mode, e.uid, e.gid)
    };
    let mut lines = vec![];
    let (mut added, mut removed, mut changed) = (0, 0, 0);
    for (p, e) in now {
        match want.get(p) {
            None => {
                added += 1;
                if lines.len() < 12 {
                    lines.push(format!("  + /{}: {}", p.display(), show(e)));
                }
            }
            Some(w) if w != e => {
                changed += 1;
                if lines.len() < 12 {
                    lines.push(format!(
                        "  ~ /{}: was {}, now {}",
                        p.display(),
                        show(w),
                        show(e)
                    ));
                }
            }
            Some(_) => {}
        }
    }
    for (p, w) in want {
        if !now.contains_key(p) {
            removed += 1;
            if lines.len() < 12 {
                lines.push(format!("  - /{}: {}", p.display(), show(w)));
            }
        }
    }
    format!(
        "{added} added, {removed} removed, {changed} changed:\n{}",
        lines.join("\n")
    )
}

/// A cgroup with a small CPU quota, holding the backend.
enum SlowGroup {
    V1(PathBuf),
    V2(PathBuf),
}

impl SlowGroup {
    /// Put `pid` into a new CPU-limited group, on cgroup v2 or v1.
    fn join(pid: u32) -> Result<Self, String> {
        let root = Path::new("/sys/fs/cgroup");
        let name = format!("cube-adapter-test-slow-{}", std::process::id());
        if root.join("cgroup.controllers").exists() {
            let d = root.join(&name);
            let _ = std::fs::remove_dir(&d);
            let r = (|| -> std::io::Result<()> {
                let ctl = std::fs::read_to_string(root.join("cgroup.subtree_control"))?;
                if !ctl.split_whitespace().any(|c| c == "cpu") {
                    std::fs::write(root.join("cgroup.subtree_control"), "+cpu")?;
                }
                std::fs::create_dir(&d)?;
                std::fs::write(d.join("cpu.max"), format!("{QUOTA_US} {PERIOD_US}"))?;
                std::fs::write(d.join("cgroup.procs"), pid.to_string())
            })();
            return match r {
                Ok(()) => Ok(Self::V2(d)),
                Err(e) => {
                    let _ = std::fs::remove_dir(&d);
                    Err(format!("cgroup v2 {}: {e}", d.display()))
                }
            };
        }
        let d = root.join("cpu").join(&name);
        let _ = std::fs::remove_dir(&d);
        let r = (|| -> std::io::Result<()> {
            std::fs::create_dir(&d)?;
            std::fs::write(d.join("cpu.cfs_period_us"), PERIOD_US.to_string())?;
            std::fs::write(d.join("cpu.cfs_quota_us"), QUOTA_US.to_string())?;
            std::fs::write(d.join("cgroup.procs"), pid.to_string())
        })();
        match r {
            Ok(()) => Ok(Self::V1(d)),
            Err(e) => {
                let _ = std::fs::remove_dir(&d);
                Err(format!("cgroup v1 {}: {e}", d.display()))
            }
        }
    }

    fn dir(&self) -> &Path {
        match self {
            Self::V1(d) | Self::V2(d) => d,
        }
    }
}

/// Remove a cgroup once its processes are gone (polls for a few seconds).
fn remove_group(dir: &Path) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::fs::remove_dir(dir).is_err() && dir.exists() {
        if Instant::now() > deadline {
            eprintln!("rollback_race: could not remove {}", dir.display());
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The standalone backend as a child process; killed (with its sandboxes)
/// on drop, also when the test panics.
struct Backend {
    child: Child,
    dir: TempDir,
    url: String,
    slow: Option<SlowGroup>,
}

impl Backend {
    fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut child = Command::new(BIN)
            .args([
                "embedded-backend",
                "--listen",
                "127.0.0.1:0",
                "--plain-http",
                "--domain",
                DOMAIN,
                // Sandboxes unthrottled: the attacker at full speed.
                "--cpus",
                "0",
                "--max-processes",
                &MAX_PROCS.to_string(),
                "--state-dir",
            ])
            .arg(dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        // Keep draining stdout so the backend never blocks on it.
        std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
        let url = line
            .trim()
            .rsplit(' ')
            .next()
            .unwrap_or_default()
            .to_string();
        let b = Self {
            child,
            dir,
            url,
            slow: None,
        };
        assert!(
            b.url.starts_with("http://127.0.0.1:"),
            "the backend did not say where it listens: {line:?}"
        );
        b
    }

    fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.dir.path().join("embedded/sandboxes").join(id)
    }

    /// The sandbox's init (host pid), as the launcher recorded it.
    fn init_pid(&self, id: &str) -> i32 {
        let b = std::fs::read(self.sandbox_dir(id).join("init.json")).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        v["pid"].as_i64().unwrap() as i32
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(g) = self.slow.take() {
            remove_group(g.dir());
        }
        // Sandboxes outlive their backend by design: end them (the kit
        // thaws and kills each init, which ends its pid namespace,
        // attackers included), then remove their cgroups.
        let sandboxes = self.dir.path().join("embedded/sandboxes");
        crate::kit::end_sandboxes(&sandboxes);
        for d in std::fs::read_dir(&sandboxes)
            .into_iter()
            .flatten()
            .flatten()
        {
            for h in ["", "pids", "memory", "cpu", "freezer"] {
                let g = Path::new("/sys/fs/cgroup")
                    .join(h)
                    .join("cube-adapter")
                    .join(d.file_name());
                if g.is_dir() {
                    remove_group(&g);
                }
            }
        }
    }
}

/// `POST /sandboxes/{id}/rollback` on the raw endpoint: `Ok` on success,
/// else the HTTP status and the error message. A transport failure (the
/// backend died or hung up) or a malformed answer fails the test.
async fn rollback(
    http: &reqwest::Client,
    url: &str,
    id: &str,
    snap: &str,
    attempt: usize,
) -> Result<(), (u16, String)> {
    let call = http
        .post(format!("{url}/sandboxes/{id}/rollback"))
        .json(&serde_json::json!({ "snapshotID": snap }))
        .send();
    let resp = tokio::time::timeout(CALL_TIMEOUT, call)
        .await
        .unwrap_or_else(|_| {
            panic!("attempt {attempt}: rollback gave no answer in {CALL_TIMEOUT:?}")
        })
        .unwrap_or_else(|e| panic!("attempt {attempt}: rollback failed in transport: {e}"));
    let status = resp.status();
    let body = resp
        .bytes()
        .await
        .unwrap_or_else(|e| panic!("attempt {attempt}: rollback answer cut short: {e}"));
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_else(|e| {
        panic!(
            "attempt {attempt}: rollback answered {status} with a non-JSON body ({e}): {}",
            String::from_utf8_lossy(&body)
        )
    });
    if status.is_success() {
        assert_eq!(v["status"], "READY", "attempt {attempt}: {v}");
        assert_eq!(v["sandboxID"], id, "attempt {attempt}: {v}");
        return Ok(());
    }
    Err((
        status.as_u16(),
        v["message"].as_str().unwrap_or_default().to_string(),
    ))
}

/// Build the snapshot's workspace: `DIRS` directories of mode 0777, each
/// with `FILES` files and `sub/` with `SUB_FILES`, and a symlink.
fn build_script() -> String {
    format!(
        r#"set -e
cd /workspace
for k in $(seq -w 0 {last}); do
    d=d$k
    mkdir -p $d/sub
    for i in $(seq -w 1 {FILES}); do printf '%s/f%s\n' $d $i > $d/f$i; done
    for i in $(seq 1 {SUB_FILES}); do printf '%s/sub/g%s\n' $d $i > $d/sub/g$i; done
    chmod 0600 $d/f01
    chmod 0755 $d/f02
    chmod 0777 $d $d/sub
done
ln -s /etc/hostname /workspace/link
echo built"#,
        last = DIRS - 1
    )
}

/// The attacker: `CHAINS` fork-and-exit chains started in the background
/// (perl if the sandbox has it, else bash) that grow to about `POPULATION`
/// processes of the sandbox (`LIMIT` is the host's count without the
/// sandbox's, plus that); the shell itself exits at once.
fn attacker(outside: &Path) -> StartOptions {
    let renameat2 = match std::env::consts::ARCH {
        "x86_64" => 316,
        "aarch64" | "riscv64" | "loongarch64" => 276,
        _ => 0,
    };
    let script = format!(
        r#"procs=(/proc/[0-9]*)
export LIMIT=$(($(stat -c %h /proc) - ${{#procs[@]}} + POP))
for i in $(seq {CHAINS}); do
    if command -v perl >/dev/null; then perl -e "$CHAIN_PERL"; else bash -c "$CHAIN_BASH"; fi </dev/null >/dev/null 2>&1 &
done"#
    );
    StartOptions {
        cmd: "/bin/bash".into(),
        args: vec!["-c".into(), script],
        envs: BTreeMap::from([
            ("OUTSIDE".into(), outside.to_str().unwrap().into()),
            ("NDIRS".into(), DIRS.to_string()),
            ("POP".into(), POPULATION.to_string()),
            ("RENAMEAT2".into(), renameat2.to_string()),
            ("CHAIN_PERL".into(), CHAIN_PERL.into()),
            ("CHAIN_BASH".into(), CHAIN_BASH.into()),
        ]),
        ..Default::default()
    }
}

/// `/proc/<pid>/cmdline` of each pid, for messages.
fn describe(pids: &[i32]) -> Vec<String> {
    pids.iter()
        .map(|p| {
            let c = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
            format!("{p}: {}", String::from_utf8_lossy(&c).replace('\0', " "))
        })
        .collect()
}

async fn run_ok(client: &CubeClient, sb: &SandboxAddr, cmd: &str) -> String {
    let out = client
        .run(sb, &StartOptions::shell(cmd), MB)
        .await
        .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert_eq!(out.exit_code, 0, "{cmd}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollback_never_writes_through_links_a_racing_sandbox_makes() {
    cube_adapter::tls::install_default_provider();
    let mut backend = Backend::start();
    let mut cfg = BackendConfig::new("race", backend.url.clone());
    cfg.domain = DOMAIN.into();
    let client = CubeClient::new(cfg).unwrap();
    let http = reqwest::Client::builder().no_proxy().build().unwrap();

    // The host directory the attacker points its links at. It holds files
    // named like the snapshot's (as /etc would hold a `passwd` a snapshot
    // also holds): a chmod or chown through a swapped link changes one of
    // them, a create through it adds a file.
    let host = tempfile::tempdir().unwrap();
    let outside = host.path().join("outside");
    std::fs::create_dir_all(outside.join("sub")).unwrap();
    for i in 1..=FILES {
        std::fs::write(outside.join(format!("f{i:02}")), format!("host f{i:02}\n")).unwrap();
    }
    for i in 1..=SUB_FILES {
        std::fs::write(outside.join(format!("sub/g{i}")), format!("host g{i}\n")).unwrap();
    }
    std::os::unix::fs::symlink("f01", outside.join("link")).unwrap();
    for p in ["", "sub"] {
        std::fs::set_permissions(outside.join(p), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let outside_before = walk(&outside).unwrap();
    assert_eq!(outside_before[Path::new("")].mode, 0o755);

    // The sandbox, its workspace and the snapshot (at full speed).
    let sb = client
        .create(&CreateSandbox {
            template_id: "host".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let sb = client.addr(&sb);
    assert_eq!(run_ok(&client, &sb, &build_script()).await, "built\n");
    let snap = client
        .create_snapshot(&sb.id, Some("race"))
        .await
        .unwrap()
        .snapshot_id;
    let workspace = backend.sandbox_dir(&sb.id).join("state/workspace");
    let mut expected = walk(&workspace).unwrap();
    // The workspace directory itself is kept, not restored.
    expected.remove(Path::new(""));
    assert_eq!(
        expected.len(),
        DIRS * (FILES + SUB_FILES + 2) + 1,
        "the workspace was built as planned"
    );
    assert!(
        matches!(&expected[Path::new("link")].kind, Kind::Link(t) if t == Path::new("/etc/hostname"))
    );
    assert_eq!(expected[Path::new("d03")].mode, 0o777);

    // Slow the backend down (its sandboxes keep their own cgroups).
    match SlowGroup::join(backend.child.id()) {
        Ok(g) => {
            eprintln!(
                "rollback_race: backend limited to {QUOTA_US}/{PERIOD_US} µs of CPU ({})",
                g.dir().display()
            );
            backend.slow = Some(g);
        }
        Err(e) => eprintln!("rollback_race: NOTE: running unslowed, no CPU-limited cgroup: {e}"),
    }

    let attack = attacker(&outside);
    let started = Instant::now();
    let (mut ok, mut failed) = (0usize, 0usize);
    let mut errors: BTreeMap<String, usize> = BTreeMap::new();
    let mut attempts = 0;
    while attempts < MAX_ATTEMPTS
        && (started.elapsed() < BUDGET || attempts < MIN_ATTEMPTS)
        && started.elapsed() < HARD_CAP
    {
        let i = attempts;
        attempts += 1;
        let init = backend.init_pid(&sb.id);
        let ns = std::fs::read_link(format!("/proc/{init}/ns/pid")).unwrap();
        // Keep the stream open: the attacker runs until the rollback.
        let _attacker = client
            .start(&sb, &attack)
            .await
            .unwrap_or_else(|e| panic!("attempt {i}: starting the attacker: {e}"));
        // Deliberately varied, not a readiness wait: where in its chains the
        // attacker is when the rollback lands.
        tokio::time::sleep(Duration::from_millis((i as u64 * 17) % 41)).await;
        let result = rollback(&http, &backend.url, &sb.id, &snap, i).await;

        // (a) The host directory never changes, whatever the rollback said.
        let now = walk(&outside).unwrap();
        assert!(
            now == outside_before,
            "attempt {i} (rollback {}): the host directory {} changed: {}",
            match &result {
                Ok(()) => "answered OK".to_string(),
                Err((s, m)) => format!("failed {s}: {m}"),
            },
            outside.display(),
            diff(&outside_before, &now)
        );

        match result {
            Ok(()) => {
                ok += 1;
                // (b) Only the init and the agent are left ...
                let left = pids_in_ns(&ns);
                assert_eq!(
                    left.len(),
                    2,
                    "attempt {i}: processes survived an OK rollback (init {init}): {:?}",
                    describe(&left)
                );
                // ... and the workspace is the snapshot's, exactly.
                let mut now = walk(&workspace)
                    .unwrap_or_else(|e| panic!("attempt {i}: walking the workspace: {e}"));
                now.remove(Path::new(""));
                assert!(
                    now == expected,
                    "attempt {i}: an OK rollback restored a different workspace: {}",
                    diff(&expected, &now)
                );
            }
            Err((status, message)) => {
                // (c) A clean refusal: an API error with a message, and the
                // sandbox still works.
                failed += 1;
                assert!(
                    (400..600).contains(&status) && status != 404,
                    "attempt {i}: rollback failed with HTTP {status}: {message}"
                );
                assert!(
                    !message.is_empty(),
                    "attempt {i}: rollback failed with HTTP {status} and no message"
                );
                *errors.entry(format!("{status} {message}")).or_default() += 1;
                assert_eq!(
                    run_ok(&client, &sb, "echo alive").await,
                    "alive\n",
                    "attempt {i}: the sandbox after a failed rollback"
                );
            }
        }
    }
    let took = started.elapsed();
    eprintln!(
        "rollback_race: {attempts} rollbacks in {:.1} s: {ok} OK, {failed} failed cleanly",
        took.as_secs_f64()
    );
    for (e, n) in &errors {
        eprintln!("rollback_race:   {n} x {e}");
    }
    assert!(
        attempts >= MIN_ATTEMPTS,
        "only {attempts} rollbacks in {took:?}; at least {MIN_ATTEMPTS} are needed to mean anything"
    );
    assert!(ok >= 1, "no rollback succeeded in {attempts} attempts");
    let _ = client.kill(&sb.id).await;
}
