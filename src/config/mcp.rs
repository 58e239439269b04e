//! Governed MCP inside the sandbox (`[mcp_policies.NAME]`): the MCP server an
//! operator pins for the sandboxes of a profile (`mcp_policy`), the tools an
//! agent may call on it, each with a closed JSON Schema of its arguments,
//! and the limits of a call. The agent never names a server, a command or an
//! address: it names a lease, one of these tools and its arguments
//! (`cube_mcp_call`, `POST /v1/leases/{lease_ref}/mcp/call`).
//!
//! The server runs inside the sandbox behind CubeSandbox's MCP gateway
//! (`cube-protocol.md` §4): at acquire the appliance starts the gateway with
//! the policy's [`McpPolicy::gateway_config`], and every call goes through
//! it. Policies reload with the rest of the configuration (SIGHUP); a lease
//! keeps the gateway it was made with, and its calls are checked against the
//! policy as it is now.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::tasks::{SchemaError, check_schema};

/// The longest wait for one call.
pub const MAX_CALL_TIMEOUT_SECONDS: u64 = 600;
/// The most argument bytes (as compact JSON) a policy may allow.
pub const MAX_INPUT_BYTES: u64 = 1024 * 1024;
/// The most result bytes (as compact JSON) a policy may allow.
pub const MAX_OUTPUT_BYTES: u64 = 8 * 1024 * 1024;
/// The most tools a policy may allow.
pub const MAX_TOOLS: usize = 64;
/// The longest start command.
pub const MAX_COMMAND: usize = 4096;
/// The gateway's own variable: a policy cannot set it.
pub const TOKEN_VAR: &str = "GATEWAY_ACCESS_TOKEN";

/// `[mcp_policies.NAME]`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct McpPolicy {
    /// What the server is for, for people (the console, `cube_profiles`).
    #[serde(default)]
    pub description: String,
    /// The server's name in the gateway's configuration (its key in
    /// CubeSandbox's `mcp` object: `github/OWNER/REPO` for a server the
    /// gateway builds from a repository); none: the policy's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<String>,
    /// How the gateway starts the server inside the sandbox: a shell
    /// command (the gateway's `runCmd`) speaking MCP on stdio.
    pub command: String,
    /// The server's environment (the gateway's `envs`). Not a place for
    /// secrets: whoever is root in the sandbox can read it.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// How long one call may take; past it the call's intent stays pending
    /// and its lease blocked until an operator reconciles it.
    #[serde(default = "default_timeout")]
    pub call_timeout_seconds: u64,
    /// The most bytes a call's arguments may take, as compact JSON.
    #[serde(default = "default_input")]
    pub max_input_bytes: u64,
    /// The most bytes a call's result may take, as compact JSON; a larger
    /// one is not returned (`mcp_result_too_large`).
    #[serde(default = "default_output")]
    pub max_output_bytes: u64,
    /// The tools an agent may call, by the server's name for them.
    pub tools: BTreeMap<String, McpTool>,
}

/// `[mcp_policies.NAME.tools.TOOL]`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct McpTool {
    #[serde(default)]
    pub description: String,
    /// JSON Schema (Draft 2020-12) of the arguments: `type = "object"` and
    /// `additionalProperties = false`. Checked by the appliance before
    /// anything reaches the sandbox.
    pub input_schema: Value,
}

fn default_timeout() -> u64 {
    30
}
fn default_input() -> u64 {
    16 * 1024
}
fn default_output() -> u64 {
    256 * 1024
}

/// A tool's name: what MCP allows (`^[A-Za-z0-9_.-]{1,64}$`).
pub fn valid_tool_name(n: &str) -> bool {
    (1..=64).contains(&n.len())
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
}

fn valid_server_name(n: &str) -> bool {
    (1..=128).contains(&n.len())
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.-/".contains(&b))
        && !n.starts_with('/')
        && !n.split('/').any(|c| c.is_empty() || c == "." || c == "..")
}

fn valid_env_name(n: &str) -> bool {
    let mut b = n.bytes();
    b.next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == b'_')
        && b.all(|c| c.is_ascii_alphanumeric() || c == b'_')
        && n.len() <= 128
}

impl McpPolicy {
    /// The server's name for the gateway.
    pub fn server_name<'a>(&'a self, policy: &'a str) -> &'a str {
        self.server.as_deref().unwrap_or(policy)
    }

    /// The gateway's `--config` (CubeSandbox's `mcp` object): one server.
    pub fn gateway_config(&self, policy: &str) -> Value {
        json!({
            self.server_name(policy): {
                "runCmd": self.command,
                "envs": self.env,
            }
        })
    }

    /// Everything that must hold before the policy may be used.
    pub fn validate(&self, name: &str) -> Result<(), McpPolicyError> {
        if !super::valid_profile_name(name) {
            return Err(McpPolicyError::Name(name.to_string()));
        }
        self.check().map_err(|problem| McpPolicyError::Invalid {
            policy: name.to_string(),
            problem,
        })
    }

    fn check(&self) -> Result<(), McpPolicyProblem> {
        use McpPolicyProblem as P;
        if let Some(s) = &self.server
            && !valid_server_name(s)
        {
            return Err(P::Server(s.clone()));
        }
        if self.command.trim().is_empty()
            || self.command.len() > MAX_COMMAND
            || self.command.contains('\0')
        {
            return Err(P::Command);
        }
        for (k, v) in &self.env {
            if !valid_env_name(k) {
                return Err(P::EnvName(k.clone()));
            }
            if k == TOKEN_VAR {
                return Err(P::TokenVar);
            }
            if v.contains('\0') {
                return Err(P::EnvValue(k.clone()));
            }
        }
        if !(1..=MAX_CALL_TIMEOUT_SECONDS).contains(&self.call_timeout_seconds) {
            return Err(P::Timeout);
        }
        if !(2..=MAX_INPUT_BYTES).contains(&self.max_input_bytes) {
            return Err(P::Input);
        }
        if !(1..=MAX_OUTPUT_BYTES).contains(&self.max_output_bytes) {
            return Err(P::Output);
        }
        if self.tools.is_empty() || self.tools.len() > MAX_TOOLS {
            return Err(P::Tools);
        }
        for (tool, t) in &self.tools {
            if !valid_tool_name(tool) {
                return Err(P::ToolName(tool.clone()));
            }
            let s = &t.input_schema;
            if s.get("type") != Some(&json!("object"))
                || s.get("additionalProperties") != Some(&json!(false))
            {
                return Err(P::NotClosed(tool.clone()));
            }
            check_schema(s, &format!("tools.{tool}.input_schema")).map_err(P::Schema)?;
        }
        Ok(())
    }
}

/// Why `[mcp_policies.NAME]` is refused.
#[derive(Debug, thiserror::Error)]
pub enum McpPolicyError {
    #[error("mcp policy name '{0}' must match ^[a-z][a-z0-9-]{{0,62}}$")]
    Name(String),
    #[error("mcp_policies.{policy}: {problem}")]
    Invalid {
        policy: String,
        #[source]
        problem: McpPolicyProblem,
    },
}

/// What is wrong in an MCP policy.
#[derive(Debug, thiserror::Error)]
pub enum McpPolicyProblem {
    #[error("server '{0}' must be 1 to 128 of A-Z a-z 0-9 _ . - and / between names")]
    Server(String),
    #[error("command is required: the server's start command (at most {MAX_COMMAND} bytes)")]
    Command,
    #[error("env name '{0}' must match ^[A-Za-z_][A-Za-z0-9_]{{0,127}}$")]
    EnvName(String),
    #[error("env must not set {TOKEN_VAR} (the gateway's own)")]
    TokenVar,
    #[error("env {0} holds a NUL byte")]
    EnvValue(String),
    #[error("call_timeout_seconds must be 1..={MAX_CALL_TIMEOUT_SECONDS}")]
    Timeout,
    #[error("max_input_bytes must be 2..={MAX_INPUT_BYTES}")]
    Input,
    #[error("max_output_bytes must be 1..={MAX_OUTPUT_BYTES}")]
    Output,
    #[error("tools must allow 1 to {MAX_TOOLS} tools")]
    Tools,
    #[error("tool name '{0}' must match ^[A-Za-z0-9_.-]{{1,64}}$")]
    ToolName(String),
    #[error(
        "tools.{0}.input_schema must be a closed object schema (type = \"object\", additionalProperties = false)"
    )]
    NotClosed(String),
    #[error(transparent)]
    Schema(SchemaError),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn echo() -> McpPolicy {
        toml::from_str(
            r#"
command = "exec node /srv/echo.js"
call_timeout_seconds = 15
max_input_bytes = 1024
max_output_bytes = 4096
[tools.echo]
description = "Echo the text back"
input_schema = { type = "object", additionalProperties = false, required = ["text"], properties = { text = { type = "string", maxLength = 256 } } }
"#,
        )
        .unwrap()
    }

    #[test]
    fn the_controlled_echo_policy_is_valid_and_its_gateway_config_names_one_server() {
        let p = echo();
        p.validate("controlled-echo").unwrap();
        assert_eq!(
            p.gateway_config("controlled-echo"),
            json!({"controlled-echo": {"runCmd": "exec node /srv/echo.js", "envs": {}}})
        );
    }

    #[test]
    fn each_bad_setting_is_named() {
        type Change = Box<dyn Fn(&mut McpPolicy)>;
        let cases: Vec<(Change, &str)> = vec![
            (Box::new(|p| p.command = " ".into()), "command is required"),
            (
                Box::new(|p| p.server = Some("../x".into())),
                "server '../x'",
            ),
            (
                Box::new(|p| {
                    p.env.insert(TOKEN_VAR.into(), "x".into());
                }),
                "GATEWAY_ACCESS_TOKEN",
            ),
            (
                Box::new(|p| {
                    p.env.insert("1A".into(), "x".into());
                }),
                "env name '1A'",
            ),
            (Box::new(|p| p.call_timeout_seconds = 0), "call_timeout"),
            (Box::new(|p| p.max_input_bytes = 1), "max_input_bytes"),
            (Box::new(|p| p.max_output_bytes = 0), "max_output_bytes"),
            (Box::new(|p| p.tools.clear()), "tools must allow"),
            (
                Box::new(|p| {
                    let t = p.tools["echo"].clone();
                    p.tools.insert("bad name".into(), t);
                }),
                "tool name 'bad name'",
            ),
            (
                Box::new(|p| {
                    p.tools.get_mut("echo").unwrap().input_schema["additionalProperties"] =
                        json!(true)
                }),
                "closed object schema",
            ),
            (
                Box::new(|p| {
                    p.tools.get_mut("echo").unwrap().input_schema["properties"]["text"]["maxLength"] =
                        json!("many")
                }),
                "tools.echo.input_schema: not a valid JSON Schema",
            ),
        ];
        for (change, want) in cases {
            let mut p = echo();
            change(&mut p);
            let e = p.validate("controlled-echo").unwrap_err().to_string();
            assert!(e.contains(want), "{e:?} lacks {want:?}");
            assert!(e.starts_with("mcp_policies.controlled-echo: "), "{e}");
        }
        assert!(
            echo()
                .validate("Bad")
                .unwrap_err()
                .to_string()
                .contains("mcp policy name 'Bad'")
        );
    }
}
