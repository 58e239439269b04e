"""The official MCP Python SDK (mcp==2.3.0, unmodified) against the appliance:
MCP_MODE=http connects to its /mcp endpoint over HTTPS with the generated CA;
MCP_MODE=stdio spawns `cube-adapter mcp` (MCP_BIN), which reaches the
appliance's /v1 over HTTPS. Prints "mcp-smoke: all ok"."""

import asyncio
import base64
import os
import ssl
import sys

import httpx2
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

MODE = os.environ.get("MCP_MODE", "http")
URL = os.environ["MCP_URL"]
# The agent's identity: a token, or (MCP_CERT + MCP_KEY) a client
# certificate the appliance issued.
TOKEN = os.environ.get("MCP_TOKEN")
CERT = os.environ.get("MCP_CERT")
KEY = os.environ.get("MCP_KEY")
CA = os.environ["MCP_CA"]
# The appliance's base URL and an approver's token (approval is a person's
# act on /v1: no tool approves).
API = os.environ["MCP_API"]
APPROVER = os.environ["MCP_APPROVER"]


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)


async def call(c, name, args):
    r = await c.call_tool(name, args)
    return r


async def main():
    http = None
    if MODE == "http":
        # No token: refused before any MCP processing.
        async with httpx2.AsyncClient(verify=CA) as raw:
            r = await raw.post(URL, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
            check(r.status_code == 401, f"no token gives 401, got {r.status_code}")
            check(r.json()["error"]["code"] == "unauthorized", "the 401 carries the code")
        if CERT:
            ctx = ssl.create_default_context(cafile=CA)
            ctx.load_cert_chain(CERT, KEY)
            http = httpx2.AsyncClient(verify=ctx, timeout=httpx2.Timeout(120))
        else:
            http = httpx2.AsyncClient(
                verify=CA, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=httpx2.Timeout(120)
            )
        target = streamable_http_client(URL, http_client=http)
    else:
        target = StdioServerParameters(
            command=os.environ["MCP_BIN"],
            args=["mcp"],
            env={
                "CUBE_ADAPTER_URL": URL,
                **({"CUBE_ADAPTER_CLIENT_CERT_FILE": CERT, "CUBE_ADAPTER_CLIENT_KEY_FILE": KEY}
                   if CERT else {"CUBE_ADAPTER_TOKEN": TOKEN}),
                "CUBE_ADAPTER_CA_FILE": CA,
                "CUBE_ADAPTER_PROFILE": "offline-code",
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            },
        )
    async with Client(target) as c:
        tools = {t.name: t for t in (await c.list_tools()).tools}
        reference = ["cube_acquire", "cube_status", "cube_exec", "cube_read_text", "cube_write_text",
                     "cube_list_files", "cube_stat_file", "cube_upload_artifact", "cube_download_artifact",
                     "cube_job_start", "cube_job_status", "cube_job_output", "cube_job_cancel",
                     "cube_task_plan", "cube_task_submit", "cube_task_status", "cube_task_result",
                     "cube_task_cancel", "cube_task_receipt", "cube_checkpoint", "cube_rollback",
                     "cube_fork", "cube_release"]
        for name in reference + ["cube_job_resume", "cube_profiles", "cube_renew", "cube_recover", "cube_checkpoint_list",
                                 "cube_task_templates"]:
            check(name in tools, f"tool {name} is listed")
        check(not any("approve" in n for n in tools), "no tool approves")
        check(not any(n.startswith("cube_mcp_") for n in tools),
              "no governed MCP tools on a profile without an MCP policy")
        check(tools["cube_read_text"].annotations.read_only_hint is True, "read is read-only")
        check(tools["cube_release"].annotations.destructive_hint is True, "release is destructive")
        check("profile" not in tools["cube_acquire"].input_schema["properties"], "no profile argument")

        r = await call(c, "cube_acquire", {"runtime": "mcp", "session_key": "mcp-smoke"})
        check(not r.is_error, f"acquire: {r.content}")
        lease = r.structured_content["lease_ref"]

        r = await call(c, "cube_exec", {"lease_ref": lease, "command": "echo hi; echo there >&2"})
        check(not r.is_error and r.structured_content["stdout"] == "hi\n", f"exec: {r.structured_content}")
        check(r.structured_content["stderr"] == "there\n", "exec stderr")

        r = await call(c, "cube_write_text", {"lease_ref": lease, "path": "/workspace/a.txt", "content": "héllo"})
        check(not r.is_error, f"write: {r.content}")
        r = await call(c, "cube_read_text", {"lease_ref": lease, "path": "/workspace/a.txt"})
        check(r.structured_content["content"] == "héllo", f"read: {r.structured_content}")

        r = await call(c, "cube_job_start", {"lease_ref": lease, "command": "printf abc; sleep 0.3; printf err >&2"})
        check(not r.is_error, f"job start: {r.content}")
        job = r.structured_content["job_ref"]
        out, err = b"", b""
        for _ in range(200):
            r = await call(c, "cube_job_resume",
                           {"job_ref": job, "stdout_offset": len(out), "stderr_offset": len(err)})
            check(not r.is_error, f"job resume: {r.content}")
            s = r.structured_content
            out += base64.b64decode(s["stdout_base64"])
            err += base64.b64decode(s["stderr_base64"])
            if s["eof"]:
                break
            await asyncio.sleep(0.1)
        check((out, err) == (b"abc", b"err"), f"job output by cursor: {out!r} {err!r}")

        # After a restart an agent finds its lease and job again; nothing runs.
        r = await call(c, "cube_recover", {"lease_ref": lease})
        check(not r.is_error and r.structured_content["lease_ref"] == lease
              and r.structured_content["recoverable"] is True, f"recover lease: {r.content}")
        r = await call(c, "cube_recover", {"job_ref": job})
        check(not r.is_error and r.structured_content["job_ref"] == job
              and r.structured_content["state"] == "succeeded", f"recover job: {r.content}")
        r = await call(c, "cube_recover", {})
        check(r.is_error, "recover needs a lease_ref or a job_ref")

        # A terminal: type, read what it printed (the profile allows PTYs).
        check("cube_pty_create" in tools, "terminal tools are listed")
        r = await call(c, "cube_pty_create", {"lease_ref": lease, "rows": 30, "cols": 100})
        check(not r.is_error, f"pty create: {r.content}")
        pty = r.structured_content["pty_ref"]
        r = await call(c, "cube_pty_input", {"pty_ref": pty, "data": "stty size; echo pty-$((6*7))\n"})
        check(not r.is_error, f"pty input: {r.content}")
        seen, offset = b"", 0
        for _ in range(20):
            r = await call(c, "cube_pty_read", {"pty_ref": pty, "offset": offset, "wait_ms": 1000})
            check(not r.is_error, f"pty read: {r.content}")
            seen += base64.b64decode(r.structured_content["content_base64"])
            offset = r.structured_content["next_offset"]
            if b"pty-42" in seen:
                break
        check(b"pty-42" in seen and b"30 100" in seen, f"terminal output: {seen!r}")
        r = await call(c, "cube_pty_kill", {"pty_ref": pty})
        check(r.structured_content["state"] == "cancelled", f"pty kill: {r.structured_content}")

        # A denied action is a tool error carrying the appliance's code.
        r = await call(c, "cube_read_text", {"lease_ref": lease, "path": "/etc/passwd"})
        check(r.is_error, "reading /etc/passwd is refused")
        check(r.structured_content["code"] == "path_denied", f"code: {r.structured_content}")
        check("path_denied" in r.content[0].text, "the text names the code")

        # A checkpoint, and a fork of it that starts from its files.
        r = await call(c, "cube_write_text", {"lease_ref": lease, "path": "/workspace/f.txt", "content": "v1"})
        check(not r.is_error, f"write: {r.content}")
        r = await call(c, "cube_checkpoint", {"lease_ref": lease, "name": "v1"})
        check(not r.is_error, f"checkpoint: {r.content}")
        ckpt = r.structured_content["checkpoint_ref"]
        await call(c, "cube_write_text", {"lease_ref": lease, "path": "/workspace/f.txt", "content": "v2"})
        r = await call(c, "cube_fork", {"lease_ref": lease, "checkpoint_ref": ckpt, "branch": f"b-{MODE}"})
        check(not r.is_error, f"fork: {r.content}")
        fork = r.structured_content["lease_ref"]
        check(fork != lease and r.structured_content["reused"] is False, f"fork: {r.structured_content}")
        r = await call(c, "cube_read_text", {"lease_ref": fork, "path": "/workspace/f.txt"})
        check(r.structured_content["content"] == "v1", f"the fork has the checkpoint's files: {r.structured_content}")
        r = await call(c, "cube_release", {"lease_ref": fork})
        check(not r.is_error, f"release fork: {r.content}")

        # A trusted task: the agent plans, a person approves, the agent runs it
        # and gets its result and signed receipt.
        r = await call(c, "cube_task_templates", {})
        check(not r.is_error and any(t["name"] == "word-count" for t in r.structured_content["task_templates"]),
              f"templates: {r.content}")
        r = await call(c, "cube_task_plan", {"template": "word-count", "parameters": {"text": "one two three", "repeat": 1}})
        check(not r.is_error and r.structured_content["state"] == "pending_approval", f"plan: {r.content}")
        plan = r.structured_content["plan_ref"]
        r = await call(c, "cube_task_submit", {"plan_ref": plan})
        check(r.is_error and r.structured_content["code"] == "plan_not_approved", f"submit before approval: {r.content}")
        async with httpx2.AsyncClient(verify=CA, headers={"Authorization": f"Bearer {APPROVER}"}) as people:
            a = await people.post(f"{API}/v1/task-plans/{plan}/approve", json={"reason": "looks fine"})
            check(a.status_code == 200 and a.json()["state"] == "approved", f"approve: {a.text}")
        r = await call(c, "cube_task_submit", {"plan_ref": plan})
        check(not r.is_error, f"submit: {r.content}")
        task = r.structured_content["task_ref"]
        for _ in range(300):
            r = await call(c, "cube_task_status", {"task_ref": task})
            check(not r.is_error, f"task status: {r.content}")
            if r.structured_content["execution_ended"]:
                break
            await asyncio.sleep(0.1)
        r = await call(c, "cube_task_result", {"task_ref": task})
        check(not r.is_error and r.structured_content["state"] == "succeeded", f"result: {r.content}")
        check(r.structured_content["result"]["outputs"]["summary"]["words"] == 3, f"outputs: {r.structured_content}")
        r = await call(c, "cube_task_receipt", {"task_ref": task})
        check(not r.is_error and r.structured_content["receipt"]["signature"]["alg"] == "HS256", f"receipt: {r.content}")
        check(r.structured_content["receipt"]["signatures"][0]["alg"] == "EdDSA", "and Ed25519")

        r = await call(c, "cube_release", {"lease_ref": lease})
        check(not r.is_error and r.structured_content["action"] == "kill", f"release: {r.content}")
        r = await call(c, "cube_status", {"lease_ref": lease})
        check(r.is_error and r.structured_content["code"] == "lease_not_found", "released lease is gone")
    if http is not None:
        await http.aclose()
    print(f"mcp-smoke ({MODE}{', certificate' if CERT else ''}): all ok")


asyncio.run(main())
