"""Runs the policy's tool calls: tools registered by import path (tools.functions), each call in a sandboxed child
of one sandbox process (sandbox.py: time, memory and network limits, a concurrency cap). Whatever a call does
(raises, hangs, crashes, floods its output, names no tool) comes back as a ToolResult whose text the model reads;
the run goes on."""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import json
import logging
import subprocess
import sys
import threading
from concurrent.futures import Future
from typing import Literal

from rlhf_mc.config import ConfigError, ToolsConfig, import_by_path
from rlhf_mc.tools import parsers
from rlhf_mc.tools.parsers import ToolCall

log = logging.getLogger(__name__)
CHARS_PER_TOKEN = 16  # the sandbox cuts an answer at output_tokens x this many characters; the tokens cut it after


@dataclasses.dataclass
class ToolResult:
    name: str
    content: str
    status: Literal["ok", "error", "timeout", "crashed"]


def tool_schema(path: str) -> dict:
    """The JSON schema of the tool at `path`, as chat templates take it (from its signature and docstring)."""
    from transformers.utils import get_json_schema

    fn = import_by_path("tools.functions", path)
    try:
        return get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - transformers raises several types for undocumented functions
        raise ConfigError(f"tools.functions: {path!r} has no usable schema ({e}); document it with a Google-style "
                          "docstring and type hints") from None


class ToolExecutor:
    def __init__(self, config: ToolsConfig):
        self.config = config
        self.schemas = [tool_schema(path) for path in config.functions]
        self.parse = parsers.resolve(config.parser)
        self.paths = {schema["function"]["name"]: path for schema, path in zip(self.schemas, config.functions)}
        if len(self.paths) != len(config.functions):
            raise ConfigError(f"tools.functions: two tools share a name ({list(config.functions)})")
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._waiting: dict[int, Future] = {}  # the calls out with the current sandbox process
        self._process: subprocess.Popen | None = None
        self.network = ""  # how the sandbox is cut off from the network (sandbox.leave_network)
        atexit.register(self.close)

    def _start(self) -> subprocess.Popen:
        settings = {"tools": self.paths, "concurrency": self.config.concurrency, "timeout_s": self.config.timeout_s,
                    "memory_mb": self.config.memory_mb, "max_chars": self.config.output_tokens * CHARS_PER_TOKEN}
        process = subprocess.Popen([sys.executable, "-m", "rlhf_mc.tools.sandbox", json.dumps(settings)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        ready = json.loads(process.stdout.readline() or "null")
        if not ready or ready.get("status") != "ready":
            process.kill()
            raise RuntimeError(f"the tool sandbox did not start (exit code {process.wait()})")
        self.network = ready["content"]
        self._waiting = {}
        threading.Thread(target=self._read, args=(process, self._waiting), daemon=True).start()
        return process

    def _read(self, process: subprocess.Popen, waiting: dict[int, Future]) -> None:
        for line in process.stdout:
            result = json.loads(line)
            with self._lock:
                future = waiting.pop(result["id"], None)
            if future is not None:
                future.set_result(result)
        with self._lock:  # the sandbox died: every call still out gets an answer
            lost = list(waiting.values())
            waiting.clear()
        for future in lost:
            _lost(future)

    def run(self, calls: list[ToolCall]) -> list[ToolResult]:
        """The results of `calls`, in order; malformed calls are answered with their error, unrun."""
        futures: list[Future | ToolResult] = []
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                if self._process is not None:
                    log.warning("the tool sandbox stopped (exit code %s); starting it again", self._process.poll())
                self._process = self._start()
            for call in calls:
                if call.error:
                    futures.append(ToolResult(call.name, call.error, "error"))
                    continue
                future, call_id = Future(), next(self._ids)
                self._waiting[call_id] = future
                futures.append(future)
                try:
                    self._process.stdin.write(json.dumps({"id": call_id, "name": call.name,
                                                          "arguments": call.arguments}).encode() + b"\n")
                except BrokenPipeError:  # it died just now: its reader may have answered the others already
                    _lost(future)
            try:
                self._process.stdin.flush()
            except BrokenPipeError:
                for future in futures:
                    if isinstance(future, Future):
                        _lost(future)
        results = []
        for call, future in zip(calls, futures):
            if isinstance(future, ToolResult):
                results.append(future)
                continue
            answer = future.result()
            results.append(ToolResult(call.name, answer["content"], answer["status"]))
        return results

    def close(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.stdin.close()
            try:
                self._process.wait(timeout=self.config.timeout_s + 5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        atexit.unregister(self.close)


def _lost(future: Future) -> None:
    if not future.done():
        future.set_result({"status": "crashed", "content": "the tool sandbox stopped"})
