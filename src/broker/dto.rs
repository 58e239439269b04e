//! The /v1 answer shapes: what the broker's calls return, serialised as is
//! by /v1 (and so by MCP and the console). They are documented in
//! `docs/openapi.yaml`.
//!
//! The wire is the contract: each struct declares its fields in the
//! alphabetical order of their names on the wire (the order the hand-built
//! answers had), a field that was always present stays present (`null` when
//! unset), and only fields that were absent when unset are skipped.
//! Free-form parts (a template's parameter schema, a task's result, a
//! signed receipt) stay JSON values.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::tasks::{Expose, OutputFormat};
use crate::store::jobs::{Job, JobState};
use crate::store::leases::LeaseState;
use crate::store::plans::PlanState;
use crate::store::ptys::{Pty, PtyState};
use crate::store::tasks::TaskState;

/// What ran the sandbox, as every lease answer says it: a CubeSandbox
/// MicroVM (the reference's only value), or the embedded backend's
/// namespaced process tree, or (isolation `none`) plain processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Executor {
    #[serde(rename = "cubesandbox-microvm")]
    CubesandboxMicrovm,
    #[serde(rename = "cube-adapter-namespaces")]
    EmbeddedNamespaces,
    #[serde(rename = "cube-adapter-processes")]
    EmbeddedProcesses,
}

impl Executor {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::CubesandboxMicrovm => "cubesandbox-microvm",
            Self::EmbeddedNamespaces => "cube-adapter-namespaces",
            Self::EmbeddedProcesses => "cube-adapter-processes",
        }
    }
}

// ---------------------------------------------------------------- leases

/// `POST /v1/leases/acquire`: the lease for the session.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LeaseAnswer {
    pub executor: Executor,
    pub lease_ref: String,
    /// Always false.
    pub persistent_workspace: bool,
    pub profile: String,
    pub request_id: String,
    /// The session's existing lease was returned.
    pub reused: bool,
    /// The session's previous lease, whose sandbox was gone: this new
    /// lease (and sandbox, empty) takes its place. Only in the answer of
    /// the acquire that replaced it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replaced_lease_ref: Option<String>,
    pub sandbox_ref: String,
    pub state: LeaseState,
}

/// `POST /v1/leases/{ref}/checkpoints/{ckpt}/fork` (201).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ForkResponse {
    pub branch: String,
    pub checkpoint_ref: String,
    pub executor: Executor,
    pub lease_ref: String,
    pub persistent_workspace: bool,
    pub profile: String,
    pub request_id: String,
    pub reused: bool,
    pub sandbox_ref: String,
    pub source_lease_ref: String,
    pub state: LeaseState,
}

/// `GET /v1/leases`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LeaseList {
    pub leases: Vec<LeaseItem>,
}

/// One lease as listed.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LeaseItem {
    pub created_at: String,
    pub last_used_at: String,
    pub lease_ref: String,
    pub profile: String,
    pub runtime: String,
    pub sandbox_ref: String,
    pub state: LeaseState,
    /// Shown to admins only (`null` otherwise).
    pub tenant: Option<String>,
}

/// `GET|POST /v1/leases/{ref}/status`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LeaseStatus {
    /// The lease's checkpoints, oldest first (`checkpoints` is their count,
    /// as in the reference).
    pub checkpoint_list: Vec<CheckpointSummary>,
    pub checkpoints: usize,
    pub created_at: String,
    /// Only when the lease's profile has brokered egress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<LeaseEgress>,
    pub executor: Executor,
    pub expires_in_seconds: i64,
    /// The lease's jobs (`jobs` is their count, as in the reference).
    pub job_list: Vec<JobSummary>,
    pub jobs: usize,
    pub last_used_at: String,
    pub lease_ref: String,
    /// The template preset applied to its sandbox, `NAME@VERSION` (only
    /// when one was).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preset: Option<String>,
    /// SHA-256 (hex) of that preset as it was applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preset_digest: Option<String>,
    pub profile: String,
    /// Always true.
    pub recoverable: bool,
    pub request_id: String,
    pub runtime: String,
    pub sandbox_ref: String,
    pub state: LeaseState,
    /// Always false.
    pub volume_attached: bool,
}

/// A lease's brokered egress, as its status says it: where its sandbox
/// may reach through the proxy, never a credential or where one is kept.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseEgress {
    /// The profile's destinations, as it writes them, less those an
    /// operator narrowed away.
    pub destinations: Vec<String>,
    /// An operator narrowed the lease (`lease egress --only|--none`).
    pub narrowed: bool,
    /// The proxy's address inside the sandbox.
    pub proxy: String,
}

/// `GET /v1/leases/{ref}/recover`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LeaseRecovery {
    pub created_at: String,
    pub executor: Executor,
    pub jobs: Vec<JobSummary>,
    pub last_used_at: String,
    pub lease_ref: String,
    pub profile: String,
    pub recoverable: bool,
    pub request_id: String,
    pub runtime: String,
    pub sandbox_ref: String,
    /// As the backend sees it now.
    pub state: LeaseState,
}

/// How a lease is released.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReleaseAction {
    Pause,
    Kill,
}

/// `POST /v1/leases/{ref}/release`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReleaseResponse {
    pub action: ReleaseAction,
    pub executor: Executor,
    pub request_id: String,
    pub sandbox_ref: String,
}

/// `POST /v1/leases/{ref}/renew`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RenewResponse {
    /// Less than asked for: the keepalive budget ends sooner.
    pub capped: bool,
    pub executor: Executor,
    pub keepalive_until: String,
    pub lease_ref: String,
    pub request_id: String,
    pub sandbox_ref: String,
    pub timeout_seconds: u64,
}

/// `POST /v1/leases/{ref}/exec`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExecResponse {
    pub duration_ms: u64,
    pub executor: Executor,
    pub exit_code: i32,
    pub request_id: String,
    pub sandbox_ref: String,
    pub stderr: String,
    pub stderr_truncated: bool,
    pub stdout: String,
    pub stdout_truncated: bool,
}

/// `GET /v1/profiles`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProfileList {
    pub profiles: Vec<ProfileInfo>,
    pub request_id: String,
}

/// A profile as the caller may use it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProfileInfo {
    pub allow_internet_access: bool,
    /// Those the caller may use.
    pub allowed_runtimes: Vec<String>,
    pub checkpoints_enabled: bool,
    pub keepalive_enabled: bool,
    pub lease_idle_ttl_seconds: u64,
    pub max_active_leases_per_tenant: u32,
    pub max_command_seconds: u64,
    pub max_jobs_per_lease: u32,
    pub max_keepalive_seconds: u64,
    pub name: String,
    pub ptys_enabled: bool,
    pub sandbox_timeout_seconds: u64,
    /// Its governed MCP policy: the tools its sandboxes serve
    /// (`cube_mcp_tools` lists them once a lease is held).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mcp_policy: Option<String>,
}

/// `GET /v1/leases/{ref}/mcp/tools`: what the lease's MCP policy allows.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct McpToolList {
    pub lease_ref: String,
    pub policy: String,
    pub call_timeout_seconds: u64,
    pub max_input_bytes: u64,
    pub max_output_bytes: u64,
    pub tools: Vec<McpToolInfo>,
    pub request_id: String,
}

/// One tool an agent may call, with the schema its arguments must match.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct McpToolInfo {
    pub name: String,
    pub description: String,
    pub input_schema: serde_json::Value,
}

/// `POST /v1/leases/{ref}/mcp/call`: the tool's result as MCP gives it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct McpCallResponse {
    pub executor: Executor,
    pub lease_ref: String,
    pub sandbox_ref: String,
    pub tool: String,
    /// The tool reported an error (its content says which).
    pub is_error: bool,
    /// MCP content blocks (`{"type": "text", "text": …}` and the like).
    pub content: serde_json::Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub structured_content: Option<serde_json::Value>,
    /// The result's size as JSON (what the policy's limit counts).
    pub result_bytes: u64,
    pub duration_ms: u64,
    pub request_id: String,
}

/// `POST /v1/admin/gc`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GcResponse {
    pub collected: u64,
    pub failed: u64,
    pub request_id: String,
}

// ---------------------------------------------------------------- files

/// What a directory entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EntryType {
    Dir,
    File,
    Other,
}

/// A file or directory (the listing fields the reference exposes).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Entry {
    pub is_dir: bool,
    pub mode: u32,
    /// The same as `modified_time`, under the reference's name.
    #[serde(rename = "modifiedTime")]
    pub modified_time_ref: Option<String>,
    pub modified_time: Option<String>,
    pub name: String,
    pub path: String,
    pub permissions: String,
    pub size: u64,
    #[serde(rename = "type")]
    pub kind: EntryType,
}

impl From<&crate::cube::wire::EntryInfo> for Entry {
    fn from(e: &crate::cube::wire::EntryInfo) -> Self {
        let kind = match e.kind.as_str() {
            crate::cube::wire::FILE_TYPE_DIRECTORY => EntryType::Dir,
            crate::cube::wire::FILE_TYPE_FILE => EntryType::File,
            _ => EntryType::Other,
        };
        Self {
            is_dir: e.is_dir(),
            mode: e.mode,
            modified_time_ref: e.modified_time.clone(),
            modified_time: e.modified_time.clone(),
            name: e.name.clone(),
            path: e.path.clone(),
            permissions: e.permissions.clone(),
            size: e.size,
            kind,
        }
    }
}

/// `POST /v1/leases/{ref}/files/read`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReadResponse {
    pub content: String,
    pub executor: Executor,
    pub path: String,
    pub request_id: String,
    pub sandbox_ref: String,
    pub truncated: bool,
}

/// `POST /v1/leases/{ref}/files/write`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WriteResponse {
    pub bytes: u64,
    pub executor: Executor,
    pub path: String,
    pub request_id: String,
    pub sandbox_ref: String,
}

/// `POST /v1/leases/{ref}/files/list`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ListResponse {
    pub entries: Vec<Entry>,
    pub executor: Executor,
    pub path: String,
    pub request_id: String,
    pub sandbox_ref: String,
}

/// `POST /v1/leases/{ref}/files/stat` and `…/mkdir`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EntryResponse {
    pub entry: Entry,
    pub executor: Executor,
    pub path: String,
    pub request_id: String,
    pub sandbox_ref: String,
}

/// `POST /v1/leases/{ref}/files/remove`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RemoveResponse {
    pub executor: Executor,
    pub path: String,
    /// Always true.
    pub removed: bool,
    pub request_id: String,
    pub sandbox_ref: String,
}

/// `POST /v1/leases/{ref}/files/move`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MoveResponse {
    pub destination: String,
    pub entry: Entry,
    pub executor: Executor,
    pub path: String,
    pub request_id: String,
    pub sandbox_ref: String,
}

/// `POST /v1/leases/{ref}/artifacts/upload`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UploadResponse {
    pub bytes: u64,
    pub executor: Executor,
    pub path: String,
    pub request_id: String,
    pub sandbox_ref: String,
    pub sha256: String,
}

/// `POST /v1/leases/{ref}/artifacts/download`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DownloadResponse {
    pub bytes: u64,
    pub content_base64: String,
    pub executor: Executor,
    pub path: String,
    pub request_id: String,
    pub sandbox_ref: String,
    pub sha256: String,
}

/// The answer of a file operation: the shape its operation gives.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum FileAnswer {
    Download(DownloadResponse),
    Upload(UploadResponse),
    Move(MoveResponse),
    Read(ReadResponse),
    List(ListResponse),
    Entry(EntryResponse),
    Write(WriteResponse),
    Remove(RemoveResponse),
}

// ---------------------------------------------------------------- checkpoints

/// A checkpoint as listed.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CheckpointSummary {
    pub checkpoint_ref: String,
    pub created_at: String,
    pub executor: Executor,
    pub name: String,
    pub sandbox_ref: String,
}

impl CheckpointSummary {
    pub(crate) fn new(
        c: &crate::store::checkpoints::Checkpoint,
        executor: Executor,
        sandbox_ref: &str,
    ) -> Self {
        Self {
            checkpoint_ref: c.checkpoint_ref.clone(),
            created_at: c.created_at.clone(),
            executor,
            name: c.name.clone(),
            sandbox_ref: sandbox_ref.to_string(),
        }
    }
}

/// `GET /v1/leases/{ref}/checkpoints`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CheckpointList {
    /// Oldest first.
    pub checkpoints: Vec<CheckpointSummary>,
    pub executor: Executor,
    pub request_id: String,
    pub sandbox_ref: String,
}

/// `POST /v1/leases/{ref}/checkpoints` (201).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CheckpointCreated {
    pub checkpoint_ref: String,
    pub created_at: String,
    pub executor: Executor,
    pub name: String,
    pub request_id: String,
    pub sandbox_ref: String,
}

/// `POST /v1/leases/{ref}/checkpoints/{ckpt}/rollback`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RollbackResponse {
    pub checkpoint_ref: String,
    pub executor: Executor,
    pub request_id: String,
    pub sandbox_ref: String,
    /// Always `running`.
    pub state: LeaseState,
}

/// `POST /v1/leases/{ref}/checkpoints/{ckpt}/delete`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CheckpointDeleted {
    pub checkpoint_ref: String,
    /// Always true.
    pub deleted: bool,
    pub executor: Executor,
    pub request_id: String,
    pub sandbox_ref: String,
}

// ---------------------------------------------------------------- jobs

/// A job as a lease's status lists it (its stored state).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobSummary {
    pub created_at: String,
    pub exit_code: Option<i32>,
    pub job_ref: String,
    pub state: JobState,
    pub updated_at: String,
}

impl From<&Job> for JobSummary {
    fn from(j: &Job) -> Self {
        Self {
            created_at: j.created_at.clone(),
            exit_code: j.exit_code,
            job_ref: j.job_ref.clone(),
            state: j.state,
            updated_at: j.updated_at.clone(),
        }
    }
}

/// `POST /v1/leases/{ref}/jobs` (202).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobStarted {
    pub executor: Executor,
    pub job_ref: String,
    pub lease_ref: String,
    pub request_id: String,
    pub sandbox_ref: String,
    pub state: JobState,
}

/// `GET|POST /v1/jobs/{ref}/status` and `POST /v1/jobs/{ref}/cancel`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobAnswer {
    pub cancelled: bool,
    pub created_at: String,
    pub executor: Executor,
    pub exit_code: Option<i32>,
    pub job_ref: String,
    pub lease_ref: String,
    pub request_id: String,
    pub sandbox_ref: String,
    pub state: JobState,
    pub timed_out: bool,
    pub updated_at: String,
}

impl JobAnswer {
    pub(crate) fn new(j: &Job, executor: Executor, sandbox_ref: &str, request_id: &str) -> Self {
        Self {
            cancelled: j.cancelled,
            created_at: j.created_at.clone(),
            executor,
            exit_code: j.exit_code,
            job_ref: j.job_ref.clone(),
            lease_ref: j.lease_ref.clone(),
            request_id: request_id.to_string(),
            sandbox_ref: sandbox_ref.to_string(),
            state: j.state,
            timed_out: j.state == JobState::TimedOut,
            updated_at: j.updated_at.clone(),
        }
    }
}

/// `GET /v1/jobs/{ref}/recover`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobRecovery {
    pub cancelled: bool,
    pub created_at: String,
    pub executor: Executor,
    pub exit_code: Option<i32>,
    pub job_ref: String,
    pub lease_ref: String,
    /// False once the job is `lost`.
    pub recoverable: bool,
    pub request_id: String,
    pub sandbox_ref: String,
    pub state: JobState,
    pub stderr_bytes: u64,
    pub stdout_bytes: u64,
    pub timed_out: bool,
    pub updated_at: String,
}

/// How an output chunk's `data`/`content_base64` is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum OutputEncoding {
    /// A slice of `{"stdout":…,"stderr":…}` (the reference's paging).
    #[serde(rename = "json-fragment")]
    JsonFragment,
    #[serde(rename = "base64")]
    Base64,
}

/// `POST /v1/jobs/{ref}/output` with `offset`/`max_bytes`: the
/// reference's fragment paging.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobOutputFragment {
    pub cancelled: bool,
    pub created_at: String,
    pub data: String,
    /// `json-fragment`.
    pub encoding: OutputEncoding,
    pub eof: bool,
    pub executor: Executor,
    pub exit_code: Option<i32>,
    pub job_ref: String,
    pub lease_ref: String,
    pub next_offset: u64,
    pub offset: u64,
    pub request_id: String,
    pub sandbox_ref: String,
    pub state: JobState,
    pub timed_out: bool,
    /// A stream is longer than the fragment holds.
    pub truncated: bool,
    pub updated_at: String,
}

/// `POST /v1/jobs/{ref}/output` with per-stream cursors.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobOutputCursors {
    pub cancelled: bool,
    pub created_at: String,
    pub eof: bool,
    pub executor: Executor,
    pub exit_code: Option<i32>,
    pub job_ref: String,
    pub lease_ref: String,
    pub request_id: String,
    pub sandbox_ref: String,
    pub state: JobState,
    pub stderr_base64: String,
    pub stderr_next_offset: u64,
    pub stderr_offset: u64,
    pub stdout_base64: String,
    pub stdout_next_offset: u64,
    pub stdout_offset: u64,
    pub timed_out: bool,
    pub updated_at: String,
}

/// `POST /v1/jobs/{ref}/output`: the paging the caller asked for.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum JobOutput {
    Cursors(JobOutputCursors),
    Fragment(JobOutputFragment),
}

// ---------------------------------------------------------------- PTYs

/// A PTY: `POST /v1/leases/{ref}/ptys` (201), status, input, resize, kill.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PtyAnswer {
    pub cols: u32,
    pub created_at: String,
    pub executor: Executor,
    pub exit_code: Option<i32>,
    pub lease_ref: String,
    pub pty_ref: String,
    pub request_id: String,
    pub rows: u32,
    pub sandbox_ref: String,
    pub state: PtyState,
    pub updated_at: String,
}

impl PtyAnswer {
    pub(crate) fn new(p: &Pty, executor: Executor, sandbox_ref: &str, request_id: &str) -> Self {
        Self {
            cols: p.cols,
            created_at: p.created_at.clone(),
            executor,
            exit_code: p.exit_code,
            lease_ref: p.lease_ref.clone(),
            pty_ref: p.pty_ref.clone(),
            request_id: request_id.to_string(),
            rows: p.rows,
            sandbox_ref: sandbox_ref.to_string(),
            state: p.state,
            updated_at: p.updated_at.clone(),
        }
    }
}

/// Output bytes the PTY's buffer no longer held.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Missed {
    pub from: u64,
    pub to: u64,
}

/// `POST /v1/ptys/{ref}/output`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PtyOutput {
    pub cols: u32,
    pub content_base64: String,
    pub created_at: String,
    /// `base64`.
    pub encoding: OutputEncoding,
    pub eof: bool,
    pub executor: Executor,
    pub exit_code: Option<i32>,
    pub lease_ref: String,
    pub missed: Option<Missed>,
    pub next_offset: u64,
    pub offset: u64,
    pub pty_ref: String,
    pub request_id: String,
    pub rows: u32,
    pub sandbox_ref: String,
    pub state: PtyState,
    pub updated_at: String,
}

// ---------------------------------------------------------------- tasks

/// One declared output of a task template.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OutputContract {
    pub expose: Expose,
    pub format: OutputFormat,
    pub name: String,
    pub required: bool,
}

/// A task template as an identity that may plan it sees it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TaskTemplateContract {
    pub approval_required: bool,
    /// Approvals from distinct people a plan needs.
    pub approvals_required: u32,
    pub description: String,
    pub name: String,
    pub outputs: Vec<OutputContract>,
    /// The operator's JSON Schema for the parameters.
    pub parameters: Value,
    pub plan_ttl_seconds: u64,
    pub profile: String,
    /// A plan must say why (`reason`).
    pub reason_required: bool,
    pub template_sha256: String,
}

impl TaskTemplateContract {
    pub(crate) fn new(name: &str, t: &crate::config::TaskTemplate) -> Self {
        Self {
            approval_required: t.approval_required,
            approvals_required: t.approvals_required,
            reason_required: t.reason_required,
            description: t.description.clone(),
            name: name.to_string(),
            outputs: t
                .outputs
                .iter()
                .map(|o| OutputContract {
                    expose: o.expose,
                    format: o.format,
                    name: o.name.clone(),
                    required: o.required,
                })
                .collect(),
            parameters: t.parameters.clone(),
            plan_ttl_seconds: t.plan_ttl_seconds,
            profile: t.profile.clone(),
            template_sha256: t.digest(name),
        }
    }
}

/// `GET /v1/task-templates`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TaskTemplateList {
    pub request_id: String,
    pub task_templates: Vec<TaskTemplateContract>,
}

/// One person's decision on a plan, as answered (issue #36).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PlanDecision {
    /// The decider's identity digest (the stable key).
    pub identity: String,
    pub subject: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    pub tenant: String,
    pub at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// `console` or `api`.
    pub via: String,
}

impl From<&crate::store::plans::Decision> for PlanDecision {
    fn from(d: &crate::store::plans::Decision) -> Self {
        Self {
            identity: d.identity.clone(),
            subject: d.subject.clone(),
            label: d.label.clone(),
            tenant: d.tenant.clone(),
            at: d.at.clone(),
            reason: d.reason.clone(),
            via: d.via.clone(),
        }
    }
}

/// A plan: `POST /v1/tasks/plan` (201) and the approver's decision.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PlanAnswer {
    pub approval_required: bool,
    pub approved_at: Option<String>,
    /// Approvals from distinct people it needs, and those given so far.
    pub approvals_required: u32,
    pub approvals: Vec<PlanDecision>,
    /// The denial that ended it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub denial: Option<PlanDecision>,
    /// Why the agent asked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Who asked, readable (absent for plans made before it was kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested_by: Option<crate::store::plans::Requester>,
    pub command_sha256: String,
    pub created_at: String,
    pub decided_at: Option<String>,
    pub expires_at: String,
    pub parameters_sha256: String,
    pub plan_ref: String,
    pub profile: String,
    pub request_id: String,
    pub state: PlanState,
    pub task_ref: Option<String>,
    pub task_template: String,
    pub template_sha256: String,
}

impl PlanAnswer {
    pub(crate) fn new(p: &crate::store::plans::Plan, request_id: &str) -> Self {
        Self {
            approval_required: p.approval_required,
            approved_at: p.approved_at.clone(),
            approvals_required: p.approvals_required,
            approvals: p.approvals.iter().map(PlanDecision::from).collect(),
            denial: p.denial.as_ref().map(PlanDecision::from),
            reason: p.reason.clone(),
            requested_by: p.requested_by.clone(),
            command_sha256: p.command_sha256.clone(),
            created_at: p.created_at.clone(),
            decided_at: p.decided_at.clone(),
            expires_at: p.expires_at.clone(),
            parameters_sha256: p.parameters_sha256.clone(),
            plan_ref: p.plan_ref.clone(),
            profile: p.profile.clone(),
            request_id: request_id.to_string(),
            state: p.state,
            task_ref: p.task_ref.clone(),
            task_template: p.template.clone(),
            template_sha256: p.template_digest.clone(),
        }
    }
}

/// `GET /v1/task-plans/{ref}`: the plan, its template's contract, and for
/// approvers the parameters.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PlanReview {
    pub approval_required: bool,
    pub approved_at: Option<String>,
    pub approvals_required: u32,
    pub approvals: Vec<PlanDecision>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub denial: Option<PlanDecision>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested_by: Option<crate::store::plans::Requester>,
    pub command_sha256: String,
    pub contract: TaskTemplateContract,
    pub created_at: String,
    pub decided_at: Option<String>,
    pub expires_at: String,
    /// To approvers only (absent otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Value>,
    pub parameters_sha256: String,
    pub plan_ref: String,
    pub profile: String,
    pub request_id: String,
    pub state: PlanState,
    pub task_ref: Option<String>,
    pub task_template: String,
    pub template_sha256: String,
}

impl PlanReview {
    pub(crate) fn new(
        plan: PlanAnswer,
        contract: TaskTemplateContract,
        parameters: Option<Value>,
    ) -> Self {
        Self {
            approval_required: plan.approval_required,
            approved_at: plan.approved_at,
            approvals_required: plan.approvals_required,
            approvals: plan.approvals,
            denial: plan.denial,
            reason: plan.reason,
            requested_by: plan.requested_by,
            command_sha256: plan.command_sha256,
            contract,
            created_at: plan.created_at,
            decided_at: plan.decided_at,
            expires_at: plan.expires_at,
            parameters,
            parameters_sha256: plan.parameters_sha256,
            plan_ref: plan.plan_ref,
            profile: plan.profile,
            request_id: plan.request_id,
            state: plan.state,
            task_ref: plan.task_ref,
            task_template: plan.task_template,
            template_sha256: plan.template_sha256,
        }
    }
}

/// A task: submit (202), status, result and cancel.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TaskAnswer {
    /// `verified` or `pending`, once the sandbox's end was attempted.
    pub cleanup: Option<String>,
    pub completed_at: Option<String>,
    pub created_at: String,
    pub execution_ended: bool,
    pub exit_code: Option<i32>,
    pub plan_ref: String,
    pub profile: String,
    /// With the result (to those who may act on the task): the signed
    /// receipt, `null` until it is issued. Absent otherwise.
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    pub receipt: Option<Value>,
    pub receipt_ready: bool,
    /// Why its setup failed (`code: message`), for a `setup_failed` task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub setup_error: Option<String>,
    pub request_id: String,
    /// Once computed, to those who may act on the task (absent otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    pub result_ready: bool,
    pub sandbox_ref: Option<String>,
    pub state: TaskState,
    pub task_ref: String,
    pub task_template: String,
    pub template_sha256: String,
    pub updated_at: String,
}

/// `GET|POST /v1/tasks/{ref}/receipt`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReceiptResponse {
    /// The signed envelope, exactly as signed.
    pub receipt: Value,
    pub request_id: String,
    pub task_ref: String,
}

/// `GET /v1/receipts/public-key`: the Ed25519 key receipts are signed with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublicKey {
    /// `EdDSA`.
    pub alg: String,
    /// `Ed25519`.
    pub crv: String,
    pub kid: String,
    /// Base64url, unpadded.
    pub public_key: String,
}

/// A key that is present, even as `null`: `Some(Value::Null)`, not `None`.
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}

#[cfg(test)]
mod tests {
    use serde::de::DeserializeOwned;

    use super::*;

    /// The typed bytes are those of the same object built as a JSON value
    /// (whose keys serde_json sorts), and they read back unchanged.
    fn same_wire<T: Serialize + DeserializeOwned>(t: &T) -> String {
        let typed = serde_json::to_string(t).unwrap();
        let value = serde_json::to_value(t).unwrap();
        assert_eq!(typed, serde_json::to_string(&value).unwrap());
        let back: T = serde_json::from_str(&typed).unwrap();
        assert_eq!(serde_json::to_string(&back).unwrap(), typed);
        typed
    }

    fn job() -> JobAnswer {
        JobAnswer {
            cancelled: false,
            created_at: "t0".into(),
            executor: Executor::CubesandboxMicrovm,
            exit_code: None,
            job_ref: "job_1".into(),
            lease_ref: "lease_1".into(),
            request_id: "r".into(),
            sandbox_ref: "sbx".into(),
            state: JobState::Running,
            timed_out: false,
            updated_at: "t1".into(),
        }
    }

    #[test]
    fn lease_answer_keeps_its_bytes() {
        let s = same_wire(&LeaseAnswer {
            executor: Executor::CubesandboxMicrovm,
            lease_ref: "lease_x".into(),
            persistent_workspace: false,
            profile: "default".into(),
            request_id: "r".into(),
            reused: true,
            replaced_lease_ref: None,
            sandbox_ref: "sbx".into(),
            state: LeaseState::Running,
        });
        assert_eq!(
            s,
            r#"{"executor":"cubesandbox-microvm","lease_ref":"lease_x","persistent_workspace":false,"profile":"default","request_id":"r","reused":true,"sandbox_ref":"sbx","state":"running"}"#
        );
    }

    #[test]
    fn job_answers_keep_their_bytes_and_nulls() {
        let s = same_wire(&job());
        assert!(s.contains(r#""exit_code":null"#));
        let a = job();
        same_wire(&JobOutput::Cursors(JobOutputCursors {
            cancelled: a.cancelled,
            created_at: a.created_at,
            eof: false,
            executor: a.executor,
            exit_code: Some(0),
            job_ref: a.job_ref,
            lease_ref: a.lease_ref,
            request_id: a.request_id,
            sandbox_ref: a.sandbox_ref,
            state: a.state,
            stderr_base64: String::new(),
            stderr_next_offset: 0,
            stderr_offset: 0,
            stdout_base64: "aGk=".into(),
            stdout_next_offset: 2,
            stdout_offset: 0,
            timed_out: false,
            updated_at: a.updated_at,
        }));
    }

    #[test]
    fn file_answers_read_back_as_their_operation() {
        let entry = Entry {
            is_dir: false,
            mode: 0o644,
            modified_time_ref: None,
            modified_time: None,
            name: "a".into(),
            path: "/workspace/a".into(),
            permissions: "-rw-r--r--".into(),
            size: 2,
            kind: EntryType::File,
        };
        let m = same_wire(&FileAnswer::Move(MoveResponse {
            destination: "/workspace/b".into(),
            entry: entry.clone(),
            executor: Executor::CubesandboxMicrovm,
            path: "/workspace/a".into(),
            request_id: "r".into(),
            sandbox_ref: "sbx".into(),
        }));
        assert!(matches!(
            serde_json::from_str::<FileAnswer>(&m).unwrap(),
            FileAnswer::Move(_)
        ));
        let d = same_wire(&FileAnswer::Download(DownloadResponse {
            bytes: 2,
            content_base64: "aGk=".into(),
            executor: Executor::CubesandboxMicrovm,
            path: "/workspace/a".into(),
            request_id: "r".into(),
            sandbox_ref: "sbx".into(),
            sha256: "00".into(),
        }));
        assert!(matches!(
            serde_json::from_str::<FileAnswer>(&d).unwrap(),
            FileAnswer::Download(_)
        ));
        assert!(same_wire(&entry).ends_with(r#""size":2,"type":"file"}"#));
    }

    #[test]
    fn a_task_answer_shows_a_null_receipt_only_with_its_result() {
        let mut t = TaskAnswer {
            cleanup: None,
            completed_at: None,
            created_at: "t0".into(),
            execution_ended: true,
            exit_code: Some(0),
            plan_ref: "plan_1".into(),
            profile: "default".into(),
            receipt: None,
            receipt_ready: false,
            request_id: "r".into(),
            result: None,
            result_ready: false,
            sandbox_ref: None,
            setup_error: None,
            state: TaskState::Succeeded,
            task_ref: "task_1".into(),
            task_template: "train".into(),
            template_sha256: "00".into(),
            updated_at: "t1".into(),
        };
        let s = same_wire(&t);
        assert!(!s.contains(r#""receipt":"#) && !s.contains(r#""result":"#));
        t.receipt = Some(Value::Null);
        t.result = Some(serde_json::json!({"outputs": {}}));
        let s = same_wire(&t);
        assert!(s.contains(r#""receipt":null"#));
    }
}
