//! `user add|list|passwd|disable|enable|remove`: people (approvers,
//! auditors) who sign in with a password (HTTP Basic on /v1 and /mcp, and
//! the console). Each subcommand builds one `UserOp` for [`apply`], which
//! runs it through the running service's admin socket, or on the store
//! when stopped.

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};

use super::Exit;
use super::common::{Access, Common, access, ask, runtime, unexpected};
use crate::admin::{Request, Response};
use crate::auth::users::{UserAnswer, UserOp, hash_new_password, user_principal};

#[derive(Subcommand)]
pub enum UserCommand {
    /// Add a user (default role approver; without --action, the roles'
    /// default scopes, as for tokens).
    Add(UserAddArgs),
    /// List users (never their passwords).
    List(UserListArgs),
    /// Set a new password.
    Passwd(UserPasswdArgs),
    /// Refuse a user's sign-ins (at once) until enabled again.
    Disable(UserNameArgs),
    /// Allow a disabled user again.
    Enable(UserNameArgs),
    /// Delete a user (what they did stays in the audit journal).
    Remove(UserNameArgs),
}

#[derive(Args)]
pub struct UserAddArgs {
    #[command(flatten)]
    pub common: Common,
    /// ^[a-z][a-z0-9._-]{0,63}$; the user's subject in the audit journal.
    pub name: String,
    /// Tenant whose plans the user sees and decides on.
    #[arg(long)]
    pub tenant: String,
    /// Role: approver, auditor, admin or agent (repeatable).
    #[arg(long = "role")]
    pub roles: Vec<String>,
    /// Action scope (repeatable; replaces the default scopes).
    #[arg(long = "action")]
    pub actions: Vec<String>,
    /// Allowed profile (repeatable; default: any).
    #[arg(long = "profile")]
    pub profiles: Vec<String>,
    /// Task template the user may decide on (repeatable; default: *).
    #[arg(long = "task-template")]
    pub task_templates: Vec<String>,
    /// Read the password from this file (default: stdin).
    #[arg(long)]
    pub password_file: Option<PathBuf>,
}

#[derive(Args)]
pub struct UserListArgs {
    #[command(flatten)]
    pub common: Common,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct UserPasswdArgs {
    #[command(flatten)]
    pub common: Common,
    pub name: String,
    #[arg(long)]
    pub password_file: Option<PathBuf>,
}

/// `disable`, `enable` and `remove`: a user by name.
#[derive(Args)]
pub struct UserNameArgs {
    #[command(flatten)]
    pub common: Common,
    pub name: String,
}

fn usage(m: String) -> Exit {
    eprintln!("error: {m}");
    Exit::Usage
}

pub fn add(a: UserAddArgs) -> Exit {
    let principal = match user_principal(
        &a.name,
        &a.tenant,
        &a.roles,
        a.actions,
        a.profiles,
        a.task_templates,
    ) {
        Ok(p) => p,
        Err(e) => return usage(e.message),
    };
    let hash = match read_password(a.password_file.as_deref())
        .and_then(|p| hash_new_password(&p).map_err(String::from))
    {
        Ok(h) => h,
        Err(e) => return usage(e),
    };
    apply(
        &a.common,
        UserOp::Add {
            principal: Box::new(principal),
            hash,
        },
        false,
    )
}

pub fn list(a: UserListArgs) -> Exit {
    apply(&a.common, UserOp::List, a.json)
}

pub fn passwd(a: UserPasswdArgs) -> Exit {
    match read_password(a.password_file.as_deref())
        .and_then(|p| hash_new_password(&p).map_err(String::from))
    {
        Ok(hash) => apply(&a.common, UserOp::Passwd { name: a.name, hash }, false),
        Err(e) => usage(e),
    }
}

pub fn disable(a: UserNameArgs) -> Exit {
    let op = UserOp::SetDisabled {
        name: a.name,
        disabled: true,
    };
    apply(&a.common, op, false)
}

pub fn enable(a: UserNameArgs) -> Exit {
    let op = UserOp::SetDisabled {
        name: a.name,
        disabled: false,
    };
    apply(&a.common, op, false)
}

pub fn remove(a: UserNameArgs) -> Exit {
    apply(&a.common, UserOp::Remove { name: a.name }, false)
}

/// A password from a file (its first line) or from stdin's first line.
fn read_password(file: Option<&Path>) -> Result<String, String> {
    let text = match file {
        Some(f) => std::fs::read_to_string(f).map_err(|e| format!("read {}: {e}", f.display()))?,
        None => {
            let mut s = String::new();
            std::io::stdin()
                .read_line(&mut s)
                .map_err(|e| format!("read the password from stdin: {e}"))?;
            s
        }
    };
    Ok(text.lines().next().unwrap_or("").to_string())
}

/// Runs `op` and prints what it answers (the listing, with `UserOp::List`).
/// Exit 0 done, 1 refused (no such user, exists already).
fn apply(common: &Common, op: UserOp, list_json: bool) -> Exit {
    let state = match common.state_dir() {
        Ok(s) => s,
        Err(c) => return c,
    };
    let changed = match &op {
        UserOp::Passwd { .. } => "password changed",
        UserOp::SetDisabled { disabled: true, .. } => "disabled",
        UserOp::SetDisabled {
            disabled: false, ..
        } => "enabled",
        _ => "changed",
    };
    let answer = match access(&state) {
        Err(c) => return c,
        Ok(Access::Socket(p)) => match ask(&p, &Request::User { op }) {
            Ok(Response::User { user }) => user,
            Ok(r) => return unexpected(r),
            Err(c) => return c,
        },
        Ok(Access::Store(store)) => {
            let rt = match runtime() {
                Ok(r) => r,
                Err(c) => return c,
            };
            match rt.block_on(crate::auth::users::user_op(
                &store,
                op,
                &crate::clock::Clock::System,
            )) {
                Ok(a) => a,
                Err(e) => {
                    eprintln!("error: {e}");
                    return Exit::Failed;
                }
            }
        }
    };
    let users = match answer {
        UserAnswer::Users(users) => users,
        // What was done, for the person at the terminal (stdout stays
        // empty for scripts, as before).
        UserAnswer::Added(n) => return done(&format!("user {n} added")),
        UserAnswer::Changed(n) => return done(&format!("user {n}: {changed}")),
        UserAnswer::Removed(n) => return done(&format!("user {n} removed")),
    };
    if list_json {
        // Through a `Value`: keys sorted, as `user list --json` has always
        // printed them.
        let v = serde_json::to_value(&users).unwrap_or_default();
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        return Exit::Ok;
    }
    println!(
        "{:<20} {:<16} {:<24} {:<10} {:<20} SCOPES",
        "NAME", "TENANT", "ROLES", "STATE", "PASSWORD CHANGED"
    );
    for u in users {
        let roles: Vec<&str> = u.principal.roles.iter().map(|r| r.as_str()).collect();
        println!(
            "{:<20} {:<16} {:<24} {:<10} {:<20} {}",
            u.name,
            u.principal.tenant,
            roles.join(","),
            if u.disabled_at.is_none() {
                "active"
            } else {
                "disabled"
            },
            u.password_changed_at,
            u.principal.scopes_text(",")
        );
    }
    Exit::Ok
}

fn done(what: &str) -> Exit {
    eprintln!("{what}");
    Exit::Ok
}
