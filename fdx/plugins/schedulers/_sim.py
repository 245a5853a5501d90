"""A fake model runner and a driver to simulate schedulers without a model.

:class:`FakeRunner` keeps, for every KV slot, the token id and position
written there, and on each step verifies that every position a request has
already computed is present in its block table (so prefix sharing,
preemption and block reuse are checked for real), that no written slot lies
in a block registered in the prefix cache, and samples a token that depends
only on the request's token list (so greedy outputs are schedule
independent).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import attrs
import numpy as np

from fdx.core.interfaces import ModelOutput, ScheduledBatch
from fdx.core.messages import SamplingParams
from fdx.core.request import Request

if TYPE_CHECKING:
    from fdx.core.interfaces import Scheduler
    from fdx.core.kv_cache import KVCacheManager


class FakeRunner:
    """Checks KV placement; samples ``token = f(all tokens)``."""

    def __init__(self, kv: KVCacheManager, vocab: int = 64, eos: int = 0) -> None:
        self.kv = kv
        self.bs = kv.block_size
        n = kv.num_blocks * kv.block_size
        self.slot_tok = np.full(n, -1, dtype=np.int64)
        self.slot_pos = np.full(n, -1, dtype=np.int64)
        self.vocab = vocab
        self.eos = eos
        self.num_kv_blocks = kv.num_blocks
        self.block_size = kv.block_size
        self.eos_token_ids = frozenset({eos})

    def next_token(self, toks: list[int]) -> int:
        return hash((len(toks), tuple(toks[-3:]))) % self.vocab

    def _slots(self, req: Request, lo: int, hi: int) -> np.ndarray:
        pos = np.arange(lo, hi)
        table = np.asarray(req.block_ids, dtype=np.int64)
        return table[pos // self.bs] * self.bs + pos % self.bs

    def execute(self, batch: ScheduledBatch) -> ModelOutput:
        out = np.full(len(batch.seqs), -1, dtype=np.int64)
        seen: set[int] = set()
        for i, seq in enumerate(batch.seqs):
            r = seq.request
            assert id(r) not in seen, f"{r.request_id} scheduled twice in one step"
            seen.add(id(r))
            nc, n = r.num_computed_tokens, seq.num_new_tokens
            assert n > 0 and nc + n <= r.num_tokens, f"{r.request_id}: bad chunk {nc}+{n} of {r.num_tokens}"
            assert len(r.block_ids) * self.bs >= nc + n, f"{r.request_id}: block table too short"
            toks = np.asarray(r.all_token_ids, dtype=np.int64)
            if nc:
                s = self._slots(r, 0, nc)
                assert (self.slot_tok[s] == toks[:nc]).all() and (self.slot_pos[s] == np.arange(nc)).all(), (
                    f"{r.request_id}: KV of computed positions is wrong"
                )
            s = self._slots(r, nc, nc + n)
            for b in set((s // self.bs).tolist()):
                assert self.kv.block_hash[b] is None, f"{r.request_id}: writes into cached block {b}"
                assert self.kv.ref_cnt[b] == 1, f"{r.request_id}: writes into shared block {b}"
            self.slot_tok[s] = toks[nc : nc + n]
            self.slot_pos[s] = np.arange(nc, nc + n)
            if nc + n >= r.num_tokens:
                out[i] = self.next_token(r.all_token_ids)
        return ModelOutput(out)


@attrs.define
class SimResult:
    outputs: dict[str, list[int]]
    ends: dict[str, str]  # request id -> finished/failed/aborted
    steps: int
    preemptions: int
    errors: dict[str, str]


def make_request(rid: str, prompt: list[int], max_tokens: int, max_model_len: int = 4096) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=prompt,
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        eos_token_ids=frozenset({0}),
        max_model_len=max_model_len,
    )


def simulate(
    sched: Scheduler,
    runner: FakeRunner,
    *,
    seed: int = 0,
    num_requests: int = 200,
    arrival_prob: float = 0.5,
    abort_prob: float = 0.0,
    max_prompt: int = 120,
    max_output: int = 40,
    shared_prefixes: int = 4,
    max_steps: int = 100_000,
    check: bool = True,
) -> SimResult:
    """Drive ``sched`` until every request ended; checks invariants each
    step when ``check``.  Deterministic for a given ``seed``."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 64) for _ in range(rng.randrange(16, 200))] for _ in range(shared_prefixes)]
    pending: list[Request] = []
    for k in range(num_requests):
        plen = rng.randrange(1, max_prompt)
        prompt = [rng.randrange(1, 64) for _ in range(plen)]
        if prefixes and rng.random() < 0.5:
            prompt = prefixes[rng.randrange(len(prefixes))][: rng.randrange(1, 200)] + prompt
        pending.append(make_request(f"r{k}", prompt, rng.randrange(1, max_output)))
    pending.reverse()
    outputs: dict[str, list[int]] = {}
    ends: dict[str, str] = {}
    errors: dict[str, str] = {}
    live: dict[str, Request] = {}
    cfg = sched.config
    steps = 0
    while pending or sched.has_work():
        steps += 1
        assert steps < max_steps, "simulation does not terminate (starvation?)"
        while pending and (rng.random() < arrival_prob or not sched.has_work()):
            r = pending.pop()
            live[r.request_id] = r
            sched.add_request(r)
        if abort_prob and live and rng.random() < abort_prob:
            victim = rng.choice(sorted(live))
            for r in sched.abort([victim]):
                ends[r.request_id] = "aborted"
                outputs[r.request_id] = list(r.output_token_ids)
                live.pop(r.request_id)
        batch = sched.schedule()
        assert batch.num_tokens <= cfg.max_num_batched_tokens
        assert len(batch.seqs) <= cfg.max_num_seqs
        for r in batch.failed:
            ends[r.request_id] = "failed"
            errors[r.request_id] = str(r.extra.get("error"))
            outputs[r.request_id] = list(r.output_token_ids)
            live.pop(r.request_id)
        if batch:
            out = runner.execute(batch)
            for r in sched.update(batch, out):
                ends[r.request_id] = "finished"
                outputs[r.request_id] = list(r.output_token_ids)
                live.pop(r.request_id)
        if check:
            sched.check_invariants()  # type: ignore[attr-defined]
    assert not live, f"requests lost: {sorted(live)}"
    return SimResult(outputs, ends, steps, int(sched.stats().get("num_preemptions", 0)), errors)
