"""Incremental scanning of tool calls written as JSON: one object
``{"name": ..., "arguments": ...}`` (or ``"parameters"``), or a list of them.

:class:`CallScanner` is fed text as it is generated and reports
:class:`~fdx.core.interfaces.ToolCallDelta` pieces: the name once the
object's ``"name"`` is complete, then the characters of the arguments
value as they arrive -- exactly those of the value, found by a
string-aware bracket scan, so the pieces joined are the value's JSON text.
Objects whose keys come in another order are found by :func:`parse_calls`
once the text is complete.  Shared by the ``hermes`` parser (inside its
``<tool_call>`` tags) and the server's ``tool_choice: required`` output.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fdx.core.interfaces import ToolCallDelta

HEADER = re.compile(r'\s*(?:\[\s*|,\s*)?\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
CLOSE = re.compile(r"\s*\}")
_SCALAR = re.compile(r"[^,}\]\s]*")


def value_end(text: str, start: int) -> int | None:
    """Index just past the JSON value that starts at ``text[start]`` (after
    optional whitespace), or ``None`` while it is incomplete."""
    n = len(text)
    i = start
    while i < n and text[i] in " \t\r\n":
        i += 1
    if i >= n:
        return None
    c = text[i]
    if c in "{[":
        depth, in_str, esc = 0, False, False
        for j in range(i, n):
            ch = text[j]
            if in_str:
                if esc:
                    esc = False
                elif ch == "\\":
                    esc = True
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
        return None
    if c == '"':
        esc = False
        for j in range(i + 1, n):
            ch = text[j]
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                return j + 1
        return None
    e = _SCALAR.match(text, i).end()  # type: ignore[union-attr]
    return e if e < n else None


class CallScanner:
    """Tool calls in a growing JSON text (see the module docstring)."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # where the next call's header may start
        self.args_start: int | None = None  # the current call's arguments value starts here
        self.sent = 0  # arguments characters reported up to here
        self.count = 0  # calls whose object closed

    @property
    def started(self) -> int:
        """Calls whose name was reported (the current one included)."""
        return self.count + (self.args_start is not None)

    def feed(self, text: str) -> list[ToolCallDelta]:
        self.text += text
        out: list[ToolCallDelta] = []
        while True:
            if self.args_start is None:
                m = HEADER.match(self.text, self.pos)
                if m is None:
                    break
                out.append(ToolCallDelta(self.count, name=json.loads(f'"{m.group(1)}"')))
                self.args_start = self.sent = m.end()
            end = value_end(self.text, self.args_start)
            stop = len(self.text) if end is None else end
            if stop > self.sent:
                out.append(ToolCallDelta(self.count, arguments=self.text[self.sent:stop]))
                self.sent = stop
            if end is None:
                break
            m = CLOSE.match(self.text, end)
            if m is None:
                break
            self.pos, self.args_start = m.end(), None
            self.count += 1
        return out


def parse_calls(text: str) -> list[ToolCallDelta] | None:
    """The calls of a complete JSON text (an object or a list of objects
    with ``name`` and ``arguments``/``parameters``, any key order), one
    delta each with compact arguments; ``None`` when it is not that."""
    try:
        data: Any = json.loads(text)
    except ValueError:
        return None
    items = data if isinstance(data, list) else [data]
    out = []
    for i, it in enumerate(items):
        if not isinstance(it, dict) or not isinstance(it.get("name"), str):
            return None
        args = it.get("arguments", it.get("parameters", {}))
        if isinstance(args, str):  # arguments sent as a JSON string of an object
            try:
                args = json.loads(args)
            except ValueError:
                pass
        out.append(ToolCallDelta(i, name=it["name"], arguments=json.dumps(args, ensure_ascii=False)))
    return out or None
