//! The MCP gateway inside a sandbox (`cube-protocol.md` §4): started as the
//! SDK starts it (envd `Start`, as root, `mcp-gateway --config '<json>'` with
//! `GATEWAY_ACCESS_TOKEN`; exit 0 means it serves), then reached as MCP
//! Streamable HTTP at `50005-<sandboxID>.<domain>/mcp` through CubeProxy,
//! with the token as a bearer. The token never leaves the appliance: it is
//! sent only to the gateway, and kept sealed with the lease.
//!
//! The client is rmcp's; each call is a session of its own (initialize,
//! `tools/call`, close), so a sandbox paused and resumed in between needs
//! nothing reconnected.

use std::collections::HashMap;
use std::time::Duration;

use reqwest::header::{HeaderName, HeaderValue};
use rmcp::ServiceExt;
use rmcp::model::{CallToolRequestParams, CallToolResponse, CallToolResult, JsonObject};
use rmcp::service::{RoleClient, RunningService};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;

use super::{CubeClient, CubeError, ErrorKind, Result, SandboxAddr, Secret, StartOptions};

/// The gateway's port in the sandbox.
pub const GATEWAY_PORT: u16 = super::wire::MCP_GATEWAY_PORT;
/// What CubeSandbox's templates call the gateway.
pub const GATEWAY_PROGRAM: &str = "mcp-gateway";
/// The gateway's start may take this long (the SDK's).
pub const GATEWAY_START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a session may take to open (initialize) before the call.
pub const SESSION_TIMEOUT: Duration = Duration::from_secs(15);

/// Quote for a POSIX shell: one word, whatever it holds.
fn shell_word(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// A call that reached the gateway and failed there, or whose answer did
/// not come.
#[derive(Debug)]
pub enum CallError {
    /// No answer (the transport failed after the request was sent): the
    /// tool may or may not have run.
    Unconfirmed(String),
    /// The server answered with a JSON-RPC error: the call did not run to
    /// a result.
    Refused { code: i32, message: String },
    /// The server answered with something other than a result (asked for
    /// input, or made a task): not supported.
    Unsupported(&'static str),
}

/// One MCP session with a sandbox's gateway.
pub struct McpSession {
    client: RunningService<RoleClient, ()>,
}

impl McpSession {
    /// `tools/call`, without a deadline (the caller keeps it).
    pub async fn call(
        &self,
        tool: &str,
        arguments: JsonObject,
    ) -> std::result::Result<CallToolResult, CallError> {
        let mut params = CallToolRequestParams::new(tool.to_string());
        params.arguments = Some(arguments);
        match self.client.call_tool_once(params).await {
            Ok(CallToolResponse::Complete(r)) => Ok(r),
            Ok(CallToolResponse::InputRequired(_)) => Err(CallError::Unsupported(
                "the server asked for input during the call",
            )),
            Ok(CallToolResponse::Task(_)) => {
                Err(CallError::Unsupported("the server made the call a task"))
            }
            Ok(_) => Err(CallError::Unsupported("an answer of an unknown kind")),
            Err(rmcp::ServiceError::McpError(e)) => Err(CallError::Refused {
                code: e.code.0,
                message: e.message.to_string(),
            }),
            Err(e) => Err(CallError::Unconfirmed(e.to_string())),
        }
    }

    /// End the session (the gateway forgets it).
    pub async fn close(self) {
        let _ = self.client.cancel().await;
    }
}

impl CubeClient {
    /// Start a sandbox's MCP gateway with `config` (CubeSandbox's `mcp`
    /// object) as the SDK does: `program` is `mcp-gateway` on CubeSandbox,
    /// the embedded backend's own path on it.
    pub async fn start_mcp_gateway(
        &self,
        sb: &SandboxAddr,
        program: &str,
        config: &serde_json::Value,
        token: &Secret,
    ) -> Result<()> {
        let mut o = StartOptions::shell(&format!(
            "{} --config {}",
            shell_word(program),
            shell_word(&config.to_string())
        ));
        o.user = Some("root".into());
        o.timeout = Some(GATEWAY_START_TIMEOUT);
        o.envs
            .insert("GATEWAY_ACCESS_TOKEN".into(), token.expose().to_string());
        let out = self.run(sb, &o, 16 * 1024).await?;
        if out.timed_out {
            return Err(CubeError::new(
                ErrorKind::Timeout,
                "the MCP gateway did not start in time",
            ));
        }
        match out.exit_code {
            0 => Ok(()),
            127 => Err(CubeError::new(
                ErrorKind::Unsupported,
                format!("the sandbox's template has no {program}"),
            )),
            code => {
                // The gateway's own words (never the token, which it does
                // not print): for the operator's log, not the caller.
                let said = String::from_utf8_lossy(&out.stderr);
                let said: String = said.trim().chars().take(400).collect();
                Err(CubeError::new(
                    ErrorKind::Internal,
                    format!("the MCP gateway exited with {code}: {said}"),
                ))
            }
        }
    }

    /// Open an MCP session with a sandbox's gateway (initialize within
    /// [`SESSION_TIMEOUT`]). Answers of up to `max_answer` bytes are read.
    pub async fn mcp_session(
        &self,
        sb: &SandboxAddr,
        token: &Secret,
        max_answer: usize,
    ) -> Result<McpSession> {
        let host = format!("{GATEWAY_PORT}-{}.{}", sb.id, sb.domain);
        let req = self.proxy_request(reqwest::Method::POST, &host, "/mcp", true)?;
        let (http, req) = req.build_split();
        let req = req.map_err(|e| CubeError::protocol(e.to_string()))?;
        let mut headers: HashMap<HeaderName, HeaderValue> = HashMap::new();
        for (k, v) in req.headers() {
            headers.insert(k.clone(), v.clone());
        }
        if let Some(t) = &sb.traffic_token {
            let mut v = HeaderValue::from_str(t.expose())
                .map_err(|_| CubeError::protocol("traffic token contains invalid characters"))?;
            v.set_sensitive(true);
            headers.insert(HeaderName::from_static("e2b-traffic-access-token"), v);
        }
        let cfg = StreamableHttpClientTransportConfig::with_uri(req.url().as_str())
            .auth_header(token.expose())
            .custom_headers(headers)
            .max_json_response_size(max_answer);
        let mut cfg = cfg;
        cfg.max_sse_event_size = max_answer;
        let transport = StreamableHttpClientTransport::with_client(http, cfg);
        let client = tokio::time::timeout(SESSION_TIMEOUT, ().serve(transport))
            .await
            .map_err(|_| CubeError::new(ErrorKind::Timeout, "the MCP gateway did not answer"))?
            .map_err(|e| {
                CubeError::new(
                    ErrorKind::Unavailable,
                    format!("the MCP gateway did not open a session: {e}"),
                )
            })?;
        Ok(McpSession { client })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shell_words_hold_quotes() {
        assert_eq!(shell_word("a'b"), "'a'\\''b'");
        assert_eq!(shell_word(r#"{"x":"y z"}"#), r#"'{"x":"y z"}'"#);
    }
}
