"""Tool calling end to end: the official ``openai`` client against a real
``fdx serve`` (one server for the module).

``tool_choice`` ``required`` and a named function are enforced by the
grammar backend, so the small embedded model returns valid calls
(arguments validated with ``jsonschema`` against the tool's parameters),
streaming (``delta.tool_calls``: id, type and name first, then argument
pieces) and not (``message.tool_calls``), with ``finish_reason``
``tool_calls``; ``parallel_tool_calls: false`` gives one call; ``auto``
shows the tools in the prompt and never leaks a ``<tool_call>`` tag into
content; ``none`` shows no tools; a tool-call history renders; bad
combinations are 400s naming the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from serverutil import start_server  # noqa: E402

pytestmark = pytest.mark.slow

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20},
                          "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "minLength": 1, "maxLength": 20}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone.",
                                      "parameters": TIME}},
]
PARAMS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def client() -> Any:
    with start_server("--max-num-seqs", "8") as (base, _proc):
        yield openai.OpenAI(base_url=base + "/v1", api_key="x", timeout=120, max_retries=0)


def create(client: Any, **kw: Any) -> Any:
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 80)
    return client.chat.completions.create(model="smollm2", **kw)


def check_call(name: str, arguments: str) -> None:
    assert name in PARAMS
    jsonschema.validate(json.loads(arguments), PARAMS[name])


def streamed(client: Any, **kw: Any) -> tuple[dict[int, dict[str, Any]], str, str | None]:
    calls: dict[int, dict[str, Any]] = {}
    content, reason = "", None
    for chunk in create(client, stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for tc in ch.delta.tool_calls or []:
            if tc.index not in calls:  # the first piece of a call: id, type, name
                assert tc.id and tc.type == "function" and tc.function.name
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments or ""}
            else:
                assert tc.id is None and not tc.function.name
                calls[tc.index]["arguments"] += tc.function.arguments or ""
        reason = ch.finish_reason or reason
    return calls, content, reason


def test_required_non_streaming(client: Any) -> None:
    r = create(client, tools=TOOLS, tool_choice="required", temperature=0.7, seed=1, n=3)
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        assert ch.message.tool_calls
        for tc in ch.message.tool_calls:
            assert tc.type == "function" and tc.id.startswith("call_")
            check_call(tc.function.name, tc.function.arguments)
    one = create(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0)
    assert len(one.choices[0].message.tool_calls) == 1


def test_required_streaming(client: Any) -> None:
    calls, content, reason = streamed(client, tools=TOOLS, tool_choice="required", temperature=0.5, seed=2)
    assert reason == "tool_calls" and content == "" and calls
    for c in calls.values():
        check_call(c["name"], c["arguments"])


@pytest.mark.parametrize("stream", [False, True])
def test_named_function(client: Any, stream: bool) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    if stream:
        calls, content, reason = streamed(client, tools=TOOLS, tool_choice=choice, temperature=0)
        assert reason == "tool_calls" and content == "" and list(calls) == [0]
        assert calls[0]["name"] == "get_time"
        check_call("get_time", calls[0]["arguments"])
        return
    r = create(client, tools=TOOLS, tool_choice=choice, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
    assert ch.message.tool_calls[0].function.name == "get_time"
    check_call("get_time", ch.message.tool_calls[0].function.arguments)


def test_auto_and_none(client: Any) -> None:
    plain = create(client, temperature=0, max_tokens=40)
    auto = create(client, tools=TOOLS, temperature=0, max_tokens=60)
    none = create(client, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=40)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tools are in the prompt
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # none: no tools shown
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].message.content == plain.choices[0].message.content
    msg = auto.choices[0].message
    assert "<tool_call>" not in (msg.content or "")
    if auto.choices[0].finish_reason == "tool_calls":
        for tc in msg.tool_calls:
            assert tc.function.name in PARAMS and isinstance(json.loads(tc.function.arguments), dict)
    else:
        assert msg.tool_calls is None and msg.content
    calls, content, reason = streamed(client, tools=TOOLS, temperature=0, max_tokens=60)
    assert "<tool_call>" not in content
    assert (reason == "tool_calls") == bool(calls)


def test_tool_call_history_renders(client: Any) -> None:
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]
    r = create(client, messages=history, tools=TOOLS, temperature=0, max_tokens=30)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > create(client, tools=TOOLS, temperature=0, max_tokens=1).usage.prompt_tokens


@pytest.mark.parametrize("kw,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "bogus": 1}}]}, "tools"),
])
def test_bad_tool_requests_are_400(client: Any, kw: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as ei:
        create(client, **kw)
    assert ei.value.body["param"] == param
