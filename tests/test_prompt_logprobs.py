"""Prompt logprobs in the engine (``SamplingParams.prompt_logprobs``),
through ``fdx.LLM`` on the real model: each prompt token's logprob equals
the one the model gives that token when the prompt stops just before it
(a reference computed token by token), across prefill chunks; ranks and
top alternatives are consistent; a request asking for them computes its
whole prompt (no prefix-cache hit) while one that does not still hits the
cache, and gets no prompt logprobs."""

from __future__ import annotations

from typing import Iterator

import pytest

import fdx
from fdx.core.messages import SamplingParams

PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"


@pytest.fixture(scope="module")
def llm() -> Iterator[fdx.LLM]:
    # a 16-token budget: the prompt is prefilled in two chunks
    yield fdx.LLM(max_num_batched_tokens=16, num_kv_blocks=64, max_model_len=256)


def test_prompt_logprobs_match_a_token_by_token_reference(llm: fdx.LLM) -> None:
    ids = llm.tokenizer.encode(PROMPT, add_special_tokens=True)
    assert len(ids) > 16  # two chunks
    res = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3))[0]
    plp = res.prompt_logprobs
    assert plp is not None and len(plp) == len(ids) and plp[0] is None
    assert [lp.token_id for lp in plp[1:]] == ids[1:]
    checked = 0
    for t in range(1, len(ids)):
        lp = plp[t]
        assert len(lp.top) == 3 and lp.rank >= 1
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert (lp.rank == 1) == (lp.top[0][0] == ids[t]) or lp.top[0][1] == lp.logprob
        if lp.rank <= 3:
            assert dict(lp.top)[ids[t]] == pytest.approx(lp.logprob, abs=1e-6)
        ref = llm.generate([ids[:t]], SamplingParams(max_tokens=1, temperature=0, logprobs=20))[0].logprobs[0]
        assert ref.top[0][0] == lp.top[0][0]  # the same most likely next token
        if ids[t] in dict(ref.top):
            assert dict(ref.top)[ids[t]] == pytest.approx(lp.logprob, abs=0.05)
            checked += 1
    assert checked >= len(ids) // 2


def test_prompt_logprobs_skip_the_prefix_cache_and_cost_nothing_otherwise(llm: fdx.LLM) -> None:
    ids = llm.tokenizer.encode(PROMPT + " Madrid.", add_special_tokens=True)
    plain = SamplingParams(max_tokens=2, temperature=0)
    first = llm.generate([ids], plain)[0]
    again = llm.generate([ids], plain)[0]
    assert again.num_cached_tokens >= 16 and again.prompt_logprobs is None
    asked = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0))[0]
    assert asked.num_cached_tokens == 0  # computed, not taken from the cache
    assert len(asked.prompt_logprobs) == len(ids) and all(lp.top == () for lp in asked.prompt_logprobs[1:])
    assert asked.token_ids == first.token_ids == again.token_ids


def test_out_of_range_prompt_logprobs_fail_alone(llm: fdx.LLM) -> None:
    from fdx.core.errors import RequestError

    with pytest.raises(RequestError, match="prompt_logprobs"):
        llm.generate(["Hi"], SamplingParams(max_tokens=1, prompt_logprobs=llm.config.max_logprobs + 1))
    assert llm.generate(["Hi"], SamplingParams(max_tokens=1, temperature=0))[0].outputs[0].token_ids
