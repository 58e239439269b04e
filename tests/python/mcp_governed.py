"""Governed MCP through the appliance with the official MCP Python SDK
(unmodified): MCP_MODE=http over /mcp?profile=MCP_PROFILE, MCP_MODE=stdio
through `cube-adapter mcp` (MCP_BIN). The profile binds the controlled-echo
policy (one `echo` tool, `text` at most 256 characters, closed schema).
Prints "mcp-governed (MODE): all ok"."""

import asyncio
import json
import os
import sys

import httpx2
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

MODE = os.environ.get("MCP_MODE", "http")
URL = os.environ["MCP_URL"]
TOKEN = os.environ["MCP_TOKEN"]
CA = os.environ["MCP_CA"]
PROFILE = os.environ["MCP_PROFILE"]


def check(cond, what):
    if not cond:
        print(f"FAILED ({MODE}): {what}", file=sys.stderr)
        sys.exit(1)


def text_of(r):
    return "".join(getattr(c, "text", "") for c in r.content)


async def main():
    if MODE == "http":
        http = httpx2.AsyncClient(
            verify=CA, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=httpx2.Timeout(120)
        )
        target = streamable_http_client(f"{URL}?profile={PROFILE}", http_client=http)
    else:
        target = StdioServerParameters(
            command=os.environ["MCP_BIN"],
            args=["mcp"],
            env={
                "CUBE_ADAPTER_URL": URL,
                "CUBE_ADAPTER_TOKEN": TOKEN,
                "CUBE_ADAPTER_CA_FILE": CA,
                "CUBE_ADAPTER_PROFILE": PROFILE,
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            },
        )
    async with Client(target) as c:
        tools = {t.name: t for t in (await c.list_tools()).tools}
        check("cube_mcp_call" in tools and "cube_mcp_tools" in tools, "the governed MCP tools are listed")
        props = tools["cube_mcp_call"].input_schema["properties"]
        check("server" not in props and "command" not in props, "no server or command argument")

        r = await c.call_tool("cube_acquire", {"runtime": "mcp", "session_key": f"governed-{MODE}"})
        check(not r.is_error, f"acquire: {text_of(r)}")
        lease = r.structured_content["lease_ref"]

        r = await c.call_tool("cube_mcp_tools", {"lease_ref": lease})
        check(not r.is_error, f"tools: {text_of(r)}")
        listed = r.structured_content["tools"]
        check([t["name"] for t in listed] == ["echo"], f"only echo is listed: {listed}")
        check(listed[0]["input_schema"]["properties"]["text"]["maxLength"] == 256, "with its schema")

        text = ("governed-" + MODE + "-") .ljust(256, "x")
        r = await c.call_tool("cube_mcp_call", {"lease_ref": lease, "tool": "echo", "arguments": {"text": text}})
        check(not r.is_error, f"echo 256: {text_of(r)}")
        s = r.structured_content
        check(s["tool"] == "echo" and not s["is_error"], f"echo answered: {s}")
        check(s["content"][0]["text"] == text, f"the text came back: {s['content']}")

        refusals = [
            ({"tool": "echo", "arguments": {"text": text + "y"}}, "mcp_arguments_invalid"),
            ({"tool": "echo", "arguments": {"text": "a", "extra": 1}}, "mcp_arguments_invalid"),
            ({"tool": "sleep", "arguments": {"seconds": 1}}, "mcp_tool_denied"),
            ({"tool": "echo", "arguments": {"text": "a"}, "server": "evil"}, "unknown_fields"),
        ]
        for args, code in refusals:
            r = await c.call_tool("cube_mcp_call", {"lease_ref": lease, **args})
            check(r.is_error and code in text_of(r), f"{args} is refused with {code}: {text_of(r)}")

        r = await c.call_tool("cube_release", {"lease_ref": lease})
        check(not r.is_error, f"release: {text_of(r)}")
    print(f"mcp-governed ({MODE}): all ok")


asyncio.run(main())
