//! `embedded-backend`: the embedded CubeSandbox-compatible backend on its
//! own (CubeAPI and envd on one port, sandboxes as namespaced process trees
//! on this host), until SIGTERM or SIGINT. Exit 2 for a bad template or API
//! key file, 1 when it fails at run time.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, ValueEnum};

use super::Exit;
use super::common::shutdown_signal;
use crate::embedded::{Isolation, Limits, TemplateConfig};

#[derive(Args)]
pub struct EmbeddedBackendArgs {
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:3000")]
    pub listen: SocketAddr,
    /// Directory for sandboxes, snapshots and certificates.
    #[arg(long)]
    pub state_dir: PathBuf,
    /// Serve plain HTTP without client certificates (loopback only).
    #[arg(long)]
    pub plain_http: bool,
    /// How sandboxes are isolated.
    #[arg(long, value_enum, default_value = "namespaces")]
    pub isolation: IsolationArg,
    /// Extra template: ID=ROOTFS_DIR (the built-in `host` template is the
    /// host's root, read-only). Repeatable.
    #[arg(long = "template", value_name = "ID=DIR")]
    pub templates: Vec<String>,
    /// Sandbox domain used in data-plane Host names.
    #[arg(long, default_value = "cube.local")]
    pub domain: String,
    /// File holding an API key that CubeAPI calls must present.
    #[arg(long)]
    pub api_key_file: Option<PathBuf>,
    /// Extra DNS names or IPs for the server certificate. Repeatable.
    #[arg(long = "server-name")]
    pub server_names: Vec<String>,
    /// Memory limit per sandbox, MiB.
    #[arg(long, default_value_t = 2048)]
    pub memory_mb: u64,
    /// Process limit per sandbox.
    #[arg(long, default_value_t = 512)]
    pub max_processes: u64,
    /// CPUs per sandbox where cgroups allow (0 = no limit).
    #[arg(long, default_value_t = 1.0)]
    pub cpus: f64,
    /// Behave as a real CubeSandbox does where this backend is otherwise
    /// kinder: 500 "error code 130404" for an unknown template, an idle
    /// clock that counts calls only when they end, X-API-Key forwarded to
    /// envd, deadline end-streams that kill only the direct process. For
    /// testing clients against production behaviour.
    #[arg(long)]
    pub faithful: bool,
    /// With --faithful: how long each pause takes, in milliseconds.
    #[arg(long, default_value_t = 0, requires = "faithful")]
    pub faithful_pause_ms: u64,
    /// With --faithful: report and behave as this older envd version
    /// (e.g. 0.5.1: no CloseStdin, multipart-only uploads).
    #[arg(long, requires = "faithful")]
    pub faithful_envd_version: Option<String>,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum IsolationArg {
    /// User, mount, pid, ipc, uts and network namespaces (default).
    Namespaces,
    /// No isolation at all: sandboxes are plain processes on this host.
    None,
}

pub fn run(args: EmbeddedBackendArgs) -> Exit {
    let EmbeddedBackendArgs {
        listen,
        state_dir,
        plain_http,
        isolation,
        templates,
        domain,
        api_key_file,
        server_names,
        memory_mb,
        max_processes,
        cpus,
        faithful,
        faithful_pause_ms,
        faithful_envd_version,
    } = args;
    let mut tpls = vec![];
    for t in templates {
        let Some((id, dir)) = t.split_once('=') else {
            eprintln!("error: --template takes ID=DIR, got '{t}'");
            return Exit::Usage;
        };
        if !crate::embedded::sandbox::valid_id(id) {
            eprintln!("error: template id '{id}' must be letters, digits and '-'");
            return Exit::Usage;
        }
        if crate::embedded::templates::BUILT_IN.contains(&id) {
            eprintln!("error: '{id}' is a built-in template; give yours another name");
            return Exit::Usage;
        }
        tpls.push(TemplateConfig {
            id: id.into(),
            rootfs: dir.into(),
        });
    }
    let api_key = match api_key_file {
        Some(f) => match std::fs::read_to_string(&f) {
            Ok(k) => Some(k.trim().to_string()),
            Err(e) => {
                eprintln!("error: cannot read {}: {e}", f.display());
                return Exit::Usage;
            }
        },
        None => None,
    };
    let launcher = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: cannot find this executable: {e}");
            return Exit::Failed;
        }
    };
    let opts = crate::standalone::Options {
        listen,
        state_dir,
        plain_http,
        isolation: match isolation {
            IsolationArg::Namespaces => Isolation::Namespaces,
            IsolationArg::None => Isolation::None,
        },
        templates: tpls,
        domain,
        api_key,
        server_names,
        limits: Limits {
            memory_mb,
            max_processes,
            ..Limits::default()
        },
        cpus,
        launcher,
        faithful: faithful.then(|| crate::embedded::sandbox::Faithful {
            pause_delay: std::time::Duration::from_millis(faithful_pause_ms),
            envd_version: faithful_envd_version,
        }),
    };
    if let Err(e) = crate::app::enter_subordinate_ids(opts.isolation) {
        eprintln!("error: {e}");
        return Exit::Failed;
    }
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return Exit::Failed;
        }
    };
    let result = rt.block_on(crate::standalone::run(
        opts,
        |s| {
            println!("cube-adapter embedded backend listening on {}", s.url);
            if let (Some(ca), Some(c), Some(k)) = (&s.ca_file, &s.client_cert, &s.client_key) {
                println!("  CA certificate:     {}", ca.display());
                if let Some(fp) = &s.ca_fingerprint {
                    println!("  CA SHA-256:         {fp}");
                }
                println!("  client certificate: {}", c.display());
                println!("  client key:         {}", k.display());
            }
        },
        shutdown_signal(),
    ));
    match result {
        Ok(()) => Exit::Ok,
        Err(e) => {
            eprintln!("error: {e:#}");
            Exit::Failed
        }
    }
}
