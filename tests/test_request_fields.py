"""No request field is silently ignored (issue 15): every field of the
OpenAI request schemas (the ``openai`` package's own ``TypedDict``s, so the
list grows with the package) and the vLLM/FastDeploy extensions clients
send is either declared by fdx's request model -- and then read by the
server code, or listed as having no effect -- or refused with a 400 naming
it.  The end-to-end counterpart (a real server answering 400 through the
``openai`` client) is in ``tests/test_openai_surface.py``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from fdx.core.errors import RequestError
from fdx.request_params import sampling_params
from fdx.server.protocol import (
    DEFAULT_ONLY_FIELDS,
    NO_EFFECT_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
)

openai = pytest.importorskip("openai")
from openai.types import completion_create_params  # noqa: E402
from openai.types.chat import completion_create_params as chat_create_params  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

#: extension fields of vLLM / FastDeploy / SGLang that clients send
EXTENSIONS = [
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "request_id",
    "prompt_logprobs", "return_token_ids", "add_generation_prompt", "continue_final_message",
    "chat_template_kwargs", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "add_special_tokens", "truncate_prompt_tokens", "chat_template", "documents", "mm_processor_kwargs",
    "priority", "cache_salt", "return_tokens_as_token_ids", "bad_words", "allowed_token_ids", "length_penalty",
    "use_beam_search", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
    "guided_decoding_backend", "logits_processors", "echo", "vllm_xargs", "enable_thinking", "reasoning_max_tokens",
]


def openai_fields(module: Any) -> set[str]:
    out: set[str] = set()
    for name in dir(module):
        t = getattr(module, name)
        if name.endswith(("Streaming", "NonStreaming", "ParamsBase")) and hasattr(t, "__optional_keys__"):
            out |= set(t.__required_keys__) | set(t.__optional_keys__)
    return out


CASES = [
    (CompletionRequest, {"prompt": "hi"}, openai_fields(completion_create_params)),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]}, openai_fields(chat_create_params)),
]


#: what a request means for the engine, outside the HTTP layer (docs/ARCHITECTURE.md, "Requests")
REQUEST_MODULES = ("fdx/request_params.py", "fdx/chat_template.py", "fdx/prompt_tokenizer.py", "fdx/beam_search.py",
                   "fdx/structured_outputs.py", "fdx/tool_calling.py")


def _server_code() -> str:
    parts = []
    for p in sorted((ROOT / "fdx").rglob("*.py")):
        if p.parts[-3:-1] == ("fdx", "server") or "serving" in p.parts or "plugins" in p.parts \
                or p.name in ("protocol.py",) or p.relative_to(ROOT).as_posix() in REQUEST_MODULES:
            parts.append(p.read_text())
    text = "\n".join(parts)
    # drop the declarations themselves ("    name: Type = ..." inside the models)
    return re.sub(r"(?m)^    [a-z_]+: .*$", "", text)


def test_the_openai_schemas_are_walked() -> None:
    """The walk sees the fields we know OpenAI has (a change in how the
    ``openai`` package spells its types must not make the test vacuous)."""
    assert {"prompt", "echo", "logprobs", "suffix", "best_of", "logit_bias", "stream", "user"} <= CASES[0][2]
    assert {"messages", "tools", "tool_choice", "response_format", "top_logprobs", "stream",
            "metadata", "store", "service_tier"} <= CASES[1][2]
    assert all((ROOT / m).is_file() for m in REQUEST_MODULES), REQUEST_MODULES


@pytest.mark.parametrize("model,base,fields", CASES, ids=["completions", "chat"])
def test_every_field_is_implemented_or_refused(model: Any, base: dict[str, Any], fields: set[str]) -> None:
    code = _server_code()
    declared = set(model.model_fields)
    refused, implemented = [], []
    for field in sorted(fields | set(EXTENSIONS)):
        if field in base:
            continue
        body = json.dumps({**base, field: None}).encode()
        if field in declared:
            implemented.append(field)
            if field in NO_EFFECT_FIELDS:
                continue
            # an implemented field is read by the server code, not only declared
            assert re.search(rf"\.{field}\b", code), f"{field!r} is declared but never read"
            continue
        with pytest.raises(RequestError) as ei:
            parse_body(body, model)
        assert ei.value.code == 400 and ei.value.param == field, (field, str(ei.value))
        assert field in str(ei.value)
        refused.append(field)
    assert refused and implemented


@pytest.mark.parametrize("model,base", [(c[0], c[1]) for c in CASES], ids=["completions", "chat"])
def test_no_effect_fields_are_declared_and_type_checked(model: Any, base: dict[str, Any]) -> None:
    for field in ("user", "metadata", "store", "service_tier"):
        assert field in model.model_fields
        parse_body(json.dumps({**base, field: {"metadata": {"k": "v"}, "store": False}.get(field, "x")}).encode(),
                   model)
    with pytest.raises(RequestError) as ei:
        parse_body(json.dumps({**base, "store": "yes"}).encode(), model)
    assert ei.value.param == "store"


def test_unknown_nested_field_is_refused() -> None:
    with pytest.raises(RequestError) as ei:
        parse_body(b'{"prompt": "x", "stream": true, "stream_options": {"include_usage": true, "bogus": 1}}',
                   CompletionRequest)
    assert ei.value.code == 400 and ei.value.param == "stream_options" and "bogus" in str(ei.value)


@pytest.mark.parametrize("body", [
    b'{"prompt": "x", "stream_options": {"include_usage": true}}',
    b'{"prompt": "x", "stream": false, "stream_options": {"continuous_usage_stats": true}}',
])
def test_stream_options_without_stream_is_refused(body: bytes) -> None:
    req = parse_body(body, CompletionRequest)
    with pytest.raises(RequestError) as ei:
        sampling_params(req, max_tokens=4, num_logprobs=None, max_logprobs=20, vocab_size=100)
    assert ei.value.code == 400 and ei.value.param == "stream_options"


def test_prompt_logprobs_range_and_echo() -> None:
    req = parse_body(b'{"prompt": "x", "prompt_logprobs": 21}', CompletionRequest)
    with pytest.raises(RequestError) as ei:
        sampling_params(req, max_tokens=4, num_logprobs=None, max_logprobs=20, vocab_size=100)
    assert ei.value.param == "prompt_logprobs"
    req = parse_body(b'{"prompt": "x", "echo": true, "logprobs": 3}', CompletionRequest)
    p = sampling_params(req, max_tokens=4, num_logprobs=3, max_logprobs=20, vocab_size=100)
    assert p.prompt_logprobs == 3 and p.logprobs == 3
    req = parse_body(b'{"prompt": "x", "logprobs": 3}', CompletionRequest)
    assert sampling_params(req, max_tokens=4, num_logprobs=3, max_logprobs=20, vocab_size=100).prompt_logprobs is None


@pytest.mark.parametrize("model,base", [(c[0], c[1]) for c in CASES], ids=["completions", "chat"])
def test_router_added_fields_are_accepted_only_at_their_neutral_value(model: Any, base: dict[str, Any]) -> None:
    """What vllm-router / sglang-router add to every request passes at the
    value that asks for fdx's own behaviour; any other value is a 400 naming
    the field (never silently ignored)."""
    req = parse_body(json.dumps({**base, **DEFAULT_ONLY_FIELDS}).encode(), model)
    assert not set(DEFAULT_ONLY_FIELDS) & set(req.model_dump(exclude_unset=True))
    for field, neutral in DEFAULT_ONLY_FIELDS.items():
        for other in (not neutral, None, int(neutral), str(neutral).lower()):
            with pytest.raises(RequestError) as ei:
                parse_body(json.dumps({**base, field: other}).encode(), model)
            assert ei.value.code == 400 and ei.value.param == field, (field, other)
