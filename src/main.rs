//! The `cube-adapter` command line. Everything else lives in the library.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use cube_adapter::embedded::{Isolation, Limits, TemplateConfig};

#[derive(Parser)]
#[command(
    name = "cube-adapter",
    version,
    about = "An appliance between AI coding agents and CubeSandbox sandboxes"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum IsolationArg {
    /// User, mount, pid, ipc, uts and network namespaces (default).
    Namespaces,
    /// No isolation at all: sandboxes are plain processes on this host.
    None,
}

#[derive(Subcommand)]
enum BenchCommand {
    /// The embedded backend through the cube client over mTLS: sandbox
    /// create → exec → kill cycles and exec round-trips on a live sandbox.
    Backend {
        /// Create/exec/kill cycles to time.
        #[arg(long, default_value_t = 100)]
        cycles: usize,
        /// Exec round-trips on one live sandbox.
        #[arg(long, default_value_t = 1000)]
        execs: usize,
        /// Also write the report as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum Command {
    /// Measure performance (prints p50/p90/p99/max; never a pass/fail test).
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Run the embedded CubeSandbox-compatible backend on its own.
    ///
    /// Speaks CubeAPI and (by Host, like CubeProxy) envd on one port. Sandboxes
    /// are namespaced process trees on this host: for a single host,
    /// evaluation and tests; production uses CubeSandbox. By default it serves
    /// HTTPS and requires a client certificate issued by its CA (files under
    /// STATE/tls); --plain-http serves plain HTTP on loopback only.
    EmbeddedBackend {
        /// Address to listen on (port 0 picks a free port).
        #[arg(long, default_value = "127.0.0.1:3000")]
        listen: SocketAddr,
        /// Directory for sandboxes, snapshots and certificates.
        #[arg(long)]
        state_dir: PathBuf,
        /// Serve plain HTTP without client certificates (loopback only).
        #[arg(long)]
        plain_http: bool,
        /// How sandboxes are isolated.
        #[arg(long, value_enum, default_value = "namespaces")]
        isolation: IsolationArg,
        /// Extra template: ID=ROOTFS_DIR (the built-in `host` template is the
        /// host's root, read-only). Repeatable.
        #[arg(long = "template", value_name = "ID=DIR")]
        templates: Vec<String>,
        /// Sandbox domain used in data-plane Host names.
        #[arg(long, default_value = "cube.local")]
        domain: String,
        /// File holding an API key that CubeAPI calls must present.
        #[arg(long)]
        api_key_file: Option<PathBuf>,
        /// Extra DNS names or IPs for the server certificate. Repeatable.
        #[arg(long = "server-name")]
        server_names: Vec<String>,
        /// Memory limit per sandbox, MiB.
        #[arg(long, default_value_t = 2048)]
        memory_mb: u64,
        /// Process limit per sandbox.
        #[arg(long, default_value_t = 512)]
        max_processes: u64,
        /// CPUs per sandbox where cgroups allow (0 = no limit).
        #[arg(long, default_value_t = 1.0)]
        cpus: f64,
    },
}

fn main() -> ExitCode {
    // Internal entry points run single-threaded, before anything else.
    let mut args = std::env::args_os();
    let _ = args.next();
    match args.next().as_deref().and_then(|a| a.to_str()) {
        Some("__sandbox-launch") => {
            let dir = args.next().map(PathBuf::from).unwrap_or_default();
            return exit(cube_adapter::embedded::launch::launcher_main(&dir));
        }
        Some("__probe-namespaces") => return exit(cube_adapter::embedded::launch::probe_main()),
        _ => {}
    }
    cube_adapter::tls::install_default_provider();
    let cli = Cli::parse();
    cube_adapter::telemetry::init();
    match cli.command {
        Command::Bench(BenchCommand::Backend {
            cycles,
            execs,
            json,
        }) => {
            let launcher = match std::env::current_exe() {
                Ok(p) => p,
                Err(e) => {
                    eprintln!("error: cannot find this executable: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let rt = match tokio::runtime::Runtime::new() {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("error: cannot start the runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let opts = cube_adapter::bench::BackendBench {
                cycles,
                execs,
                launcher,
            };
            match rt.block_on(cube_adapter::bench::backend(&opts)) {
                Ok(report) => {
                    println!("machine: {}", report.machine);
                    for r in &report.results {
                        println!("{}", r.line());
                    }
                    let text = serde_json::to_string_pretty(&report).unwrap_or_default();
                    if let Some(path) = json {
                        if let Err(e) = std::fs::write(&path, &text) {
                            eprintln!("error: cannot write {}: {e}", path.display());
                            return ExitCode::FAILURE;
                        }
                    } else {
                        println!("{text}");
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::EmbeddedBackend {
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
        } => {
            let mut tpls = vec![];
            for t in templates {
                let Some((id, dir)) = t.split_once('=') else {
                    eprintln!("error: --template takes ID=DIR, got '{t}'");
                    return ExitCode::from(2);
                };
                if !cube_adapter::embedded::sandbox::valid_id(id) {
                    eprintln!("error: template id '{id}' must be letters, digits and '-'");
                    return ExitCode::from(2);
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
                        return ExitCode::from(2);
                    }
                },
                None => None,
            };
            let launcher = match std::env::current_exe() {
                Ok(p) => p,
                Err(e) => {
                    eprintln!("error: cannot find this executable: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let opts = cube_adapter::standalone::Options {
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
            };
            let rt = match tokio::runtime::Runtime::new() {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("error: cannot start the runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let result = rt.block_on(cube_adapter::standalone::run(
                opts,
                |s| {
                    println!("cube-adapter embedded backend listening on {}", s.url);
                    if let (Some(ca), Some(c), Some(k)) =
                        (&s.ca_file, &s.client_cert, &s.client_key)
                    {
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
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

fn exit(code: i32) -> ExitCode {
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
