#!/usr/bin/env python3
"""Smoke test: drive our CubeSandbox emulator with the official, unmodified
Python SDK (`pip install cubesandbox==0.7.3`).

The caller sets the environment:

    CUBE_API_URL=http://127.0.0.1:<port>      control plane (CubeAPI)
    CUBE_PROXY_NODE_IP=127.0.0.1              data plane: SDK connects here ...
    CUBE_PROXY_PORT_HTTP=<port>               ... on this port, keeping Host=49983-<id>.<domain>
    CUBE_TEMPLATE_ID=host                     template for Sandbox.create()

Optional: SDK_SMOKE_STEP_TIMEOUT (seconds per step, default 30).

Each step prints `ok: <step>`; the first failure prints the error and exits 1;
success ends with `sdk-smoke: all ok` and exit 0. There are no retries.

Network safety: the script refuses to start unless both endpoints are
loopback, drops proxy environment variables (the SDK's control plane uses
`requests`, which honours HTTP(S)_PROXY), and installs an audit hook that
rejects any socket connect / name lookup that is not loopback.

SDK 0.7.3 facts this script relies on (see /tmp/sdk-notes.md):
- commands.run() never raises for a non-zero exit: it returns
  CommandResult(stdout, stderr, exit_code). Transport/protocol failures raise
  RuntimeError.
- commands.run() has no background mode (extra kwargs are silently ignored),
  so none is tested here.
- files.read() always returns str (UTF-8 decoded with replacement); there is
  no bytes format. files.write() accepts str or bytes. Exact binary content is
  therefore checked through a command (sha256sum) rather than files.read().
- Only commands.run() takes a timeout; everything else is bounded here by a
  SIGALRM watchdog per step.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import signal
import socket
import sys
import traceback
import uuid
from urllib.parse import urlsplit

STEP_TIMEOUT = float(os.environ.get("SDK_SMOKE_STEP_TIMEOUT", "30"))


# --------------------------------------------------------------------------
# Loopback-only guard (must run before the SDK makes any connection)
# --------------------------------------------------------------------------

def _is_loopback_host(host: str | None) -> bool:
    if host is None:
        return True  # getaddrinfo(None, port) = local wildcard, no lookup
    if isinstance(host, bytes):
        host = host.decode("ascii", "replace")
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def _audit(event: str, args: tuple) -> None:
    if event == "socket.connect":
        sock, address = args[0], args[1]
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            if not _is_loopback_host(address[0]):
                raise PermissionError(f"sdk-smoke: blocked non-loopback connect to {address!r}")
    elif event in ("socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex",
                   "socket.gethostbyaddr"):
        if not _is_loopback_host(args[0]):
            raise PermissionError(f"sdk-smoke: blocked name lookup of {args[0]!r}")


def _check_env() -> None:
    missing = [k for k in ("CUBE_API_URL", "CUBE_PROXY_NODE_IP", "CUBE_PROXY_PORT_HTTP",
                           "CUBE_TEMPLATE_ID") if not os.environ.get(k)]
    if missing:
        raise SystemExit(f"sdk-smoke: missing env: {', '.join(missing)}")
    api = urlsplit(os.environ["CUBE_API_URL"])
    if api.scheme != "http" or not _is_loopback_host(api.hostname):
        raise SystemExit(f"sdk-smoke: CUBE_API_URL must be http://<loopback>, got {api.geturl()!r}")
    node_ip = os.environ["CUBE_PROXY_NODE_IP"]
    try:
        if not ipaddress.ip_address(node_ip).is_loopback:
            raise ValueError
    except ValueError:
        raise SystemExit(f"sdk-smoke: CUBE_PROXY_NODE_IP must be a loopback IP, got {node_ip!r}")
    int(os.environ["CUBE_PROXY_PORT_HTTP"])
    # requests (control plane) would route through these; httpx (data plane)
    # ignores them because the SDK passes its own transport.
    for k in list(os.environ):
        if k.lower() in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
            del os.environ[k]


_check_env()
sys.addaudithook(_audit)

import cubesandbox  # noqa: E402  (imported after the guard on purpose)
from cubesandbox import Sandbox, SandboxNotFoundError  # noqa: E402


# --------------------------------------------------------------------------
# Step runner
# --------------------------------------------------------------------------

class StepTimeout(BaseException):
    """BaseException so no `except Exception` inside the SDK can swallow it."""


def _on_alarm(signum, frame):
    raise StepTimeout(f"step exceeded {STEP_TIMEOUT:g}s watchdog")


signal.signal(signal.SIGALRM, _on_alarm)


class StepFailed(Exception):
    pass


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise StepFailed(msg)


_current_step = "startup"


def step(name: str, fn):
    global _current_step
    _current_step = name
    # Watchdog slightly longer than the SDK-level timeout so that, where the
    # SDK has its own deadline, its error is the one reported.
    signal.setitimer(signal.ITIMER_REAL, STEP_TIMEOUT + 5)
    try:
        result = fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    print(f"ok: {name}", flush=True)
    return result


# --------------------------------------------------------------------------
# Steps
# --------------------------------------------------------------------------

def run_all() -> None:
    print(f"sdk-smoke: cubesandbox {cubesandbox.__version__}, "
          f"api={os.environ['CUBE_API_URL']}, "
          f"proxy={os.environ['CUBE_PROXY_NODE_IP']}:{os.environ['CUBE_PROXY_PORT_HTTP']}, "
          f"template={os.environ['CUBE_TEMPLATE_ID']}", flush=True)

    sbx: Sandbox | None = None
    killed = False
    try:
        def create():
            s = Sandbox.create()
            check(isinstance(s.sandbox_id, str) and s.sandbox_id and "." not in s.sandbox_id,
                  f"bad sandboxID {s.sandbox_id!r}")
            return s
        sbx = step("create", create)

        def run_echo():
            r = sbx.commands.run("echo hello; echo oops 1>&2", timeout=STEP_TIMEOUT)
            check(r.stdout == "hello\n", f"stdout {r.stdout!r} != 'hello\\n'")
            check(r.stderr == "oops\n", f"stderr {r.stderr!r} != 'oops\\n'")
            check(r.exit_code == 0, f"exit_code {r.exit_code!r} != 0")
        step("commands.run stdout+stderr", run_echo)

        def run_exit3():
            # SDK 0.7.3 returns a CommandResult for non-zero exits (no exception).
            r = sbx.commands.run("exit 3", timeout=STEP_TIMEOUT)
            check(r.exit_code == 3, f"exit_code {r.exit_code!r} != 3")
            check(r.stdout == "" and r.stderr == "", f"unexpected output {r.stdout!r} / {r.stderr!r}")
        step("commands.run non-zero exit", run_exit3)

        def run_env_cwd():
            r = sbx.commands.run('printf "%s|%s" "$SMOKE_VAR" "$(pwd)"', cwd="/tmp",
                                 envs={"SMOKE_VAR": "v1"}, timeout=STEP_TIMEOUT)
            check((r.exit_code, r.stdout) == (0, "v1|/tmp"), f"got {r!r}")
        step("commands.run envs+cwd", run_env_cwd)

        def write_text():
            sbx.files.write("/workspace/hello.txt", "hi there")
        step("files.write str", write_text)

        def read_text():
            got = sbx.files.read("/workspace/hello.txt")
            check(got == "hi there", f"read {got!r} != 'hi there'")
        step("files.read", read_text)

        def bytes_roundtrip():
            # files.read() is text-only, so read back a UTF-8-valid payload...
            text_bytes = "caf\u00e9 \u2713\n".encode("utf-8") + b"\x00\x01tail"
            sbx.files.write("/workspace/utf8.bin", text_bytes)
            got = sbx.files.read("/workspace/utf8.bin")
            check(got == text_bytes.decode("utf-8"), f"read {got!r}")
            # ...and verify arbitrary bytes exactly through a command.
            blob = bytes(range(256)) * 4
            sbx.files.write("/workspace/blob.bin", blob)
            r = sbx.commands.run("sha256sum /workspace/blob.bin", timeout=STEP_TIMEOUT)
            check(r.exit_code == 0, f"sha256sum exit {r.exit_code}: {r.stderr!r}")
            want = hashlib.sha256(blob).hexdigest()
            check(r.stdout.split()[:1] == [want], f"sha256 {r.stdout!r} != {want}")
        step("files.write bytes round-trip", bytes_roundtrip)

        def exists():
            check(sbx.files.exists("/workspace/hello.txt") is True, "hello.txt should exist")
            missing = f"/workspace/missing-{uuid.uuid4().hex}"
            check(sbx.files.exists(missing) is False, f"{missing} should not exist")
        step("files.exists", exists)

        def listing():
            entries = sbx.files.list("/workspace")
            by_name = {e.get("name"): e for e in entries}
            e = by_name.get("hello.txt")
            check(e is not None, f"hello.txt not in {sorted(by_name)}")
            check(e.get("path") == "/workspace/hello.txt", f"path {e.get('path')!r}")
            check(e.get("type") == "FILE_TYPE_FILE", f"type {e.get('type')!r}")
        step("files.list", listing)

        def dirs_rename_remove():
            d = "/workspace/smoke-dir"
            entry = sbx.files.make_dir(d)
            check(entry.get("type") == "FILE_TYPE_DIRECTORY", f"make_dir entry {entry!r}")
            moved = sbx.files.rename("/workspace/hello.txt", f"{d}/moved.txt")
            check(moved.get("path") == f"{d}/moved.txt", f"rename entry {moved!r}")
            check(sbx.files.read(f"{d}/moved.txt") == "hi there", "moved content differs")
            check(not sbx.files.exists("/workspace/hello.txt"), "rename left the source behind")
            sbx.files.remove(d)
            check(not sbx.files.exists(d), "remove did not delete the directory")
        step("files.make_dir/rename/remove", dirs_rename_remove)

        def kill():
            nonlocal killed
            sbx.kill()
            killed = True
            try:
                sbx.get_info()
            except SandboxNotFoundError:
                return
            raise StepFailed("get_info after kill did not raise SandboxNotFoundError")
        step("kill", kill)
    finally:
        if sbx is not None:
            if not killed:
                # Best-effort cleanup after a failure; never hides the failure.
                signal.setitimer(signal.ITIMER_REAL, STEP_TIMEOUT)
                try:
                    sbx.kill()
                except BaseException:  # noqa: BLE001
                    pass
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            sbx.close()


def main() -> int:
    try:
        run_all()
    except (Exception, StepTimeout) as e:  # noqa: BLE001
        traceback.print_exc(file=sys.stderr)
        print(f"FAIL: {_current_step}: {type(e).__name__}: {e}", flush=True)
        return 1
    print("sdk-smoke: all ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
