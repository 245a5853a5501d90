"""What v0 and v1 share: the request tables, update(), abort, failures.

Invariants kept here:

* every live request is in exactly one of ``waiting``, ``running`` or
  ``_failed`` (ended by the scheduler, reported in the next batch), and in
  ``requests`` by id;
* a request leaves the scheduler only through :meth:`update` (finished),
  :meth:`abort`, :meth:`preempt_all` or ``ScheduledBatch.failed``, with its
  blocks freed.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np

from fdx.core.interfaces import ModelOutput, ScheduledBatch, Scheduler
from fdx.core.kv_cache import cdiv
from fdx.core.messages import SpecDecodeStats, TokenLogprob
from fdx.core.request import Request, Status
from fdx.plugins.schedulers.beam import GREEDY_EPS, BeamGroup, OutOfBlocks, beam_conflict, stop_ids

if TYPE_CHECKING:
    from fdx.config import EngineConfig
    from fdx.core.interfaces import Speculator
    from fdx.core.kv_cache import KVCacheManager



def speculation_is_exact(req: Request) -> bool:
    """Whether verifying drafts by greedy argmax gives exactly the tokens
    plain decoding would: greedy, no logprobs, no history-dependent
    penalties, no logit bias, no grammar, past ``min_tokens`` (so no
    position of the step masks eos/stop ids)."""
    p = req.params
    return (p.temperature < GREEDY_EPS and p.logprobs is None and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 and not p.logit_bias
            and req.grammar is None and req.num_output_tokens >= p.min_tokens)


class BaseScheduler(Scheduler):
    #: whether :meth:`schedule` runs beam groups (:mod:`fdx.plugins.schedulers.beam`); v1 does
    supports_beam_search = False

    def __init__(self, config: EngineConfig, kv: KVCacheManager, speculator: Speculator | None = None) -> None:
        super().__init__(config, kv)
        #: ``--speculative``: proposes drafts for decoding requests (:meth:`drafts_for`)
        self.speculator = speculator
        self._spec_hist: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (token buffer, tokens in it)
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted = 0
        self.spec_accepted_per_pos = [0] * (config.num_speculative_tokens if speculator is not None else 0)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._failed: list[Request] = []
        #: structured requests whose grammar still compiles (off the engine thread), in arrival order
        self.compiling: list[Request] = []
        self.num_preemptions = 0
        self.num_failed = 0
        self.num_finished = 0
        self.num_admitted = 0  # cumulative requests taken to run (the engine-side admissions)
        self.num_scheduled_tokens = 0  # cumulative
        self.num_generated_tokens = 0  # cumulative sampled tokens
        self.last_step_tokens = 0
        #: beam-search requests by id (their parent is in the tables above)
        self.beams: dict[str, BeamGroup] = {}

    # ------------------------------------------------------------------
    # request tables
    # ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        request.status = Status.WAITING
        self.requests[request.request_id] = request
        error = self.never_fits(request)
        if error is None and request.params.beam_width:
            error = self.beam_error(request)
            if error is None:
                self.beams[request.request_id] = BeamGroup.of(request)
        if error is not None:
            self._fail(request, error, 400)
            return
        (self.compiling if getattr(request.grammar, "pending", False) else self.waiting).append(request)
        self.num_admitted += 1

    def admit_compiled(self) -> None:
        """Called first in ``schedule()``: compiling requests whose grammar is
        ready join the waiting queue (in arrival order); one whose compile
        failed ends with its error (400).  With nothing else to run, wait up
        to 20 ms for the oldest compile (no busy loop while a grammar compiles)."""
        if not self.compiling:
            return
        if not self.running and not self.waiting:
            self.compiling[0].grammar.wait(0.02)  # type: ignore[union-attr]
        keep: list[Request] = []
        for r in self.compiling:
            g: Any = r.grammar
            if g.pending:
                keep.append(r)
            elif g.error is not None:
                self._fail(r, f"structured output ({r.params.structured.kind}): {g.error}", 400)  # type: ignore[union-attr]
            else:
                self.waiting.append(r)
        self.compiling = keep

    def beam_error(self, request: Request) -> str | None:
        """Why this scheduler cannot run ``request``'s beam search, or ``None``."""
        if not self.supports_beam_search:
            return f"use_beam_search is not supported by the {self.config.scheduler!r} scheduler (use v1)"
        if request.params.beam_width > self.config.max_num_seqs:
            return (f"use_beam_search: n (the beam width, {request.params.beam_width}) must be at most "
                    f"--max-num-seqs ({self.config.max_num_seqs}): every beam is a row of the batch")
        return beam_conflict(request.params, self.config.max_logprobs, len(stop_ids(request)))

    def num_rows(self) -> int:
        """Rows the running requests decode per step (a beam group: its width)."""
        extra = sum(g.width - 1 for g in self.beams.values() if g.parent.status is Status.RUNNING)
        return len(self.running) + extra

    def max_blocks_needed(self, request: Request) -> int:
        """Blocks a request may hold at its largest: KV exists for every
        token but the last sampled one."""
        n = min(request.num_prompt_tokens + request.params.max_tokens, request.max_model_len) - 1
        w, bs = request.params.beam_width, self.kv.block_size
        if w:  # the prompt's blocks once, then each beam's own (from the prompt's last, partial block on)
            return cdiv(request.num_prompt_tokens, bs) + w * (cdiv(max(n - request.num_prompt_tokens, 0), bs) + 1)
        return cdiv(max(n, request.num_prompt_tokens), bs)

    def never_fits(self, request: Request) -> str | None:
        """An error message when ``request`` can never complete here."""
        need = self.max_blocks_needed(request)
        if need > self.kv.num_blocks:
            return (
                f"request needs up to {need} KV blocks (prompt {request.num_prompt_tokens} + max_tokens "
                f"{request.params.max_tokens} tokens) but the whole pool has {self.kv.num_blocks}; "
                "lower max_tokens or raise --num-kv-blocks"
            )
        if not self.config.enable_chunked_prefill and request.num_prompt_tokens > self.config.max_num_batched_tokens:
            return (
                f"prompt ({request.num_prompt_tokens} tokens) exceeds --max-num-batched-tokens "
                f"({self.config.max_num_batched_tokens}) and chunked prefill is disabled"
            )
        return None

    def _fail(self, request: Request, error: str, code: int) -> None:
        """End ``request`` with an error; it is reported in the next batch."""
        self.kv.free(request)
        group = self.beams.pop(request.request_id, None)
        if group is not None:
            group.release(self.kv)
        request.fail(error, code)
        self._failed.append(request)
        self.num_failed += 1

    def _take_failed(self, batch: ScheduledBatch) -> None:
        for r in self._failed:
            self.requests.pop(r.request_id, None)
        batch.failed.extend(self._failed)
        self._failed.clear()

    def get(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def request_ids(self) -> list[str]:
        return list(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self._failed) + len(self.compiling)

    def live_requests(self) -> list[Request]:
        return [*self.running, *self.waiting]

    # ------------------------------------------------------------------
    # removal
    # ------------------------------------------------------------------

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        ids = {i for i in request_ids if i in self.requests}
        if not ids:
            return []
        removed: list[Request] = []
        keep_running: list[Request] = []
        for r in self.running:
            (removed if r.request_id in ids else keep_running).append(r)
        self.running = keep_running
        keep_waiting: collections.deque[Request] = collections.deque()
        for r in self.waiting:
            (removed if r.request_id in ids else keep_waiting).append(r)
        self.waiting = keep_waiting
        keep_failed: list[Request] = []
        for r in self._failed:
            (removed if r.request_id in ids else keep_failed).append(r)
        self._failed = keep_failed
        keep_compiling: list[Request] = []
        for r in self.compiling:
            (removed if r.request_id in ids else keep_compiling).append(r)
        self.compiling = keep_compiling
        for r in removed:
            self.kv.free(r)
            self.requests.pop(r.request_id, None)
            self._on_removed(r)
        return removed

    def preempt_all(self) -> list[Request]:
        return self.abort(list(self.requests))

    def _on_removed(self, request: Request) -> None:
        """Hook for subclasses (v0 drops chunk plans); a beam group frees its beams."""
        self._spec_hist.pop(request.request_id, None)
        group = self.beams.pop(request.request_id, None)
        if group is not None:
            group.release(self.kv)

    # ------------------------------------------------------------------
    # speculative decoding
    # ------------------------------------------------------------------

    def drafts_for(self, req: Request, budget: int) -> list[int]:
        """Draft tokens to verify with ``req``'s next decode step (none
        unless a speculator is set, ``req`` decodes -- one uncomputed token
        -- and speculation is exact for it).  At most
        ``--num-speculative-tokens``, ``budget - 1``, and what
        ``max_tokens`` / ``max_model_len`` leave after the bonus token."""
        sp = self.speculator
        if sp is None or budget < 2 or req.num_tokens - req.num_computed_tokens != 1 or not speculation_is_exact(req):
            return []
        k = min(self.config.num_speculative_tokens, budget - 1, req.params.max_tokens - req.num_output_tokens - 1,
                req.max_model_len - req.num_tokens)
        if k <= 0:
            return []
        buf, n = self._spec_hist.get(req.request_id, (None, 0))
        if buf is None or len(buf) < req.num_tokens:  # the request's tokens, copied once each
            old = buf
            buf = np.empty(max(2 * req.num_tokens, 64), dtype=np.int64)
            if old is not None:
                buf[:n] = old[:n]
        np_ = req.num_prompt_tokens
        if n < np_:
            buf[n:np_] = req.prompt_token_ids[n:]
            n = np_
        if n < req.num_tokens:
            buf[n : req.num_tokens] = req.output_token_ids[n - np_ :]
            n = req.num_tokens
        self._spec_hist[req.request_id] = (buf, n)
        drafts = sp.propose(buf[:n], k)
        return [int(t) for t in drafts[:k]]

    def _accept(self, req: Request, k: int, toks: list[int]) -> str | None:
        """Apply a verified speculative step: ``toks`` are the accepted
        drafts then the bonus token; the last token and the accepted drafts
        now have KV.  Stop conditions run token by token (nothing after a
        stop is appended); the blocks of rejected positions are released."""
        a = len(toks) - 1
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += k
        self.spec_num_accepted += a
        for j in range(min(a, len(self.spec_accepted_per_pos))):
            self.spec_accepted_per_pos[j] += 1
        reason = None
        for t in toks:
            self.num_generated_tokens += 1
            reason = req.append_token(int(t), None)
            if reason is not None:
                break
        # KV is there for every token but the last appended (the bonus, or the stop): when a stop ended the
        # step early, the positions after it are not the request's, so they never count as computed
        req.num_computed_tokens = req.num_tokens - 1
        self.kv.trim(req)
        return reason

    def spec_decode_stats(self) -> SpecDecodeStats | None:
        if self.speculator is None:
            return None
        return SpecDecodeStats(self.spec_num_drafts, self.spec_num_draft_tokens, self.spec_num_accepted,
                               tuple(self.spec_accepted_per_pos))

    # ------------------------------------------------------------------
    # update
    # ------------------------------------------------------------------

    def update(self, batch: ScheduledBatch, output: ModelOutput) -> None:
        finished: list[Request] = []
        token_ids = output.token_ids.tolist() if hasattr(output.token_ids, "tolist") else list(output.token_ids)
        logprobs = output.logprobs
        spec = output.spec_token_ids or {}
        kv = self.kv
        beams = self.beams
        beam_rows: dict[str, list[TokenLogprob | None]] = {}
        for i, seq in enumerate(batch.seqs):
            req = seq.request
            if req.status is not Status.RUNNING:  # removed between schedule and update
                continue
            tok = token_ids[i]
            if beams and req.request_id in beams:  # a beam row: the group picks its tokens after the loop
                req.num_computed_tokens += seq.num_new_tokens
                kv.commit(req)
                if tok >= 0:
                    beam_rows.setdefault(req.request_id, []).append(logprobs[i] if logprobs is not None else None)
                continue
            reason = None
            if seq.draft_token_ids and tok >= 0:  # verified drafts (none accepted when the runner did not say)
                reason = self._accept(req, len(seq.draft_token_ids), spec.get(i) or [int(tok)])
                kv.commit(req)
                if reason is not None:
                    finished.append(req)
                continue
            req.num_computed_tokens += seq.num_new_tokens
            if tok >= 0:
                self.num_generated_tokens += 1
                reason = req.append_token(int(tok), logprobs[i] if logprobs is not None else None)
            kv.commit(req)
            if reason is not None:
                finished.append(req)
        for rid, lps in beam_rows.items():
            group = beams[rid]
            self.num_generated_tokens += len(lps)
            if len(lps) != len(group.rows) or any(lp is None or len(lp.top) < group.keep for lp in lps):
                self.running = [r for r in self.running if r is not group.parent]
                self._fail(group.parent, "beam search: the model runner did not return the top logprobs", 500)
            else:
                try:
                    if group.advance(kv, [lp for lp in lps if lp is not None]):
                        finished.append(self._finish_beams(group, batch))
                except OutOfBlocks:
                    self.restart_beams(group)
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
            for req in finished:
                req.status = Status.FINISHED
                kv.free(req)
                self.requests.pop(req.request_id, None)
                self._on_removed(req)
            self.num_finished += len(finished)

    def restart_beams(self, group: BeamGroup) -> None:
        """Start ``group`` again from its prompt (front of the queue), its blocks freed."""
        parent = group.parent
        group.reset(self.kv)
        self.kv.free(parent)
        self.running = [r for r in self.running if r is not parent]
        parent.status = Status.PREEMPTED
        parent.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(parent)

    def _finish_beams(self, group: BeamGroup, batch: ScheduledBatch) -> Request:
        """The parent of a finished search, with its result; sent through
        ``batch.emitted`` unless it ran this step (its prompt's step)."""
        parent = group.parent
        self.beams.pop(parent.request_id, None)
        best = group.finished[0] if group.finished else None
        parent.beams = tuple(group.finished)
        parent.output_token_ids = list(best.token_ids) if best else []
        parent.pending_token_ids = list(parent.output_token_ids)  # the best beam, for readers of new_token_ids
        parent.finish_reason = best.finish_reason if best else "length"
        if not any(s.request is parent for s in batch.seqs):
            batch.emitted.append(parent)
        return parent

    def _record(self, batch: ScheduledBatch) -> None:
        n = batch.num_tokens
        self.last_step_tokens = n
        self.num_scheduled_tokens += n

    def stats(self) -> dict[str, int]:
        return {
            "num_preemptions": self.num_preemptions,
            "num_failed": self.num_failed,
            "num_finished": self.num_finished,
            "num_admitted": self.num_admitted,
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "num_scheduled_tokens": self.num_scheduled_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "last_step_tokens": self.last_step_tokens,
            "kv_blocks_used": self.kv.num_used_blocks,
            "kv_blocks_free": self.kv.num_free_blocks,
            "kv_blocks_cached": self.kv.num_cached_blocks,
        }

    def check_invariants(self) -> None:
        """Scheduler + block accounting consistency (tests call it each step)."""
        live = self.live_requests()
        ids = [r.request_id for r in live] + [r.request_id for r in self._failed]
        assert len(ids) == len(set(ids)), "a request is queued twice"
        assert set(ids) == set(self.requests), "request table out of sync"
        assert self.num_rows() <= self.config.max_num_seqs
        for r in self.running:
            assert r.status is Status.RUNNING
        for r in self.waiting:
            assert r.status in (Status.WAITING, Status.PREEMPTED)
            assert not r.block_ids and r.num_computed_tokens == 0, f"waiting {r.request_id} holds blocks"
        for r in self._failed:
            assert not r.block_ids
        from fdx.testing import check_kv_invariants

        rows = [b.seq for g in self.beams.values() for b in g.live]
        check_kv_invariants(self.kv, live + rows)
