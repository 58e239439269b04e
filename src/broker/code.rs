//! The error catalogue: every machine code an error carries, from one
//! table. Per code: its wire name (the `code` of the error envelope), its
//! HTTP status, the audit outcome an effect that fails with it records, and
//! the `Retry-After` (seconds) its answer carries.
//!
//! `docs/openapi.yaml` lists exactly these wire names as `Error.code` (a
//! test keeps them in step).

use http::StatusCode;

/// What an effect (a sandbox operation after its committed intent)
/// records when it fails with a code: `rejected`, `error` or `uncertain`.
/// A request refused before its intent is always recorded `rejected`
/// (`Broker::reject`), whatever its code.
pub use crate::audit::event::Outcome;

macro_rules! codes {
    ($(
        $(#[$doc:meta])*
        $variant:ident = $wire:literal, $status:ident, $outcome:ident, $retry:expr;
    )*) => {
        /// An error's stable machine code.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Code {
            $($(#[$doc])* $variant,)*
        }

        impl Code {
            /// Every code, in table order.
            pub const ALL: &'static [Code] = &[$(Code::$variant,)*];

            /// The wire name: the envelope's `code`.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(Code::$variant => $wire,)*
                }
            }

            /// The code with this wire name.
            pub fn from_wire(s: &str) -> Option<Code> {
                Code::ALL.iter().copied().find(|c| c.as_str() == s)
            }

            /// The HTTP status of an answer with this code.
            pub const fn status(self) -> StatusCode {
                match self {
                    $(Code::$variant => StatusCode::$status,)*
                }
            }

            /// What an effect that fails with this code records.
            pub const fn outcome(self) -> Outcome {
                match self {
                    $(Code::$variant => Outcome::$outcome,)*
                }
            }

            /// The `Retry-After` (seconds) an answer with this code carries.
            pub const fn retry_after(self) -> Option<u32> {
                match self {
                    $(Code::$variant => $retry,)*
                }
            }
        }
    };
}

codes! {
    // 400
    /// An empty body (400 here, where the reference said 413).
    InvalidBody = "invalid_body", BAD_REQUEST, Rejected, None;
    InvalidJson = "invalid_json", BAD_REQUEST, Rejected, None;
    UnknownFields = "unknown_fields", BAD_REQUEST, Rejected, None;
    /// `error`, not `rejected`: a PTY that is no longer running, found by
    /// the effect itself, has always been recorded so.
    InvalidRequest = "invalid_request", BAD_REQUEST, Error, None;
    InvalidRuntime = "invalid_runtime", BAD_REQUEST, Rejected, None;
    InvalidPath = "invalid_path", BAD_REQUEST, Rejected, None;
    InvalidTimeout = "invalid_timeout", BAD_REQUEST, Rejected, None;
    InvalidBase64 = "invalid_base64", BAD_REQUEST, Rejected, None;
    InvalidOffset = "invalid_offset", BAD_REQUEST, Rejected, None;
    InvalidLimit = "invalid_limit", BAD_REQUEST, Rejected, None;
    InvalidPtySize = "invalid_pty_size", BAD_REQUEST, Rejected, None;
    InvalidBranch = "invalid_branch", BAD_REQUEST, Rejected, None;
    InvalidAction = "invalid_action", BAD_REQUEST, Rejected, None;
    InvalidParameters = "invalid_parameters", BAD_REQUEST, Rejected, None;
    /// A template that requires a reason, and a plan without one.
    ReasonRequired = "reason_required", BAD_REQUEST, Rejected, None;
    InvalidDecision = "invalid_decision", BAD_REQUEST, Rejected, None;
    /// Arguments of a governed MCP call that its tool's schema refuses
    /// (or that are not an object); checked before the sandbox sees them.
    McpArgumentsInvalid = "mcp_arguments_invalid", BAD_REQUEST, Rejected, None;

    // 401
    Unauthorized = "unauthorized", UNAUTHORIZED, Rejected, None;
    /// An OIDC token that does not hold, or claims more than its issuer
    /// may grant (`[[auth.oidc]]` tenants, allowed_roles).
    InvalidToken = "invalid_token", UNAUTHORIZED, Rejected, None;

    // 403
    ActionDenied = "action_denied", FORBIDDEN, Rejected, None;
    AdminRequired = "admin_required", FORBIDDEN, Rejected, None;
    RuntimeDenied = "runtime_denied", FORBIDDEN, Rejected, None;
    ProfileDenied = "profile_denied", FORBIDDEN, Rejected, None;
    PathDenied = "path_denied", FORBIDDEN, Rejected, None;
    CheckpointDenied = "checkpoint_denied", FORBIDDEN, Rejected, None;
    TaskTemplateDenied = "task_template_denied", FORBIDDEN, Rejected, None;
    ApproverRequired = "approver_required", FORBIDDEN, Rejected, None;
    SelfApprovalDenied = "self_approval_denied", FORBIDDEN, Rejected, None;
    /// Reading evidence (a session recording) needs the auditor or admin
    /// role.
    AuditorRequired = "auditor_required", FORBIDDEN, Rejected, None;
    /// A governed MCP call to a tool its policy does not allow (or on a
    /// lease without a policy).
    McpToolDenied = "mcp_tool_denied", FORBIDDEN, Rejected, None;
    /// The egress proxy refused a destination the lease's profile does not
    /// name (or no longer names: narrowed), or whose name resolved to a
    /// private address.
    EgressDestinationDenied = "egress_destination_denied", FORBIDDEN, Rejected, None;
    /// The lease moved as many bytes through the egress proxy as its
    /// profile allows (`egress.max_bytes`).
    EgressBudgetExceeded = "egress_budget_exceeded", FORBIDDEN, Rejected, None;

    // 404
    /// An unknown route.
    NotFound = "not_found", NOT_FOUND, Rejected, None;
    LeaseNotFound = "lease_not_found", NOT_FOUND, Rejected, None;
    JobNotFound = "job_not_found", NOT_FOUND, Rejected, None;
    /// No such recording, or not one of the caller's tenant.
    RecordingNotFound = "recording_not_found", NOT_FOUND, Rejected, None;
    PtyNotFound = "pty_not_found", NOT_FOUND, Rejected, None;
    /// `error`, not `rejected`: a snapshot found gone by the effect (a
    /// rollback, a fork) has always been recorded so.
    CheckpointNotFound = "checkpoint_not_found", NOT_FOUND, Error, None;
    ArtifactNotFound = "artifact_not_found", NOT_FOUND, Rejected, None;
    TaskPlanNotFound = "task_plan_not_found", NOT_FOUND, Rejected, None;
    TaskNotFound = "task_not_found", NOT_FOUND, Rejected, None;
    PathNotFound = "path_not_found", NOT_FOUND, Rejected, None;

    // 407
    /// The egress proxy's network listener got a request without its
    /// lease's proxy token (`Proxy-Authorization: Basic LEASE:TOKEN`).
    EgressProxyAuthRequired = "egress_proxy_auth_required", PROXY_AUTHENTICATION_REQUIRED, Rejected, None;

    // 409
    ProfileConflict = "profile_conflict", CONFLICT, Rejected, None;
    KeepaliveExhausted = "keepalive_exhausted", CONFLICT, Rejected, None;
    AlreadyExists = "already_exists", CONFLICT, Rejected, None;
    /// Never produced here (the reference's answer for a checkpoint of a
    /// lease with a mounted volume); kept: the reference's catalogue lists
    /// it.
    CheckpointWithMountDenied = "checkpoint_with_mount_denied", CONFLICT, Rejected, None;
    PlanNotPending = "plan_not_pending", CONFLICT, Rejected, None;
    /// The same person approving a plan again (a quorum counts people).
    AlreadyApproved = "already_approved", CONFLICT, Rejected, None;
    PlanNotApproved = "plan_not_approved", CONFLICT, Rejected, None;
    PlanExpired = "plan_expired", CONFLICT, Rejected, None;
    TaskTemplateChanged = "task_template_changed", CONFLICT, Rejected, None;
    /// Never produced here (the reference's answer for a task without a
    /// job); kept: the reference's catalogue lists it.
    TaskNotReady = "task_not_ready", CONFLICT, Rejected, None;
    TaskRunning = "task_running", CONFLICT, Rejected, None;
    ReceiptNotReady = "receipt_not_ready", CONFLICT, Rejected, None;
    /// Input or a resize for a PTY that has ended (or was lost at a
    /// restart): the request was fine, the terminal is gone.
    PtyNotRunning = "pty_not_running", CONFLICT, Rejected, None;
    ForkConflict = "fork_conflict", CONFLICT, Rejected, None;
    /// The lease holds an operation whose result nobody knows (an MCP
    /// call past its timeout): nothing more is done with it until an
    /// operator reconciles that operation.
    LeaseBlocked = "lease_blocked", CONFLICT, Rejected, None;

    // 410
    /// The sandbox behind the lease is gone (it ended, was killed, timed
    /// out or died): acquire again with the same session key for a new one.
    SandboxGone = "sandbox_gone", GONE, Error, None;

    // 413
    /// A body over 16 MiB: the reference's 413 `invalid_body`, the same
    /// wire name as `InvalidBody` with another status.
    BodyTooLarge = "invalid_body", PAYLOAD_TOO_LARGE, Rejected, None;
    ValueTooLarge = "value_too_large", PAYLOAD_TOO_LARGE, Rejected, None;
    ArtifactTooLarge = "artifact_too_large", PAYLOAD_TOO_LARGE, Rejected, None;

    // 415
    UnsupportedMediaType = "unsupported_media_type", UNSUPPORTED_MEDIA_TYPE, Rejected, None;

    // 429
    LeaseQuotaExceeded = "lease_quota_exceeded", TOO_MANY_REQUESTS, Rejected, None;
    JobQuotaExceeded = "job_quota_exceeded", TOO_MANY_REQUESTS, Rejected, None;
    SessionQuotaExceeded = "session_quota_exceeded", TOO_MANY_REQUESTS, Rejected, None;
    PlanQuotaExceeded = "plan_quota_exceeded", TOO_MANY_REQUESTS, Rejected, None;
    SignInThrottled = "sign_in_throttled", TOO_MANY_REQUESTS, Rejected, None;
    /// The lease started requests through the egress proxy faster than its
    /// profile allows (`egress.requests_per_second`).
    EgressRateLimited = "egress_rate_limited", TOO_MANY_REQUESTS, Rejected, None;

    // 500
    /// A request handler panicked.
    InternalError = "internal_error", INTERNAL_SERVER_ERROR, Error, None;

    // 502
    /// A backend (CubeSandbox) operation failed.
    ExecutionFailed = "execution_failed", BAD_GATEWAY, Error, None;
    /// The profile names a template the backend does not have: the
    /// operator's configuration, not the agent's request (alert on it).
    TemplateNotFound = "template_not_found", BAD_GATEWAY, Error, None;
    /// The profile gives sandboxes network access the backend's host
    /// cannot provide (the embedded backend without `pasta` or `nft`): the
    /// operator's configuration, not the agent's request.
    NetworkUnavailable = "network_unavailable", BAD_GATEWAY, Error, None;
    CheckpointCleanupFailed = "checkpoint_cleanup_failed", BAD_GATEWAY, Error, None;
    InvalidArtifact = "invalid_artifact", BAD_GATEWAY, Error, None;
    /// The sandbox's MCP gateway would not start or open a session: the
    /// call was not sent.
    McpGatewayUnavailable = "mcp_gateway_unavailable", BAD_GATEWAY, Error, None;
    /// The profile's template preset could not be applied to a new sandbox
    /// (a bootstrap or after command failed, a file or a secret it names):
    /// the sandbox is killed, no lease.
    PresetFailed = "preset_failed", BAD_GATEWAY, Error, None;
    /// A pre-check of the profile's template preset failed: the sandbox is
    /// killed, no lease.
    PresetCheckFailed = "preset_check_failed", BAD_GATEWAY, Error, None;
    /// The egress proxy could not resolve or reach an allowed destination,
    /// or the destination broke off.
    EgressUpstreamFailed = "egress_upstream_failed", BAD_GATEWAY, Error, None;
    /// A brokered credential's secret file could not be read: the request
    /// was not sent.
    EgressCredentialUnavailable = "egress_credential_unavailable", BAD_GATEWAY, Error, None;
    /// The sandbox's MCP server answered a call with an error (or with
    /// something other than a result).
    McpCallFailed = "mcp_call_failed", BAD_GATEWAY, Error, None;
    /// A governed MCP call's result is larger than its policy allows: it
    /// ran, and its result is not returned.
    McpResultTooLarge = "mcp_result_too_large", BAD_GATEWAY, Error, None;
    /// A governed MCP call sent, whose answer never came: it may have
    /// run. Its intent stays pending and the lease blocked.
    McpCallUnconfirmed = "mcp_call_unconfirmed", BAD_GATEWAY, Uncertain, None;

    // 503
    /// The audit journal (or the store, or the identity store) is
    /// unavailable.
    AuditUnavailable = "audit_unavailable", SERVICE_UNAVAILABLE, Error, Some(5);
    /// The disk the appliance (or its embedded backend) writes is nearly
    /// full: no new sandboxes until space returns.
    StorageLow = "storage_low", SERVICE_UNAVAILABLE, Error, Some(30);
    /// The backend of the lease or profile does not answer (its health
    /// watch found it down): nothing was done; the other backends serve.
    BackendUnavailable = "backend_unavailable", SERVICE_UNAVAILABLE, Error, Some(5);
    /// Too many open connections (from the client's address, or in all):
    /// the listener answers only health checks until some close.
    ConnectionLimit = "connection_limit", SERVICE_UNAVAILABLE, Error, Some(5);

    // 504
    /// A backend operation or a command timed out: it may have happened.
    Timeout = "timeout", GATEWAY_TIMEOUT, Uncertain, None;
    /// A governed MCP call past its policy's timeout: it may have run.
    /// Its intent stays pending and the lease blocked.
    McpCallTimeout = "mcp_call_timeout", GATEWAY_TIMEOUT, Uncertain, None;
}

impl Code {
    /// A call sent whose answer is unknown: its intent stays pending and
    /// its lease is held until an operator reconciles it.
    pub const fn holds_lease(self) -> bool {
        matches!(self, Code::McpCallTimeout | Code::McpCallUnconfirmed)
    }
}

impl std::fmt::Display for Code {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl serde::Serialize for Code {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_names_are_unique_but_for_the_413_invalid_body() {
        let mut seen = std::collections::HashMap::new();
        for c in Code::ALL {
            if let Some(other) = seen.insert(c.as_str(), *c) {
                assert_eq!(
                    (other, *c),
                    (Code::InvalidBody, Code::BodyTooLarge),
                    "{} is used twice",
                    c.as_str()
                );
            }
        }
    }

    #[test]
    fn wire_names_are_snake_case_and_serialised_as_such() {
        for c in Code::ALL {
            let s = c.as_str();
            assert!(
                s.starts_with(|c: char| c.is_ascii_lowercase())
                    && s.bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
                "{s}"
            );
            assert_eq!(serde_json::to_value(c).unwrap(), serde_json::json!(s));
            assert_eq!(c.to_string(), s);
        }
    }

    #[test]
    fn every_code_is_an_error_status_and_only_503_says_when_to_retry() {
        for c in Code::ALL {
            assert!(
                c.status().is_client_error() || c.status().is_server_error(),
                "{c}"
            );
            assert_eq!(
                c.retry_after().is_some(),
                c.status() == StatusCode::SERVICE_UNAVAILABLE,
                "{c}"
            );
        }
        assert_eq!(Code::BodyTooLarge.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(Code::InvalidBody.status(), StatusCode::BAD_REQUEST);
    }

    #[test]
    fn only_a_timeout_is_uncertain_and_server_errors_are_errors() {
        for c in Code::ALL {
            // The codes that hold a lease write no outcome at all: their
            // intent stays pending until an operator reconciles it.
            assert_eq!(
                c.outcome() == Outcome::Uncertain,
                *c == Code::Timeout || c.holds_lease(),
                "{c}"
            );
            if c.status().is_server_error() && *c != Code::Timeout && !c.holds_lease() {
                assert_eq!(c.outcome(), Outcome::Error, "{c}");
            }
        }
    }
}
