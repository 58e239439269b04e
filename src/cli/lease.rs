//! `lease egress`: what a live lease's sandbox may reach through the egress
//! proxy, and narrowing it (docs/operations.md, "Brokered egress").

use clap::{Args, Subcommand};

use super::Exit;
use super::common::{Common, Reach, reach};
use crate::admin::{Request, Response};

#[derive(Subcommand)]
pub enum LeaseCommand {
    /// A live lease's egress destinations; with --only or --none, narrow
    /// them first (e.g. once its dependencies are installed).
    ///
    /// Through the running service (exit 3 when it is not running). A
    /// lease's destinations can only be narrowed: each --only must be one
    /// it has now, written as its profile writes it. The change is in the
    /// audit journal (`egress_narrow`) and applies to the next request;
    /// a tunnel already open runs to its end. Prints the destinations
    /// left, one a line. Exit 0, 1 refused (no such live lease, a
    /// destination it does not have), 2 bad arguments, 3 not running.
    #[command(after_help = super::EXIT_CODES)]
    Egress(EgressArgs),
}

#[derive(Args)]
pub struct EgressArgs {
    #[command(flatten)]
    pub common: Common,
    /// The lease (`lease_…`).
    pub lease: String,
    /// Keep only this destination (repeat for several).
    #[arg(long, value_name = "DEST", conflicts_with = "none")]
    pub only: Vec<String>,
    /// Keep none: the sandbox reaches nothing more through the proxy.
    #[arg(long)]
    pub none: bool,
    /// Print JSON: {"lease_ref": …, "destinations": […]}.
    #[arg(long)]
    pub json: bool,
}

pub fn egress(a: EgressArgs) -> Exit {
    let state = match a.common.state_dir() {
        Ok(s) => s,
        Err(c) => return c,
    };
    let Reach::Running(sock) = reach(&state) else {
        eprintln!("error: the service is not running: a lease's egress lives in it");
        return Exit::State;
    };
    let only = if a.none {
        Some(vec![])
    } else if a.only.is_empty() {
        None
    } else {
        Some(a.only)
    };
    let req = Request::LeaseEgress {
        lease_ref: a.lease,
        only,
    };
    match super::common::ask(&sock, &req) {
        Ok(Response::LeaseEgress {
            lease_ref,
            destinations,
        }) => {
            if a.json {
                super::common::print_json(&serde_json::json!({
                    "lease_ref": lease_ref,
                    "destinations": destinations,
                }));
            } else {
                for d in destinations {
                    println!("{d}");
                }
            }
            Exit::Ok
        }
        Ok(Response::Error { message }) => {
            eprintln!("error: {message}");
            Exit::Failed
        }
        Ok(other) => super::common::unexpected(other),
        Err(c) => c,
    }
}
