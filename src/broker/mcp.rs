//! Governed MCP inside a lease's sandbox (`config::mcp`): the gateway a
//! profile's `mcp_policy` starts with each sandbox, the tools an agent may
//! list, and `cube_mcp_call`.
//!
//! A call is refused before anything reaches the sandbox when the lease has
//! no policy, the tool is not allowed, or the arguments are not an object,
//! too large or not what the tool's schema says. Otherwise it runs under an
//! intent (the tool, a keyed digest and the size of the arguments) and an
//! outcome (a keyed digest and the size of the result): never the values.
//! A call sent whose answer does not come in time, or at all, may have run:
//! its intent stays pending and the lease is blocked (`lease_blocked`) until
//! an operator reconciles the operation. Nothing is ever sent twice.

use std::time::{Duration, Instant};

use serde_json::{Map, Value};

use super::leases::{Done, Lease};
use super::{Broker, Code, Ctx, Error, Result, dto};
use crate::audit::event::Action;
use crate::auth::Principal;
use crate::config::McpPolicy;
use crate::cube::mcp::CallError;
use crate::cube::{CubeClient, ErrorKind, SandboxAddr, Secret};

/// Room for the JSON-RPC envelope around a result.
const ENVELOPE: usize = 64 * 1024;

impl Broker {
    /// Start a new sandbox's gateway with the policy's server and keep its
    /// token: the sealed token. The caller kills the sandbox on an error.
    pub(crate) async fn start_gateway(
        &self,
        cube: &CubeClient,
        sb: &SandboxAddr,
        backend_name: &str,
        policy_name: &str,
    ) -> Result<String> {
        let cfg = self.config();
        let Some(policy) = cfg.mcp_policies.get(policy_name) else {
            return Err(Error::new(
                Code::McpGatewayUnavailable,
                format!("the profile's mcp_policy {policy_name} is not configured"),
            ));
        };
        let program = match cfg.backend_defs().get(backend_name) {
            // The appliance's own binary, bound read-only in every sandbox.
            Some(d) if d.is_embedded() => crate::embedded::gateway::GATEWAY_PATH,
            _ => crate::cube::mcp::GATEWAY_PROGRAM,
        };
        let token = Secret::new(crate::ids::random_hex(32));
        let sealed = self
            .inner
            .store
            .sealer
            .seal(token.expose().as_bytes())
            .map_err(|_| Error::new(Code::ExecutionFailed, "the sandbox could not be recorded"))?;
        cube.start_mcp_gateway(sb, program, &policy.gateway_config(policy_name), &token)
            .await
            .map_err(|e| {
                tracing::warn!(policy = policy_name, error = %e.message, "the MCP gateway did not start");
                Error::new(
                    Code::McpGatewayUnavailable,
                    match e.kind {
                        ErrorKind::Unsupported => {
                            "the sandbox's template has no MCP gateway: ask the operator"
                        }
                        ErrorKind::Timeout => "the sandbox's MCP gateway did not start in time",
                        _ => "the sandbox's MCP gateway did not start its server: ask the operator (the appliance's log says why)",
                    },
                )
            })?;
        Ok(sealed)
    }

    /// The policy of a lease's MCP calls, as configured now.
    fn lease_policy(&self, l: &Lease) -> std::result::Result<(String, McpPolicy), Error> {
        let Some(name) = &l.mcp_policy else {
            return Err(Error::new(
                Code::McpToolDenied,
                "this lease's profile has no MCP policy: it calls no MCP tools",
            ));
        };
        match self.config().mcp_policies.get(name) {
            Some(p) => Ok((name.clone(), p.clone())),
            None => Err(Error::new(
                Code::McpToolDenied,
                format!("the lease's MCP policy {name} is no longer configured"),
            )),
        }
    }

    /// `GET /v1/leases/{ref}/mcp/tools`: the tools the lease's policy
    /// allows, with their schemas (from the policy, not the server).
    pub async fn mcp_tools(
        &self,
        p: &Principal,
        ctx: &Ctx,
        lease_ref: &str,
    ) -> Result<dto::McpToolList> {
        let ev = self.event(p, Action::McpCall, ctx);
        self.authorize(p, "mcp:list", &ev).await?;
        let l = self.owned_lease(p, lease_ref, &ev).await?;
        let (name, policy) = match self.lease_policy(&l) {
            Ok(x) => x,
            Err(e) => {
                return Err(self
                    .reject(self.lease_event(p, Action::McpCall, ctx, &l), e)
                    .await);
            }
        };
        Ok(dto::McpToolList {
            lease_ref: l.lease_ref.clone(),
            policy: name,
            call_timeout_seconds: policy.call_timeout_seconds,
            max_input_bytes: policy.max_input_bytes,
            max_output_bytes: policy.max_output_bytes,
            tools: policy
                .tools
                .iter()
                .map(|(n, t)| dto::McpToolInfo {
                    name: n.clone(),
                    description: t.description.clone(),
                    input_schema: t.input_schema.clone(),
                })
                .collect(),
            request_id: ctx.request_id.clone(),
        })
    }

    /// `POST /v1/leases/{ref}/mcp/call`.
    pub async fn mcp_call(
        &self,
        p: &Principal,
        ctx: &Ctx,
        lease_ref: &str,
        tool: &str,
        arguments: Value,
    ) -> Result<dto::McpCallResponse> {
        let ev = self.event(p, Action::McpCall, ctx);
        self.authorize(p, "mcp:call", &ev).await?;
        let l = self.owned_lease(p, lease_ref, &ev).await?;
        let mut ev = self.lease_event(p, Action::McpCall, ctx, &l);
        ev.tool = Some(tool.to_string());
        let (args, encoded, policy) = match self.check_call(&l, tool, arguments) {
            Ok(x) => x,
            Err(e) => return Err(self.reject(ev, e).await),
        };
        let j = &self.inner.journal;
        let args_digest = j.digest("mcp_arguments", &encoded);
        let args_len = encoded.len() as u64;
        let tool_name = tool.to_string();
        let t2 = tool_name.clone();
        let timeout = Duration::from_secs(policy.call_timeout_seconds);
        let max_output = usize::try_from(policy.max_output_bytes).unwrap_or(usize::MAX);
        let started = Instant::now();
        let (l, (result, size)) = self
            .effect_on(
                p,
                ctx,
                l,
                Action::McpCall,
                |e| {
                    e.tool = Some(t2);
                    e.parameters_digest = Some(args_digest);
                    e.bytes = Some(args_len);
                },
                None,
                move |b: Broker, l: Lease, addr| async move {
                    let token = b.gateway_token(&l)?;
                    let session = addr
                        .cube
                        .mcp_session(&addr, &token, max_output + ENVELOPE)
                        .await
                        .map_err(|e| {
                            tracing::warn!(lease = %l.lease_ref, error = %e.message, "no MCP session with the sandbox's gateway");
                            Error::new(
                                Code::McpGatewayUnavailable,
                                "the sandbox's MCP gateway did not answer; the call was not sent",
                            )
                        })?;
                    // From here on the call may have reached the server.
                    let r = tokio::time::timeout(timeout, session.call(&tool_name, args)).await;
                    let r = match r {
                        Err(_) => {
                            return Err(Error::new(
                                Code::McpCallTimeout,
                                format!(
                                    "the tool did not answer within {} s; it may have run. The lease is blocked until an operator reconciles the call",
                                    timeout.as_secs()
                                ),
                            ));
                        }
                        Ok(r) => r,
                    };
                    session.close().await;
                    let result = match r {
                        Ok(r) => r,
                        Err(CallError::Unconfirmed(why)) => {
                            tracing::warn!(lease = %l.lease_ref, error = %why, "an MCP call's answer was lost");
                            return Err(Error::new(
                                Code::McpCallUnconfirmed,
                                "the tool's answer was lost; it may have run. The lease is blocked until an operator reconciles the call",
                            ));
                        }
                        Err(CallError::Refused { code, .. }) => {
                            return Err(Error::new(
                                Code::McpCallFailed,
                                format!("the MCP server refused the call (JSON-RPC error {code})"),
                            ));
                        }
                        Err(CallError::Unsupported(what)) => {
                            return Err(Error::new(Code::McpCallFailed, what));
                        }
                    };
                    let encoded = serde_json::to_vec(&result).unwrap_or_default();
                    if encoded.len() > max_output {
                        return Err(Error::new(
                            Code::McpResultTooLarge,
                            format!(
                                "the tool's result is {} bytes; the policy allows {max_output}",
                                encoded.len()
                            ),
                        ));
                    }
                    let digest = b.inner.journal.digest("mcp_result", &encoded);
                    let size = encoded.len() as u64;
                    Ok(Done::new((result, size))
                        .bytes(Some(size))
                        .fill(move |e| e.result_digest = Some(digest)))
                },
            )
            .await?;
        let value = serde_json::to_value(&result).unwrap_or(Value::Null);
        Ok(dto::McpCallResponse {
            executor: self.executor(&l.backend),
            lease_ref: l.lease_ref.clone(),
            sandbox_ref: l.sandbox_ref.clone(),
            tool: tool.to_string(),
            is_error: result.is_error.unwrap_or(false),
            content: value
                .get("content")
                .cloned()
                .unwrap_or(Value::Array(vec![])),
            structured_content: value.get("structuredContent").cloned(),
            result_bytes: size,
            duration_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
            request_id: ctx.request_id.clone(),
        })
    }

    /// What must hold before a call reaches the sandbox: the lease's policy
    /// allows the tool, the arguments are an object within the policy's
    /// size and the tool's schema. The arguments and their compact JSON.
    fn check_call(
        &self,
        l: &Lease,
        tool: &str,
        arguments: Value,
    ) -> Result<(Map<String, Value>, Vec<u8>, McpPolicy)> {
        let (name, policy) = self.lease_policy(l)?;
        if !policy.tools.contains_key(tool) {
            let allowed: Vec<&str> = policy.tools.keys().map(String::as_str).collect();
            return Err(Error::new(
                Code::McpToolDenied,
                format!(
                    "the MCP policy {name} does not allow this tool (allowed: {})",
                    allowed.join(", ")
                ),
            ));
        }
        let Value::Object(args) = arguments else {
            return Err(Error::new(
                Code::McpArgumentsInvalid,
                "arguments must be a JSON object",
            ));
        };
        let encoded = serde_json::to_vec(&args).unwrap_or_default();
        if encoded.len() as u64 > policy.max_input_bytes {
            return Err(Error::new(
                Code::ValueTooLarge,
                format!(
                    "the arguments are {} bytes as JSON; the policy allows {}",
                    encoded.len(),
                    policy.max_input_bytes
                ),
            ));
        }
        let Some(validator) = self
            .policy()
            .mcp_tools
            .get(&(name.clone(), tool.to_string()))
            .cloned()
        else {
            return Err(Error::new(
                Code::McpToolDenied,
                "the tool's schema does not compile",
            ));
        };
        let instance = Value::Object(args);
        // Where and which rule, never the value (it may be long, or not
        // the caller's to see echoed in a log).
        let problems: Vec<String> = validator
            .iter_errors(&instance)
            .take(5)
            .map(|e| {
                let at = e.instance_path().to_string();
                let at = if at.is_empty() { "/".to_string() } else { at };
                format!("{at} fails {}", e.schema_path())
            })
            .collect();
        if !problems.is_empty() {
            return Err(Error::new(
                Code::McpArgumentsInvalid,
                format!(
                    "the arguments do not match the tool's schema: {}",
                    problems.join("; ")
                ),
            ));
        }
        let args = match instance {
            Value::Object(a) => a,
            _ => Map::new(),
        };
        Ok((args, encoded, policy))
    }

    /// A lease's gateway token, opened.
    fn gateway_token(&self, l: &Lease) -> Result<Secret> {
        let Some(sealed) = &l.mcp_token else {
            return Err(Error::new(
                Code::McpGatewayUnavailable,
                "this lease's sandbox has no MCP gateway",
            ));
        };
        let bytes = self.inner.store.sealer.open(sealed)?;
        String::from_utf8(bytes)
            .map(Secret::new)
            .map_err(|_| Error::new(Code::AuditUnavailable, "corrupt sealed token"))
    }
}
