"""Batch invariance of the packed compute modes, int8 and bfloat16
(fdx/csrc/qgemm.cc), engine level.

The same 16 greedy prompts run alone, then inside batches of 1, 7, 33 and
64 requests (the rest filler requests of other lengths, other ``max_tokens``
and some sampled ones, so the batch changes shape while they run), through
the real engine (``fdx.LLM``, v1 scheduler, chunked prefill, prefix cache)
with the real model.  Every one must give the same tokens AND bit-identical
logprobs (the chosen token's and the top-2) as when it ran alone -- also
when its prompt came from the prefix cache, and in a pool too small for the
64-request batch, so that requests are preempted and recomputed.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
TOPICS = [
    "What is the capital of France?", "def fibonacci(n):", "Name three colours.", "Write a haiku about the sea.",
    "Translate 'good morning' into Spanish.", "1, 2, 3, 4,", "The quick brown fox", "Explain photosynthesis briefly.",
    "SELECT * FROM users WHERE", "List three prime numbers.", "Once upon a time, in a small village,",
    "What is 17 times 23?", "import numpy as np\n", "The mitochondria is", "Dear hiring manager,",
    "Rain falls on the",
]


@pytest.fixture(scope="module", params=["int8", "bfloat16", "int8/kv-float32", "bfloat16/kv-bfloat16"])
def llm(request: pytest.FixtureRequest) -> Any:
    """The packed modes with their default KV pools (int8: bfloat16,
    bfloat16: float32), then each with the other pool (``--kv-cache-dtype``)."""
    import fdx

    dtype, _, kv = request.param.partition("/kv-")
    # 64 requests of ~3 blocks (16 tokens) each overflow 64 blocks: the 64-batch preempts
    engine = fdx.LLM(dtype=dtype, num_kv_blocks=64, max_model_len=512, max_num_seqs=64,
                     max_num_batched_tokens=512, kv_cache_dtype=kv or "auto")
    assert engine.engine.runner.compute == dtype
    assert engine.engine.runner.dtype == (kv or ("bfloat16" if dtype == "int8" else "float32"))
    return engine


def _params(**kw: Any) -> Any:
    from fdx import SamplingParams

    return SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, "logprobs": 2, "ignore_eos": True, **kw})


def _key(res: Any) -> tuple[list[int], list[tuple[int, float, tuple[tuple[int, float], ...]]]]:
    lps = [(lp.token_id, lp.logprob, tuple(lp.top)) for lp in res.outputs[0].logprobs]
    return list(res.token_ids), lps


def _fillers(rng: random.Random, n: int, vocab: int) -> list[tuple[list[int], Any]]:
    out = []
    for _ in range(n):
        ids = [rng.randrange(100, vocab) for _ in range(rng.randrange(3, 60))]
        kw: dict[str, Any] = {"max_tokens": rng.randrange(1, 2 * MAX_TOKENS + 1), "logprobs": None}
        if rng.random() < 0.3:
            kw.update(temperature=0.8, seed=rng.randrange(1 << 30))
        out.append((ids, _params(**kw)))
    return out


def test_same_tokens_and_logprobs_alone_and_in_any_batch(llm: Any) -> None:
    tok = llm.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in TOPICS]
    alone = [_key(llm.generate([p], _params())[0]) for p in prompts]
    assert all(len(t) == MAX_TOKENS for t, _ in alone)
    # a second run alone starts from the prefix cache (every prompt's full blocks)
    hits0 = llm.engine.kv.prefix_hits
    assert [_key(llm.generate([p], _params())[0]) for p in prompts] == alone
    assert llm.engine.kv.prefix_hits > hits0

    rng = random.Random(16)
    preempt0 = llm.engine.stats().num_preemptions
    checked = 0
    for size in (1, 7, 33, 64):
        per = min(size, len(prompts))  # target prompts per batch
        for first in range(0, len(prompts), per):
            targets = list(range(first, min(first + per, len(prompts))))
            items = [(prompts[i], _params()) for i in targets] + _fillers(rng, size - len(targets), tok.vocab_size)
            order = list(range(len(items)))
            rng.shuffle(order)  # targets land anywhere in the step's rows
            results = llm.generate([items[j][0] for j in order], [items[j][1] for j in order])
            for pos, j in enumerate(order):
                if j < len(targets):
                    i = targets[j]
                    assert _key(results[pos]) == alone[i], f"prompt {i} differs in a batch of {size}"
                    checked += 1
    assert checked == 4 * len(prompts)
    assert llm.engine.stats().num_preemptions > preempt0, "the 64-request batch was meant to preempt"
    assert llm.engine.kv.num_used_blocks == 0
