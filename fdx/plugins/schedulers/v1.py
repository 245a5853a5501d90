"""The ``v1`` scheduler (registered here; the default): continuous
batching under a per-step token budget.

Like vLLM v1 / FastDeploy's ResourceManagerV1:

* each step has ``max_num_batched_tokens`` tokens; running requests are
  served first (decodes and continuing prefill chunks, oldest first), then
  waiting requests are admitted in FIFO order (preempted ones are at the
  front) while budget, ``max_num_seqs`` and blocks allow;
* long prompts are split into chunks (chunked prefill) interleaved with the
  decodes of other requests;
* prompts reuse cached prefix blocks (``enable_prefix_caching``);
* when a running request needs a block and none is free, the newest running
  request is preempted by recompute: it loses its blocks and goes back to the
  front of the waiting queue with its output so far; when resumed its prompt
  + output are recomputed (mostly from the prefix cache), so greedy
  decoding yields the same tokens;
* no request is admitted in a step that preempted one (avoids thrash);
* a beam-search request (:mod:`fdx.plugins.schedulers.beam`) is one unit:
  its prompt is admitted like any prompt, then all its live beams decode
  in the same step as rows of the batch (or wait for a step with budget
  for all of them); preempting it frees every beam and restarts it;
* with ``enable_chunked_prefill`` off a prompt is admitted only whole;
  resumed requests are still recomputed in chunks.

Pause: :meth:`preempt_all` (inherited) removes every request and frees its
blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import ScheduledBatch, ScheduledSeq
from fdx.core.request import Request, Status
from fdx.plugins.schedulers.base import BaseScheduler
from fdx.plugins.schedulers.beam import BeamGroup

if TYPE_CHECKING:
    from fdx.core.hookspecs import Register


class V1Scheduler(BaseScheduler):
    supports_beam_search = True

    def schedule(self) -> ScheduledBatch:
        self.admit_compiled()
        batch = ScheduledBatch()
        self._take_failed(batch)
        kv = self.kv
        cfg = self.config
        budget = cfg.max_num_batched_tokens

        # 1. running requests, oldest first; preempt the newest when short
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            group = self.beams.get(req.request_id) if self.beams else None
            if group is not None and group.live:  # a beam group decodes all its beams, or waits
                got = self._schedule_beams(group, budget, batch)
                if got is None:
                    break  # the group itself was preempted: every newer request is gone too
                budget -= got
                i += 1
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:  # nothing to compute (should not happen)
                i += 1
                continue
            drafts = self.drafts_for(req, budget) if self.speculator is not None else []
            if drafts and kv.can_allocate(req, num_new + len(drafts)):  # drafts never cause a preemption
                num_new += len(drafts)
            else:
                drafts = []
            while not kv.allocate(req, num_new):
                victim = self.running.pop()
                self._preempt(victim, batch)
                if victim is req:
                    break
            else:
                batch.seqs.append(ScheduledSeq(req, num_new, drafts))
                budget -= num_new
                i += 1
                continue
            break  # req itself was preempted: every newer request is gone too

        # 2. waiting requests, FIFO (preempted ones first)
        if not batch.preempted:
            while self.waiting and budget > 0 and (self.num_rows() if self.beams else len(self.running)) \
                    < cfg.max_num_seqs:
                req = self.waiting[0]
                if req.params.beam_width and self.num_rows() + req.params.beam_width > cfg.max_num_seqs:
                    break  # its beams would overrun --max-num-seqs rows
                computed = kv.get_computed_blocks(req)
                n_cached = len(computed) * kv.block_size
                num_new = req.num_tokens - n_cached
                if num_new > budget:
                    # without chunked prefill a prompt runs whole; a resumed
                    # request (prompt + output may exceed the budget) is
                    # still recomputed in chunks, or it could never resume
                    if not cfg.enable_chunked_prefill and req.num_preemptions == 0:
                        break
                    num_new = budget
                if not kv.allocate(req, num_new, computed):
                    break
                self.waiting.popleft()
                req.status = Status.RUNNING
                self.running.append(req)
                batch.seqs.append(ScheduledSeq(req, num_new))
                budget -= num_new
        self._record(batch)
        return batch

    def _schedule_beams(self, group: BeamGroup, budget: int, batch: ScheduledBatch) -> int | None:
        """One decode row per live beam of ``group``, with the partial
        blocks its last forks copy; the tokens scheduled (0: no room in the
        budget this step), or ``None`` when a block shortage preempted the
        group itself."""
        n = len(group.live)
        if n > budget:
            return 0
        for beam in group.live:
            while not self.kv.allocate(beam.seq, 1):
                victim = self.running.pop()
                self._preempt(victim, batch)
                if victim is group.parent:
                    return None
        while self.kv.num_free_blocks < n - 1:  # room for the forks this step's candidates may need
            victim = self.running.pop()
            self._preempt(victim, batch)
            if victim is group.parent:
                return None
        batch.seqs.extend(ScheduledSeq(b.seq, 1) for b in group.live)
        batch.block_copies.extend(group.take_copies())
        return n

    def _preempt(self, req: Request, batch: ScheduledBatch) -> None:
        group = self.beams.get(req.request_id) if self.beams else None
        if group is not None:  # a beam search restarts from its prompt
            group.reset(self.kv)
        self.kv.free(req)
        req.status = Status.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        batch.preempted.append(req)


@hookimpl
def fdx_register_schedulers(register: Register) -> None:
    register("v1", V1Scheduler, description="token budget, chunked prefill, prefix cache, preemption by recompute")
