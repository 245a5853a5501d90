"""Driving a model runner by hand (no scheduler), for the runner tests."""

from __future__ import annotations

from typing import Any

from fdx.core.interfaces import ScheduledBatch, ScheduledSeq
from fdx.core.messages import SamplingParams
from fdx.core.request import Request


def run_greedy(runner: Any, prompts: list[list[int]], n: int, chunk: int = 1 << 30, ignore_eos: bool = True) -> list[list[int]]:
    """Run all prompts concurrently: prefill in chunks of ``chunk`` tokens,
    mixed with the decode tokens of sequences already generating, ONE
    runner.execute per step.  Blocks are handed out from the top of the
    pool downwards, interleaved between requests (so block tables are not
    contiguous).  A step's non-sampling rows must come back as ``-1``."""
    bs = runner.block_size
    reqs = [Request(f"r{i}", list(p), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=ignore_eos),
                    eos_token_ids=runner.eos_token_ids, max_model_len=runner.max_model_len)
            for i, p in enumerate(prompts)]
    next_block = runner.num_kv_blocks - 1
    need = [-(-(len(p) + n) // bs) for p in prompts]
    for j in range(max(need)):
        for i, r in enumerate(reqs):
            if j < need[i]:
                r.block_ids.append(next_block)
                next_block -= 1
    assert next_block >= -1
    live = list(reqs)
    while live:
        seqs = [ScheduledSeq(r, min(chunk, r.num_tokens - r.num_computed_tokens)) for r in live]
        samples = [s.samples for s in seqs]
        out = runner.execute(ScheduledBatch(seqs))
        for s, smp, tok in zip(seqs, samples, out.token_ids):
            s.request.num_computed_tokens += s.num_new_tokens
            if smp:
                assert tok >= 0
                reason = s.request.append_token(int(tok))
                if reason:
                    s.request.finish_reason = reason
            else:
                assert tok == -1
        live = [r for r in live if r.finish_reason is None]
    return [list(r.output_token_ids) for r in reqs]
