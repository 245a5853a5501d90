"""The ``v0`` scheduler (registered here): FastDeploy's older static-slot policy.

Behaviour (learned from the seed engine's insert path and
``update_requests_chunk_size``):

* **Static slots.**  At most ``max_num_seqs`` requests run.  New requests are
  admitted in *prefill batches* of at most :attr:`V0Scheduler.max_prefill_batch`
  (FastDeploy's ``MAX_PREFILL_NUM``), only once the previous batch finished
  its prefill, and only when the blocks for the whole prompt plus
  :attr:`V0Scheduler.reserved_output_blocks` (``enc_dec_block_num``) are
  free.  The prompt's blocks are allocated at admission.
* **Chunk plan.**  Each prefill batch gets a fixed plan from
  :func:`plan_chunks` (the seed's rule): in every round each unfinished
  request gets ``min(remaining, partial_chunked_tokens[n])`` where ``n`` is
  the number of requests still prefilling and ``partial_chunked_tokens[n] =
  (max_num_batched_tokens // n) // block_size * block_size``; then, while at
  least one block's worth of budget is left, the leftover goes to the
  request with the fewest remaining tokens.  One round runs per step.
  Difference from the seed (which lets decodes ride on top of the budget):
  the decode tokens running in a round are taken out of that round's budget
  first, so a step never exceeds ``max_num_batched_tokens``; with no decodes
  the plan is exactly the seed's.
* **No preemption.**  Decodes take blocks one at a time; when none is free
  the request ends with error 507 ("KV cache blocks ran out"), like
  FastDeploy's v0 which cannot recompute.
* **Pause.**  :meth:`preempt_all` removes every request (v0 has nothing to
  recompute, so there is no difference between draining and dropping).
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import ScheduledBatch, ScheduledSeq
from fdx.core.request import Request, Status
from fdx.plugins.schedulers.base import BaseScheduler

if TYPE_CHECKING:
    from fdx.config import EngineConfig
    from fdx.core.hookspecs import Register
    from fdx.core.kv_cache import KVCacheManager

#: HTTP-like code for "KV blocks ran out" (507 Insufficient Storage)
OUT_OF_BLOCKS = 507


def partial_chunked_tokens(max_num_batched_tokens: int, block_size: int, n: int) -> list[int]:
    """``table[k]`` = per-request chunk when ``k`` requests prefill together
    (``table[0] = 0``)."""
    return [0] + [(max_num_batched_tokens // k) // block_size * block_size for k in range(1, n + 1)]


def plan_chunks(
    sizes: list[int],
    max_num_batched_tokens: int,
    block_size: int,
    num_decodes: int = 0,
) -> list[list[int]]:
    """The seed's chunk rule.  ``sizes`` are the prompt tokens to compute per
    request; returns each request's chunk list, one entry per round (a ``0``
    entry means "nothing this round").

    ``num_decodes`` decode tokens run beside the first round; a request that
    finished its prefill in an earlier round decodes (one token) in every
    later round; decode tokens come out of the round's budget.  With
    ``num_decodes == 0`` and one request finishing in the last round this is
    exactly the seed's ``update_requests_chunk_size``.

    Requires ``len(sizes) <= max_num_batched_tokens // block_size`` and
    ``num_decodes + len(sizes) <= max_num_batched_tokens`` (so every round
    makes progress).
    """
    n_req = len(sizes)
    if n_req == 0:
        return []
    if n_req * block_size > max_num_batched_tokens or num_decodes + n_req > max_num_batched_tokens:
        raise ValueError(f"cannot plan {n_req} prefills with {num_decodes} decodes in {max_num_batched_tokens} tokens")
    table = partial_chunked_tokens(max_num_batched_tokens, block_size, n_req)
    left = list(sizes)
    chunks: list[list[int]] = [[] for _ in sizes]
    active = sum(1 for s in left if s > 0)
    finished_before = 0  # requests whose prefill ended in an earlier round
    while active >= 1:
        remain = max_num_batched_tokens - num_decodes - finished_before
        done_this_round = 0

        def take(idx: int, size: int, extend: bool) -> None:
            nonlocal remain, active, done_this_round
            if extend:
                chunks[idx][-1] += size
            else:
                chunks[idx].append(size)
            remain -= size
            left[idx] -= size
            if left[idx] <= 0:
                active -= 1
                done_this_round += 1

        for idx in range(n_req):
            if left[idx] <= 0:
                continue
            take(idx, max(0, min(left[idx], table[active], remain)), extend=False)
        while remain >= block_size:
            rest = [s for s in left if s > 0]
            if not rest:
                break
            idx = left.index(min(rest))
            size = min(left[idx], table[active], remain // block_size * block_size)
            take(idx, size, extend=True)
        finished_before += done_this_round
    return chunks


class V0Scheduler(BaseScheduler):
    """Static slots, admission with an output-block reserve, seed chunk plan,
    no preemption."""

    #: requests admitted together in one prefill batch (FastDeploy MAX_PREFILL_NUM)
    max_prefill_batch: int = 3
    #: free blocks required beyond the prompt's at admission (FastDeploy enc_dec_block_num)
    reserved_output_blocks: int = 2

    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        super().__init__(config, kv)
        #: request_id -> remaining chunk sizes of its prefill (one per step)
        self.plans: dict[str, collections.deque[int]] = {}

    def never_fits(self, request: Request) -> str | None:
        err = super().never_fits(request)
        if err is not None:
            return err
        need = self.kv.blocks_for(request.num_prompt_tokens) + self.reserved_output_blocks
        if need > self.kv.num_blocks:
            return (
                f"prompt ({request.num_prompt_tokens} tokens) needs {need} KV blocks with the output reserve "
                f"but the whole pool has {self.kv.num_blocks}"
            )
        return None

    def _on_removed(self, request: Request) -> None:
        self.plans.pop(request.request_id, None)

    def schedule(self) -> ScheduledBatch:
        self.admit_compiled()
        batch = ScheduledBatch()
        self._take_failed(batch)
        kv = self.kv
        prefilling = bool(self.plans)
        # 1. decodes and planned prefill chunks of running requests
        still: list[Request] = []
        for req in self.running:
            plan = self.plans.get(req.request_id)
            if plan:
                n = plan.popleft()
                if not plan:
                    del self.plans[req.request_id]
                if n > 0:
                    batch.seqs.append(ScheduledSeq(req, n))
                still.append(req)
                continue
            n = req.num_tokens - req.num_computed_tokens
            if kv.allocate(req, n):
                batch.seqs.append(ScheduledSeq(req, n))
                still.append(req)
            else:
                self._fail(
                    req,
                    f"KV cache blocks ran out while decoding (pool of {kv.num_blocks} blocks is full; scheduler v0 "
                    "does not preempt): retry, lower concurrency or max_tokens, or use --scheduler v1",
                    OUT_OF_BLOCKS,
                )
        self.running = still
        if self._failed:
            self._take_failed(batch)
        # 2. admit a new prefill batch once the previous one is done (so
        #    every seq already in this batch is a one-token decode)
        if not prefilling and self.waiting:
            self._admit(batch)
        self._record(batch)
        return batch

    def _admit(self, batch: ScheduledBatch) -> None:
        cfg, kv = self.config, self.kv
        budget = cfg.max_num_batched_tokens
        n_dec = batch.num_tokens  # every running request decodes (one token) this step
        limit = min(
            self.max_prefill_batch,
            cfg.max_num_seqs - len(self.running),
            budget // kv.block_size,
            budget - len(self.running),
        )
        admitted: list[Request] = []
        sizes: list[int] = []
        while self.waiting and len(admitted) < limit:
            req = self.waiting[0]
            computed = kv.get_computed_blocks(req)
            size = req.num_tokens - len(computed) * kv.block_size
            if not cfg.enable_chunked_prefill and sum(sizes) + size > budget - n_dec:
                break
            if not kv.allocate(req, size, computed, watermark=self.reserved_output_blocks):
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            admitted.append(req)
            sizes.append(size)
        if not admitted:
            return
        if cfg.enable_chunked_prefill:
            plans = plan_chunks(sizes, budget, kv.block_size, num_decodes=n_dec)
        else:
            plans = [[s] for s in sizes]
        for req, plan in zip(admitted, plans):
            self.running.append(req)
            q = collections.deque(plan)
            n = q.popleft()
            if q:
                self.plans[req.request_id] = q
            if n > 0:
                batch.seqs.append(ScheduledSeq(req, n))


@hookimpl
def fdx_register_schedulers(register: Register) -> None:
    register("v0", V0Scheduler, description="static slots, seed chunk plan, output-block reserve, no preemption")
