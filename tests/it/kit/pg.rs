//! Real PostgreSQL servers and haproxy for the integration tests.
//!
//! `Postgres::start` makes a fresh cluster in a temp dir, owned by the
//! unprivileged `postgres` user when the tests run as root (postgres refuses
//! to run as root), listening on 127.0.0.1 on a free port, with fsync on so
//! crash tests see real durability. Each test gets its own cluster, so tests
//! run in parallel threads without sharing state. `Haproxy::start_tcp` puts
//! a TCP proxy with health checks in front of backends, for failover tests.
//! What they need (the PostgreSQL server binaries, haproxy, the postgres
//! user) fails loudly when missing: nothing here skips.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::thread::sleep;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::{Gid, Pid, Uid, User};

/// How long a server may take to accept connections (start, crash recovery).
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// A PostgreSQL cluster of its own, stopped and removed on drop.
pub struct Postgres {
    pub port: u16,
    /// Holds the data directory (`data/`), the unix socket, the server log
    /// (`server.log`) and the password file; removed on drop.
    pub dir: tempfile::TempDir,
    bin: PathBuf,
    owner: Option<(Uid, Gid)>,
    password: String,
    postmaster: Mutex<Option<Child>>,
}

impl Postgres {
    /// A fresh cluster, accepting connections, with a role `cube` (password
    /// in `password_file()`) owning a database `cube`.
    pub fn start() -> Postgres {
        let bin = pg_bin();
        let owner = unprivileged_owner();
        let dir = tempfile::Builder::new()
            .prefix("cube-pg-")
            .tempdir()
            .expect("creating the cluster's temp dir");
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o700)).unwrap();
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::chown(dir.path(), Some(uid.as_raw()), Some(gid.as_raw())).unwrap();
        }
        let data = dir.path().join("data");
        let out = as_owner(Command::new(bin.join("initdb")), owner, dir.path())
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C"])
            // The fresh cluster's files need no fsync: a crash test kills
            // the server, not the machine. The server itself runs with
            // fsync on.
            .args(["--no-sync", "--no-instructions"])
            .output()
            .expect("running initdb");
        assert!(
            out.status.success(),
            "initdb failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let mut conf = fs::OpenOptions::new()
            .append(true)
            .open(data.join("postgresql.conf"))
            .unwrap();
        write!(
            conf,
            "\n# cube-adapter test kit\n\
             listen_addresses = '127.0.0.1'\n\
             unix_socket_directories = '{}'\n\
             fsync = on\n\
             synchronous_commit = on\n\
             full_page_writes = on\n\
             shared_buffers = 16MB\n\
             max_connections = 200\n\
             password_encryption = 'scram-sha-256'\n\
             log_line_prefix = '%m [%p] '\n",
            dir.path().display()
        )
        .unwrap();
        fs::write(
            data.join("pg_hba.conf"),
            "local all all trust\nhost all all 127.0.0.1/32 scram-sha-256\n",
        )
        .unwrap();

        let password = random_hex(16);
        let password_file = dir.path().join("password");
        fs::write(&password_file, format!("{password}\n")).unwrap();
        fs::set_permissions(&password_file, fs::Permissions::from_mode(0o600)).unwrap();

        let mut pg = Postgres {
            port: 0,
            dir,
            bin,
            owner,
            password,
            postmaster: Mutex::new(None),
        };
        // A free port can be taken by someone else between finding it and
        // binding it (tests start servers in parallel): try another.
        let mut tries = 0;
        loop {
            pg.port = free_port();
            match pg.launch() {
                Ok(()) => break,
                Err(log) if log.contains("Address already in use") && tries < 10 => tries += 1,
                Err(log) => panic!("postgres did not start:\n{log}"),
            }
        }
        pg.psql(&format!(
            "CREATE ROLE cube LOGIN PASSWORD '{}'",
            pg.password
        ));
        pg.psql("CREATE DATABASE cube OWNER cube");
        pg
    }

    /// `postgres://cube@127.0.0.1:PORT/cube`, without the password.
    pub fn url(&self) -> String {
        format!("postgres://cube@127.0.0.1:{}/cube", self.port)
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port))
    }

    /// A 0600 file holding the role `cube`'s password and a newline.
    pub fn password_file(&self) -> PathBuf {
        self.dir.path().join("password")
    }

    /// The role `cube`'s password (to check it leaks nowhere).
    pub fn password(&self) -> &str {
        &self.password
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    /// A clean shutdown (`pg_ctl stop -m fast`): sessions are ended, then
    /// the server checkpoints and exits.
    pub fn stop(&self) {
        let mut postmaster = self.postmaster.lock().unwrap();
        let Some(mut child) = postmaster.take() else {
            return;
        };
        let out = as_owner(
            Command::new(self.bin.join("pg_ctl")),
            self.owner,
            self.dir.path(),
        )
        .arg("-D")
        .arg(self.data())
        .args(["stop", "-m", "fast", "-w", "-t", "30"])
        .output()
        .expect("running pg_ctl");
        assert!(
            out.status.success(),
            "pg_ctl stop failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        child.wait().unwrap();
    }

    /// A crash: SIGKILL to the postmaster and to every backend, as when the
    /// machine or container dies (killing only the postmaster leaves its
    /// backends running until they notice). Returns once they are gone.
    pub fn kill(&self) {
        let mut postmaster = self.postmaster.lock().unwrap();
        if let Some(mut child) = postmaster.take() {
            crash(&mut child);
        }
    }

    /// Starts the server again on the same port and data directory (after
    /// `stop` or `kill`; crash recovery included) and waits until it
    /// accepts connections.
    pub fn restart(&self) {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            match self.launch() {
                Ok(()) => return,
                // Just after a crash the old shared memory or the port can
                // still be held for a moment.
                Err(_) if Instant::now() < deadline => sleep(Duration::from_millis(200)),
                Err(log) => panic!("postgres did not restart:\n{log}"),
            }
        }
    }

    /// Runs SQL as the superuser over the unix socket (in database
    /// `postgres`), each statement on its own, and returns what it printed
    /// (`-At`: unaligned, tuples only, no trailing newline). Panics on error.
    pub fn psql(&self, sql: &str) -> String {
        self.psql_in("postgres", sql)
    }

    /// `psql` in another database (e.g. `cube`).
    pub fn psql_in(&self, db: &str, sql: &str) -> String {
        let mut child = Command::new(self.bin.join("psql"))
            .args(["-X", "-q", "-At", "-v", "ON_ERROR_STOP=1", "-h"])
            .arg(self.dir.path())
            .args([
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
                "-d",
                db,
                "-f",
                "-",
            ])
            .env_remove("PGOPTIONS")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("running psql");
        child
            .stdin
            .take()
            .unwrap()
            .write_all(sql.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "psql failed on {sql:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        text.strip_suffix('\n').unwrap_or(&text).to_owned()
    }

    /// Turns TLS on (both PEM strings: the server's certificate chain and
    /// its key) and waits until new sessions use it. Plain connections are
    /// still accepted; `sslmode` decides.
    pub fn enable_tls(&self, cert_pem: &str, key_pem: &str) {
        let cert = self.dir.path().join("server.crt");
        let key = self.dir.path().join("server.key");
        fs::write(&cert, cert_pem).unwrap();
        fs::write(&key, key_pem).unwrap();
        for file in [&cert, &key] {
            fs::set_permissions(file, fs::Permissions::from_mode(0o600)).unwrap();
            if let Some((uid, gid)) = self.owner {
                std::os::unix::fs::chown(file, Some(uid.as_raw()), Some(gid.as_raw())).unwrap();
            }
        }
        self.psql(&format!(
            "ALTER SYSTEM SET ssl_cert_file = '{}';\n\
             ALTER SYSTEM SET ssl_key_file = '{}';\n\
             ALTER SYSTEM SET ssl = on;\n\
             SELECT pg_reload_conf();",
            cert.display(),
            key.display()
        ));
        // The reload is asynchronous; a new session sees it once done.
        let deadline = Instant::now() + READY_TIMEOUT;
        while self.psql("SHOW ssl") != "on" {
            assert!(
                Instant::now() < deadline,
                "TLS did not turn on:\n{}",
                self.log()
            );
            sleep(Duration::from_millis(50));
        }
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// Spawns the postmaster and waits until it accepts connections; the
    /// new part of the log when it exits instead.
    fn launch(&self) -> Result<(), String> {
        let log_path = self.dir.path().join("server.log");
        let log_start = fs::metadata(&log_path).map(|m| m.len()).unwrap_or(0);
        let log = File::options()
            .create(true)
            .append(true)
            .open(&log_path)
            .unwrap();
        let mut child = as_owner(
            Command::new(self.bin.join("postgres")),
            self.owner,
            self.dir.path(),
        )
        .arg("-D")
        .arg(self.data())
        .args(["-p", &self.port.to_string()])
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("running postgres");
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if child.try_wait().unwrap().is_some() {
                let mut text = String::new();
                let mut file = File::open(&log_path).unwrap();
                std::io::Seek::seek(&mut file, std::io::SeekFrom::Start(log_start)).unwrap();
                file.read_to_string(&mut text).unwrap();
                return Err(text);
            }
            if self.ready() {
                *self.postmaster.lock().unwrap() = Some(child);
                return Ok(());
            }
            if Instant::now() > deadline {
                crash(&mut child);
                panic!(
                    "postgres did not accept connections within {READY_TIMEOUT:?}:\n{}",
                    self.log()
                );
            }
            sleep(Duration::from_millis(50));
        }
    }

    fn ready(&self) -> bool {
        Command::new(self.bin.join("pg_isready"))
            .args(["-q", "-h"])
            .arg(self.dir.path())
            .args([
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
                "-d",
                "postgres",
            ])
            .status()
            .expect("running pg_isready")
            .success()
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let Ok(mut postmaster) = self.postmaster.lock() else {
            return;
        };
        let Some(mut child) = postmaster.take() else {
            return;
        };
        // Immediate shutdown (SIGQUIT): no checkpoint, the data is thrown
        // away anyway. SIGKILL if it lingers.
        let pid = Pid::from_raw(child.id() as i32);
        let _ = kill(pid, Signal::SIGQUIT);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            sleep(Duration::from_millis(20));
        }
        crash(&mut child);
    }
}

/// SIGKILLs the postmaster and its children, reaps it, and waits until the
/// children are gone (they are reparented, possibly never reaped: a zombie
/// counts as gone, it holds no shared memory or socket).
fn crash(child: &mut Child) {
    let postmaster = child.id() as i32;
    let backends = children_of(postmaster);
    let _ = kill(Pid::from_raw(postmaster), Signal::SIGKILL);
    for pid in &backends {
        let _ = kill(Pid::from_raw(*pid), Signal::SIGKILL);
    }
    let _ = child.wait();
    let deadline = Instant::now() + Duration::from_secs(10);
    while backends.iter().any(|pid| alive(*pid)) && Instant::now() < deadline {
        sleep(Duration::from_millis(10));
    }
}

/// The pids whose parent is `parent`, from /proc.
fn children_of(parent: i32) -> Vec<i32> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| stat(*pid).is_some_and(|(_, ppid)| ppid == parent))
        .collect()
}

fn alive(pid: i32) -> bool {
    stat(pid).is_some_and(|(state, _)| state != 'Z' && state != 'X')
}

/// A process's state and parent, from /proc/PID/stat (after the `(comm)`,
/// which may hold spaces).
fn stat(pid: i32) -> Option<(char, i32)> {
    let text = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut fields = text.get(text.rfind(')')? + 1..)?.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    Some((state, ppid))
}

/// The newest /usr/lib/postgresql/VERSION/bin holding the server.
fn pg_bin() -> PathBuf {
    let root = Path::new("/usr/lib/postgresql");
    let newest = fs::read_dir(root).ok().and_then(|entries| {
        entries
            .filter_map(|e| {
                let e = e.ok()?;
                let version: u32 = e.file_name().to_str()?.parse().ok()?;
                let bin = e.path().join("bin");
                bin.join("postgres").is_file().then_some((version, bin))
            })
            .max_by_key(|(version, _)| *version)
    });
    match newest {
        Some((_, bin)) => bin,
        None => panic!(
            "no PostgreSQL server under /usr/lib/postgresql/*/bin: install postgresql \
             (apt-get install -y postgresql)"
        ),
    }
}

/// Who runs the server: the `postgres` user when we are root (postgres
/// refuses to run as root), ourselves otherwise.
fn unprivileged_owner() -> Option<(Uid, Gid)> {
    if !Uid::effective().is_root() {
        return None;
    }
    match User::from_name("postgres") {
        Ok(Some(user)) => Some((user.uid, user.gid)),
        _ => panic!(
            "the tests run as root and there is no `postgres` user to run the server as: \
             install postgresql (apt-get install -y postgresql)"
        ),
    }
}

fn as_owner(mut cmd: Command, owner: Option<(Uid, Gid)>, cwd: &Path) -> Command {
    if let Some((uid, gid)) = owner {
        // std drops the supplementary groups too when root sets a uid.
        cmd.uid(uid.as_raw()).gid(gid.as_raw());
    }
    cmd.current_dir(cwd).env("LC_ALL", "C").env_remove("PGDATA");
    cmd
}

/// A port free on 127.0.0.1 right now (bind port 0, then let it go).
pub fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .expect("binding 127.0.0.1:0")
        .port()
}

fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    File::open("/dev/urandom")
        .unwrap()
        .read_exact(&mut buf)
        .unwrap();
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

/// haproxy in TCP mode in front of some backends, stopped on drop.
pub struct Haproxy {
    pub port: u16,
    dir: tempfile::TempDir,
    child: Child,
}

impl Haproxy {
    /// Round-robin over `backends`, each health-checked by a TCP connect
    /// every 500 ms: down after one failed check, up after one good one.
    /// A backend marked down has its sessions cut (as a failover setup
    /// does), so clients notice at once. TLS passes through untouched.
    pub fn start_tcp(backends: &[SocketAddr]) -> Haproxy {
        let bin = Path::new("/usr/sbin/haproxy");
        assert!(
            bin.is_file(),
            "no /usr/sbin/haproxy: install haproxy (apt-get install -y haproxy)"
        );
        let dir = tempfile::Builder::new()
            .prefix("cube-haproxy-")
            .tempdir()
            .unwrap();
        let servers: String = backends
            .iter()
            .enumerate()
            .map(|(i, addr)| {
                format!(
                    "    server s{i} {addr} check inter 500ms fall 1 rise 1 \
                     on-marked-down shutdown-sessions\n"
                )
            })
            .collect();
        let mut tries = 0;
        loop {
            let port = free_port();
            let config = dir.path().join("haproxy.cfg");
            fs::write(
                &config,
                format!(
                    "global\n    maxconn 4096\n\
                     defaults\n    mode tcp\n    timeout connect 1s\n    timeout client 1h\n    \
                     timeout server 1h\n    timeout check 1s\n\
                     frontend front\n    bind 127.0.0.1:{port}\n    default_backend back\n\
                     backend back\n    balance roundrobin\n{servers}"
                ),
            )
            .unwrap();
            let log_path = dir.path().join("haproxy.log");
            let log = File::create(&log_path).unwrap();
            let mut child = Command::new(bin)
                .arg("-db")
                .arg("-f")
                .arg(&config)
                .stdin(Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .expect("running haproxy");
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                if child.try_wait().unwrap().is_some() {
                    let log = fs::read_to_string(&log_path).unwrap_or_default();
                    if log.contains("cannot bind") && tries < 10 {
                        tries += 1;
                        break;
                    }
                    panic!("haproxy exited:\n{log}");
                }
                if TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_ok() {
                    return Haproxy { port, dir, child };
                }
                if Instant::now() > deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!(
                        "haproxy did not listen within 10 s:\n{}",
                        fs::read_to_string(&log_path).unwrap_or_default()
                    );
                }
                sleep(Duration::from_millis(20));
            }
        }
    }

    /// haproxy's output so far (its warnings, backends going up and down).
    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join("haproxy.log")).unwrap_or_default()
    }
}

impl Drop for Haproxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
