//! `config import`: the reference adapter's configuration as ours
//! (`crate::config::import` decides and writes; this prints the report).
//! `config check` stays in `serve`, flattened into [`ConfigCommand`].

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};

use super::{EXIT_CODES, Exit};
use crate::config::import::{self, CONFIG_FILE, ENV_FILE, Sources, WriteError};

#[derive(Subcommand)]
pub enum ConfigCommand {
    #[command(flatten)]
    Check(super::serve::ConfigCommand),
    /// Translate the reference adapter's configuration into a directory of
    /// ours: config.toml, the principals file, secrets in 0600 files.
    ///
    /// Reads the reference's .env (KEY=VALUE lines; only the file, never
    /// this process's environment, so the result is reproducible), its
    /// profiles and task templates YAML and its principals JSON (their
    /// paths may come from CUBE_ADAPTER_PROFILES_FILE,
    /// CUBE_ADAPTER_TASK_TEMPLATES_FILE and CUBE_ADAPTER_TOKENS_FILE in the
    /// .env, relative to its directory). Writes DIR/config.toml (commented),
    /// DIR/principals.json (copied as is, 0600) and each secret in a 0600
    /// file of its own (cube-api-key, receipt-hmac.key, env for
    /// CUBE_ADAPTER_TOKEN); no secret is ever put in config.toml or
    /// printed. Prints what was carried over and every variable or key that
    /// was not, with the reason, then checks the result with the loader of
    /// `config check`. Exit 0 done; 2 an input that cannot be read or
    /// translated (nothing written), a file in DIR that would be replaced
    /// without --force (nothing written), or a config.toml the loader
    /// refuses (the files are left, the report says why); 4 a write error.
    #[command(after_help = EXIT_CODES)]
    Import(ConfigImportArgs),
}

#[derive(Args)]
pub struct ConfigImportArgs {
    /// The reference's .env file.
    #[arg(long, value_name = "FILE")]
    pub env: Option<PathBuf>,
    /// The reference's profiles YAML (default: CUBE_ADAPTER_PROFILES_FILE
    /// of the .env; without either, the reference's built-in offline-code).
    #[arg(long, value_name = "FILE")]
    pub profiles: Option<PathBuf>,
    /// The reference's task templates YAML (default:
    /// CUBE_ADAPTER_TASK_TEMPLATES_FILE of the .env).
    #[arg(long, value_name = "FILE")]
    pub task_templates: Option<PathBuf>,
    /// The reference's MCP policies YAML, mcp-policies.yaml (default:
    /// CUBE_ADAPTER_MCP_POLICIES_FILE of the .env).
    #[arg(long, value_name = "FILE")]
    pub mcp_policies: Option<PathBuf>,
    /// The reference's template presets YAML (default:
    /// CUBE_ADAPTER_TEMPLATE_PRESETS_FILE of the .env).
    #[arg(long, value_name = "FILE")]
    pub presets: Option<PathBuf>,
    /// The reference's principals JSON (default: CUBE_ADAPTER_TOKENS_FILE
    /// of the .env).
    #[arg(long, value_name = "FILE")]
    pub principals: Option<PathBuf>,
    /// The directory to write into (made if missing), e.g.
    /// /etc/cube-adapter: config.toml names its files there.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Replace files DIR already has.
    #[arg(long)]
    pub force: bool,
}

pub fn import(a: ConfigImportArgs) -> Exit {
    // Absolute, so that config.toml's comments say where it came from.
    let abs = |p: Option<PathBuf>| p.map(|p| std::path::absolute(&p).unwrap_or(p));
    let src = Sources {
        env: abs(a.env),
        profiles: abs(a.profiles),
        task_templates: abs(a.task_templates),
        principals: abs(a.principals),
        mcp_policies: abs(a.mcp_policies),
        presets: abs(a.presets),
    };
    if src.env.is_none()
        && src.profiles.is_none()
        && src.task_templates.is_none()
        && src.principals.is_none()
        && src.mcp_policies.is_none()
        && src.presets.is_none()
    {
        eprintln!(
            "error: nothing to import: give --env FILE (and --profiles, --task-templates, --principals as needed)"
        );
        return Exit::Usage;
    }
    let out = match std::path::absolute(&a.out) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {}: {e}", a.out.display());
            return Exit::Usage;
        }
    };
    let now = crate::clock::rfc3339(crate::clock::system_now());
    let plan = match import::plan(&src, &out, &now) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            eprintln!("nothing was written");
            return Exit::Usage;
        }
    };
    let written = match import::write(&plan, &out, a.force) {
        Ok(w) => w,
        Err(WriteError::Exists(list)) => {
            let names: Vec<String> = list.iter().map(|p| p.display().to_string()).collect();
            eprintln!(
                "error: {} already exist{}: nothing was written (give --force to replace {})",
                names.join(", "),
                if names.len() == 1 { "s" } else { "" },
                if names.len() == 1 { "it" } else { "them" }
            );
            return Exit::Usage;
        }
        Err(e @ WriteError::Io { .. }) => {
            eprintln!("error: {e}");
            return Exit::Store;
        }
    };
    print_report(&plan, &out, &written);
    let config = out.join(CONFIG_FILE);
    match import::check(&config) {
        Ok((cfg, warnings)) => {
            println!();
            println!(
                "Checked: the loader of `config check` accepts {} ({} profiles: {}; {} task templates).",
                config.display(),
                cfg.profiles.len(),
                cfg.profiles.keys().cloned().collect::<Vec<_>>().join(", "),
                cfg.tasks.len()
            );
            for w in warnings {
                println!("  warning: {w}");
            }
            next_steps(&plan, &out);
            Exit::Ok
        }
        Err(e) => {
            println!();
            println!(
                "Check FAILED: the loader of `config check` refuses {}: {e}",
                config.display()
            );
            println!(
                "The files are left in {}: fix config.toml and run `cube-adapter config check --config {}`.",
                out.display(),
                config.display()
            );
            eprintln!("error: {}: {e}", config.display());
            Exit::Usage
        }
    }
}

fn print_report(plan: &import::Plan, out: &Path, written: &[PathBuf]) {
    let r = &plan.report;
    println!(
        "Imported the reference adapter's configuration into {}",
        out.display()
    );
    for (kind, p) in &r.sources {
        println!("  {kind}: {}", p.display());
    }
    println!();
    println!("Written:");
    for (f, p) in plan.files.iter().zip(written) {
        println!(
            "  {}  ({:o}{})",
            p.display(),
            f.mode,
            if f.secret { ", secret" } else { "" }
        );
    }
    println!();
    println!("Carried over:");
    for e in &r.carried {
        println!("  {}\n      -> {}", e.what, e.detail);
    }
    println!();
    if r.not_carried.is_empty() {
        println!("Not carried over: nothing.");
    } else {
        println!("Not carried over:");
        for e in &r.not_carried {
            println!("  {}\n      {}", e.what, e.detail);
        }
    }
    if !r.notes.is_empty() {
        println!();
        println!("Notes:");
        for n in &r.notes {
            println!("  - {n}");
        }
    }
}

fn next_steps(plan: &import::Plan, out: &Path) {
    let etc = Path::new("/etc/cube-adapter");
    println!();
    println!("Next:");
    if out != etc {
        println!(
            "  - config.toml names its files in {}: run again with --out /etc/cube-adapter, or move them and edit the paths",
            out.display()
        );
    }
    println!(
        "  - the service reads the files as the user cube-adapter: chgrp cube-adapter config.toml, chown cube-adapter: the 0600 ones (all but env, which systemd reads)"
    );
    if plan.files.iter().any(|f| f.name == ENV_FILE) {
        println!(
            "  - load env into the service: systemctl edit cube-adapter, then [Service] EnvironmentFile=/etc/cube-adapter/env"
        );
    }
    println!(
        "  - sudo cube-adapter config check, then sudo cube-adapter init (first start: CA, admin token)"
    );
}
