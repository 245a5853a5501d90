"""The ``hermes`` tool-call parser (``--tool-call-parser hermes``, the
default): calls written as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(Hermes / Qwen / SmolLM style; a JSON list of calls inside one tag pair is
taken too).  Text outside the tags is content.  Streaming: content is held
back only while it may be the start of ``<tool_call>``; inside a tag the
name is reported once complete and the arguments as they are generated
(:class:`~fdx.plugins.tool_parsers.json_calls.CallScanner`).  A block that
is not a tool call (no name, bad JSON) is given back as content.
"""

from __future__ import annotations

from typing import Any

from fdx.core.hookspecs import Register, hookimpl
from fdx.core.interfaces import ToolCallDelta, ToolCallStream, ToolParser
from fdx.plugins.tool_parsers.json_calls import CallScanner, parse_calls

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class HermesStream(ToolCallStream):
    """One choice's output (see the module docstring)."""

    def __init__(self) -> None:
        self.buf = ""
        self.scanner: CallScanner | None = None  # inside a <tool_call> block
        self.base = 0  # index of the block's first call

    def feed(self, text: str, finished: bool) -> tuple[str, list[ToolCallDelta]]:
        self.buf += text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            if self.scanner is None:
                i = self.buf.find(OPEN)
                if i < 0:
                    keep = 0 if finished else partial_suffix(self.buf, OPEN)
                    content.append(self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep :]
                    break
                content.append(self.buf[:i])
                self.buf = self.buf[i + len(OPEN) :]
                self.scanner = CallScanner()
                continue
            j = self.buf.find(CLOSE)
            chunk = self.buf if j < 0 else self.buf[:j]
            if j < 0 and not finished:
                chunk = chunk[: len(chunk) - partial_suffix(chunk, CLOSE)]
            self.buf = self.buf[len(chunk) :]
            sc = self.scanner
            deltas += [ToolCallDelta(self.base + d.index, d.name, d.arguments) for d in sc.feed(chunk)]
            if j < 0 and not finished:
                break
            if j >= 0:
                self.buf = self.buf[len(CLOSE) :]
            if sc.started == 0:  # not streamable (keys in another order) or not a call at all
                calls = parse_calls(sc.text)
                if calls is None:
                    content.append(OPEN + sc.text + (CLOSE if j >= 0 else ""))
                else:
                    deltas += [ToolCallDelta(self.base + d.index, d.name, d.arguments) for d in calls]
                    self.base += len(calls)
            self.base += sc.started
            self.scanner = None
            if j < 0:
                break
        return "".join(content), deltas


class HermesToolParser(ToolParser):
    def open_stream(self) -> HermesStream:
        return HermesStream()


@hookimpl
def fdx_register_tool_parsers(register: Register) -> None:
    def factory(config: Any = None) -> HermesToolParser:
        return HermesToolParser()

    register("hermes", factory, description="<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> (Hermes/Qwen style)")
