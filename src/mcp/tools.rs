//! The agent tool set: the reference's 23 tools with the same names and
//! arguments, plus ours. Each tool is one `/v1` request; the profile comes
//! from the host, never from the model. No tool approves anything: approval
//! belongs to people, on `/v1/task-plans/{ref}/approve` or the console.

use serde_json::{Map, Value, json};

/// One tool: what the model sees, and the request it makes.
pub struct ToolDef {
    pub name: &'static str,
    pub title: &'static str,
    pub description: &'static str,
    /// Reads only (no effect on the sandbox or the appliance's state).
    pub read_only: bool,
    /// May destroy or overwrite something.
    pub destructive: bool,
    /// Calling it again with the same arguments has no further effect.
    pub idempotent: bool,
}

const fn tool(
    name: &'static str,
    title: &'static str,
    description: &'static str,
    (read_only, destructive, idempotent): (bool, bool, bool),
) -> ToolDef {
    ToolDef {
        name,
        title,
        description,
        read_only,
        destructive,
        idempotent,
    }
}

const READ: (bool, bool, bool) = (true, false, true);
const WRITE: (bool, bool, bool) = (false, false, false);
const OVERWRITE: (bool, bool, bool) = (false, true, true);
/// Ends or replaces something; doing it again changes nothing more.
const DESTROY: (bool, bool, bool) = (false, true, true);
/// Runs a command the model wrote: it may change or delete anything the
/// sandbox holds.
const RUN: (bool, bool, bool) = (false, true, false);

/// Tools that run commands the model wrote: they reach whatever the
/// sandbox's profile lets them reach (the network too, where allowed).
pub fn runs_commands(name: &str) -> bool {
    matches!(
        name,
        "cube_exec" | "cube_job_start" | "cube_pty_create" | "cube_pty_input"
    )
}

/// Every tool, in the order hosts list them.
pub const TOOLS: &[ToolDef] = &[
    tool(
        "cube_profiles",
        "List profiles",
        "List the sandbox profiles this identity may use and their limits (time per command, idle time, jobs per lease, checkpoints, keepalive). The profile itself is chosen by the host, not by you.",
        READ,
    ),
    tool(
        "cube_acquire",
        "Acquire a sandbox",
        "Get a sandbox (a MicroVM) for this session, or the one it already has: the same session_key always returns the same lease_ref until it is released. Use the returned lease_ref with every other tool.",
        (false, false, true),
    ),
    tool(
        "cube_status",
        "Lease status",
        "The lease's state, its jobs and checkpoints, and how long it stays before it is collected for being idle.",
        READ,
    ),
    tool(
        "cube_exec",
        "Run a command",
        "Run a shell command (bash -l -c) in the sandbox and wait for it: exit_code, stdout and stderr (64 KiB each, truncated with a flag). timeout_ms defaults to 120000 and is capped by the profile. For anything longer, use cube_job_start.",
        RUN,
    ),
    tool(
        "cube_read_text",
        "Read a text file",
        "Read a UTF-8 file under /workspace or /tmp (the first 64 KiB, truncated with a flag).",
        READ,
    ),
    tool(
        "cube_write_text",
        "Write a text file",
        "Create or replace a UTF-8 file under /workspace or /tmp (up to 256 KiB).",
        OVERWRITE,
    ),
    tool(
        "cube_list_files",
        "List a directory",
        "List a directory under /workspace or /tmp (at most 1000 entries).",
        READ,
    ),
    tool(
        "cube_stat_file",
        "File metadata",
        "Type, size, mode and modification time of a path under /workspace or /tmp.",
        READ,
    ),
    tool(
        "cube_upload_artifact",
        "Upload a binary file",
        "Write a binary file (base64, up to 8 MiB decoded) under /workspace or /tmp; returns its sha256.",
        OVERWRITE,
    ),
    tool(
        "cube_download_artifact",
        "Download a binary file",
        "Read a binary file (up to 8 MiB) as base64, with its sha256.",
        READ,
    ),
    tool(
        "cube_job_start",
        "Start a background job",
        "Start a long-running command (builds, tests, training) that outlives this call: returns a job_ref at once. Its output is kept in the sandbox; read it with cube_job_resume (or cube_job_output), check it with cube_job_status, stop it with cube_job_cancel. The profile's time limit ends it (state timed_out).",
        RUN,
    ),
    tool(
        "cube_job_status",
        "Job status",
        "A job's state: running, succeeded, failed, cancelled, timed_out or lost, and its exit code.",
        READ,
    ),
    tool(
        "cube_job_output",
        "Job output (fragment)",
        "Page a job's output the reference's way: a JSON fragment of both streams sliced by bytes (offset, max_bytes). Prefer cube_job_resume, whose offsets never shift.",
        READ,
    ),
    tool(
        "cube_job_resume",
        "Job output (cursors)",
        "Read a job's output from where you left off: pass the stdout_offset and stderr_offset from the previous call (0 at first). Returns the new bytes of each stream (base64), the next offsets, and eof once the job has ended and everything is read.",
        READ,
    ),
    tool(
        "cube_job_cancel",
        "Cancel a job",
        "Stop a running job and everything it started.",
        DESTROY,
    ),
    tool(
        "cube_checkpoint",
        "Create a checkpoint",
        "Snapshot the sandbox's files so that you can roll back to them (when the profile allows checkpoints).",
        WRITE,
    ),
    tool(
        "cube_checkpoint_list",
        "List checkpoints",
        "The lease's checkpoints, oldest first.",
        READ,
    ),
    tool(
        "cube_rollback",
        "Roll back to a checkpoint",
        "Restore the sandbox's files to a checkpoint. Running commands, jobs and terminals end.",
        DESTROY,
    ),
    tool(
        "cube_fork",
        "Fork from a checkpoint",
        "Start a second, independent sandbox from a checkpoint of this lease (same profile), to try something without disturbing the first. Returns the new lease_ref. The same branch name returns the same fork while it lives; leave branch out for a new one each time. Counts against the tenant's lease quota.",
        (false, false, true),
    ),
    tool(
        "cube_recover",
        "Find a lease or job again",
        "After a restart (yours or the appliance's): look up what a lease_ref or job_ref still stands for — its state, its sandbox and whether it is recoverable. It never runs anything again and never makes a new sandbox; give one of lease_ref or job_ref.",
        READ,
    ),
    tool(
        "cube_mcp_tools",
        "List the sandbox's MCP tools",
        "The MCP tools the lease's profile lets you call inside its sandbox (its operator's MCP policy), each with the JSON Schema its arguments must match, and the call limits. Empty policy: the profile has none.",
        READ,
    ),
    tool(
        "cube_mcp_call",
        "Call an MCP tool in the sandbox",
        "Call one of the MCP tools from cube_mcp_tools on the server inside the lease's sandbox. The operator chose the server; you give only the tool's name and its arguments, which must match its schema exactly (no extra fields). A call that does not answer within the policy's timeout may have run: the lease is then blocked until an operator checks it, so do not retry blindly.",
        WRITE,
    ),
    tool(
        "cube_renew",
        "Keep the sandbox alive",
        "Extend the sandbox's time while you are not using it (within the profile's keepalive limit after your last use).",
        (false, false, true),
    ),
    tool(
        "cube_pty_create",
        "Open a terminal",
        "Open an interactive login shell on a terminal in the sandbox (when the profile allows terminals). Type into it with cube_pty_input, read what it prints with cube_pty_read. Prefer cube_exec and jobs unless you need interaction.",
        WRITE,
    ),
    tool(
        "cube_pty_input",
        "Type into a terminal",
        "Send text to a terminal (include a newline to press Enter; the character U+0003 is Ctrl-C).",
        RUN,
    ),
    tool(
        "cube_pty_read",
        "Read a terminal",
        "Read what a terminal printed from an offset (0 at first, then next_offset), waiting up to wait_ms for something new. Output is base64.",
        READ,
    ),
    tool(
        "cube_pty_resize",
        "Resize a terminal",
        "Change a terminal's rows and columns.",
        (false, false, true),
    ),
    tool(
        "cube_pty_status",
        "Terminal status",
        "A terminal's state (running, exited, cancelled, lost) and exit code.",
        READ,
    ),
    tool(
        "cube_pty_kill",
        "Close a terminal",
        "Kill a terminal's shell and everything running in it.",
        DESTROY,
    ),
    tool(
        "cube_task_templates",
        "List trusted tasks",
        "The operator's trusted task templates you may ask for: what each does, the JSON Schema of its parameters, whether it needs a person's approval, and the outputs it returns.",
        READ,
    ),
    tool(
        "cube_task_plan",
        "Plan a trusted task",
        "Ask for a trusted task: an operator-defined command run with your parameters in a sandbox of its own, usually after a person approves it. Checks the parameters against the template's schema and returns a plan_ref; nothing runs yet. Then wait for approval and call cube_task_submit with the plan_ref.",
        WRITE,
    ),
    tool(
        "cube_task_submit",
        "Run an approved task",
        "Run a plan once it is approved (or needs no approval): returns a task_ref at once. Fails with plan_not_approved while a person has not approved it yet. Calling it again returns the same task.",
        (false, false, true),
    ),
    tool(
        "cube_task_status",
        "Trusted task status",
        "A trusted task's state (starting, running, succeeded, failed, cancelled, timed_out, setup_failed, orphaned, cleanup_pending, output_validation_failed) and whether its result and receipt are ready.",
        READ,
    ),
    tool(
        "cube_task_result",
        "Trusted task result",
        "Once the task's command has ended: validate its declared outputs, end its sandbox, and return the outputs it exposes with a signed receipt of what ran. Fails with task_running while it runs. Calling it again returns the same result.",
        DESTROY,
    ),
    tool(
        "cube_task_cancel",
        "Cancel a trusted task",
        "Stop a trusted task's command, end its sandbox and return its (cancelled) result and receipt.",
        DESTROY,
    ),
    tool(
        "cube_task_receipt",
        "Trusted task receipt",
        "The signed receipt of a finished trusted task: digests of the template, parameters, command and outputs, who approved it, and how it ended.",
        READ,
    ),
    tool(
        "cube_release",
        "Release the sandbox",
        "End the lease: kill (the default) deletes the sandbox and its checkpoints; pause keeps it for later.",
        DESTROY,
    ),
];

/// The JSON Schema of a tool's arguments, as a host that fixes nothing
/// sees it (see `schema_for`).
pub fn schema(name: &str) -> Value {
    let lease = json!({"type": "string", "pattern": "^lease_[a-f0-9]{20}$", "description": "From cube_acquire."});
    let job = json!({"type": "string", "pattern": "^job_[a-f0-9]{20}$", "description": "From cube_job_start."});
    let pty = json!({"type": "string", "pattern": "^pty_[a-f0-9]{20}$", "description": "From cube_pty_create."});
    let checkpoint = json!({"type": "string", "pattern": "^(checkpoint|ckpt)_[a-f0-9]{20}$", "description": "From cube_checkpoint or cube_checkpoint_list."});
    let task = json!({"type": "string", "pattern": "^task_[a-f0-9]{20}$", "description": "From cube_task_submit."});
    let size = json!({"type": "integer", "minimum": 1, "maximum": 1000});
    let path = json!({"type": "string", "maxLength": 4096, "description": "An absolute path under /workspace or /tmp."});
    let request_id = json!({"type": "string", "pattern": "^[A-Za-z0-9_.:-]{1,80}$", "description": "Optional, echoed back and recorded in the audit journal."});
    let (props, required): (Value, &[&str]) = match name {
        "cube_profiles" => (json!({}), &[]),
        "cube_acquire" => (
            json!({
                "runtime": {"type": "string", "enum": crate::auth::RUNTIMES, "description": "Which agent runtime you are. Leave it out when your identity may use only one: that one is used."},
                "session_key": {"type": "string", "minLength": 1, "maxLength": 512, "description": "A stable key for this conversation or task."},
                "request_id": request_id,
            }),
            &["session_key"],
        ),
        "cube_status" | "cube_checkpoint_list" => (json!({"lease_ref": lease}), &["lease_ref"]),
        "cube_exec" => (
            json!({
                "lease_ref": lease,
                "command": {"type": "string", "minLength": 1, "maxLength": 16384},
                "cwd": path,
                "timeout_ms": {"type": "integer", "minimum": 1, "default": 120000},
                "request_id": request_id,
            }),
            &["lease_ref", "command"],
        ),
        "cube_read_text" | "cube_stat_file" | "cube_download_artifact" => (
            json!({"lease_ref": lease, "path": path}),
            &["lease_ref", "path"],
        ),
        "cube_list_files" => (json!({"lease_ref": lease, "path": path}), &["lease_ref"]),
        "cube_write_text" => (
            json!({"lease_ref": lease, "path": path, "content": {"type": "string", "maxLength": 262144}}),
            &["lease_ref", "path", "content"],
        ),
        "cube_upload_artifact" => (
            json!({"lease_ref": lease, "path": path, "content_base64": {"type": "string", "contentEncoding": "base64"}}),
            &["lease_ref", "path", "content_base64"],
        ),
        "cube_job_start" => (
            json!({"lease_ref": lease, "command": {"type": "string", "minLength": 1, "maxLength": 16384}, "cwd": path}),
            &["lease_ref", "command"],
        ),
        "cube_job_status" | "cube_job_cancel" => (json!({"job_ref": job}), &["job_ref"]),
        "cube_job_output" => (
            json!({"job_ref": job, "offset": {"type": "integer", "minimum": 0, "default": 0}, "max_bytes": {"type": "integer", "minimum": 1, "maximum": 1048576, "default": 65536}}),
            &["job_ref"],
        ),
        "cube_job_resume" => (
            json!({
                "job_ref": job,
                "stdout_offset": {"type": "integer", "minimum": 0, "default": 0},
                "stderr_offset": {"type": "integer", "minimum": 0, "default": 0},
                "max_bytes": {"type": "integer", "minimum": 1, "maximum": 1048576, "default": 65536, "description": "Per stream."},
            }),
            &["job_ref"],
        ),
        "cube_checkpoint" => (
            json!({"lease_ref": lease, "name": {"type": "string", "minLength": 1, "maxLength": 128}}),
            &["lease_ref"],
        ),
        "cube_rollback" => (
            json!({"lease_ref": lease, "checkpoint_ref": checkpoint}),
            &["lease_ref", "checkpoint_ref"],
        ),
        "cube_fork" => (
            json!({"lease_ref": lease, "checkpoint_ref": checkpoint, "branch": {"type": "string", "minLength": 1, "maxLength": 128, "description": "A name for this line of work; the same name returns the same fork."}}),
            &["lease_ref", "checkpoint_ref"],
        ),
        "cube_task_templates" => (json!({}), &[]),
        "cube_task_plan" => (
            json!({
                "template": {"type": "string", "pattern": "^[a-z][a-z0-9-]{0,62}$", "description": "A name from cube_task_templates."},
                "parameters": {"type": "object", "description": "Values for the template's parameters, matching its schema."},
                "reason": {"type": "string", "maxLength": 1024, "description": "Why the task is needed, in plain words: the person approving reads it first. Some templates require it."},
                "lease_ref": {"type": "string", "pattern": "^lease_[a-f0-9]{20}$", "description": "The lease you are working in, if any: shown to the approver."},
                "request_id": request_id,
            }),
            &["template", "parameters"],
        ),
        "cube_task_submit" => (
            json!({"plan_ref": {"type": "string", "pattern": "^plan_[a-f0-9]{20}$", "description": "From cube_task_plan."}}),
            &["plan_ref"],
        ),
        "cube_task_status" | "cube_task_result" | "cube_task_cancel" | "cube_task_receipt" => {
            (json!({"task_ref": task}), &["task_ref"])
        }
        "cube_renew" => (
            json!({"lease_ref": lease, "seconds": {"type": "integer", "minimum": 1, "maximum": 86400}}),
            &["lease_ref"],
        ),
        "cube_recover" => (json!({"lease_ref": lease, "job_ref": job}), &[]),
        "cube_mcp_tools" => (json!({"lease_ref": lease}), &["lease_ref"]),
        "cube_mcp_call" => (
            json!({
                "lease_ref": lease,
                "tool": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$", "description": "A tool name from cube_mcp_tools."},
                "arguments": {"type": "object", "description": "The tool's arguments, matching its input_schema from cube_mcp_tools."},
                "request_id": request_id,
            }),
            &["lease_ref", "tool"],
        ),
        "cube_release" => (
            json!({"lease_ref": lease, "action": {"type": "string", "enum": ["kill", "pause"], "default": "kill"}}),
            &["lease_ref"],
        ),
        "cube_pty_create" => (
            json!({"lease_ref": lease, "rows": size, "cols": size, "cwd": path}),
            &["lease_ref"],
        ),
        "cube_pty_input" => (
            json!({"pty_ref": pty, "data": {"type": "string", "maxLength": 262144}}),
            &["pty_ref", "data"],
        ),
        "cube_pty_read" => (
            json!({
                "pty_ref": pty,
                "offset": {"type": "integer", "minimum": 0, "default": 0},
                "max_bytes": {"type": "integer", "minimum": 1, "maximum": 1048576, "default": 65536},
                "wait_ms": {"type": "integer", "minimum": 0, "maximum": 30000, "default": 2000},
            }),
            &["pty_ref"],
        ),
        "cube_pty_resize" => (
            json!({"pty_ref": pty, "rows": size, "cols": size}),
            &["pty_ref", "rows", "cols"],
        ),
        "cube_pty_status" | "cube_pty_kill" => (json!({"pty_ref": pty}), &["pty_ref"]),
        _ => (json!({}), &[]),
    };
    json!({"type": "object", "properties": props, "required": required, "additionalProperties": false})
}

/// The JSON Schema of a tool's arguments for this host: what the host
/// fixes is no argument (`cube_acquire` has no `runtime` when the host
/// names one).
pub fn schema_for(name: &str, host: &Host) -> Value {
    let mut s = schema(name);
    if name == "cube_acquire"
        && host.runtime.is_some()
        && let Some(p) = s.get_mut("properties").and_then(Value::as_object_mut)
    {
        p.remove("runtime");
    }
    s
}

/// What the host fixes for every call; the model cannot change it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Host {
    /// The profile `cube_acquire` asks for (default: the appliance's).
    pub profile: Option<String>,
    /// The runtime `cube_acquire` uses, whatever the model says. Without
    /// one the model may name it, and when it does not the identity's only
    /// allowed runtime is used (`McpServer` asks the appliance).
    pub runtime: Option<String>,
}

/// A `/v1` request.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub method: &'static str,
    pub path: String,
    pub body: Option<Value>,
}

/// Why a tool call makes no request: a message for the model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadCall {
    #[error("{0} must be a string")]
    NotAString(String),
    #[error("{0} is required")]
    Missing(String),
    #[error("{key} is not a {prefix}_… reference")]
    NotARef { key: String, prefix: &'static str },
    #[error("no tool named {0}")]
    NoSuchTool(String),
    #[error("give one of {0} and {1}")]
    OneOf(&'static str, &'static str),
}

/// The request a tool call makes, or a message for the model.
pub fn request(name: &str, args: &Map<String, Value>, host: &Host) -> Result<Request, BadCall> {
    let s = |k: &str| -> Result<String, BadCall> {
        match args.get(k) {
            Some(Value::String(v)) => Ok(v.clone()),
            Some(_) => Err(BadCall::NotAString(k.to_string())),
            None => Err(BadCall::Missing(k.to_string())),
        }
    };
    // A reference that goes into the URL path: only the shape it must have.
    let r = |k: &str, prefix: &'static str| -> Result<String, BadCall> {
        let v = s(k)?;
        let ok = v
            .strip_prefix(prefix)
            .and_then(|h| h.strip_prefix('_'))
            .is_some_and(|h| h.len() == 20 && h.bytes().all(|b| b.is_ascii_hexdigit()));
        if ok {
            Ok(v)
        } else {
            Err(BadCall::NotARef {
                key: k.to_string(),
                prefix,
            })
        }
    };
    // The body: the given fields except the ones in the path.
    let body = |skip: &[&str], extra: &[(&str, Value)]| -> Value {
        let mut m: Map<String, Value> = args
            .iter()
            .filter(|(k, _)| !skip.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (k, v) in extra {
            m.entry(k.to_string()).or_insert_with(|| v.clone());
        }
        Value::Object(m)
    };
    let post = |path: String, b: Value| Request {
        method: "POST",
        path,
        body: Some(b),
    };
    let get = |path: String| Request {
        method: "GET",
        path,
        body: None,
    };
    Ok(match name {
        "cube_profiles" => get("/v1/profiles".into()),
        "cube_acquire" => {
            let mut b = body(&["profile"], &[]);
            if let Some(m) = b.as_object_mut() {
                // The host's settings win over the model's arguments.
                if let Some(p) = &host.profile {
                    m.insert("profile".into(), json!(p));
                }
                if let Some(r) = &host.runtime {
                    m.insert("runtime".into(), json!(r));
                }
            }
            post("/v1/leases/acquire".into(), b)
        }
        "cube_status" => post(
            format!("/v1/leases/{}/status", r("lease_ref", "lease")?),
            json!({}),
        ),
        "cube_exec" => post(
            format!("/v1/leases/{}/exec", r("lease_ref", "lease")?),
            body(
                &["lease_ref"],
                &[("cwd", json!("/workspace")), ("timeout_ms", json!(120000))],
            ),
        ),
        "cube_read_text" | "cube_write_text" | "cube_stat_file" => {
            let op = match name {
                "cube_read_text" => "read",
                "cube_write_text" => "write",
                _ => "stat",
            };
            post(
                format!("/v1/leases/{}/{op}", r("lease_ref", "lease")?),
                body(&["lease_ref"], &[]),
            )
        }
        "cube_list_files" => post(
            format!("/v1/leases/{}/list", r("lease_ref", "lease")?),
            body(&["lease_ref"], &[("path", json!("/workspace"))]),
        ),
        "cube_upload_artifact" => post(
            format!("/v1/leases/{}/artifacts/upload", r("lease_ref", "lease")?),
            body(&["lease_ref"], &[]),
        ),
        "cube_download_artifact" => post(
            format!("/v1/leases/{}/artifacts/download", r("lease_ref", "lease")?),
            body(&["lease_ref"], &[]),
        ),
        "cube_job_start" => post(
            format!("/v1/leases/{}/jobs", r("lease_ref", "lease")?),
            body(&["lease_ref"], &[("cwd", json!("/workspace"))]),
        ),
        "cube_job_status" => post(
            format!("/v1/jobs/{}/status", r("job_ref", "job")?),
            json!({}),
        ),
        "cube_job_cancel" => post(
            format!("/v1/jobs/{}/cancel", r("job_ref", "job")?),
            json!({}),
        ),
        "cube_job_output" => post(
            format!("/v1/jobs/{}/output", r("job_ref", "job")?),
            body(
                &["job_ref"],
                &[("offset", json!(0)), ("max_bytes", json!(65536))],
            ),
        ),
        "cube_job_resume" => post(
            format!("/v1/jobs/{}/output", r("job_ref", "job")?),
            body(
                &["job_ref"],
                &[("stdout_offset", json!(0)), ("stderr_offset", json!(0))],
            ),
        ),
        "cube_checkpoint" => post(
            format!("/v1/leases/{}/checkpoints", r("lease_ref", "lease")?),
            body(&["lease_ref"], &[]),
        ),
        "cube_checkpoint_list" => get(format!(
            "/v1/leases/{}/checkpoints",
            r("lease_ref", "lease")?
        )),
        "cube_rollback" => post(
            format!(
                "/v1/leases/{}/checkpoints/{}/rollback",
                r("lease_ref", "lease")?,
                r("checkpoint_ref", "checkpoint").or_else(|_| r("checkpoint_ref", "ckpt"))?
            ),
            json!({}),
        ),
        "cube_fork" => post(
            format!(
                "/v1/leases/{}/checkpoints/{}/fork",
                r("lease_ref", "lease")?,
                r("checkpoint_ref", "checkpoint").or_else(|_| r("checkpoint_ref", "ckpt"))?
            ),
            body(&["lease_ref", "checkpoint_ref"], &[]),
        ),
        "cube_task_templates" => get("/v1/task-templates".into()),
        "cube_task_plan" => post("/v1/tasks/plan".into(), body(&[], &[])),
        "cube_task_submit" => post(
            format!("/v1/task-plans/{}/submit", r("plan_ref", "plan")?),
            json!({}),
        ),
        "cube_task_status" => post(
            format!("/v1/tasks/{}/status", r("task_ref", "task")?),
            json!({}),
        ),
        "cube_task_result" => post(
            format!("/v1/tasks/{}/result", r("task_ref", "task")?),
            json!({}),
        ),
        "cube_task_cancel" => post(
            format!("/v1/tasks/{}/cancel", r("task_ref", "task")?),
            json!({}),
        ),
        "cube_task_receipt" => post(
            format!("/v1/tasks/{}/receipt", r("task_ref", "task")?),
            json!({}),
        ),
        "cube_recover" => match (args.contains_key("lease_ref"), args.contains_key("job_ref")) {
            (true, false) => get(format!("/v1/leases/{}/recover", r("lease_ref", "lease")?)),
            (false, true) => get(format!("/v1/jobs/{}/recover", r("job_ref", "job")?)),
            _ => return Err(BadCall::OneOf("lease_ref", "job_ref")),
        },
        "cube_mcp_tools" => get(format!("/v1/leases/{}/mcp/tools", r("lease_ref", "lease")?)),
        "cube_mcp_call" => post(
            format!("/v1/leases/{}/mcp/call", r("lease_ref", "lease")?),
            body(&["lease_ref"], &[("arguments", json!({}))]),
        ),
        "cube_renew" => post(
            format!("/v1/leases/{}/renew", r("lease_ref", "lease")?),
            body(&["lease_ref"], &[]),
        ),
        "cube_release" => post(
            format!("/v1/leases/{}/release", r("lease_ref", "lease")?),
            body(&["lease_ref"], &[("action", json!("kill"))]),
        ),
        "cube_pty_create" => post(
            format!("/v1/leases/{}/ptys", r("lease_ref", "lease")?),
            body(&["lease_ref"], &[]),
        ),
        "cube_pty_input" => post(
            format!("/v1/ptys/{}/input", r("pty_ref", "pty")?),
            body(&["pty_ref"], &[]),
        ),
        "cube_pty_read" => post(
            format!("/v1/ptys/{}/output", r("pty_ref", "pty")?),
            body(&["pty_ref"], &[("wait_ms", json!(2000))]),
        ),
        "cube_pty_resize" => post(
            format!("/v1/ptys/{}/resize", r("pty_ref", "pty")?),
            body(&["pty_ref"], &[]),
        ),
        "cube_pty_status" => get(format!("/v1/ptys/{}/status", r("pty_ref", "pty")?)),
        "cube_pty_kill" => post(format!("/v1/ptys/{}/kill", r("pty_ref", "pty")?), json!({})),
        other => return Err(BadCall::NoSuchTool(other.to_string())),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tool_has_a_schema_and_a_request() {
        for t in TOOLS {
            let s = schema(t.name);
            assert_eq!(s["type"], "object", "{}", t.name);
            let mut args = Map::new();
            for k in s["required"].as_array().unwrap() {
                let k = k.as_str().unwrap();
                let v = match k {
                    "lease_ref" => "lease_0123456789abcdef0123",
                    "job_ref" => "job_0123456789abcdef0123",
                    "checkpoint_ref" => "checkpoint_0123456789abcdef0123",
                    "plan_ref" => "plan_0123456789abcdef0123",
                    "task_ref" => "task_0123456789abcdef0123",
                    "pty_ref" => "pty_0123456789abcdef0123",
                    "runtime" => "mcp",
                    _ => "x",
                };
                args.insert(k.into(), json!(v));
            }
            if t.name == "cube_recover" {
                // One of two, which a schema without `oneOf` (some hosts
                // refuse it) cannot require.
                args.insert("lease_ref".into(), json!("lease_0123456789abcdef0123"));
            }
            let r = request(t.name, &args, &Host::default()).unwrap();
            assert!(r.path.starts_with("/v1/"), "{}", t.name);
            assert!(!r.path.contains('{'), "{}", t.name);
        }
    }

    /// `cube_recover` looks up a lease or a job, one of them, and never
    /// changes anything (a GET).
    #[test]
    fn recover_takes_one_reference() {
        let lease = "lease_0123456789abcdef0123";
        let job = "job_0123456789abcdef0123";
        let call = |pairs: &[(&str, &str)]| {
            let args: Map<String, Value> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), json!(v)))
                .collect();
            request("cube_recover", &args, &Host::default())
        };
        let r = call(&[("lease_ref", lease)]).unwrap();
        assert_eq!(
            (r.method, r.path.as_str()),
            ("GET", "/v1/leases/lease_0123456789abcdef0123/recover")
        );
        let r = call(&[("job_ref", job)]).unwrap();
        assert_eq!(
            (r.method, r.path.as_str()),
            ("GET", "/v1/jobs/job_0123456789abcdef0123/recover")
        );
        for bad in [vec![], vec![("lease_ref", lease), ("job_ref", job)]] {
            assert_eq!(
                call(&bad).unwrap_err(),
                BadCall::OneOf("lease_ref", "job_ref")
            );
        }
        assert!(matches!(
            call(&[("job_ref", lease)]).unwrap_err(),
            BadCall::NotARef { .. }
        ));
    }

    #[test]
    fn the_reference_tools_are_all_here() {
        let reference = [
            "cube_acquire",
            "cube_status",
            "cube_exec",
            "cube_read_text",
            "cube_write_text",
            "cube_list_files",
            "cube_stat_file",
            "cube_upload_artifact",
            "cube_download_artifact",
            "cube_job_start",
            "cube_job_status",
            "cube_job_output",
            "cube_job_cancel",
            "cube_task_plan",
            "cube_task_submit",
            "cube_task_status",
            "cube_task_result",
            "cube_task_cancel",
            "cube_task_receipt",
            "cube_checkpoint",
            "cube_rollback",
            "cube_fork",
            "cube_release",
        ];
        assert_eq!(reference.len(), 23);
        for n in reference {
            assert!(TOOLS.iter().any(|t| t.name == n), "{n} is missing");
        }
        assert!(
            !TOOLS.iter().any(|t| t.name.contains("approve")),
            "no tool approves"
        );
    }

    #[test]
    fn refs_and_profile_cannot_come_from_the_model() {
        let mut args = Map::new();
        args.insert("lease_ref".into(), json!("lease_../../admin/gc/xxxxxxx"));
        assert!(request("cube_status", &args, &Host::default()).is_err());
        let mut args = Map::new();
        args.insert("runtime".into(), json!("mcp"));
        args.insert("session_key".into(), json!("s"));
        args.insert("profile".into(), json!("wide-open"));
        let host = Host {
            profile: Some("offline-code".into()),
            runtime: None,
        };
        let r = request("cube_acquire", &args, &host).unwrap();
        assert_eq!(r.body.unwrap()["profile"], "offline-code");
        let r = request("cube_acquire", &args, &Host::default()).unwrap();
        assert!(r.body.unwrap().get("profile").is_none());
    }

    #[test]
    fn the_hosts_runtime_wins_and_is_no_argument() {
        let mut args = Map::new();
        args.insert("runtime".into(), json!("mcp"));
        args.insert("session_key".into(), json!("s"));
        let host = Host {
            profile: None,
            runtime: Some("hermes".into()),
        };
        let b = request("cube_acquire", &args, &host).unwrap().body.unwrap();
        assert_eq!(b["runtime"], "hermes");
        let b = request("cube_acquire", &args, &Host::default())
            .unwrap()
            .body
            .unwrap();
        assert_eq!(b["runtime"], "mcp", "without a host runtime the model's");
        let hosted = schema_for("cube_acquire", &host);
        assert!(hosted["properties"].get("runtime").is_none());
        assert_eq!(hosted["required"], json!(["session_key"]));
        let open = schema_for("cube_acquire", &Host::default());
        assert!(open["properties"].get("runtime").is_some());
        assert_eq!(
            open["required"],
            json!(["session_key"]),
            "runtime is optional"
        );
        assert_eq!(schema_for("cube_exec", &host), schema("cube_exec"));
    }
}
