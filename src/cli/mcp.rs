//! `mcp`: the agent tools over MCP on stdin/stdout, as a client of an
//! appliance's /v1 (configured by the environment; see `--help`). Exit 2
//! when the settings are refused, 1 when it fails at run time.

use super::Exit;
use crate::mcp::stdio;

pub fn run() -> Exit {
    let settings = match stdio::Settings::from_env(|k| std::env::var(k).ok()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("cube-adapter mcp: {e}");
            return Exit::Usage;
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cube-adapter mcp: {e}");
            return Exit::Failed;
        }
    };
    match rt.block_on(stdio::run(settings)) {
        Ok(()) => Exit::Ok,
        Err(e) => {
            eprintln!("cube-adapter mcp: {e}");
            Exit::Failed
        }
    }
}
