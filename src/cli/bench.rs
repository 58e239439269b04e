//! `bench …`: performance measurements of the appliance, the journal and
//! the embedded backend (p50/p90/p99/max; never a pass/fail test). Exit 1
//! when a measurement cannot be taken.

use std::path::PathBuf;

use clap::Subcommand;

use super::Exit;
use crate::bench::{self, appliance};

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Every scenario below with its defaults, one after the other; with
    /// --json-dir, one JSON report per scenario.
    All {
        #[arg(long)]
        json_dir: Option<PathBuf>,
    },
    /// Added latency of the appliance: the same exec through /v1 and
    /// directly with the cube client, and what a durable commit costs.
    Overhead {
        #[arg(long, default_value_t = 300)]
        iterations: usize,
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// The audited exec with three audit sinks (file, HTTP, syslog)
    /// against none, on two appliances called alternately.
    Sinks {
        #[arg(long, default_value_t = 300)]
        iterations: usize,
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// acquire → exec → release(kill) cycles with 1, 16 and 64 agents.
    Cycle {
        #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
        concurrency: Vec<usize>,
        #[arg(long, default_value_t = 4)]
        cycles_per_agent: usize,
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Exec on existing leases with many concurrent agents.
    Hot {
        #[arg(long, default_value_t = 64)]
        agents: usize,
        #[arg(long, default_value_t = 30)]
        ops_per_agent: usize,
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Journal commits: group commit vs one fsync per event.
    Audit {
        #[arg(long, value_delimiter = ',', default_value = "1,64")]
        writers: Vec<usize>,
        #[arg(long, default_value_t = 200)]
        events_per_writer: usize,
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Job-output throughput: a job's stdout and stderr read to the end by
    /// per-stream cursors and by SSE.
    Jobs {
        /// MiB the job writes to each stream.
        #[arg(long, default_value_t = 32)]
        mib: usize,
        /// Full reads by each method.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Session recordings: this process's RSS while PTYs stream output
    /// with recording on and off, and a job's output throughput with and
    /// without recording.
    Recordings {
        /// PTYs streaming at once.
        #[arg(long, default_value_t = 16)]
        ptys: usize,
        /// MiB each PTY prints.
        #[arg(long, default_value_t = 10)]
        mib: usize,
        /// MiB the job writes to each stream.
        #[arg(long, default_value_t = 32)]
        job_mib: usize,
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Run the jobs' sandboxes on a CPU of their own, and the appliance
        /// on the others (as a CubeSandbox's sandboxes run on their own
        /// vCPUs, on another host).
        #[arg(long)]
        pin: bool,
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// RSS idle and with many live leases, and start-to-ready time, of a
    /// real `serve` process.
    Memory {
        #[arg(long, default_value_t = 1000)]
        leases: usize,
        #[arg(long, default_value_t = 10)]
        starts: usize,
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// RSS of a real `serve` process with many agents, each holding its
    /// own token and a lease, and after many failed HTTP Basic sign-ins
    /// with random names.
    Identities {
        #[arg(long, default_value_t = 1000)]
        tokens: usize,
        #[arg(long, default_value_t = 10_000)]
        sign_ins: usize,
        /// Sign-ins in flight at once.
        #[arg(long, default_value_t = 8)]
        concurrency: usize,
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// RSS of a real `serve` process while `audit export` streams a large
    /// journal through its admin socket, several times over.
    Export {
        #[arg(long, default_value_t = 1_000_000)]
        events: u64,
        #[arg(long, default_value_t = 3)]
        exports: usize,
        /// Agents making audited calls on leases of their own while the
        /// exports run (a soak under load: `--exports 100 --load 64`).
        #[arg(long, default_value_t = 0)]
        load: usize,
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// The web console of a real `serve` process on a long journal: server
    /// time of each page, audit searches by indexed fields, idle RSS with
    /// and without the console used.
    Console {
        /// Events in the journal while the pages are timed.
        #[arg(long, default_value_t = 100_000)]
        events: u64,
        /// Events in the journal while the searches are timed.
        #[arg(long, default_value_t = 1_000_000)]
        search_events: u64,
        /// Fetches of each page.
        #[arg(long, default_value_t = 200)]
        views: usize,
        /// Searches of each kind.
        #[arg(long, default_value_t = 50)]
        searches: usize,
        #[arg(long)]
        json: Option<PathBuf>,
    },
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

pub fn run(b: BenchCommand) -> Exit {
    let launcher = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: cannot find this executable: {e}");
            return Exit::Failed;
        }
    };
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return Exit::Failed;
        }
    };
    let (result, json) = match b {
        BenchCommand::All { json_dir } => {
            return match rt.block_on(bench::all(&launcher, json_dir.as_deref())) {
                Ok(()) => Exit::Ok,
                Err(e) => {
                    eprintln!("error: {e:#}");
                    Exit::Failed
                }
            };
        }
        BenchCommand::Backend {
            cycles,
            execs,
            json,
        } => {
            let opts = bench::BackendBench {
                cycles,
                execs,
                launcher,
            };
            (rt.block_on(bench::backend(&opts)), json)
        }
        BenchCommand::Overhead { iterations, json } => (
            rt.block_on(appliance::overhead(&launcher, iterations)),
            json,
        ),
        BenchCommand::Sinks { iterations, json } => {
            (rt.block_on(appliance::sinks(&launcher, iterations)), json)
        }
        BenchCommand::Cycle {
            concurrency,
            cycles_per_agent,
            json,
        } => (
            rt.block_on(appliance::cycle(&launcher, &concurrency, cycles_per_agent)),
            json,
        ),
        BenchCommand::Hot {
            agents,
            ops_per_agent,
            json,
        } => (
            rt.block_on(appliance::hot(&launcher, agents, ops_per_agent)),
            json,
        ),
        BenchCommand::Audit {
            writers,
            events_per_writer,
            json,
        } => (
            rt.block_on(appliance::audit(&writers, events_per_writer)),
            json,
        ),
        BenchCommand::Recordings {
            ptys,
            mib,
            job_mib,
            rounds,
            pin,
            json,
        } => (
            rt.block_on(appliance::recordings(
                &launcher, ptys, mib, job_mib, rounds, pin,
            )),
            json,
        ),
        BenchCommand::Jobs { mib, rounds, json } => (
            rt.block_on(appliance::job_output(&launcher, mib, rounds)),
            json,
        ),
        BenchCommand::Identities {
            tokens,
            sign_ins,
            concurrency,
            json,
        } => (
            rt.block_on(bench::identities::identities(
                &launcher,
                tokens,
                sign_ins,
                concurrency,
            )),
            json,
        ),
        BenchCommand::Export {
            events,
            exports,
            load,
            json,
        } => (
            rt.block_on(bench::export::export(&launcher, events, exports, load)),
            json,
        ),
        BenchCommand::Console {
            events,
            search_events,
            views,
            searches,
            json,
        } => (
            rt.block_on(bench::console::console(
                &launcher,
                events,
                search_events,
                views,
                searches,
            )),
            json,
        ),
        BenchCommand::Memory {
            leases,
            starts,
            json,
        } => (
            rt.block_on(appliance::memory_and_startup(&launcher, leases, starts)),
            json,
        ),
    };
    match result {
        Ok(report) => {
            report.print();
            if let Some(path) = json {
                let text = serde_json::to_string_pretty(&report).unwrap_or_default();
                if let Err(e) = std::fs::write(&path, text) {
                    eprintln!("error: cannot write {}: {e}", path.display());
                    return Exit::Failed;
                }
            }
            Exit::Ok
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            Exit::Failed
        }
    }
}
