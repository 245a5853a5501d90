"""Tool calling below the HTTP surface: the ``hermes`` parser (whole text
and streamed in pieces of every size give the same calls; content outside
the tags; partial tags held back; a block that is not a call stays
content), the JSON call scanner, the ``required`` / named streams, the
prompt rendering of tools and of a tool-call history, and the tool-parser
plugin kind (a toy parser on a fresh plugin manager)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fdx.core.hookspecs import Register, hookimpl
from fdx.core.interfaces import ToolCallDelta, ToolCallStream, ToolParser
from fdx.plugins.tool_parsers.hermes import HermesToolParser
from fdx.plugins.tool_parsers.json_calls import CallScanner, parse_calls, value_end
from fdx.tool_calling import JsonCallsStream, NamedCallStream, history, merge, tools_block

TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2], '
        '"note": "a } and a \\" inside"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
        '</tool_call>')


def run(stream: ToolCallStream, pieces: list[str]) -> tuple[str, list[dict[str, Any]]]:
    content, deltas = "", []
    for i, p in enumerate(pieces):
        c, d = stream.feed(p, i == len(pieces) - 1)
        content += c
        deltas += d
    return content, merge(deltas)


def chunks(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


def calls_of(merged: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in merged]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_hermes_streamed_equals_whole(size: int) -> None:
    content, calls = run(HermesToolParser().open_stream(), chunks(TEXT, size))
    assert content.strip() == "Let me check."
    assert calls_of(calls) == [("get_weather", {"city": "Paris", "days": [1, 2], "note": 'a } and a " inside'}),
                               ("get_time", {})]
    assert len({c["id"] for c in calls}) == 2


def test_hermes_holds_back_a_partial_tag_only() -> None:
    s = HermesToolParser().open_stream()
    assert s.feed("Hello <tool", False) == ("Hello ", [])
    assert s.feed("box> done", False) == ("<toolbox> done", [])
    assert s.feed("", True) == ("", [])


def test_hermes_name_then_argument_pieces() -> None:
    s = HermesToolParser().open_stream()
    _, d1 = s.feed('<tool_call>{"name": "f", "argu', False)
    assert d1 == []
    _, d2 = s.feed('ments": {"a": ', False)
    assert d2 == [ToolCallDelta(0, name="f"), ToolCallDelta(0, arguments='{"a": ')]
    _, d3 = s.feed('1}}</tool_call>', True)
    assert d3 == [ToolCallDelta(0, arguments="1}")]


def test_hermes_other_forms() -> None:
    # a list inside the tags (SmolLM2's training format), keys in the other order, no closing tag at the end
    text = '<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]</tool_call>'
    assert calls_of(run(HermesToolParser().open_stream(), chunks(text, 4))[1]) == [("a", {"x": 1}), ("b", {})]
    text = '<tool_call>{"arguments": {"x": 1}, "name": "a"}</tool_call>'
    assert calls_of(run(HermesToolParser().open_stream(), chunks(text, 5))[1]) == [("a", {"x": 1})]
    text = 'ok <tool_call>{"name": "a", "arguments": {"x": 1}}'
    content, calls = run(HermesToolParser().open_stream(), chunks(text, 3))
    assert content == "ok " and calls_of(calls) == [("a", {"x": 1})]


def test_hermes_arguments_as_a_json_string_are_unwrapped() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
    assert calls_of(run(HermesToolParser().open_stream(), [text])[1]) == [("f", {"x": 1})]
    text = '<tool_call>{"arguments": "{\\"x\\": 2}", "name": "f"}</tool_call>'
    assert calls_of(run(HermesToolParser().open_stream(), [text])[1]) == [("f", {"x": 2})]


def test_hermes_a_block_that_is_not_a_call_stays_content() -> None:
    text = "before <tool_call>not json at all</tool_call> after"
    content, calls = run(HermesToolParser().open_stream(), chunks(text, 4))
    assert calls == [] and content == text
    content, calls = run(HermesToolParser().open_stream(), ["no tools here"])
    assert (content, calls) == ("no tools here", [])


def test_value_end_and_scanner() -> None:
    assert value_end('{"a": "}"} tail', 0) == 10
    assert value_end('  [1, [2]] x', 0) == 10
    assert value_end('"ab\\"c" ', 0) == 7
    assert value_end("12, ", 0) == 2
    assert value_end('{"a": 1', 0) is None
    sc = CallScanner()
    got = sc.feed('[{"name": "f", "parameters": {"q": "x"}}, {"name": "g", "parameters": [1]}]')
    assert merge(got)[1]["function"] == {"name": "g", "arguments": "[1]"}
    assert sc.count == 2
    assert parse_calls('{"name": 3}') is None and parse_calls("[]") is None


def test_required_and_named_streams() -> None:
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    content, calls = run(JsonCallsStream(), chunks(text, 2))
    assert content == "" and calls_of(calls) == [("get_weather", {"city": "Oslo"})]
    content, calls = run(NamedCallStream("f"), chunks('{"a": [1, 2]}', 3))
    assert content == "" and calls_of(calls) == [("f", {"a": [1, 2]})]


def test_prompt_rendering_of_tools_and_history() -> None:
    from fdx.server.protocol import ToolSpec

    t = ToolSpec.model_validate({"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                                                   "parameters": {"type": "object"}}})
    block = tools_block([t])
    assert "<tools>" in block and '"name": "get_weather"' in block and "<tool_call>" in block
    msgs = history([
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ])
    assert msgs[0]["content"] == '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    assert "tool_calls" not in msgs[0]
    assert msgs[1]["content"] == "<tool_response>\n42\n</tool_response>"


class UpperStream(ToolCallStream):
    def feed(self, text: str, finished: bool) -> tuple[str, list[ToolCallDelta]]:
        return text.upper(), []


class ToyParser(ToolParser):
    def open_stream(self) -> ToolCallStream:
        return UpperStream()


class ToyParserPlugin:
    @hookimpl
    def fdx_register_tool_parsers(self, register: Register) -> None:
        register("upper", lambda config=None: ToyParser(), description="test: content upper-cased")


class DupPlugin:
    @hookimpl
    def fdx_register_tool_parsers(self, register: Register) -> None:
        register("hermes", lambda config=None: ToyParser())


def test_tool_parser_plugin_kind_on_a_fresh_manager() -> None:
    from fdx.core.errors import PluginError
    from fdx.core.plugins import collect, load_entry_points, new_plugin_manager

    pm = new_plugin_manager()
    infos = load_entry_points(pm)
    plugin = ToyParserPlugin()
    pm.register(plugin, name="toy-parser")
    try:
        plugins = collect(pm, infos)
        reg = plugins.registry("tool_parser")
        assert {"hermes", "upper"} <= set(reg.names())
        parser = plugins.create("tool_parser", "upper", config=None)
        assert parser.open_stream().feed("abc", True) == ("ABC", [])
        with pytest.raises(PluginError) as ei:
            reg.get("nope")
        assert "hermes" in str(ei.value) and "upper" in str(ei.value)
        dup = DupPlugin()
        pm.register(dup, name="dup")
        try:
            with pytest.raises(PluginError) as ei:
                collect(pm, infos)
            assert "twice" in str(ei.value) and "dup" in str(ei.value)
        finally:
            pm.unregister(dup)
    finally:
        pm.unregister(plugin)


def test_required_schema_rebases_each_tools_local_refs() -> None:
    from fdx.server.protocol import ToolSpec
    from fdx.tool_calling import required_schema

    a = {"$defs": {"T": {"type": "string"}}, "type": "object", "properties": {"t": {"$ref": "#/$defs/T"},
                                                                            "me": {"$ref": "#"}}}
    b = {"definitions": {"T": {"type": "integer"}}, "type": "object", "properties": {"t": {"$ref": "#/definitions/T"}}}
    tools = [ToolSpec.model_validate({"type": "function", "function": {"name": n, "parameters": p}})
             for n, p in (("a", a), ("b", b))]
    s = required_schema(tools, parallel=True)
    assert s["$defs"]["tool_0"]["properties"]["t"] == {"$ref": "#/$defs/tool_0/$defs/T"}
    assert s["$defs"]["tool_0"]["properties"]["me"] == {"$ref": "#/$defs/tool_0"}
    assert s["$defs"]["tool_1"]["properties"]["t"] == {"$ref": "#/$defs/tool_1/definitions/T"}
    assert [i["properties"]["parameters"] for i in s["items"]["anyOf"]] == [{"$ref": "#/$defs/tool_0"},
                                                                             {"$ref": "#/$defs/tool_1"}]
