//! MCP: the agent tool surface, built on `rmcp`.
//!
//! Every tool is one `/v1` request (see `tools`), so MCP adds no policy of
//! its own: on the appliance (`/mcp`) the request goes through the same
//! router in-process with the caller's own `Authorization` header (same
//! identity, scopes, audit and errors); from `cube-adapter mcp` it goes to
//! the appliance over HTTPS. An appliance error comes back as a tool error
//! carrying its code and message.

pub mod http;
pub(crate) mod stdio;
pub(crate) mod tools;

use std::sync::Arc;

use axum::body::Body;
use rmcp::ErrorData as McpError;
use rmcp::ServerHandler;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    InitializeRequestParams, InitializeResult, ListToolsResult, PaginatedRequestParams,
    ServerCapabilities, ServerConfig, Tool, ToolAnnotations,
};
use rmcp::service::{RequestContext, RoleServer};
use serde_json::{Value, json};

use self::tools::{Host, Request, TOOLS};
use crate::broker::Code;

/// The tool-error code when the appliance could not be asked (no answer,
/// so no catalogue code): the only code a tool error carries that is not
/// a `broker::Code`.
const UNAVAILABLE: &str = "unavailable";

/// The profile `/v1/leases/acquire` uses when none is given.
const DEFAULT_PROFILE: &str = "offline-code";

/// Largest `/v1` answer a tool call reads (artifacts are 8 MiB, as base64).
const MAX_ANSWER: usize = 16 * 1024 * 1024;

/// Where tool calls go.
#[derive(Clone)]
pub enum Upstream {
    /// This appliance's `/v1` router, in-process; the caller's own
    /// `Authorization` header is taken from each MCP request.
    Local(axum::Router),
    /// An appliance over HTTPS (`cube-adapter mcp`), with a fixed identity.
    Remote {
        http: reqwest::Client,
        base: String,
        token: Option<crate::cube::Secret>,
    },
}

/// The MCP server: one per session.
#[derive(Clone)]
pub struct McpServer {
    upstream: Arc<Upstream>,
    host: Host,
}

/// What a profile offers beyond the common tools.
#[derive(Debug, Default, Clone, Copy)]
struct Offers {
    ptys: bool,
    mcp: bool,
}

impl McpServer {
    pub fn new(upstream: Upstream, host: Host) -> Self {
        Self {
            upstream: Arc::new(upstream),
            host,
        }
    }

    /// The tools, as MCP lists them to `host`.
    pub fn tools(host: &Host) -> Vec<Tool> {
        TOOLS
            .iter()
            .map(|t| {
                let schema = match tools::schema_for(t.name, host) {
                    Value::Object(m) => m,
                    _ => serde_json::Map::new(),
                };
                let mut tool = Tool::new(t.name, t.description, Arc::new(schema));
                tool.title = Some(t.title.to_string());
                tool.annotations = Some(ToolAnnotations::from_raw(
                    Some(t.title.to_string()),
                    Some(t.read_only),
                    Some(t.destructive),
                    Some(t.idempotent),
                    // Commands reach what the profile allows; the rest
                    // touch only the leased sandbox.
                    Some(tools::runs_commands(t.name)),
                ));
                tool
            })
            .collect()
    }

    /// Send one `/v1` request: its status and JSON answer.
    async fn send(
        &self,
        req: &Request,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<(u16, Value), Unreachable> {
        match self.upstream.as_ref() {
            Upstream::Local(router) => {
                use tower::ServiceExt;
                // The caller's own identity: its token, or the client
                // certificate its connection presented.
                let parts = ctx
                    .extensions
                    .get::<axum::http::request::Parts>()
                    .ok_or(Unreachable::NoHttpRequest)?;
                let auth = parts
                    .headers
                    .get(axum::http::header::AUTHORIZATION)
                    .cloned();
                let cert = parts.extensions.get::<crate::auth::PeerCert>().cloned();
                if auth.is_none() && cert.is_none() {
                    return Err(Unreachable::NoIdentity);
                }
                let mut b = axum::http::Request::builder()
                    .method(req.method)
                    .uri(&req.path);
                if let Some(a) = agent_of(ctx) {
                    b = b.header(crate::api::tasks::AGENT_HEADER, a);
                }
                if let Some(a) = auth {
                    b = b.header(axum::http::header::AUTHORIZATION, a);
                }
                if let Some(c) = cert {
                    b = b.extension(c);
                }
                let body = match &req.body {
                    Some(v) => {
                        b = b.header(axum::http::header::CONTENT_TYPE, "application/json");
                        Body::from(v.to_string())
                    }
                    None => Body::empty(),
                };
                let r = b.body(body).map_err(Unreachable::Request)?;
                let Ok(resp) = router.clone().oneshot(r).await;
                let status = resp.status().as_u16();
                let bytes = axum::body::to_bytes(resp.into_body(), MAX_ANSWER)
                    .await
                    .map_err(Unreachable::Body)?;
                let v = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
                Ok((status, v))
            }
            Upstream::Remote { http, base, token } => {
                let url = format!("{}{}", base.trim_end_matches('/'), req.path);
                let mut b = match req.method {
                    "GET" => http.get(url),
                    _ => http.post(url),
                };
                if let Some(t) = token {
                    b = b.bearer_auth(t.expose());
                }
                if let Some(a) = agent_of(ctx) {
                    b = b.header(crate::api::tasks::AGENT_HEADER, a);
                }
                if let Some(v) = &req.body {
                    b = b.json(v);
                }
                let resp = b.send().await.map_err(Unreachable::NoAnswer)?;
                let status = resp.status().as_u16();
                if resp.content_length().is_some_and(|n| n > MAX_ANSWER as u64) {
                    return Err(Unreachable::TooLarge);
                }
                let mut resp = resp;
                let mut bytes = Vec::new();
                while let Some(c) = resp.chunk().await.map_err(Unreachable::BrokeOff)? {
                    if bytes.len() + c.len() > MAX_ANSWER {
                        return Err(Unreachable::TooLarge);
                    }
                    bytes.extend_from_slice(&c);
                }
                let v = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
                Ok((status, v))
            }
        }
    }

    /// What the profile leases are acquired with offers beyond the common
    /// tools (asked of the appliance; no answer means nothing): terminals,
    /// and a governed MCP policy.
    async fn profile_offers(&self, ctx: &RequestContext<RoleServer>) -> Offers {
        let want = self
            .host_for(ctx)
            .profile
            .unwrap_or_else(|| DEFAULT_PROFILE.to_string());
        let req = Request {
            method: "GET",
            path: "/v1/profiles".into(),
            body: None,
        };
        let profile = match self.send(&req, ctx).await {
            Ok((200, v)) => v
                .get("profiles")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .find(|p| p["name"] == want.as_str())
                .cloned(),
            _ => None,
        };
        let Some(p) = profile else {
            return Offers::default();
        };
        Offers {
            ptys: p.get("ptys_enabled") == Some(&Value::Bool(true)),
            mcp: p.get("mcp_policy").is_some_and(Value::is_string),
        }
    }

    /// The host settings for this call (`/mcp?profile=…&runtime=…` on the
    /// appliance, which refuses an unknown runtime before MCP sees it).
    fn host_for(&self, ctx: &RequestContext<RoleServer>) -> Host {
        let mut host = self.host.clone();
        if let Some(q) = ctx
            .extensions
            .get::<axum::http::request::Parts>()
            .and_then(|p| p.uri.query())
        {
            let (profile, runtime) = host_query(q);
            host.profile = profile.or(host.profile);
            host.runtime = runtime.or(host.runtime);
        }
        host
    }

    /// The runtime `cube_acquire` uses when neither the host nor the model
    /// names one: the only one this identity may use with the profile (as
    /// `/v1/profiles` answers for it); else a tool error that says why.
    async fn default_runtime(
        &self,
        host: &Host,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<String, CallToolResult> {
        let want = host.profile.as_deref().unwrap_or(DEFAULT_PROFILE);
        let req = Request {
            method: "GET",
            path: "/v1/profiles".into(),
            body: None,
        };
        let v = match self.send(&req, ctx).await {
            Ok((200, v)) => v,
            Ok((_, v)) => return Err(refusal(&v)),
            Err(m) => return Err(tool_error(UNAVAILABLE, &m.to_string())),
        };
        let Some(profile) = v
            .get("profiles")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .find(|p| p["name"] == want)
        else {
            return Err(tool_error(
                Code::ProfileDenied.as_str(),
                &format!("profile {want} is not available to this identity"),
            ));
        };
        let allowed: Vec<&str> = profile["allowed_runtimes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        match allowed.as_slice() {
            [one] => Ok(one.to_string()),
            [] => Err(tool_error(
                Code::RuntimeDenied.as_str(),
                &format!("this identity may use no runtime with profile {want}"),
            )),
            several => Err(tool_error(
                Code::InvalidRuntime.as_str(),
                &format!(
                    "runtime is required: this identity may use {} with profile {want}; \
                     pass one of them as runtime",
                    several.join(", ")
                ),
            )),
        }
    }
}

/// `profile` and `runtime` from `/mcp`'s query (empty values are none).
pub fn host_query(q: &str) -> (Option<String>, Option<String>) {
    let (mut profile, mut runtime) = (None, None);
    for (k, v) in url::form_urlencoded::parse(q.as_bytes()) {
        if v.is_empty() {
            continue;
        }
        match k.as_ref() {
            "profile" => profile = Some(v.into_owned()),
            "runtime" => runtime = Some(v.into_owned()),
            _ => {}
        }
    }
    (profile, runtime)
}

/// What the model is told at `initialize`: the host's runtime when it set
/// one, never a runtime of our choosing.
pub fn instructions(host: &Host) -> String {
    let acquire = match &host.runtime {
        Some(r) => format!(
            "Start with cube_acquire and a stable session_key (this host runs you as \
             runtime {r}; the tool takes no runtime)"
        ),
        None => "Start with cube_acquire and a stable session_key (give runtime only \
                 when your identity may use several; otherwise its one runtime is used)"
            .to_string(),
    };
    format!(
        "Sandboxed Linux machines for running code. {acquire}, then use the lease_ref it \
         returns. Use cube_exec for short commands and cube_job_start + cube_job_resume for \
         long ones. Paths must be under /workspace or /tmp. Release with cube_release \
         when done."
    )
}

/// The tool error for an appliance's error answer (its envelope's code and
/// message).
fn refusal(v: &Value) -> CallToolResult {
    let code = v
        .pointer("/error/code")
        .and_then(Value::as_str)
        .unwrap_or(Code::ExecutionFailed.as_str());
    let message = v
        .pointer("/error/message")
        .and_then(Value::as_str)
        .unwrap_or("the appliance refused the call");
    tool_error(code, message)
}

/// Why a tool's `/v1` request got no answer (`tool_error` `unavailable`).
#[derive(Debug, thiserror::Error)]
pub enum Unreachable {
    #[error("the MCP request carried no HTTP request")]
    NoHttpRequest,
    #[error("the MCP request carried no identity")]
    NoIdentity,
    #[error("{0}")]
    Request(#[source] axum::http::Error),
    /// The in-process router's body could not be read (over `MAX_ANSWER`).
    #[error("{0}")]
    Body(#[source] axum::Error),
    #[error("the appliance did not answer: {0}")]
    NoAnswer(#[source] reqwest::Error),
    #[error("the appliance's answer is too large")]
    TooLarge,
    #[error("the appliance's answer broke off: {0}")]
    BrokeOff(#[source] reqwest::Error),
}

/// A tool error the model can act on: the appliance's code and message
/// (passed through as the appliance sent it, which may be a newer one).
fn tool_error(code: &str, message: &str) -> CallToolResult {
    let mut r = CallToolResult::structured_error(json!({"code": code, "message": message}));
    r.content = vec![ContentBlock::text(format!("{code}: {message}"))];
    r
}

/// The MCP host as its client info names it (`name version (MCP)`),
/// printable ASCII, for the plans it asks for; none before it said.
fn agent_of(ctx: &RequestContext<RoleServer>) -> Option<String> {
    let ci = &ctx.peer.peer_info()?.client_info;
    crate::broker::Ctx::agent_from(&format!("{} {} (MCP)", ci.name, ci.version))
}

impl ServerHandler for McpServer {
    #[allow(deprecated)]
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(
                Implementation::new("cube-adapter", env!("CARGO_PKG_VERSION"))
                    .with_title("CubeSandbox sandboxes"),
            )
            .with_instructions(instructions(&self.host))
    }

    async fn initialize(
        &self,
        request: InitializeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<InitializeResult, McpError> {
        context.peer.set_peer_info(request.clone());
        let mut info = self.negotiate_initialize(&request)?;
        // On `/mcp` the host's settings come with the request.
        info.instructions = Some(instructions(&self.host_for(&context)));
        Ok(info)
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        // Terminal tools only when the host's profile allows terminals,
        // governed MCP tools only when it has a policy.
        let offers = self.profile_offers(&context).await;
        let tools = Self::tools(&self.host_for(&context))
            .into_iter()
            .filter(|t| offers.ptys || !t.name.starts_with("cube_pty_"))
            .filter(|t| offers.mcp || !t.name.starts_with("cube_mcp_"))
            .collect();
        Ok(ListToolsResult::with_all_items(tools))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let args = request.arguments.clone().unwrap_or_default();
        let mut host = self.host_for(&context);
        if request.name == "cube_acquire" && host.runtime.is_none() && !args.contains_key("runtime")
        {
            match self.default_runtime(&host, &context).await {
                Ok(r) => host.runtime = Some(r),
                Err(e) => return Ok(e.into()),
            }
        }
        let req = match tools::request(request.name.as_ref(), &args, &host) {
            Ok(r) => r,
            Err(m) => return Ok(tool_error(Code::InvalidRequest.as_str(), &m.to_string()).into()),
        };
        let (status, v) = match self.send(&req, &context).await {
            Ok(x) => x,
            Err(m) => return Ok(tool_error(UNAVAILABLE, &m.to_string()).into()),
        };
        if (200..300).contains(&status) {
            // Structured content must be an object; anything else is text.
            return Ok(if v.is_object() {
                CallToolResult::structured(v)
            } else {
                CallToolResult::success(vec![ContentBlock::text(v.to_string())])
            }
            .into());
        }
        Ok(refusal(&v).into())
    }
}
