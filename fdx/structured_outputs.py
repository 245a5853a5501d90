"""Structured outputs and ``logit_bias`` of a request, for both endpoints.

The request fields -- OpenAI's ``response_format`` (``json_object``,
``json_schema``; ``text`` is no constraint), vLLM's ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar`` and its
``structured_outputs`` object -- become one
:class:`~fdx.core.messages.StructuredOutput` on the request's
:class:`~fdx.core.messages.SamplingParams` (at most one constraint per
request; ``tool_choice`` ``required`` or a named function brings its own,
see ``fdx/tool_calling.py``).  Before anything reaches the engine the spec is
compiled by the grammar backend (``--grammar-backend``, created once in this
process) in a worker thread, so a bad schema, regex or grammar is a 400
naming the field, never an engine error; the backend caches what it
compiled.  ``logit_bias`` keys are token ids (decimal strings), values in
[-100, 100].
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any

import attrs

from fdx.core.errors import RequestError
from fdx.core.messages import SamplingParams, StructuredOutput

if TYPE_CHECKING:
    from fdx.config import EngineConfig
    from fdx.core.interfaces import GrammarBackend

log = logging.getLogger("fdx.server")

#: the grammar backend of this process, by (backend name, model, vocabulary size)
_BACKENDS: dict[tuple[str, str | None, int], GrammarBackend] = {}


def grammar_backend(cfg: EngineConfig, vocab_size: int) -> GrammarBackend:
    """The API process's grammar backend (created on first use)."""
    from fdx.core.plugins import get_plugins

    key = (cfg.grammar_backend, cfg.model, int(vocab_size))
    backend = _BACKENDS.get(key)
    if backend is None:
        backend = get_plugins(cfg.disable_plugins).create("grammar_backend", cfg.grammar_backend, config=cfg,
                                                         vocab_size=key[2])
        _BACKENDS[key] = backend
    return backend


def warm_grammar(config: EngineConfig, vocab_size: int) -> None:
    """The backend's one-time warm-up (llguidance: its tokenizer, ~0.5 s
    holding the GIL) at start-up, so the first structured request does not
    stall every stream of this process; a failure is logged (a structured
    request then reports it)."""
    if not config.grammar_backend:
        return
    try:
        grammar_backend(config, vocab_size).warm()
    except Exception:  # noqa: BLE001
        log.warning("grammar backend %r failed to warm up", config.grammar_backend, exc_info=True)


def _schema_text(schema: Any, param: str) -> str:
    """A JSON schema (object, boolean or JSON text) as JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise RequestError(f"'{param}' is not valid JSON: {exc.msg} at column {exc.colno}", 400,
                               param=param.split(".")[0]) from None
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise RequestError(f"'{param}' must be a JSON schema (an object)", 400, param=param.split(".")[0])
    return json.dumps(schema, ensure_ascii=False, sort_keys=False)


def requested_spec(req: Any) -> tuple[StructuredOutput, str] | None:
    """The request's structured-output constraint and the field that asked
    for it, or ``None``; two constraints at once are a 400."""
    found: list[tuple[StructuredOutput, str]] = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append((StructuredOutput("json_object"), "response_format"))
        else:
            js = rf.json_schema
            if js is None or js.schema_ is None:
                raise RequestError("'response_format' of type json_schema needs 'json_schema.schema'", 400,
                                   param="response_format")
            found.append((StructuredOutput("json", _schema_text(js.schema_, "response_format.json_schema.schema")),
                          "response_format"))
    if req.guided_json is not None:
        found.append((StructuredOutput("json", _schema_text(req.guided_json, "guided_json")), "guided_json"))
    if req.guided_regex is not None:
        found.append((StructuredOutput("regex", req.guided_regex), "guided_regex"))
    if req.guided_choice is not None:
        found.append((StructuredOutput("choice", json.dumps(req.guided_choice, ensure_ascii=False)), "guided_choice"))
    if req.guided_grammar is not None:
        found.append((StructuredOutput("grammar", req.guided_grammar), "guided_grammar"))
    so = req.structured_outputs
    if so is not None:
        inner: list[StructuredOutput] = []
        if so.json_ is not None:
            inner.append(StructuredOutput("json", _schema_text(so.json_, "structured_outputs.json")))
        if so.regex is not None:
            inner.append(StructuredOutput("regex", so.regex))
        if so.choice is not None:
            inner.append(StructuredOutput("choice", json.dumps(so.choice, ensure_ascii=False)))
        if so.grammar is not None:
            inner.append(StructuredOutput("grammar", so.grammar))
        if so.json_object:
            inner.append(StructuredOutput("json_object"))
        if len(inner) != 1:
            raise RequestError("'structured_outputs' must set exactly one of json, regex, choice, grammar, "
                               f"json_object (got {len(inner)})", 400, param="structured_outputs")
        found.append((inner[0], "structured_outputs"))
    if len(found) > 1:
        names = ", ".join(p for _, p in found)
        raise RequestError(f"only one structured-output constraint per request (got {names})", 400,
                           param=found[1][1])
    return found[0] if found else None


def logit_bias(req: Any, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted ``(token id, bias)`` pairs (400 for a bad id or bias)."""
    lb = req.logit_bias
    if not lb:
        return ()
    if len(lb) > 1024:
        raise RequestError(f"'logit_bias' may hold at most 1024 tokens, got {len(lb)}", 400, param="logit_bias")
    out: dict[int, float] = {}
    for key, bias in lb.items():
        if not (key.isascii() and key.isdigit()) or not 0 <= int(key) < vocab_size:
            raise RequestError(f"'logit_bias' keys must be token ids in [0, {vocab_size}), got {key[:40]!r}", 400,
                               param="logit_bias")
        if not -100.0 <= bias <= 100.0:
            raise RequestError(f"'logit_bias' values must be in [-100, 100], got {bias} for token {key}", 400,
                               param="logit_bias")
        out[int(key)] = float(bias)
    return tuple(sorted(out.items()))


async def check_spec(config: EngineConfig, vocab_size: int, spec: StructuredOutput, param: str) -> None:
    """Compile ``spec`` (in a worker thread; cached by the backend): a bad one is a 400 naming ``param``."""
    backend = grammar_backend(config, vocab_size)
    try:
        await asyncio.to_thread(backend.matcher, spec)
    except ValueError as exc:
        raise RequestError(f"invalid '{param}': {exc}", 400, param=param) from None
    except ImportError as exc:  # the backend's package is not installed: say so
        raise RequestError(str(exc), 500, param=param) from None
    except Exception:  # noqa: BLE001 - a backend bug fails this request only
        log.exception("grammar backend %r failed to compile a %s spec", config.grammar_backend, spec.kind)
        raise RequestError(f"the grammar backend failed on '{param}'", 500, param=param) from None


async def constrain(config: EngineConfig, vocab_size: int, req: Any, params: SamplingParams,
                    tool_spec: tuple[StructuredOutput, str] | None = None) -> SamplingParams:
    """``params`` with the request's structured output (checked) and ``logit_bias``."""
    found = requested_spec(req)
    if found is not None and tool_spec is not None:
        raise RequestError(f"'{found[1]}' cannot be combined with tool_choice 'required' or a named function", 400,
                           param=found[1])
    found = found or tool_spec
    bias = logit_bias(req, vocab_size)
    if found is None and not bias:
        return params
    if found is not None:
        await check_spec(config, vocab_size, *found)
    return attrs.evolve(params, structured=found[0] if found else None, logit_bias=bias)
