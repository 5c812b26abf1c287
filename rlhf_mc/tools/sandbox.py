"""The sandbox process: started once per executor (`python -m rlhf_mc.tools.sandbox SETTINGS`), it imports the
tools and forks one child per call, so a call costs a fork, not an interpreter start.

Containment, per call: its own process (and process group) with an address-space limit (RLIMIT_AS) and a CPU-time
limit, killed with its group at the wall-clock timeout; no network (the sandbox leaves the machine's network
namespace when it starts: as root, or through a user namespace; where neither is allowed, an audit hook refuses
sockets in Python code, and `network` in the ready line says which); standard streams on /dev/null; its answer cut to
`max_chars` characters. A crash, a timeout or an answer over the cap becomes a result with that status, never an
error here. At most `concurrency` children run at once; the rest wait in order.

Protocol, JSON lines: settings {"tools": {name: "module:function"}, "concurrency", "timeout_s", "memory_mb",
"max_chars"} on the command line; then requests {"id", "name", "arguments"} on stdin and results {"id", "status":
ok|error|timeout|crashed, "content"} on stdout. The first line out is {"id": null, "status": "ready", "content": how the
network is cut off}.

Standard library only: whatever is imported here is mapped into every child, inside its memory limit.
"""

from __future__ import annotations

import collections
import ctypes
import importlib
import json
import os
import resource
import selectors
import signal
import sys
import time
import traceback

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000


def leave_network() -> str:
    """Moves this process into a network namespace of its own (no interface but a loopback that is down)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) == 0:
        return "namespace"
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            try:
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
            except OSError:
                pass
        return "user namespace"

    def refuse(event: str, args) -> None:
        if event.startswith("socket.") and event != "socket.__new__" or event == "socket.getaddrinfo":
            raise PermissionError(f"no network in tools ({event})")

    sys.addaudithook(refuse)
    return "audit hook"


def _load(path: str):
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _child(fn, arguments: dict, out: int, settings: dict) -> None:
    """In the forked child: limits, then the call; one JSON answer on `out`."""
    os.setpgid(0, 0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    memory = settings["memory_mb"] * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    cpu = int(settings["timeout_s"]) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    try:
        value = fn(**arguments)
        answer = {"status": "ok", "content": value if isinstance(value, str) else json.dumps(value)}
    except MemoryError:
        answer = {"status": "error", "content": f"MemoryError: over the tool memory limit ({settings['memory_mb']} MB)"}
    except BaseException as e:  # noqa: BLE001 - the tool's failure is its answer
        answer = {"status": "error", "content": "".join(traceback.format_exception_only(e)).strip()}
    answer["content"] = answer["content"][:settings["max_chars"]]
    data = json.dumps(answer).encode()
    while data:
        data = data[os.write(out, data):]
    os._exit(0)


def serve(settings: dict) -> None:
    tools = {name: _load(path) for name, path in settings["tools"].items()}
    network = leave_network()
    waiting: collections.deque = collections.deque()
    running: dict[int, dict] = {}  # read end of the child's pipe -> its call
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    pending_input = b""
    reply = sys.stdout.buffer

    def answer(call_id, status: str, content: str) -> None:
        reply.write(json.dumps({"id": call_id, "status": status, "content": content}).encode() + b"\n")
        reply.flush()

    def finish(fd: int, status: str | None = None) -> None:
        call = running.pop(fd)
        selector.unregister(fd)
        os.close(fd)
        if status == "timeout":
            _kill_group(call["pid"])
        _, code = os.waitpid(call["pid"], 0)
        if status is None:
            try:
                done = json.loads(b"".join(call["chunks"]))
                status, content = done["status"], done["content"]
            except (ValueError, KeyError):
                status, content = "crashed", f"the tool process ended without an answer ({_exit_text(code)})"
        else:
            content = f"the tool did not answer within {settings['timeout_s']} s"
        answer(call["id"], status, content)
        _kill_group(call["pid"])  # what the tool left running

    answer(None, "ready", network)
    open_input = True
    while open_input or waiting or running:
        while waiting and len(running) < settings["concurrency"]:
            request = waiting.popleft()
            fn = tools.get(request["name"])
            if fn is None:
                answer(request["id"], "error", f"no tool named {request['name']!r}; the tools are "
                                               f"{sorted(tools)}")
                continue
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(read)
                _child(fn, request["arguments"], write, settings)
            os.close(write)
            try:  # also here, so that a timeout kill never races the child's own setpgid
                os.setpgid(pid, pid)
            except OSError:
                pass
            running[read] = {"id": request["id"], "pid": pid, "chunks": [],
                             "deadline": time.monotonic() + settings["timeout_s"]}
            selector.register(read, selectors.EVENT_READ)
        now = time.monotonic()
        timeout = max(0.0, min(c["deadline"] for c in running.values()) - now) if running else None
        for key, _ in selector.select(timeout):
            if key.fd == 0:
                data = os.read(0, 1 << 16)
                if not data:
                    open_input = False
                    selector.unregister(0)
                    continue
                *lines, pending_input = (pending_input + data).split(b"\n")
                waiting.extend(json.loads(line) for line in lines if line.strip())
                continue
            call = running[key.fd]
            data = os.read(key.fd, 1 << 16)
            if data:
                call["chunks"].append(data)
                continue
            finish(key.fd)
        now = time.monotonic()
        for fd in [fd for fd, c in running.items() if c["deadline"] <= now]:
            finish(fd, "timeout")


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def _exit_text(code: int) -> str:
    if os.WIFSIGNALED(code):
        return f"killed by {signal.Signals(os.WTERMSIG(code)).name}"
    return f"exit code {os.WEXITSTATUS(code)}"


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))
