//! Wire types shared by the CubeSandbox client (`cube/`) and the embedded
//! backend (`embedded/`): CubeAPI JSON bodies, envd messages and the Connect
//! envelope framing. Field names follow the real services exactly (see
//! `docs/cube-protocol.md`): CubeAPI is camelCase with `ID` abbreviations,
//! envd is protojson (lowerCamelCase, zero values omitted, int64 as string).

use std::collections::BTreeMap;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use serde::{Deserialize, Serialize};

/// The envd port every template exposes.
pub const ENVD_PORT: u16 = 49983;
/// The port of a sandbox's MCP gateway (`mcp-gateway`, `gateway.rs`): MCP
/// Streamable HTTP at `/mcp`, health at `/health`.
pub const MCP_GATEWAY_PORT: u16 = 50005;
/// The port a sandbox's processes reach the appliance's egress proxy on:
/// `127.0.0.1:3128` inside the sandbox's own network namespace, carried
/// to the appliance by the sandbox's egress tap (`egress_tap.rs`); never a
/// port of the host's.
pub const EGRESS_PROXY_PORT: u16 = 3128;
/// Version string our embedded envd reports (the E2B envd it mirrors).
pub const ENVD_VERSION: &str = "0.5.13";
/// Largest Connect envelope either side accepts (the SDK's own limit).
pub const MAX_ENVELOPE: usize = 64 * 1024 * 1024;
/// Envelope flag: end of stream (payload is the end-stream message).
pub const FLAG_END_STREAM: u8 = 0x02;
/// Envelope flag: compressed payload (never used with identity encoding).
pub const FLAG_COMPRESSED: u8 = 0x01;

// ---------------------------------------------------------------- CubeAPI

/// `lifecycle` on create: what happens when the timeout expires.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Lifecycle {
    #[serde(default, alias = "on_timeout", skip_serializing_if = "Option::is_none")]
    pub on_timeout: Option<String>,
    #[serde(
        default,
        alias = "auto_resume",
        skip_serializing_if = "Option::is_none"
    )]
    pub auto_resume: Option<bool>,
}

/// The subset of the network policy object we understand and echo.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct NetworkPolicy {
    #[serde(default, alias = "allow_out", skip_serializing_if = "Option::is_none")]
    pub allow_out: Option<Vec<String>>,
    #[serde(default, alias = "deny_out", skip_serializing_if = "Option::is_none")]
    pub deny_out: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_public_traffic: Option<bool>,
}

/// `POST /sandboxes` body. Unknown fields are ignored, as CubeAPI does.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CreateSandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lifecycle: Option<Lifecycle>,
    #[serde(
        default,
        rename = "autoPause",
        alias = "auto_pause",
        skip_serializing_if = "Option::is_none"
    )]
    pub auto_pause: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_internet_access: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkPolicy>,
    /// The size of the sandbox's own disk (MiB): an extension the embedded
    /// backend honours (`embedded::disk`); CubeSandbox ignores it (its
    /// templates size their disks).
    #[serde(
        default,
        rename = "diskSizeMB",
        skip_serializing_if = "Option::is_none"
    )]
    pub disk_size_mb: Option<u64>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    #[serde(
        default,
        rename = "envVars",
        alias = "envs",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub env_vars: BTreeMap<String, String>,
    /// Volumes to mount (`POST /volumes` made them). From a snapshot: None
    /// re-attaches the volumes the snapshot recorded; `Some` (even empty)
    /// replaces them.
    #[serde(
        default,
        rename = "volumeMounts",
        alias = "volume_mounts",
        skip_serializing_if = "Option::is_none"
    )]
    pub volume_mounts: Option<Vec<VolumeMount>>,
}

/// One entry of `volumeMounts`: the volume `name` (its ID) at `path`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct VolumeMount {
    /// The volume's ID.
    pub name: String,
    /// Where it appears in the sandbox (absolute).
    pub path: String,
    #[serde(
        default,
        rename = "readOnly",
        alias = "read_only",
        skip_serializing_if = "Option::is_none"
    )]
    pub read_only: Option<bool>,
}

impl VolumeMount {
    pub fn is_read_only(&self) -> bool {
        self.read_only == Some(true)
    }
}

/// `POST /volumes` body.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct CreateVolume {
    /// `^[a-zA-Z0-9_-]+$`, at most 128; empty: the server picks a UUID.
    #[serde(default)]
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver: Option<String>,
    /// The volume's size (MiB): an extension the embedded backend honours
    /// (a file system of that size, when it runs as root); CubeAPI ignores
    /// it.
    #[serde(default, rename = "sizeMB", skip_serializing_if = "Option::is_none")]
    pub size_mb: Option<u64>,
}

/// A volume, as `POST /volumes` and `GET /volumes/{id}` return it (the
/// list omits `token`, read as "").
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Volume {
    #[serde(rename = "volumeID")]
    pub volume_id: String,
    #[serde(default)]
    pub name: String,
    /// Always present on create and get, `""` when there is none.
    #[serde(default)]
    pub token: String,
}

/// One entry of `GET /volumes`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct VolumeInfo {
    #[serde(rename = "volumeID")]
    pub volume_id: String,
    #[serde(default)]
    pub name: String,
}

/// `Sandbox` as returned by create, connect and resume.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Sandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID", default)]
    pub client_id: String,
    #[serde(rename = "envdVersion", default)]
    pub envd_version: String,
    #[serde(
        rename = "trafficAccessToken",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub traffic_access_token: Option<String>,
    #[serde(default)]
    pub domain: String,
}

/// `SandboxDetail` (`GET /sandboxes/{id}`) and `ListedSandbox` (list): one
/// struct, the list omits `domain`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxDetail {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID", default)]
    pub client_id: String,
    pub started_at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_at: Option<String>,
    #[serde(default)]
    pub envd_version: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
    #[serde(default)]
    pub cpu_count: u32,
    #[serde(rename = "memoryMB", default)]
    pub memory_mb: u64,
    #[serde(rename = "diskSizeMB", default)]
    pub disk_size_mb: u64,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    pub state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_mounts: Option<Vec<VolumeMount>>,
}

/// `POST /sandboxes/{id}/timeout` and `/connect` bodies.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TimeoutBody {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<i64>,
}

/// `POST /sandboxes/{id}/refreshes` body.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RefreshBody {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration: Option<i64>,
}

/// `POST /sandboxes/{id}/snapshots` body.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SnapshotBody {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// Response of snapshot create.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotCreated {
    #[serde(rename = "snapshotID")]
    pub snapshot_id: String,
    #[serde(default)]
    pub names: Vec<String>,
}

/// One entry of `GET /snapshots`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotInfo {
    #[serde(rename = "snapshotID")]
    pub snapshot_id: String,
    #[serde(default)]
    pub names: Vec<String>,
    #[serde(default)]
    pub status: String,
    #[serde(
        rename = "originSandboxID",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub origin_sandbox_id: Option<String>,
    #[serde(rename = "createdAt", default, skip_serializing_if = "Option::is_none")]
    pub created_at: Option<String>,
}

/// `POST /sandboxes/{id}/rollback` body and response.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RollbackBody {
    #[serde(rename = "snapshotID", default)]
    pub snapshot_id: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RollbackDone {
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "snapshotID")]
    pub snapshot_id: String,
    #[serde(rename = "operationID", default)]
    pub operation_id: String,
    #[serde(default)]
    pub status: String,
}

/// A template as listed by `GET /templates` / `GET /templates/{id}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TemplateInfo {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(default)]
    pub public: bool,
    #[serde(default)]
    pub status: String,
    #[serde(default)]
    pub aliases: Vec<String>,
    #[serde(rename = "createdAt", default, skip_serializing_if = "Option::is_none")]
    pub created_at: Option<String>,
}

impl TemplateInfo {
    /// CubeMaster reports `READY` (compare case-insensitively).
    /// `READY`, or `PARTIALLY_READY` (usable; some nodes still preparing).
    pub fn is_ready(&self) -> bool {
        self.status.eq_ignore_ascii_case("ready")
            || self.status.eq_ignore_ascii_case("partially_ready")
    }
}

/// CubeAPI and envd-HTTP error body: `{"code": <http status>, "message"}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ApiErrorBody {
    pub code: u16,
    pub message: String,
}

// ---------------------------------------------------------------- envd

/// `ProcessConfig`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ProcessConfig {
    pub cmd: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub envs: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct PtySize {
    #[serde(default)]
    pub cols: u32,
    #[serde(default)]
    pub rows: u32,
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Pty {
    #[serde(default)]
    pub size: PtySize,
}

/// `StartRequest`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct StartRequest {
    pub process: ProcessConfig,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<Pty>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// Absent or true: a stdin pipe exists. False: stdin is /dev/null.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<bool>,
}

/// `ProcessSelector`: a pid or a tag.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ProcessSelector {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
}

impl ProcessSelector {
    pub fn pid(pid: u32) -> Self {
        Self {
            pid: Some(pid),
            tag: None,
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SelectorRequest {
    pub process: ProcessSelector,
}

/// `ProcessInput`: base64 bytes for stdin or the PTY.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ProcessInput {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SendInputRequest {
    pub process: ProcessSelector,
    pub input: ProcessInput,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SendSignalRequest {
    pub process: ProcessSelector,
    pub signal: serde_json::Value,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct UpdateRequest {
    pub process: ProcessSelector,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<Pty>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ProcessInfo {
    pub config: ProcessConfig,
    pub pid: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ListResponse {
    #[serde(default)]
    pub processes: Vec<ProcessInfo>,
}

/// `{"event": ProcessEvent}` on Start and Connect streams.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EventEnvelope {
    pub event: ProcessEvent,
}

/// `ProcessEvent` (a oneof: exactly one member is present).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum ProcessEvent {
    Start { pid: u32 },
    Data(DataEvent),
    End(EndEvent),
    Keepalive {},
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct DataEvent {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdout: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stderr: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<String>,
}

/// `end`: envd omits `exitCode` when it is 0 and `exited` when false.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct EndEvent {
    #[serde(default, alias = "exit_code", skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub exited: bool,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl EndEvent {
    /// The exit code the way the SDK derives it: `exitCode`, else parse
    /// `status` (`exit status N`, `signal: killed`/`signal N` → 128+N).
    pub fn code(&self) -> Option<i32> {
        if let Some(c) = self.exit_code
            && (c >= 0 || !self.status.starts_with("signal"))
        {
            return Some(c);
        }
        let s = self.status.trim();
        if let Some(n) = s.strip_prefix("exit status ") {
            return n.trim().parse().ok();
        }
        if let Some(sig) = s.strip_prefix("signal: ") {
            return signal_number(sig).map(|n| 128 + n);
        }
        if let Some(n) = s.strip_prefix("signal ") {
            return n.trim().parse::<i32>().ok().map(|n| 128 + n);
        }
        if s == "exited" || (s.is_empty() && self.exited && self.error.is_none()) {
            return Some(0);
        }
        self.exit_code
    }
}

/// Go's `ProcessState.String()` signal names → numbers.
pub fn signal_number(name: &str) -> Option<i32> {
    Some(match name.trim() {
        "hangup" => 1,
        "interrupt" => 2,
        "quit" => 3,
        "aborted" => 6,
        "killed" => 9,
        "user defined signal 1" => 10,
        "segmentation fault" => 11,
        "user defined signal 2" => 12,
        "broken pipe" => 13,
        "alarm clock" => 14,
        "terminated" => 15,
        _ => return None,
    })
}

/// Go's names for signals, as envd prints them in `status`.
pub fn signal_name(n: i32) -> String {
    match n {
        1 => "hangup".into(),
        2 => "interrupt".into(),
        3 => "quit".into(),
        6 => "aborted".into(),
        9 => "killed".into(),
        10 => "user defined signal 1".into(),
        11 => "segmentation fault".into(),
        12 => "user defined signal 2".into(),
        13 => "broken pipe".into(),
        14 => "alarm clock".into(),
        15 => "terminated".into(),
        n => format!("signal {n}"),
    }
}

/// `EntryInfo` (filesystem).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct EntryInfo {
    pub name: String,
    #[serde(rename = "type", default)]
    pub kind: String,
    pub path: String,
    /// int64 → JSON string in protojson; absent means 0.
    #[serde(default, with = "int64_string", skip_serializing_if = "is_zero")]
    pub size: u64,
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub mode: u32,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub permissions: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub owner: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub group: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub modified_time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
}

pub const FILE_TYPE_FILE: &str = "FILE_TYPE_FILE";
pub const FILE_TYPE_DIRECTORY: &str = "FILE_TYPE_DIRECTORY";
pub const FILE_TYPE_UNSPECIFIED: &str = "FILE_TYPE_UNSPECIFIED";

impl EntryInfo {
    pub fn is_dir(&self) -> bool {
        self.kind == FILE_TYPE_DIRECTORY
    }
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}
fn is_zero_u32(v: &u32) -> bool {
    *v == 0
}

/// protojson int64: written as a string, read from a string or a number.
pub mod int64_string {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&v.to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Either {
            S(String),
            N(u64),
        }
        match Either::deserialize(d)? {
            Either::S(s) => s.parse().map_err(serde::de::Error::custom),
            Either::N(n) => Ok(n),
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PathRequest {
    pub path: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ListDirRequest {
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub depth: Option<u32>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct MoveRequest {
    pub source: String,
    pub destination: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct EntryResponse {
    pub entry: EntryInfo,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ListDirResponse {
    #[serde(default)]
    pub entries: Vec<EntryInfo>,
}

/// Connect error body (unary responses and end-stream `error`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ConnectError {
    pub code: String,
    #[serde(default)]
    pub message: String,
}

/// End-stream message: `{}` or `{"error": …}`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct EndStream {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ConnectError>,
}

/// Connect code → HTTP status (connect-go ≥ 1.16, as envd 0.5.13 uses).
pub fn connect_code_status(code: &str) -> u16 {
    match code {
        "canceled" => 499,
        "invalid_argument" | "failed_precondition" | "out_of_range" => 400,
        "deadline_exceeded" => 504,
        "not_found" => 404,
        "already_exists" | "aborted" => 409,
        "permission_denied" => 403,
        "resource_exhausted" => 429,
        "unimplemented" => 501,
        "unavailable" => 503,
        "unauthenticated" => 401,
        _ => 500,
    }
}

// ---------------------------------------------------------------- framing

/// Encode one Connect envelope.
pub fn envelope(flags: u8, payload: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + payload.len());
    b.put_u8(flags);
    // Payloads are bounded by MAX_ENVELOPE (64 MiB) so this never truncates.
    b.put_u32(u32::try_from(payload.len()).unwrap_or(u32::MAX));
    b.put_slice(payload);
    b.freeze()
}

/// Encode a JSON message as a data envelope.
pub fn json_envelope<T: Serialize>(msg: &T) -> Bytes {
    let payload = serde_json::to_vec(msg).unwrap_or_else(|_| b"{}".to_vec());
    envelope(0, &payload)
}

/// Encode the end-stream envelope.
pub fn end_stream_envelope(error: Option<ConnectError>) -> Bytes {
    let payload = serde_json::to_vec(&EndStream { error }).unwrap_or_else(|_| b"{}".to_vec());
    envelope(FLAG_END_STREAM, &payload)
}

/// One decoded envelope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    pub flags: u8,
    pub payload: Bytes,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    #[error("envelope of {0} bytes exceeds the {MAX_ENVELOPE}-byte limit")]
    TooLarge(usize),
    #[error("compressed envelope received but no compression was negotiated")]
    Compressed,
}

/// Incremental envelope decoder: feed bytes, take whole envelopes.
#[derive(Debug, Default)]
pub struct EnvelopeDecoder {
    buf: BytesMut,
}

impl EnvelopeDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// Bytes received that do not yet form a whole envelope.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    pub fn next_envelope(&mut self) -> Result<Option<Envelope>, FrameError> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let flags = self.buf.first().copied().unwrap_or(0);
        let len_bytes: [u8; 4] = match self.buf.get(1..5).and_then(|s| s.try_into().ok()) {
            Some(b) => b,
            None => return Ok(None),
        };
        let len = u32::from_be_bytes(len_bytes) as usize;
        if len > MAX_ENVELOPE {
            return Err(FrameError::TooLarge(len));
        }
        if flags & FLAG_COMPRESSED != 0 {
            return Err(FrameError::Compressed);
        }
        if self.buf.len() < 5 + len {
            return Ok(None);
        }
        self.buf.advance(5);
        let payload = self.buf.split_to(len).freeze();
        Ok(Some(Envelope { flags, payload }))
    }
}

/// `[A-Za-z0-9-]+`, at most 128 bytes, as CubeAPI validates path ids.
pub fn valid_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// A volume ID as CubeAPI validates it: `[A-Za-z0-9_-]`, 1 to 128 bytes
/// (also what a volume name may be).
pub fn valid_volume_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// An envd version, for the features that depend on it (as the SDK 0.7.3
/// decides them): CloseStdin needs 0.5.2; `application/octet-stream`
/// uploads need 0.5.7 (older ones take multipart only). Unknown or
/// unparsable versions count as current: CubeAPI reports "0.2.0" when it
/// does not know, and that is taken at its word.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct EnvdVersion(pub u32, pub u32, pub u32);

impl EnvdVersion {
    pub const CURRENT: Self = Self(0, 5, 13);

    pub fn parse(v: Option<&str>) -> Self {
        let Some(v) = v else { return Self::CURRENT };
        let mut it = v
            .trim()
            .trim_start_matches('v')
            .split(['.', '-', '+'])
            .map(|p| p.parse::<u32>());
        match (it.next(), it.next(), it.next()) {
            (Some(Ok(a)), Some(Ok(b)), Some(Ok(c))) => Self(a, b, c),
            _ => Self::CURRENT,
        }
    }

    pub fn close_stdin(self) -> bool {
        self >= Self(0, 5, 2)
    }

    pub fn octet_stream_upload(self) -> bool {
        self >= Self(0, 5, 7)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_roundtrip_in_pieces() {
        let a = json_envelope(&EventEnvelope {
            event: ProcessEvent::Start { pid: 42 },
        });
        let b = end_stream_envelope(None);
        let mut all = a.to_vec();
        all.extend_from_slice(&b);
        let mut d = EnvelopeDecoder::new();
        let mut out = vec![];
        for byte in all {
            d.push(&[byte]);
            while let Some(e) = d.next_envelope().unwrap() {
                out.push(e);
            }
        }
        assert_eq!(out.len(), 2);
        assert_eq!(&out[0].payload[..], br#"{"event":{"start":{"pid":42}}}"#);
        assert_eq!(out[1].flags, FLAG_END_STREAM);
        assert_eq!(&out[1].payload[..], b"{}");
    }

    #[test]
    fn oversize_and_compressed_are_errors() {
        let mut d = EnvelopeDecoder::new();
        d.push(&[0, 0xff, 0xff, 0xff, 0xff]);
        assert!(matches!(d.next_envelope(), Err(FrameError::TooLarge(_))));
        let mut d = EnvelopeDecoder::new();
        d.push(&[1, 0, 0, 0, 0]);
        assert_eq!(d.next_envelope(), Err(FrameError::Compressed));
    }

    #[test]
    fn end_event_exit_codes_like_the_sdk() {
        let e: EndEvent =
            serde_json::from_str(r#"{"exited":true,"status":"exit status 0"}"#).unwrap();
        assert_eq!(e.code(), Some(0));
        let e: EndEvent =
            serde_json::from_str(r#"{"exitCode":3,"exited":true,"status":"exit status 3"}"#)
                .unwrap();
        assert_eq!(e.code(), Some(3));
        let e: EndEvent = serde_json::from_str(
            r#"{"exitCode":-1,"status":"signal: killed","error":"signal: killed"}"#,
        )
        .unwrap();
        assert_eq!(e.code(), Some(137));
        let ser = serde_json::to_string(&EndEvent {
            exited: true,
            status: "exit status 0".into(),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(ser, r#"{"exited":true,"status":"exit status 0"}"#);
    }

    #[test]
    fn entry_size_is_a_string_and_omitted_when_zero() {
        let e = EntryInfo {
            name: "a".into(),
            kind: FILE_TYPE_FILE.into(),
            path: "/a".into(),
            size: 12,
            ..Default::default()
        };
        let s = serde_json::to_string(&e).unwrap();
        assert!(s.contains(r#""size":"12""#), "{s}");
        let z = EntryInfo { size: 0, ..e };
        assert!(!serde_json::to_string(&z).unwrap().contains("size"));
        let back: EntryInfo =
            serde_json::from_str(r#"{"name":"a","type":"FILE_TYPE_FILE","path":"/a","size":"7"}"#)
                .unwrap();
        assert_eq!(back.size, 7);
    }

    #[test]
    fn process_event_shapes() {
        let s = serde_json::to_string(&EventEnvelope {
            event: ProcessEvent::Keepalive {},
        })
        .unwrap();
        assert_eq!(s, r#"{"event":{"keepalive":{}}}"#);
        let d: EventEnvelope =
            serde_json::from_str(r#"{"event":{"data":{"stdout":"aGk="}}}"#).unwrap();
        assert_eq!(
            d.event,
            ProcessEvent::Data(DataEvent {
                stdout: Some("aGk=".into()),
                ..Default::default()
            })
        );
    }

    #[test]
    fn volume_shapes() {
        let c = CreateSandbox {
            template_id: "t".into(),
            ..Default::default()
        };
        assert!(!serde_json::to_string(&c).unwrap().contains("volumeMounts"));
        let c = CreateSandbox {
            volume_mounts: Some(vec![VolumeMount {
                name: "v1".into(),
                path: "/mnt/v".into(),
                read_only: Some(true),
            }]),
            ..c
        };
        let s = serde_json::to_string(&c).unwrap();
        assert!(
            s.contains(r#""volumeMounts":[{"name":"v1","path":"/mnt/v","readOnly":true}]"#),
            "{s}"
        );
        let v: Volume = serde_json::from_str(r#"{"volumeID":"a","name":"a"}"#).unwrap();
        assert_eq!(v.token, "");
        let s = serde_json::to_string(&CreateVolume {
            name: "a".into(),
            driver: None,
            size_mb: Some(32),
        })
        .unwrap();
        assert_eq!(s, r#"{"name":"a","sizeMB":32}"#);
        assert!(valid_volume_id("a_b-C9"));
        assert!(!valid_volume_id(""));
        assert!(!valid_volume_id("a.b"));
        assert!(!valid_volume_id(&"a".repeat(129)));
    }
}
