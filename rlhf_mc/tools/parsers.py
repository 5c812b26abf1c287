"""Tool-call formats: a parser turns an assistant turn's text into the calls it makes. `hermes` is the format of
Hermes and Qwen models (and of their chat templates): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
number per turn. Another format is a function `parse(text) -> list[ToolCall]` named by import path
(tools.parser)."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Callable

from rlhf_mc.config import builtin_or_import

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: dict
    error: str = ""  # a malformed call: what is wrong with it (it is answered with this, not run)


def hermes(text: str) -> list[ToolCall]:
    calls = []
    for body in _HERMES.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", {}, f"the tool call is not JSON ({e.msg} at character {e.pos})"))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append(ToolCall("", {}, 'the tool call needs {"name": ..., "arguments": {...}}'))
        elif not isinstance(call.get("arguments", {}), dict):
            calls.append(ToolCall(call["name"], {}, "the tool call's arguments must be a JSON object"))
        else:
            calls.append(ToolCall(call["name"], call.get("arguments", {})))
    return calls


PARSERS: dict[str, Callable[[str], list[ToolCall]]] = {"hermes": hermes}


def resolve(name: str) -> Callable[[str], list[ToolCall]]:
    return builtin_or_import("tools.parser", name, PARSERS)
