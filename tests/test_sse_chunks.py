"""The text-only SSE choice (``Endpoint.text_choice``, written without a dict
or the JSON encoder) is exactly ``json.dumps`` of the choice ``delta``
builds, for both endpoints, whenever ``text_only`` says a request's chunks
are text-only; and ``text_only`` is off whenever a chunk would carry more."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest

from fdx.config import EngineConfig
from fdx.core.messages import SamplingParams
from fdx.output_processor import ChoiceState, OutputEvent
from fdx.server.serving.chat import ChatEndpoint
from fdx.server.serving.completions import CompletionEndpoint
from fdx.server.serving.generation import Generation, Prompt

TEXTS = ["", "Paris", " wörld ☃ 𝄞", 'quote " and \\ back', "new\nline\ttab\r", "\x00\x01\x1f\x7f", "\u2028\u2029",
         "emoji 😀", "</script>"]
REASONS = [None, "stop", "length", "abort", "tool_calls"]


def _gen(params: SamplingParams, n: int = 2, **flags: Any) -> Generation:
    gen = Generation(EngineConfig(), None, None, "cmpl-1", [Prompt([1, 2, 3], "a b c")], params, "m")  # type: ignore[arg-type]
    gen.states = [ChoiceState(f"r{i}", i, 0, 3, None) for i in range(n)]  # type: ignore[arg-type]
    for k, v in flags.items():
        setattr(gen, k, v)
    return gen


@pytest.mark.parametrize("endpoint", [CompletionEndpoint(False, 2), CompletionEndpoint(True, 2), ChatEndpoint()],
                         ids=["completions", "completions-echo", "chat"])
def test_text_choice_is_json_dumps_of_delta(endpoint: Any) -> None:
    gen = _gen(SamplingParams(max_tokens=8))
    assert endpoint.text_only(gen)
    for _ in range(2):  # a choice's first event and a later one
        for index in (0, 1):
            for text in TEXTS:
                for reason in REASONS:
                    ev = OutputEvent(index, text, (5, 6), (), reason)
                    want = endpoint.delta(gen, ev)
                    got = endpoint.text_choice(index, text, reason)
                    assert got == (None if want is None else json.dumps(want, ensure_ascii=False))


@pytest.mark.parametrize("endpoint", [CompletionEndpoint(False, 2), ChatEndpoint()], ids=["completions", "chat"])
def test_text_only_is_off_when_a_chunk_carries_more(endpoint: Any) -> None:
    base = SamplingParams(max_tokens=8)
    assert not endpoint.text_only(_gen(attrs.evolve(base, logprobs=2)))
    assert not endpoint.text_only(_gen(base, return_token_ids=True))
    if isinstance(endpoint, CompletionEndpoint):
        assert not endpoint.text_only(_gen(attrs.evolve(base, prompt_logprobs=1)))


def test_chat_with_tools_is_not_text_only() -> None:
    from fdx.tool_calling import ToolCalling

    calling = object.__new__(ToolCalling)  # only its presence matters here
    assert not ChatEndpoint(calling).text_only(_gen(SamplingParams(max_tokens=8)))
