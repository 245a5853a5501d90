"""Test doubles for fdx and for third-party plugin authors (public API).

* :class:`EchoRunner` -- a complete, tiny :class:`~fdx.core.interfaces.ModelRunner`
  without a model: each request's output repeats its prompt, token by token;
  KV blocks are real (they hold the token ids written there).  Register it
  with :class:`EchoRunnerPlugin` (``--model-runner echo``) to drive the real
  engine, scheduler and front end without Paddle.
* :class:`FakeRunner` and :func:`simulate` -- a scheduler simulator: the fake
  runner checks that every position a request has computed is present in its
  block table (so prefix sharing, preemption and block reuse are checked for
  real), that no written slot lies in a block registered in the prefix
  cache, and samples a token that depends only on the request's token list
  (so greedy outputs are schedule independent).
* :func:`check_kv_invariants` -- the block-accounting invariants of a
  :class:`~fdx.core.kv_cache.KVCacheManager`, checked from the outside.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Iterable, Sequence

import attrs
import numpy as np

from fdx.core.errors import FdxError
from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import ModelOutput, ModelRunner, ScheduledBatch
from fdx.core.messages import SamplingParams
from fdx.core.request import Request

if TYPE_CHECKING:
    from fdx.config import EngineConfig
    from fdx.core.hookspecs import Register
    from fdx.core.interfaces import Device, Scheduler
    from fdx.core.kv_cache import KVCacheManager


class EchoRunner(ModelRunner):
    """A model runner without a model: output token ``k`` of a request is
    ``prompt_token_ids[k % len(prompt)]``, so greedy or not, a request
    generates its own prompt again.

    Its KV pool is real: every step writes each computed token id into its
    slot (``block_ids[pos // block_size] * block_size + pos % block_size``)
    and checks that the already computed positions hold the request's
    tokens, so a scheduler or a storage tier that hands out wrong blocks
    fails loudly.  ``read_kv_blocks``/``write_kv_blocks`` move those slots as
    bytes; ``release``/``restore`` and ``load_weights`` keep the state the
    engine's control plane expects.
    """

    vocab_size = 1 << 17

    def __init__(self, config: EngineConfig, device: Device | None = None, num_kv_blocks: int = 256) -> None:
        self.config = config
        self.device = device
        self.block_size = config.block_size
        self.num_kv_blocks = int(config.num_kv_blocks or num_kv_blocks)
        self.max_model_len = int(config.max_model_len or 2048)
        self.eos_token_ids: frozenset[int] = frozenset()
        self.weights_version = ""
        self.released: set[str] = set()
        self.slots: np.ndarray | None = np.full(self.num_kv_blocks * self.block_size, -1, dtype=np.int64)

    def execute(self, batch: ScheduledBatch) -> ModelOutput:
        if self.released or self.slots is None:
            raise FdxError(f"echo runner is sleeping ({','.join(sorted(self.released))})")
        out = np.full(len(batch.seqs), -1, dtype=np.int64)
        bs = self.block_size
        for src, dst in batch.block_copies:  # a forked beam's partial last block
            self.slots[dst * bs : (dst + 1) * bs] = self.slots[src * bs : (src + 1) * bs]
        for i, seq in enumerate(batch.seqs):
            r = seq.request
            c, n = r.num_computed_tokens, seq.num_new_tokens
            toks = np.asarray(r.all_token_ids, dtype=np.int64)
            pos = np.arange(0, c + n)
            table = np.asarray(r.block_ids, dtype=np.int64)
            if len(table) * bs < c + n:
                raise FdxError(f"request {r.request_id}: {len(table)} blocks cannot hold {c + n} tokens")
            slot = table[pos // bs] * bs + pos % bs
            if not (self.slots[slot[:c]] == toks[:c]).all():
                raise FdxError(f"request {r.request_id}: KV of computed positions is wrong")
            self.slots[slot[c:]] = toks[c : c + n]
            if c + n >= r.num_tokens:
                out[i] = r.prompt_token_ids[r.num_output_tokens % r.num_prompt_tokens]
        return ModelOutput(out)

    def kv_fingerprint(self) -> str:
        return f"echo-{self.block_size}-{self.weights_version}"

    def read_kv_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        assert self.slots is not None
        bs = self.block_size
        return [self.slots[b * bs : (b + 1) * bs].tobytes() for b in block_ids]

    def write_kv_blocks(self, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
        assert self.slots is not None
        bs = self.block_size
        for b, p in zip(block_ids, payloads):
            self.slots[b * bs : (b + 1) * bs] = np.frombuffer(p, dtype=np.int64)

    def release(self, tags: Sequence[str]) -> None:
        self.released.update(tags)
        if "kv_cache" in tags:
            self.slots = None

    def restore(self, tags: Sequence[str]) -> None:
        if "kv_cache" in tags and self.slots is None:
            self.slots = np.full(self.num_kv_blocks * self.block_size, -1, dtype=np.int64)
        self.released.difference_update(tags)

    def load_weights(self, path: str, version: str) -> None:
        self.weights_version = version


class EchoRunnerPlugin:
    """A plugin registering :class:`EchoRunner` as model runner ``echo``:
    ``pm.register(EchoRunnerPlugin())``, then ``--model-runner echo``."""

    @hookimpl
    def fdx_register_model_runners(self, register: Register) -> None:
        register("echo", EchoRunner, description="test double: repeats the prompt (fdx.testing)")


class FakeRunner:
    """Scheduler-simulator runner: checks KV placement against the
    :class:`~fdx.core.kv_cache.KVCacheManager`; samples ``token = f(all tokens)``."""

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
    """What :func:`simulate` observed: each request's output, how it ended."""

    outputs: dict[str, list[int]]
    ends: dict[str, str]  # request id -> finished/failed/aborted
    steps: int
    preemptions: int
    errors: dict[str, str]


def make_request(rid: str, prompt: list[int], max_tokens: int, max_model_len: int = 4096) -> Request:
    """A greedy request with EOS token 0, as the simulator makes them."""
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
            errors[r.request_id] = str(r.error)
            outputs[r.request_id] = list(r.output_token_ids)
            live.pop(r.request_id)
        if batch:
            sched.update(batch, runner.execute(batch))
            for r in (seq.request for seq in batch.seqs):
                if r.finish_reason is not None:
                    ends[r.request_id] = "finished"
                    outputs[r.request_id] = list(r.output_token_ids)
                    live.pop(r.request_id)
        if check:
            sched.check_invariants()  # type: ignore[attr-defined]
    assert not live, f"requests lost: {sorted(live)}"
    return SimResult(outputs, ends, steps, int(sched.stats().get("num_preemptions", 0)), errors)


def check_kv_invariants(kv: KVCacheManager, requests: Iterable[Request] = ()) -> None:
    """Raise AssertionError when the block accounting of ``kv`` is
    inconsistent (the invariants of :mod:`fdx.core.kv_cache`).

    ``requests`` are every live request holding blocks (pass all the
    scheduler's running/waiting requests)."""
    n = kv.num_blocks
    free = list(kv._free)
    evict = list(kv._evictable)
    assert len(set(free)) == len(free), "a block is twice in the free list"
    assert not set(free) & set(evict), "a block is both free and evictable"
    refs = [0] * n
    partial: set[int] = set()  # blocks some table holds past its full, computed ones
    for r in requests:
        assert len(set(r.block_ids)) == len(r.block_ids), f"{r.request_id}: block twice in its table"
        assert len(r.block_ids) * kv.block_size >= r.num_computed_tokens, f"{r.request_id}: too few blocks"
        for b in r.block_ids:
            refs[b] += 1
        partial.update(r.block_ids[r.num_computed_tokens // kv.block_size :])
    for b in range(n):
        assert refs[b] == kv.ref_cnt[b], f"block {b}: ref_cnt {kv.ref_cnt[b]} != tables {refs[b]}"
        if refs[b] > 1:  # a cached block, or a full one shared by forked beams (never written again)
            assert kv.block_hash[b] is not None or b not in partial, f"block {b} shared but not cached"
    for b in free:
        assert kv.ref_cnt[b] == 0 and kv.block_hash[b] is None, f"free block {b} in use or cached"
    for b in evict:
        assert kv.ref_cnt[b] == 0 and kv.block_hash[b] is not None, f"evictable block {b} bad state"
    used = sum(1 for c in kv.ref_cnt if c > 0)
    assert used == kv.num_used_blocks, f"num_used_blocks {kv.num_used_blocks} != {used}"
    assert used + len(free) + len(evict) == n, f"blocks lost: used {used} free {len(free)} evictable {len(evict)}"
    for h, b in kv.cached.items():
        assert kv.block_hash[b] == h, f"cache map of block {b} inconsistent"
    assert sum(1 for h in kv.block_hash if h is not None) == len(kv.cached)
