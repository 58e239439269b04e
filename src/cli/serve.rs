//! `serve` (the appliance itself) and `config check` (the configuration
//! `serve` would run with).

use std::net::SocketAddr;
use std::path::Path;

use clap::{Args, Subcommand};

use super::common::{Common, env_vars, load, runtime, shutdown_signal};
use super::{EXIT_CODES, Exit};
use crate::config::Flags;

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub common: Common,
    /// Listen address (default 127.0.0.1:18080).
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// Serve plain HTTP (loopback addresses only).
    #[arg(long)]
    pub insecure_plain_http: bool,
}

#[derive(Subcommand)]
pub enum ConfigCommand {
    /// Load the configuration with every override, validate it, print it.
    ///
    /// Precedence: defaults < the file < CUBE_ADAPTER_* environment <
    /// flags. Unknown keys and non-boolean booleans are errors. Exit 0 and
    /// the effective configuration; 2 and the reason when it is invalid.
    #[command(after_help = EXIT_CODES)]
    Check(ConfigCheckArgs),
}

#[derive(Args)]
pub struct ConfigCheckArgs {
    #[command(flatten)]
    pub common: Common,
    #[arg(long)]
    pub listen: Option<SocketAddr>,
}

pub fn serve(args: ServeArgs) -> Exit {
    let config = args.common.config.as_deref();
    let flags = Flags {
        state_dir: args.common.state_dir.clone(),
        listen: args.listen,
        insecure_plain_http: args.insecure_plain_http,
    };
    let cfg = match load(config, &flags) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let config_file = config.unwrap_or(Path::new(crate::config::DEFAULT_CONFIG));
    match crate::ops::preflight(config_file, &cfg) {
        Ok(warnings) => {
            for w in warnings {
                tracing::warn!("{w}");
            }
        }
        Err(e) => {
            eprintln!("error: {e}");
            return Exit::Usage;
        }
    }
    let launcher = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: cannot find this executable: {e}");
            return Exit::Store;
        }
    };
    if cfg.embedded_backend().is_some()
        && let Err(e) = crate::app::enter_subordinate_ids(cfg.embedded.isolation)
    {
        eprintln!("error: {e}");
        return Exit::Failed;
    }
    let secrets = crate::app::EnvSecrets {
        shared_token: std::env::var("CUBE_ADAPTER_TOKEN")
            .ok()
            .filter(|t| !t.is_empty())
            .map(crate::cube::Secret::new),
    };
    let rt = match runtime() {
        Ok(r) => r,
        Err(c) => return c,
    };
    // SIGHUP re-reads the same file with the same environment and flags.
    let reload = crate::app::Reload::Signal(crate::ops::ConfigSource {
        path: config.map(Path::to_path_buf),
        env: env_vars(),
        flags,
    });
    let result = rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(cfg.listen)
            .await
            .map_err(|e| anyhow::anyhow!("bind {}: {e}", cfg.listen))?;
        crate::app::serve_with(
            cfg,
            secrets,
            listener,
            launcher,
            print_started,
            stopping(),
            reload,
        )
        .await
    });
    match result {
        Ok(()) => Exit::Ok,
        Err(e) => {
            eprintln!("error: {e:#}");
            if e.to_string().contains("in use by another") {
                Exit::State
            } else {
                Exit::Store
            }
        }
    }
}

/// The shutdown signal, told to systemd (STOPPING=1) as it arrives.
async fn stopping() {
    shutdown_signal().await;
    let _ = tokio::task::spawn_blocking(|| {
        crate::systemd::notify(
            "STOPPING=1\nSTATUS=stopping: letting effects in flight record their outcome",
        )
    })
    .await;
}

fn print_started(s: &crate::app::Started) {
    use std::io::Write;
    // A closed stdout must not take the service down: ignore write errors.
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "cube-adapter listening on {}", s.url);
    let _ = writeln!(o, "  CA certificate:  {}", s.ca_file.display());
    let _ = writeln!(o, "  CA SHA-256:      {}", s.ca_fingerprint);
    let _ = match &s.admin_token_file {
        Some(f) => writeln!(
            o,
            "  admin token:     {} (written once; keep it safe)",
            f.display()
        ),
        None => writeln!(
            o,
            "  admin token:     issued on first start (see `cube-adapter token list`)"
        ),
    };
    let _ = writeln!(o, "  backend:         {}", s.backend);
    let _ = o.flush();
    crate::systemd::ready(&format!("listening on {}", s.url));
}

pub fn config_check(args: ConfigCheckArgs) -> Exit {
    let flags = Flags {
        state_dir: args.common.state_dir.clone(),
        listen: args.listen,
        insecure_plain_http: false,
    };
    match load(args.common.config.as_deref(), &flags) {
        Ok(c) => {
            println!("configuration OK");
            for (profile, r) in crate::ops::network_checks(&c) {
                if let Err(e) = r {
                    eprintln!("warning: profile {profile}: {e}");
                }
            }
            match toml::to_string_pretty(&c) {
                Ok(t) => println!("{t}"),
                Err(e) => eprintln!("warning: cannot render the configuration: {e}"),
            }
            Exit::Ok
        }
        Err(code) => code,
    }
}
