//! `store migrate --to postgres`: a stopped appliance's redb store copied
//! into the PostgreSQL database its configuration names (`[store]`), to
//! run several replicas on it (docs/operations.md, "Several replicas").

use clap::{Args, Subcommand, ValueEnum};

use super::Exit;
use super::common::{Common, Reach, not_initialised, open_stopped, reach};

#[derive(Subcommand)]
pub enum StoreCommand {
    /// Copy the redb store (STATE/state.redb) into the PostgreSQL database
    /// of `[store]` (kind = "postgres").
    ///
    /// The service must be stopped (exit 3) and the database empty. The
    /// audit chain is verified in the redb store first, the copy is one
    /// transaction, and the chain is verified again in the database
    /// against the same events and head; any failure leaves the database
    /// as it was (exit 1). The redb store is not changed: start the service
    /// (it now uses the database) and keep STATE/state.redb until you are
    /// satisfied. Exit 2 when `[store]` is not a PostgreSQL one.
    Migrate(MigrateArgs),
}

#[derive(Clone, Copy, ValueEnum)]
pub enum Target {
    Postgres,
}

#[derive(Args)]
pub struct MigrateArgs {
    #[command(flatten)]
    pub common: Common,
    /// Where to: `postgres`, the database of `[store]`.
    #[arg(long, value_enum)]
    pub to: Target,
}

pub fn migrate(a: MigrateArgs) -> Exit {
    let cfg = match a.common.load() {
        Ok(c) => c,
        Err(c) => return c,
    };
    let Target::Postgres = a.to;
    let Some(settings) = cfg.store.postgres() else {
        eprintln!(
            "error: the configuration's [store] is not a PostgreSQL one: set kind = \"postgres\", \
             url and password_file first (the service uses them once started)"
        );
        return Exit::Usage;
    };
    let state = &cfg.state_dir;
    if let Reach::Running(_) = reach(state) {
        eprintln!("error: the service is running: stop it first (systemctl stop cube-adapter)");
        return Exit::State;
    }
    if !state.join("state.redb").exists() {
        return not_initialised(state);
    }
    let store = match open_stopped(state) {
        Ok(s) => s,
        Err(c) => return c,
    };
    match crate::ops::migrate_to_postgres(&store, &settings) {
        Ok(m) => {
            println!(
                "copied {} audit events (up to seq {}, head {}; the chain verifies in both), \
                 {} records, {} index entries and {} pending intents into PostgreSQL",
                m.events,
                m.last_seq,
                m.head,
                m.copied.records,
                m.copied.index_entries,
                m.copied.pending
            );
            println!(
                "the redb store is unchanged: start the service (it now uses the database); \
                 other replicas need this state directory's keys (docs/operations.md, \
                 \"Several replicas\")"
            );
            Exit::Ok
        }
        Err(e) => {
            eprintln!("error: {e}");
            Exit::Failed
        }
    }
}
