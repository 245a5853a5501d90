"""Tool calling in chat completions: ``tools``, ``tool_choice``,
``parallel_tool_calls`` (what they mean for the prompt, the grammar and the
reply; ``fdx/server/serving/chat.py`` serves them).

* **The prompt.**  When the model's chat template reads ``tools`` it gets
  them as a template variable; otherwise (the embedded SmolLM2) a system
  block lists them, in the Hermes convention (:func:`tools_block`).  Past
  assistant ``tool_calls`` are written back as ``<tool_call>`` blocks and
  ``tool`` messages as ``<tool_response>`` blocks.  ``tool_choice: none``
  shows no tools.
* **Enforcement.**  ``auto`` (the default with tools) lets the model choose;
  the tool parser (``--tool-call-parser``, default ``hermes``) reads its
  output.  ``required`` and a named function are enforced with the grammar
  backend, as vLLM does: a named choice generates the function's arguments
  (a JSON value of its ``parameters`` schema); ``required`` generates a JSON
  list of ``{"name": ..., "parameters": ...}`` objects over the tools
  (``maxItems`` 1 without ``parallel_tool_calls``).  So even a small model
  returns a valid call.
* **The reply.**  ``message.tool_calls`` (ids ``call_<hex>``, arguments as
  JSON text) and ``finish_reason: "tool_calls"``; streaming, ``delta.tool_calls``
  pieces: the first of a call has its id, type and name, the next ones the
  arguments as they are generated.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

import attrs

from fdx.core.errors import RequestError
from fdx.core.interfaces import ToolCallDelta, ToolCallStream, ToolParser
from fdx.core.messages import StructuredOutput
from fdx.plugins.tool_parsers.json_calls import CallScanner, parse_calls

if TYPE_CHECKING:
    from fdx.config import EngineConfig
    from fdx.server.protocol import ChatCompletionRequest, ToolSpec

#: the tool parser of this process, by name
_PARSERS: dict[str, ToolParser] = {}

TOOLS_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions about "
    "what values to plug into functions. Here are the available tools:\n<tools>\n{tools}\n</tools>\n"
    "For each function call return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags as follows:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)


def tool_parser(config: EngineConfig) -> ToolParser:
    """The process's ``--tool-call-parser`` (created on first use)."""
    from fdx.core.plugins import get_plugins

    name = config.tool_call_parser
    p = _PARSERS.get(name)
    if p is None:
        p = _PARSERS[name] = get_plugins(config.disable_plugins).create("tool_parser", name, config=config)
    return p


def function_json(t: ToolSpec) -> dict[str, Any]:
    f = t.function
    d: dict[str, Any] = {"name": f.name}
    if f.description is not None:
        d["description"] = f.description
    d["parameters"] = f.parameters if f.parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": d}


def tools_block(tools: list[ToolSpec]) -> str:
    """The system-prompt block that shows ``tools`` to a template without a tools section."""
    return TOOLS_PROMPT.format(tools="\n".join(json.dumps(function_json(t), ensure_ascii=False) for t in tools))


def history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Past assistant tool calls and tool results written as text blocks."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and calls:
            parts = [m.get("content") or ""]
            for c in calls:
                fn = c.get("function", {}) if isinstance(c, dict) else {}
                args = fn.get("arguments", "{}")
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except ValueError:
                    pass
                parts.append("<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args},
                                                          ensure_ascii=False) + "\n</tool_call>")
            m = {**m, "content": "\n".join(p for p in parts if p)}
            m.pop("tool_calls", None)
        elif m.get("role") == "tool":
            m = {**m, "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    return out


class NamedCallStream(ToolCallStream):
    """A named tool choice: the whole output is the arguments of ``name``."""

    def __init__(self, name: str) -> None:
        self.name: str | None = name

    def feed(self, text: str, finished: bool) -> tuple[str, list[ToolCallDelta]]:
        out = []
        if self.name is not None:
            out.append(ToolCallDelta(0, name=self.name))
            self.name = None
        if text:
            out.append(ToolCallDelta(0, arguments=text))
        return "", out


class JsonCallsStream(ToolCallStream):
    """``tool_choice: required``: a JSON list of ``{"name", "parameters"}``."""

    def __init__(self) -> None:
        self.scanner = CallScanner()

    def feed(self, text: str, finished: bool) -> tuple[str, list[ToolCallDelta]]:
        out = self.scanner.feed(text)
        if finished and self.scanner.started == 0:  # not the enforced shape (a length cut): parse, or content
            calls = parse_calls(self.scanner.text)
            return ("", calls) if calls else (self.scanner.text, [])
        return "", out


@attrs.define
class ToolCalling:
    """How one chat request's output is read: see the module docstring."""

    mode: str  # auto | required | named
    parallel: bool
    parser: ToolParser
    name: str | None = None
    spec: tuple[StructuredOutput, str] | None = None  # the grammar of required / named, and its field

    def open_stream(self) -> ToolCallStream:
        if self.mode == "named":
            assert self.name is not None
            return NamedCallStream(self.name)
        if self.mode == "required":
            return JsonCallsStream()
        return self.parser.open_stream()

    def keep(self, deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
        """Without ``parallel_tool_calls`` only the first call counts."""
        return deltas if self.parallel else [d for d in deltas if d.index == 0]


def rebase_refs(schema: Any, base: str) -> Any:
    """``schema`` with every local ``$ref`` (``#``, ``#/$defs/X``, ...)
    pointing into ``base`` (a JSON pointer such as ``#/$defs/tool_0``), for a
    schema moved from the root of its own document to ``base``."""
    if isinstance(schema, dict):
        out = {k: rebase_refs(v, base) for k, v in schema.items()}
        ref = schema.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            out["$ref"] = base + ref[1:]
        return out
    if isinstance(schema, list):
        return [rebase_refs(v, base) for v in schema]
    return schema


def required_schema(tools: list[ToolSpec], parallel: bool) -> dict[str, Any]:
    """The JSON list of calls that ``tool_choice: required`` generates.  Each
    tool's parameter schema moves to the root's ``$defs`` (``tool_<i>``) with
    its local ``$ref`` pointers rebased, so a schema using its own
    ``$defs``/``definitions`` still resolves inside the combined document."""
    defs: dict[str, Any] = {}
    items = []
    for i, t in enumerate(tools):
        params = t.function.parameters if t.function.parameters is not None else {"type": "object"}
        defs[f"tool_{i}"] = rebase_refs(params, f"#/$defs/tool_{i}")
        items.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [t.function.name]},
                           "parameters": {"$ref": f"#/$defs/tool_{i}"}},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = {"$defs": defs, "type": "array", "minItems": 1,
                              "items": {"anyOf": items} if len(items) > 1 else items[0]}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def prepare(config: EngineConfig, tokenizer: Any, req: ChatCompletionRequest, messages: list[dict[str, Any]],
            template_vars: dict[str, Any]) -> tuple[list[dict[str, Any]], ToolCalling | None]:
    """The messages to render (tools shown, history written back) and how the
    output is read; ``template_vars`` gains ``tools`` when the template reads them."""
    messages = history(messages)
    tools = list(req.tools or [])
    choice = req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise RequestError("'tool_choice' needs 'tools'", 400, param="tool_choice")
        return messages, None
    names = [t.function.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise RequestError(f"'tools' names function {dup!r} twice", 400, param="tools")
    if choice == "none":
        return messages, None
    parallel = req.parallel_tool_calls is not False
    calling = ToolCalling("auto", parallel, tool_parser(config))
    if choice == "required":
        calling.mode = "required"
        calling.spec = (StructuredOutput("json", json.dumps(required_schema(tools, parallel), ensure_ascii=False)),
                        "tools")
    elif choice is not None and not isinstance(choice, str):
        name = choice.function.name
        tool = next((t for t in tools if t.function.name == name), None)
        if tool is None:
            raise RequestError(f"'tool_choice' names function {name!r}, which is not in 'tools'", 400,
                               param="tool_choice")
        params = tool.function.parameters if tool.function.parameters is not None else {"type": "object"}
        calling.mode, calling.name = "named", name
        calling.spec = (StructuredOutput("json", json.dumps(params, ensure_ascii=False)), "tools")
    template = getattr(tokenizer, "chat_template", None) or ""
    if "tools" in template:
        template_vars.setdefault("tools", [function_json(t) for t in tools])
    else:
        block = tools_block(tools)
        if messages and messages[0].get("role") == "system":
            messages[0] = {**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{block}".lstrip()}
        else:
            messages.insert(0, {"role": "system", "content": block})
    return messages, calling


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def merge(deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
    """Non-streaming: one OpenAI tool call per index, arguments joined."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        c = calls.setdefault(d.index, {"id": new_call_id(), "type": "function",
                                       "function": {"name": "", "arguments": ""}})
        if d.name is not None:
            c["function"]["name"] = d.name
        c["function"]["arguments"] += d.arguments
    for c in calls.values():  # arguments written as a JSON string of an object: the object's text
        args = c["function"]["arguments"]
        if args.lstrip().startswith('"'):
            try:
                inner = json.loads(json.loads(args))
            except (ValueError, TypeError):
                continue
            if isinstance(inner, dict):
                c["function"]["arguments"] = json.dumps(inner, ensure_ascii=False)
    return [calls[i] for i in sorted(calls)]
