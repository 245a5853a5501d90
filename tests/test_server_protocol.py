"""Pure-logic tests of the OpenAI request parsing and validation (no server)."""

from __future__ import annotations

import json

import pytest

from fdx.core.errors import RequestError
from fdx.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    error_body,
    parse_body,
    sampling_params,
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
