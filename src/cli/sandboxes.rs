//! `sandboxes list|kill` and `template add|list|remove`: the embedded
//! backend's sandboxes and templates as they are on this host, for an
//! operator. Sandboxes outlive the service by design, and
//! their own inits end only those whose idle timeout kills them
//! (docs/security.md, "Orphans"): these commands find and end the rest,
//! with the service running (list) or stopped (list and kill).

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};

use super::Exit;
use super::common::{Common, Reach, reach};
use crate::embedded::sandbox::{Manager, Meta};

#[derive(Subcommand)]
pub enum SandboxesCommand {
    /// The embedded backend's sandboxes: id, state, whether its processes
    /// run, when it started, template, idle timeout.
    ///
    /// Reads the backend's state directory ([embedded] state_dir, default
    /// STATE/embedded), with the service running or stopped; changes
    /// nothing. `dead` means its init has ended (a running backend removes
    /// such a sandbox within a second). Exit 0, or 3 when there is no state
    /// directory.
    #[command(after_help = super::EXIT_CODES)]
    List(ListArgs),
    /// End sandboxes of a stopped service: thaw them, end every process in
    /// them, remove their cgroups and files.
    ///
    /// Refused while the service runs (exit 3): release the lease through
    /// /v1, or let the service's GC end it. Give sandbox ids (or unique
    /// prefixes of 8 or more characters), or --all. Their leases, if the
    /// store still has them, are found gone at the next use (410
    /// `sandbox_gone`) and replaced at the session's next acquire.
    #[command(after_help = super::EXIT_CODES)]
    Kill(KillArgs),
    /// As root, before an unprivileged service starts: give its user the
    /// cgroups its sandboxes' limits need.
    ///
    /// On cgroup v1, makes `/sys/fs/cgroup/{pids,memory,cpu,freezer}/cube-adapter`
    /// and gives them to --owner (systemd delegates no v1 controller to an
    /// unprivileged service); on cgroup v2 there is nothing to do (the
    /// embedded drop-in's `Delegate=yes` gives the service its own cgroup).
    /// The embedded drop-in runs it (`ExecStartPre=+`). Exit 0, or 1 when a
    /// cgroup cannot be made or given, 2 when not run as root or the user
    /// does not exist.
    #[command(after_help = super::EXIT_CODES)]
    Prepare(PrepareArgs),
}

#[derive(Args)]
pub struct PrepareArgs {
    /// The user (and its primary group) the service runs as.
    #[arg(long, default_value = "cube-adapter")]
    pub owner: String,
}

pub fn prepare(a: PrepareArgs) -> Exit {
    if !nix::unistd::geteuid().is_root() {
        eprintln!(
            "error: sandboxes prepare must run as root (the drop-in runs it with ExecStartPre=+)"
        );
        return Exit::Usage;
    }
    let user = match nix::unistd::User::from_name(&a.owner) {
        Ok(Some(u)) => u,
        Ok(None) => {
            eprintln!("error: no user {}", a.owner);
            return Exit::Usage;
        }
        Err(e) => {
            eprintln!("error: cannot look up user {}: {e}", a.owner);
            return Exit::Usage;
        }
    };
    match crate::embedded::cgroup::prepare(user.uid, user.gid) {
        Ok(said) => {
            println!("{said}");
            Exit::Ok
        }
        Err(e) => {
            eprintln!("error: cannot prepare the sandboxes' cgroups: {e}");
            Exit::Failed
        }
    }
}

#[derive(Args)]
pub struct ListArgs {
    #[command(flatten)]
    pub common: Common,
    /// Print JSON lines, one sandbox each.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct KillArgs {
    #[command(flatten)]
    pub common: Common,
    /// Sandbox ids (or unique prefixes of 8 or more characters).
    #[arg(required_unless_present = "all", conflicts_with = "all")]
    pub ids: Vec<String>,
    /// Every sandbox of the state directory.
    #[arg(long)]
    pub all: bool,
}

/// One sandbox as its directory records it.
struct Found {
    meta: Meta,
    alive: bool,
}

/// The backend's state directory under this configuration.
fn backend_dir(common: &Common) -> Result<(PathBuf, crate::config::Config), Exit> {
    let cfg = common.load()?;
    // The sandboxes' files belong to their ids: under an unprivileged
    // service, only its user namespace may remove them.
    if let Err(e) = crate::app::enter_subordinate_ids(cfg.embedded.isolation) {
        eprintln!("error: {e}");
        return Err(Exit::Failed);
    }
    let state = cfg.state_dir.clone();
    if !state.exists() {
        eprintln!("error: no state directory at {}", state.display());
        return Err(Exit::State);
    }
    let dir = cfg
        .embedded
        .state_dir
        .clone()
        .unwrap_or_else(|| state.join("embedded"));
    Ok((dir, cfg))
}

fn found(dir: &Path) -> Vec<Found> {
    let mut v: Vec<Found> = std::fs::read_dir(dir.join("sandboxes"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("meta.json")).ok())
        .filter_map(|b| serde_json::from_slice::<Meta>(&b).ok())
        .map(|meta| Found {
            alive: meta.tree().init_alive(),
            meta,
        })
        .collect();
    v.sort_by(|a, b| (&a.meta.started_at, &a.meta.id).cmp(&(&b.meta.started_at, &b.meta.id)));
    v
}

pub fn list(a: ListArgs) -> Exit {
    let (dir, _) = match backend_dir(&a.common) {
        Ok(d) => d,
        Err(e) => return e,
    };
    let all = found(&dir);
    if a.json {
        for f in &all {
            let m = &f.meta;
            println!(
                "{}",
                serde_json::json!({
                    "sandbox_id": m.id,
                    "state": if f.alive { m.state.as_str() } else { "dead" },
                    "started_at": m.started_at,
                    "template_id": m.template_id,
                    "timeout_seconds": m.timeout_secs,
                    "on_timeout": if m.on_timeout_pause { "pause" } else { "kill" },
                    "init_pid": m.init.pid,
                })
            );
        }
        return Exit::Ok;
    }
    if all.is_empty() {
        println!("no sandboxes in {}", dir.display());
        return Exit::Ok;
    }
    println!(
        "{:<33} {:<8} {:<31} {:<12} TIMEOUT",
        "SANDBOX", "STATE", "STARTED", "TEMPLATE"
    );
    for f in &all {
        let m = &f.meta;
        let timeout = match m.timeout_secs {
            Some(t) => format!(
                "{t} s, then {}",
                if m.on_timeout_pause { "pause" } else { "kill" }
            ),
            None => "none".into(),
        };
        println!(
            "{:<33} {:<8} {:<31} {:<12} {timeout}",
            m.id,
            if f.alive { m.state.as_str() } else { "dead" },
            m.started_at,
            m.template_id,
        );
    }
    Exit::Ok
}

pub fn kill(a: KillArgs) -> Exit {
    let (dir, cfg) = match backend_dir(&a.common) {
        Ok(d) => d,
        Err(e) => return e,
    };
    if let Reach::Running(_) = reach(&cfg.state_dir) {
        eprintln!(
            "error: the service is running: release the lease through /v1 (or let its GC end \
             the sandbox); stop the service to kill sandboxes here"
        );
        return Exit::State;
    }
    let all = found(&dir);
    let mut chosen: Vec<String> = Vec::new();
    if a.all {
        chosen = all.iter().map(|f| f.meta.id.clone()).collect();
    } else {
        for want in &a.ids {
            let hits: Vec<&Found> = all
                .iter()
                .filter(|f| f.meta.id == *want || (want.len() >= 8 && f.meta.id.starts_with(want)))
                .collect();
            match hits.as_slice() {
                [one] => chosen.push(one.meta.id.clone()),
                [] => {
                    eprintln!("error: no sandbox {want} in {}", dir.display());
                    return Exit::Failed;
                }
                _ => {
                    eprintln!(
                        "error: {want} names {} sandboxes; give more of the id",
                        hits.len()
                    );
                    return Exit::Usage;
                }
            }
        }
    }
    if chosen.is_empty() {
        println!("no sandboxes in {}", dir.display());
        return Exit::Ok;
    }
    let launcher = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("cube-adapter"));
    let settings = crate::app::embedded_settings(&cfg, &cfg.state_dir, launcher);
    let manager = match Manager::open(settings) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("error: cannot open the embedded backend's state: {e}");
            return Exit::Failed;
        }
    };
    let rt = match super::common::runtime() {
        Ok(rt) => rt,
        Err(e) => return e,
    };
    let mut failed = 0;
    for id in &chosen {
        match rt.block_on(manager.kill(id)) {
            Ok(()) => println!("killed {id}"),
            // Its init had ended: opening the backend's state removed it.
            Err(crate::embedded::sandbox::BackendError::SandboxNotFound(_)) => {
                println!("removed {id} (it had ended)")
            }
            Err(e) => {
                failed += 1;
                eprintln!("error: {id}: {e}");
            }
        }
    }
    if failed > 0 { Exit::Failed } else { Exit::Ok }
}

#[derive(Subcommand)]
pub enum TemplateCommand {
    /// Import a root filesystem as a template of the embedded backend.
    ///
    /// --rootfs is a directory (copied) or an uncompressed tar archive (for
    /// example `mmdebstrap --variant=apt bookworm debian.tar`): directories,
    /// files and links are unpacked below the template's own root, never
    /// outside it; device nodes and FIFOs are passed over. Stored under the
    /// backend's state directory (templates/NAME); a running service offers
    /// it at once (`GET /templates`), and a profile uses it with
    /// `template = "NAME"`. Exit 2 for a bad name or one taken, 1 when the
    /// import fails (nothing is left of it).
    #[command(after_help = super::EXIT_CODES)]
    Add(TemplateAddArgs),
    /// The templates: built-in, imported and configured.
    #[command(after_help = super::EXIT_CODES)]
    List(TemplateListArgs),
    /// Remove an imported template. Refused (exit 1) while a sandbox uses it.
    #[command(after_help = super::EXIT_CODES)]
    Remove(TemplateRemoveArgs),
}

#[derive(Args)]
pub struct TemplateAddArgs {
    #[command(flatten)]
    pub common: Common,
    /// The template's name: 1 to 63 of a-z, 0-9, '.', '_', '-'.
    pub name: String,
    /// A directory, or an uncompressed tar archive, holding the root.
    #[arg(long)]
    pub rootfs: PathBuf,
}

#[derive(Args)]
pub struct TemplateListArgs {
    #[command(flatten)]
    pub common: Common,
}

#[derive(Args)]
pub struct TemplateRemoveArgs {
    #[command(flatten)]
    pub common: Common,
    pub name: String,
}

pub fn template_add(a: TemplateAddArgs) -> Exit {
    use crate::embedded::templates;
    let (dir, cfg) = match backend_dir(&a.common) {
        Ok(d) => d,
        Err(e) => return e,
    };
    if let Err(m) = templates::check_id(&a.name) {
        eprintln!("error: {m}");
        return Exit::Usage;
    }
    if cfg.embedded.templates.iter().any(|t| t.id == a.name) {
        eprintln!("error: template {} is in the configuration", a.name);
        return Exit::Usage;
    }
    if !a.rootfs.exists() {
        eprintln!("error: no such file or directory: {}", a.rootfs.display());
        return Exit::Usage;
    }
    match templates::import(&dir, &a.name, &a.rootfs, &crate::clock::now().0) {
        Ok(t) => {
            println!(
                "imported template {} ({} entries{}) into {}",
                t.id,
                t.entries,
                if t.skipped > 0 {
                    format!(
                        ", {} device nodes, FIFOs or unsafe paths passed over",
                        t.skipped
                    )
                } else {
                    String::new()
                },
                t.rootfs.display()
            );
            Exit::Ok
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            eprintln!("error: {e}");
            Exit::Usage
        }
        Err(e) => {
            eprintln!("error: importing {}: {e}", a.rootfs.display());
            Exit::Failed
        }
    }
}

pub fn template_list(a: TemplateListArgs) -> Exit {
    use crate::embedded::sandbox::{HOST_TEMPLATE, MINIMAL_TEMPLATE};
    let (dir, cfg) = match backend_dir(&a.common) {
        Ok(d) => d,
        Err(e) => return e,
    };
    println!("{:<24} {:<10} ROOT", "TEMPLATE", "FROM");
    println!(
        "{MINIMAL_TEMPLATE:<24} {:<10} the host's programs, libraries and a filtered /etc",
        "built-in"
    );
    println!(
        "{HOST_TEMPLATE:<24} {:<10} the host's whole root, read-only",
        "built-in"
    );
    for t in crate::embedded::templates::imported(&dir) {
        println!(
            "{:<24} {:<10} {} (from {}, {})",
            t.id,
            "imported",
            t.rootfs.display(),
            t.source,
            t.imported_at
        );
    }
    for t in &cfg.embedded.templates {
        let missing = if t.rootfs.is_dir() { "" } else { " (missing)" };
        println!(
            "{:<24} {:<10} {}{missing}",
            t.id,
            "config",
            t.rootfs.display()
        );
    }
    Exit::Ok
}

pub fn template_remove(a: TemplateRemoveArgs) -> Exit {
    let (dir, _) = match backend_dir(&a.common) {
        Ok(d) => d,
        Err(e) => return e,
    };
    let users: Vec<String> = found(&dir)
        .into_iter()
        .filter(|f| f.meta.template_id == a.name)
        .map(|f| f.meta.id)
        .collect();
    if !users.is_empty() {
        eprintln!(
            "error: template {} is in use by {} sandbox(es): {}",
            a.name,
            users.len(),
            users.join(", ")
        );
        return Exit::Failed;
    }
    match crate::embedded::templates::remove(&dir, &a.name) {
        Ok(()) => {
            println!("removed template {}", a.name);
            Exit::Ok
        }
        Err(e) => {
            eprintln!("error: {e}");
            Exit::Failed
        }
    }
}
