"""The tool executor against real misbehaving tools (each in its sandboxed child process): a hang is killed at the
timeout, a crash and a memory hog are answered, a flood is cut, the network is unreachable, the concurrency cap
holds, malformed and unknown calls are answered unrun, a dead sandbox is restarted; and the Hermes parser, the
calculator and the Python tool on hand-computed values."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from rlhf_mc.config import ConfigError, ToolsConfig
from rlhf_mc.tools import builtin
from rlhf_mc.tools.executor import ToolExecutor
from rlhf_mc.tools.parsers import ToolCall, hermes

TOOLS = ("rlhf_mc.tools.builtin:calculator", "rlhf_mc.tools.builtin:python", "tests.sandbox_tools:interval")


@pytest.fixture(scope="module")
def executor():
    ex = ToolExecutor(ToolsConfig(functions=TOOLS, timeout_s=2.0, memory_mb=256, concurrency=2, output_tokens=64))
    yield ex
    ex.close()


def _python(code: str) -> ToolCall:
    return ToolCall("python", {"code": code})


def test_misbehaving_tools_are_contained(executor):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    calls = [_python("while True: pass"),  # hangs
             _python("import subprocess; subprocess.run(['sleep', '60'])"),  # hangs in a grandchild
             _python("import os; os._exit(3)"),  # dies
             _python("import ctypes; ctypes.string_at(0)"),  # segfaults
             _python("x = bytearray(2 * 10**9)"),  # over the memory limit
             _python("print('x' * 10**7)"),  # floods
             _python(f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)"),  # network
             _python("raise ValueError('bad input')"),
             ToolCall("nonexistent", {}),
             ToolCall("", {}, "the tool call is not JSON"),
             ToolCall("calculator", {"expression": "2**10 + 1"})]
    start = time.monotonic()
    results = executor.run(calls)
    elapsed = time.monotonic() - start
    server.close()
    statuses = [r.status for r in results]
    assert statuses == ["timeout", "timeout", "crashed", "crashed", "error", "ok", "error", "error", "error", "error",
                        "ok"], [(r.status, r.content[:80]) for r in results]
    assert "within 2.0 s" in results[0].content
    assert "exit code 3" in results[2].content and "SIGSEGV" in results[3].content
    assert "MemoryError" in results[4].content
    assert len(results[5].content) == 64 * 16  # cut at output_tokens x 16 characters
    assert "unreachable" in results[6].content or "no network" in results[6].content
    assert results[7].content == "ValueError: bad input"
    assert "no tool named 'nonexistent'" in results[8].content and results[9].content == "the tool call is not JSON"
    assert results[10].content == "1025"
    assert elapsed < 10, elapsed  # the two hangs were killed at 2 s, side by side
    # nothing left behind: no sleep(60) grandchild
    assert not [p for p in os.popen("ps -eo args").read().splitlines() if p.strip() == "sleep 60"]


def test_concurrency_cap_and_order(executor):
    results = executor.run([ToolCall("interval", {"seconds": 0.3}) for _ in range(6)])
    spans = [tuple(map(float, r.content.split())) for r in results]
    overlap = max(sum(a <= t < b for a, b in spans) for t, _ in spans)
    assert overlap == 2  # concurrency=2: never more, and used
    # calls from several threads at once are answered each with its own result
    answers = {}

    def ask(k):
        answers[k] = executor.run([ToolCall("calculator", {"expression": f"{k}*{k}"})])[0].content

    threads = [threading.Thread(target=ask, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == {k: str(k * k) for k in range(8)}


def test_a_dead_sandbox_is_restarted(executor):
    executor._process.kill()
    executor._process.wait()
    assert executor.run([ToolCall("calculator", {"expression": "6*7"})])[0].content == "42"


def test_hermes_parser():
    text = ('Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>\n'
            '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "1"</tool_call>'
            '<tool_call>["calculator"]</tool_call><tool_call>{"name": "f", "arguments": [1]}</tool_call>')
    calls = hermes(text)
    assert [(c.name, c.arguments) for c in calls[:2]] == [("calculator", {"expression": "6*7"}),
                                                         ("python", {"code": "print(1)"})]
    assert "not JSON" in calls[2].error and '"name"' in calls[3].error and "JSON object" in calls[4].error
    assert hermes("no calls here") == []


def test_builtin_tools():
    assert builtin.calculator("(3 + 4) * 12") == "84" and builtin.calculator("7 / 2") == "3.5"
    assert builtin.calculator("2 ** 0.5").startswith("1.414")
    for bad in ("__import__('os')", "2 ** 10000", "x + 1"):
        with pytest.raises(ValueError):
            builtin.calculator(bad)
    assert builtin.python("x = 6\nprint(x * 7)\nx + 1") == "42\n7\n"
    assert builtin.python("for i in range(10**6): print(i)").endswith("more characters not shown]")


def test_bad_tool_settings_are_refused():
    with pytest.raises(ConfigError, match="tools.functions: cannot import"):
        ToolExecutor(ToolsConfig(functions=("rlhf_mc.tools.builtin:nothing",)))
    with pytest.raises(ConfigError, match="tools.parser"):
        ToolExecutor(ToolsConfig(functions=TOOLS[:1], parser="xml"))
    with pytest.raises(ConfigError, match="timeout_s: must be > 0"):
        ToolsConfig(functions=TOOLS[:1], timeout_s=0)
