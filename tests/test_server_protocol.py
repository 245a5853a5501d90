"""Pure-logic tests of the OpenAI request parsing and validation (no server)."""

from __future__ import annotations

import json

import pytest

from fdx.core.errors import RequestError
from fdx.request_params import sampling_params
from fdx.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    error_body,
    parse_body,
)


def _params(body: dict, max_tokens: int = 16, num_logprobs: int | None = None, model=CompletionRequest):
    req = parse_body(json.dumps(body).encode(), model)
    return sampling_params(req, max_tokens=max_tokens, num_logprobs=num_logprobs, max_logprobs=20, vocab_size=100)


def test_defaults_and_mapping() -> None:
    p = _params({"prompt": "x", "temperature": 0, "top_k": -1, "stop": "END", "seed": 7, "n": 3,
                 "stop_token_ids": [5], "ignore_eos": True, "min_tokens": 2}, max_tokens=9, num_logprobs=2)
    assert p.max_tokens == 9 and p.min_tokens == 2 and p.greedy and p.top_k == 0
    assert p.stop == ("END",) and p.stop_token_ids == (5,) and p.seed == 7 and p.n == 3
    assert p.ignore_eos and p.logprobs == 2


@pytest.mark.parametrize(
    "body,param",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"min_p": 2}, "min_p"),
        ({"top_k": -2}, "top_k"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"stop_token_ids": [100]}, "stop_token_ids"),
        ({"stop": [""]}, "stop"),
        ({"min_tokens": 50}, "min_tokens"),
    ],
)
def test_out_of_range(body: dict, param: str) -> None:
    with pytest.raises(RequestError) as ei:
        _params({"prompt": "x", **body})
    assert ei.value.code == 400 and ei.value.param == param


def test_max_tokens_and_logprobs_limits() -> None:
    with pytest.raises(RequestError, match="max_tokens"):
        _params({"prompt": "x"}, max_tokens=-5)
    with pytest.raises(RequestError, match=r"'logprobs' must be in \[0, 20\]"):
        _params({"prompt": "x"}, num_logprobs=21)
    with pytest.raises(RequestError, match="top_logprobs"):
        _params({"messages": [{"role": "user", "content": "hi"}]}, num_logprobs=21, model=ChatCompletionRequest)


@pytest.mark.parametrize(
    "raw,needle",
    [
        (b"{bad", "malformed JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"prompt": "x", "max_tokens": "abc"}', "max_tokens"),
        (b'{"max_tokens": 3}', "missing required parameter 'prompt'"),
        (b'{"prompt": {"a": 1}}', "prompt"),
    ],
)
def test_parse_errors(raw: bytes, needle: str) -> None:
    with pytest.raises(RequestError) as ei:
        parse_body(raw, CompletionRequest)
    assert ei.value.code == 400 and needle in str(ei.value)


def test_prompt_forms() -> None:
    assert parse_body(b'{"prompt": [1, 2, 3]}', CompletionRequest).prompt == [1, 2, 3]
    assert parse_body(b'{"prompt": ["a", "b"]}', CompletionRequest).prompt == ["a", "b"]
    assert parse_body(b'{"prompt": [[1], [2, 3]]}', CompletionRequest).prompt == [[1], [2, 3]]


def test_chat_messages_flatten_parts() -> None:
    req = parse_body(json.dumps({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]}).encode(), ChatCompletionRequest)
    msgs = chat_messages(req)
    assert msgs[1]["content"] == "ab" and msgs[0]["role"] == "system"
    with pytest.raises(RequestError):
        chat_messages(parse_body(b'{"messages": []}', ChatCompletionRequest))


def test_error_envelope() -> None:
    body = error_body("nope", 404, "model")
    assert body == {"error": {"message": "nope", "type": "not_found_error", "param": "model", "code": 404}}


# --------------------------------------------------------------------------
# strict JSON and strict types (issue 14)
# --------------------------------------------------------------------------

from fdx.server.protocol import MAX_JSON_DEPTH, json_depth_exceeds, loads_strict  # noqa: E402


@pytest.mark.parametrize(
    "raw,param,needle",
    [
        (b'{"prompt": "x", "seed": -1}', "seed", "[0, 2^63-1]"),
        (b'{"prompt": "x", "seed": 9223372036854775808}', "seed", "seed"),
        (b'{"prompt": "x", "top_k": 9223372036854775808}', "top_k", "top_k"),
        (b'{"prompt": "x", "top_k": 18446744073709551616}', "top_k", "2^64"),
        (b'{"prompt": "x", "top_k": false}', "top_k", "valid integer"),
        (b'{"prompt": "x", "top_k": 2.0}', "top_k", "valid integer"),
        (b'{"prompt": "x", "stream": 0}', "stream", "boolean"),
        (b'{"prompt": "x", "echo": "yes"}', "echo", "boolean"),
        (b'{"prompt": "x", "temperature": true}', "temperature", "number"),
        (b'{"prompt": "x", "temperature": "1"}', "temperature", "number"),
        (b'{"prompt": "x", "temperature": NaN}', "temperature", "NaN"),
        (b'{"prompt": "x", "temperature": Infinity}', "temperature", "Infinity"),
        (b'{"prompt": "x", "top_p": -Infinity}', "top_p", "-Infinity"),
        (b'{"prompt": "x", "min_p": 1e400}', "min_p", "finite"),
        (b'{"prompt": "x", "extra": {"deep": [1, 2, 99999999999999999999999]}}', "extra", "extra.deep[2]"),
        (b'{"prompt": "\\ud800"}', "prompt", "surrogate"),
        (b'{"prompt": ["ok", "\\udfff"]}', "prompt", "prompt[1]"),
        (b'{"prompt": "x", "stop": ["\\ud800"]}', "stop", "stop[0]"),
        (b'{"prompt": "x", "request_id": "\\udc00"}', "request_id", "request_id"),
        (b'{"prompt": "x", "request_id": "' + b"r" * 257 + b'"}', "request_id", "256"),
        (b'{"prompt": "x", "n": 129}', "n", "128"),
        (b'{"prompt": [[1]], "max_tokens": 0}', "max_tokens", "max_tokens"),
    ],
)
def test_strict_values_name_the_field(raw: bytes, param: str, needle: str) -> None:
    with pytest.raises(RequestError) as ei:
        parse_body(raw, CompletionRequest)
    assert ei.value.code == 400 and ei.value.param == param, (str(ei.value), ei.value.param)
    assert needle in str(ei.value)
    assert "Error" not in str(ei.value)


def test_depth_limit_and_big_numbers_never_raise_python_errors() -> None:
    for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
                b'{"prompt": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}"):
        with pytest.raises(RequestError, match=f"deeper than {MAX_JSON_DEPTH}"):
            parse_body(raw, CompletionRequest)
    with pytest.raises(RequestError, match="too large"):
        loads_strict(b'{"a": ' + b"7" * 5000 + b"}")
    with pytest.raises(RequestError, match="UTF-8"):
        loads_strict(b'{"prompt": "\xed\xa0\x80"}')  # a surrogate encoded as UTF-8 bytes
    # brackets inside strings do not count; a valid surrogate pair is fine
    assert not json_depth_exceeds(b'{"prompt": "' + b"[" * 1000 + b'\\"{{{"}')
    assert json_depth_exceeds(b"[" * 65 + b"]" * 65) and not json_depth_exceeds(b"[" * 64 + b"]" * 64)
    assert loads_strict(b'{"p": "\\ud83d\\ude00", "n": 18446744073709551615}') == {"p": "\U0001f600",
                                                                                 "n": 2**64 - 1}


def test_seed_and_top_k_bounds_at_the_edges() -> None:
    assert _params({"prompt": "x", "seed": 2**63 - 1}).seed == 2**63 - 1
    assert _params({"prompt": "x", "top_k": 100}).top_k == 100  # vocab_size=100 in _params
    with pytest.raises(RequestError, match="vocabulary size") as ei:
        _params({"prompt": "x", "top_k": 101})
    assert ei.value.param == "top_k"
    with pytest.raises(RequestError, match=r"seed' \+ n - 1") as ei:
        _params({"prompt": "x", "seed": 2**63 - 2, "n": 3})
    assert ei.value.param == "seed"
    assert _params({"prompt": "x", "seed": 2**63 - 3, "n": 3}).seed == 2**63 - 3


def test_schema_matches_the_bounds() -> None:
    js = CompletionRequest.model_json_schema()
    seed = next(s for s in js["properties"]["seed"]["anyOf"] if s.get("type") == "integer")
    assert (seed["minimum"], seed["maximum"]) == (0, 2**63 - 1)
    top_k = next(s for s in js["properties"]["top_k"]["anyOf"] if s.get("type") == "integer")
    assert top_k["minimum"] == -1
    stream = js["properties"]["stream"]["anyOf"][0]
    assert stream == {"type": "boolean"}
