#!/usr/bin/env python3
"""A scripted model on 127.0.0.1 that real agent hosts talk to as if it
were their provider, so that a test can watch them make real MCP tool calls
through the appliance (tests/it/hosts.rs in CI, tests/hosts/run.sh for all
five hosts).

    python3 model.py --marker TEXT [--port 0] [--log FILE] [--session-key KEY]
                     [--first-call TOOL --first-args JSON] [--mcp-call JSON]

Prints `model listening on http://127.0.0.1:PORT` once it listens, then
serves until killed. Each request it answers is appended to --log as one
JSON line: {"path": ..., "tools": [...], "results": [...], "answer": ...}.

The script, the same whatever the host: each answer follows from the tools
the host offers and the tool results sent back so far, as a model's would.
  1. no result yet          -> call *cube_acquire {session_key}
  2. one result (the lease) -> call *cube_exec, writing MARKER to PROOF
  3. two results            -> call *cube_read_text PROOF
  4. then                   -> say "FINAL <lease> read back MARKER" (or what
                               it read instead)
With --mcp-call {"tool": T, "arguments": {...}}, step 4 is a call of
*cube_mcp_call {lease_ref, tool, arguments} (a governed MCP tool in the
sandbox), and the last word adds "mcp said <its result>".
With --first-call, step 0 comes before all of these: call TOOL with the
JSON object ARGS, whether or not the host offers TOOL (a hardened host's
own shell, which it should refuse or not have); its result is not one of
the script's results, whatever it says.
Tools are matched by suffix: hosts prefix MCP tools with the server's name
(`mcp__cube__cube_exec`, `cube_cube_exec`, ...; Codex's namespace
`mcp__cube` of functions is seen as `mcp__cube__cube_exec`).

Wire APIs, told apart by the path:
  POST .../chat/completions   OpenAI chat completions, streaming or not
                              (Hermes, OpenCode, OpenClaw)
  POST .../responses          OpenAI Responses, streaming (SSE) or not (Codex)
  POST .../messages           Anthropic Messages, streaming or not (Claude
                              Code); .../messages/count_tokens is answered too
GET .../models lists the one model, `scripted`, with a context length, so
that hosts need not look it up elsewhere.

A request that offers no tools at all is a host's side request (a title, a
summary, a quota probe): it is answered "OK" and does not count as a step.
Where the host hides its MCP tools behind a tool search and does not offer
*cube_acquire, the first step is to search for the three cube tools, as a
model would, and the search's result is not one of the script's results:
  - Claude Code (`ToolSearch`, Messages): select them by name; they are
    offered from the next request on.
  - OpenClaw (`tool_search` + `tool_call`, chat completions): search, then
    call each through `tool_call` with the id the search returned; the log's
    "tools" then include those ids, and its "answer" is the `tool_call`.

Standard library only; nothing but loopback.
"""
import argparse
import json
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PROOF = "/workspace/proof.txt"
LEASE = re.compile(r"lease_[0-9a-f]{20}")
MODEL = {"id": "scripted", "object": "model", "owned_by": "cube-adapter-tests",
         "context_length": 131072}


SIDE = ("say", "OK")
CUBE_TOOLS = ("cube_acquire", "cube_exec", "cube_read_text")


def plan(tools, results, marker, session_key, search=None, first=None, mcp=None):
    """The next step: ("call", tool, args) or ("say", text). `search` is
    the ("call", tool, args) that selects deferred tools, if the host has
    such a tool and it has not been called yet; `first` the call made before
    anything else (its result is the first of `results`)."""
    if first:
        if not results:
            return first
        results = results[1:]

    def tool(suffix):
        return next((t for t in tools if t.endswith(suffix)), None)

    def call(suffix, args):
        name = tool(suffix)
        return ("call", name, args) if name else ("say", f"MISSING TOOL {suffix} among {tools}")

    if search and not tool("cube_acquire"):
        return search
    if not results:
        return call("cube_acquire", {"session_key": session_key})
    m = LEASE.search(results[0])
    if not m:
        return ("say", f"NO LEASE in {results[0][:500]}")
    lease = m.group(0)
    if len(results) == 1:
        return call("cube_exec", {"lease_ref": lease,
                                  "command": f"printf '%s\\n' {marker} > {PROOF}"})
    if len(results) == 2:
        return call("cube_read_text", {"lease_ref": lease, "path": PROOF})
    if mcp and len(results) == 3:
        return call("cube_mcp_call", {"lease_ref": lease, **mcp})
    said = f" mcp said {results[3][:500]}" if mcp else ""
    if marker in results[2]:
        return ("say", f"FINAL {lease} read back {marker}{said}")
    return ("say", f"FINAL {lease} read something else: {results[2][:500]}")


def text_of(content):
    """A message's content as text (a string, or a list of parts)."""
    if isinstance(content, str):
        return content
    return json.dumps(content)


# ---------------------------------------------------------------- chat completions
def chat_completions(req, step, call_id):
    """(content type, body) for an OpenAI chat completions request."""
    if step[0] == "call":
        message = {"role": "assistant", "content": None, "tool_calls": [{
            "id": call_id, "type": "function",
            "function": {"name": step[1], "arguments": json.dumps(step[2])}}]}
        finish = "tool_calls"
    else:
        message = {"role": "assistant", "content": step[1]}
        finish = "stop"
    base = {"id": "chatcmpl-scripted", "created": 0, "model": req.get("model") or "scripted"}
    if not req.get("stream"):
        return "application/json", json.dumps(dict(base, object="chat.completion", choices=[
            {"index": 0, "message": message, "finish_reason": finish}],
            usage={"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}))
    delta = dict(message)
    if "tool_calls" in delta:
        delta["tool_calls"] = [dict(c, index=i) for i, c in enumerate(delta["tool_calls"])]
    chunks = [{"index": 0, "delta": delta, "finish_reason": None},
              {"index": 0, "delta": {}, "finish_reason": finish}]
    events = [json.dumps(dict(base, object="chat.completion.chunk", choices=[c])) for c in chunks]
    if (req.get("stream_options") or {}).get("include_usage"):
        events.append(json.dumps(dict(base, object="chat.completion.chunk", choices=[],
                                      usage={"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2})))
    return "text/event-stream", "".join(f"data: {e}\n\n" for e in events) + "data: [DONE]\n\n"


def chat_conversation(req):
    tools = [t.get("function", {}).get("name", "") for t in req.get("tools") or []]
    results = [text_of(m.get("content")) for m in req.get("messages") or [] if m.get("role") == "tool"]
    return tools, results


CATALOG_SEARCH, CATALOG_CALL = "tool_search", "tool_call"


def chat_catalog_conversation(req):
    """Chat completions, where the host may keep its MCP tools in a catalog
    behind `tool_search` and `tool_call` (OpenClaw's default Tool Search):
    then search it for the cube tools first, and call them through
    `tool_call` by the names the search returned, as a model would."""
    tools, results = chat_conversation(req)
    if any(t.endswith("cube_acquire") for t in tools) or not {CATALOG_SEARCH, CATALOG_CALL} <= set(tools):
        return tools, results, None, None
    called = {}
    for m in req.get("messages") or []:
        for c in m.get("tool_calls") or [] if m.get("role") == "assistant" else []:
            called[c.get("id")] = (c.get("function") or {}).get("name")
    found, results = [], []
    for m in req.get("messages") or []:
        if m.get("role") != "tool":
            continue
        if called.get(m.get("tool_call_id")) != CATALOG_SEARCH:
            results.append(text_of(m.get("content")))
            continue
        # The search's result lists the tools it found, each with the id to pass to tool_call.
        c = m.get("content")
        text = c if isinstance(c, str) else " ".join(p.get("text", "") for p in c or [] if isinstance(p, dict))
        for suffix in CUBE_TOOLS:
            ids = re.findall(r'"id"\s*:\s*"([^"\\]*' + suffix + r')"', text)
            found += ids[:1]
    if CATALOG_SEARCH not in called.values():
        return tools, results, ("call", CATALOG_SEARCH, {"query": " ".join(CUBE_TOOLS)}), None
    real = set(tools)

    def through_catalog(step):
        if step[0] == "call" and step[1] not in real:
            return ("call", CATALOG_CALL, {"id": step[1], "args": step[2]})
        return step
    # The tools the model can call: those offered, and those the search found.
    return tools + [f for f in found if f not in real], results, None, through_catalog


# ---------------------------------------------------------------- OpenAI Responses
def responses_tools(req):
    """{name as the script sees it: (namespace or None, name)}. Codex offers
    an MCP server's tools as one namespace (`mcp__cube`) of functions
    (`cube_exec`); the script sees `mcp__cube__cube_exec`."""
    out = {}
    for t in req.get("tools") or []:
        if t.get("type") == "namespace":
            for f in t.get("tools") or []:
                out[f"{t.get('name')}__{f.get('name')}"] = (t.get("name"), f.get("name"))
        elif t.get("name") or (t.get("function") or {}).get("name"):
            name = t.get("name") or t["function"]["name"]
            out[name] = (None, name)
    return out


def responses(req, step, call_id):
    """(content type, body) for an OpenAI Responses request."""
    if step[0] == "call":
        namespace, name = responses_tools(req).get(step[1], (None, step[1]))
        item = {"type": "function_call", "id": "fc_" + call_id, "call_id": call_id, "status": "completed",
                "name": name, "arguments": json.dumps(step[2])}
        if namespace:
            item["namespace"] = namespace
    else:
        item = {"type": "message", "id": "msg_" + call_id, "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": step[1], "annotations": []}]}
    usage = {"input_tokens": 1, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 1,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 2}
    resp = {"id": "resp_" + call_id, "object": "response", "created_at": 0, "status": "in_progress",
            "model": req.get("model") or "scripted", "output": []}
    done = dict(resp, status="completed", output=[item], usage=usage)
    if not req.get("stream"):
        return "application/json", json.dumps(done)
    events = [{"type": "response.created", "response": resp},
              {"type": "response.output_item.added", "output_index": 0, "item": item},
              {"type": "response.output_item.done", "output_index": 0, "item": item},
              {"type": "response.completed", "response": done}]
    return "text/event-stream", "".join(
        f"event: {e['type']}\ndata: {json.dumps(dict(e, sequence_number=i))}\n\n" for i, e in enumerate(events))


def responses_conversation(req):
    tools = list(responses_tools(req))
    items = req.get("input")
    items = items if isinstance(items, list) else []
    results = [text_of(i.get("output")) for i in items
               if isinstance(i, dict) and i.get("type") == "function_call_output"]
    return tools, results, None, None


# ---------------------------------------------------------------- Anthropic Messages
SEARCH_TOOL = "ToolSearch"


def messages(req, step, call_id):
    """(content type, body) for an Anthropic Messages request."""
    if step[0] == "call":
        block, stop = {"type": "tool_use", "id": "toolu_" + call_id, "name": step[1], "input": step[2]}, "tool_use"
    else:
        block, stop = {"type": "text", "text": step[1]}, "end_turn"
    usage = {"input_tokens": 1, "output_tokens": 1, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    msg = {"id": "msg_" + call_id, "type": "message", "role": "assistant",
           "model": req.get("model") or "scripted", "content": [], "stop_reason": None,
           "stop_sequence": None, "usage": usage}
    if not req.get("stream"):
        return "application/json", json.dumps(dict(msg, content=[block], stop_reason=stop))
    if block["type"] == "tool_use":
        start, delta = dict(block, input={}), {"type": "input_json_delta", "partial_json": json.dumps(step[2])}
    else:
        start, delta = dict(block, text=""), {"type": "text_delta", "text": step[1]}
    events = [{"type": "message_start", "message": msg},
              {"type": "content_block_start", "index": 0, "content_block": start},
              {"type": "content_block_delta", "index": 0, "delta": delta},
              {"type": "content_block_stop", "index": 0},
              {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
               "usage": {"output_tokens": 1}},
              {"type": "message_stop"}]
    return "text/event-stream", "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events)


def messages_conversation(req):
    offered = {t.get("name", ""): t for t in req.get("tools") or []}
    called, results = {}, []
    for m in req.get("messages") or []:
        if not isinstance(m.get("content"), list):
            continue
        for b in m["content"]:
            if not isinstance(b, dict):
                continue
            if m.get("role") == "assistant" and b.get("type") == "tool_use":
                called[b.get("id")] = b.get("name")
            elif m.get("role") == "user" and b.get("type") == "tool_result":
                if called.get(b.get("tool_use_id")) != SEARCH_TOOL:
                    results.append(text_of(b.get("content")))
    search = None
    if SEARCH_TOOL in offered and SEARCH_TOOL not in called.values():
        search = ("call", SEARCH_TOOL, search_args(offered[SEARCH_TOOL], req))
    return list(offered), results, search, None


def search_args(tool, req):
    """ToolSearch's input, from its own schema: select the cube tools the
    request names (the host lists its deferred tools somewhere in it)."""
    props = (tool.get("input_schema") or {}).get("properties") or {}
    def strings(o):
        if isinstance(o, str):
            yield o
        elif isinstance(o, (list, dict)):
            for v in (o.values() if isinstance(o, dict) else o):
                yield from strings(v)
    text = "\n".join(strings(req))
    names = []
    for suffix in CUBE_TOOLS:
        found = re.findall(r"[A-Za-z0-9_-]*" + suffix + r"(?![A-Za-z0-9_])", text)
        names.append(max(found, key=len, default=suffix))   # the full name, not a prompt's mention
    key = "query" if "query" in props else next(iter(props), "query")
    args = {key: "select:" + ",".join(names)}
    if "max_results" in props:
        args["max_results"] = len(names)
    return args


# path suffix: (conversation, encode). conversation(request) is (the tools
# the model can call, the script's results so far, a search step or None, a
# function that rewrites the step for the host or None); encode(request,
# step, call id) is (content type, body).
WIRES = {
    "/chat/completions": (chat_catalog_conversation, chat_completions),
    "/responses": (responses_conversation, responses),
    "/messages": (messages_conversation, messages),
}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def reply(self, status, ctype, body):
        data = body.encode()
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        path = self.path.split("?")[0]
        if path.endswith("/models"):
            return self.reply(200, "application/json", json.dumps({"object": "list", "data": [MODEL]}))
        if path.endswith("/models/scripted"):
            return self.reply(200, "application/json", json.dumps(MODEL))
        print(f"model: no GET {path}", file=sys.stderr, flush=True)
        self.reply(404, "application/json", '{"error": "not found"}')

    def do_POST(self):
        path = self.path.split("?")[0]
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        if path.endswith("/messages/count_tokens"):
            return self.reply(200, "application/json", '{"input_tokens": 1}')
        wire = next((w for suffix, w in WIRES.items() if path.endswith(suffix)), None)
        if wire is None:
            print(f"model: no POST {path}", file=sys.stderr, flush=True)
            return self.reply(404, "application/json", '{"error": "not found"}')
        try:
            req = json.loads(body)
        except ValueError:
            return self.reply(400, "application/json", '{"error": "not JSON"}')
        conversation, encode = wire
        tools, results, search, wrap = conversation(req)
        srv = self.server
        step = (plan(tools, results, srv.marker, srv.session_key, search, srv.first, srv.mcp)
                if tools else SIDE)
        if wrap:
            step = wrap(step)
        with srv.lock:
            srv.calls += 1
            call_id = f"call_{srv.calls}"
            if srv.log:
                srv.log.write(json.dumps({"path": path, "tools": tools, "results": results,
                                          "answer": list(step)}) + "\n")
                srv.log.flush()
        ctype, out = encode(req, step, call_id)
        self.reply(200, ctype, out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--marker", required=True, help="what the model writes and expects to read back")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--log", help="append each request's gist here, one JSON line each")
    ap.add_argument("--session-key", default="hosts-test")
    ap.add_argument("--first-call", metavar="TOOL", help="call TOOL before the script (a host's own tool)")
    ap.add_argument("--first-args", metavar="JSON", default="{}", help="its arguments, a JSON object")
    ap.add_argument("--mcp-call", metavar="JSON", help='then cube_mcp_call {"tool", "arguments"}')
    a = ap.parse_args()
    srv = ThreadingHTTPServer(("127.0.0.1", a.port), Handler)
    srv.daemon_threads = True
    srv.marker, srv.session_key = a.marker, a.session_key
    srv.lock, srv.calls = threading.Lock(), 0
    srv.first = ("call", a.first_call, json.loads(a.first_args)) if a.first_call else None
    srv.mcp = json.loads(a.mcp_call) if a.mcp_call else None
    srv.log = open(a.log, "a", encoding="utf-8") if a.log else None
    print(f"model listening on http://127.0.0.1:{srv.server_address[1]}", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
