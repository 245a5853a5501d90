"""Beam search inside the scheduler (``SamplingParams.beam_width > 0``).

A beam-search request is one :class:`BeamGroup`: the request the engine
knows (the *parent*: in ``running``/``waiting``, in ``requests`` by id)
and, once its prompt is prefilled, up to ``width`` live beams.  Each beam is
a :class:`~fdx.core.request.Request` of its own (its block table, tokens and
sampler state) carrying the parent's id, so the runner, failure isolation
and abort treat it like any row; only the scheduler knows it is a beam.

Per step (the group is one unit of the normal continuous batch):

* prefill: the parent's prompt runs like any prompt (chunked, prefix cache);
  the step that completes it samples the first candidates;
* decode: every live beam is one row of the batch (all or none: a group is
  skipped in a step whose token budget has no room for all its rows);
* the runner returns each row's top ``keep`` logprobs (raw log-softmax, the
  sampler's ``logprobs``); :meth:`BeamGroup.advance` picks the candidates,
  forks the beams' KV (:meth:`KVCacheManager.fork
  <fdx.core.kv_cache.KVCacheManager.fork>`: full blocks shared by
  reference count, the partial last block copied by the runner before the
  next forward, ``ScheduledBatch.block_copies``) and frees dropped beams.

The selection is Hugging Face transformers' (``generate(num_beams=W,
do_sample=False)``, 5.x): ``keep = max(2, 1 + #stop ids) * W`` candidates
by summed logprob; the best ``W`` that do not stop continue; a candidate
among the best ``W`` that ends on a stop id (or reaches ``max_tokens``) is
a finished hypothesis scored ``sum_logprobs / generated_len **
length_penalty`` (``generated_len`` counts the stop token); the best ``W``
hypotheses are kept.  ``early_stopping``: ``"true"`` ends the search when
``W`` hypotheses are finished; ``"false"`` (the default) also ends it when
the best running beam, scored at its current length, cannot beat the worst
finished one; ``"never"`` scores it at ``max_tokens`` when
``length_penalty > 0`` (the exact bound).  The result is the ``W`` best
hypotheses, best first (:attr:`Request.beams`).

Preemption restarts a group: its beams are freed and the parent goes back
to the waiting queue with its prompt (beam search is deterministic, so the
restart finds the same beams; nothing was streamed yet).  So does a step
whose forks find no free block (:class:`OutOfBlocks`; v1 keeps
``width - 1`` blocks free when it schedules a group, so only requests
admitted later in the same step can take them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from fdx.core.messages import BeamSequence, SamplingParams, TokenLogprob
from fdx.core.request import Request, Status

if TYPE_CHECKING:
    from fdx.core.kv_cache import KVCacheManager

#: temperatures below this are greedy (the sampler's ``GREEDY_EPS``)
GREEDY_EPS = 1e-5


def beam_conflict(p: SamplingParams, max_logprobs: int, num_stop_ids: int) -> str | None:
    """Why ``p`` (``beam_width > 0``) cannot be served by beam search, naming
    the field, or ``None``.  Beam search here is deterministic over the raw
    log-softmax: no sampling, penalties, biases, grammars, logprobs or stop
    strings."""
    conflicts = (
        ("temperature", p.temperature >= GREEDY_EPS, "must be 0 (beam search does not sample)"),
        ("top_p", p.top_p != 1.0, "must be 1"),
        ("top_k", p.top_k > 0, "must be 0 or -1"),
        ("min_p", p.min_p != 0.0, "must be 0"),
        ("presence_penalty", p.presence_penalty != 0.0, "must be 0"),
        ("frequency_penalty", p.frequency_penalty != 0.0, "must be 0"),
        ("repetition_penalty", p.repetition_penalty != 1.0, "must be 1"),
        ("min_tokens", p.min_tokens != 0, "must be 0"),
        ("logprobs", p.logprobs is not None, "is not supported"),
        ("prompt_logprobs", p.prompt_logprobs is not None, "is not supported"),
        ("logit_bias", bool(p.logit_bias), "is not supported"),
        ("stop", bool(p.stop), "(stop strings) is not supported; stop_token_ids are"),
        ("structured outputs", p.structured is not None, "are not supported"),
    )
    for name, bad, why in conflicts:
        if bad:
            return f"use_beam_search: {name} {why} with beam search"
    keep = p.beam_candidates(p.beam_width, num_stop_ids)
    if keep > max_logprobs:
        mult = keep // p.beam_width
        return (f"use_beam_search: n (the beam width, {p.beam_width}) must be at most {max_logprobs // mult} "
                f"(each step reads {mult} x n top logprobs per beam; --max-logprobs is {max_logprobs})")
    return None


def stop_ids(req: Request) -> frozenset[int]:
    p = req.params
    return (frozenset() if p.ignore_eos else req.eos_token_ids) | frozenset(p.stop_token_ids)


class OutOfBlocks(Exception):
    """No free block for a fork's partial last block: the group restarts."""


@attrs.define(eq=False)
class Beam:
    """A live beam: ``seq`` holds its tokens and KV; ``cum`` is its summed logprob."""

    seq: Request
    cum: float


@attrs.define(eq=False)
class BeamGroup:
    """One beam-search request: the parent, its live beams, its finished hypotheses."""

    parent: Request
    width: int
    #: the rows' params: greedy, ``keep`` logprobs
    row_params: SamplingParams
    keep: int
    stops: frozenset[int]
    live: list[Beam] = attrs.field(factory=list)
    finished: list[BeamSequence] = attrs.field(factory=list)  # best first, at most width
    #: HF's ``is_early_stop_heuristic_unsatisfied``: a running beam may still beat a finished one
    improvable: bool = True
    #: partial blocks to copy before the next forward
    copies: list[tuple[int, int]] = attrs.field(factory=list)

    @classmethod
    def of(cls, parent: Request) -> BeamGroup:
        """The group of a queued beam-search request; its params become the
        rows' (greedy, ``keep`` logprobs): the prompt's step samples the
        first candidates."""
        stops = stop_ids(parent)
        width = parent.params.beam_width
        keep = parent.params.beam_candidates(width, len(stops))
        parent.params = attrs.evolve(parent.params, temperature=0.0, logprobs=keep, n=1)
        return cls(parent, width, parent.params, keep, stops)

    @property
    def rows(self) -> list[Request]:
        """The requests holding this group's KV (the parent until its first candidates)."""
        return [b.seq for b in self.live] if self.live else [self.parent]

    def max_new(self) -> int:
        p = self.parent
        return min(p.params.max_tokens, p.max_model_len - p.num_prompt_tokens)

    def release(self, kv: KVCacheManager) -> None:
        """Free every beam's blocks (finish, abort, preemption) and forget
        the copies not run yet (their blocks are gone)."""
        for b in self.live:
            kv.free(b.seq)
            b.seq.status = Status.FINISHED
        self.live.clear()
        self.copies.clear()

    def reset(self, kv: KVCacheManager) -> None:
        """Back to the start (preemption): no beams, no hypotheses."""
        self.release(kv)
        self.finished.clear()
        self.improvable = True

    def take_copies(self) -> list[tuple[int, int]]:
        c, self.copies = self.copies, []
        return c

    # ------------------------------------------------------------------ one step

    def advance(self, kv: KVCacheManager, logprobs: list[TokenLogprob]) -> bool:
        """Apply a step's top logprobs (one per row of :attr:`rows`, in
        order, each with at least ``keep`` alternatives).  Returns True when
        the search is over: :attr:`finished` holds the result and the
        beams are freed."""
        p = self.parent.params
        sources = self.live or [Beam(self.parent, 0.0)]
        gen_len = len(sources[0].seq.output_token_ids) + 1  # the candidates' generated length
        cands: list[tuple[float, int, int]] = []
        for bi, (beam, lp) in enumerate(zip(sources, logprobs)):
            cands.extend((beam.cum + float(v), bi, int(t)) for t, v in lp.top[: self.keep])
        cands.sort(key=lambda c: -c[0])  # stable: ties keep beam, then rank order
        cands = cands[: self.keep]
        at_max = gen_len >= self.max_new()
        ends = [at_max or t in self.stops for _, _, t in cands]
        # finished hypotheses come from the best `width` candidates only (HF's top_num_beam_mask)
        if self.improvable and not (p.early_stopping == "true" and len(self.finished) >= self.width):
            new = [self._hyp(sources[bi].seq, cum, t, gen_len)
                   for (cum, bi, t), end in zip(cands[: self.width], ends[: self.width]) if end]
            if new:
                self.finished = sorted(self.finished + new, key=lambda h: -h.score)[: self.width]
        self._fork(kv, sources, [c for c, end in zip(cands, ends) if not end][: self.width])
        if self.live and len(self.finished) >= self.width:
            hyp_len = self.max_new() if p.early_stopping == "never" and p.length_penalty > 0 else gen_len
            self.improvable = self.live[0].cum / hyp_len**p.length_penalty > self.finished[-1].score
        done = not self.live or not self.improvable or (p.early_stopping == "true"
                                                        and len(self.finished) >= self.width)
        if done:
            for b in self.live[: self.width - len(self.finished)]:  # a search cut short: live beams fill in
                self.finished.append(self._hyp(b.seq, b.cum, None, gen_len))
            self.release(kv)
        return done

    def _hyp(self, seq: Request, cum: float, tok: int | None, length: int) -> BeamSequence:
        toks = tuple(seq.output_token_ids) + (() if tok is None else (tok,))
        reason = "stop" if tok is not None and tok in self.stops else "length"
        return BeamSequence(toks, cum, cum / length**self.parent.params.length_penalty, reason)

    def _fork(self, kv: KVCacheManager, sources: list[Beam], nxt: list[tuple[float, int, int]]) -> None:
        """The next beams from their sources.  A source's first continuation
        takes over its KV and tokens (a beam in place; the parent's prompt
        blocks move to a new row), every other one forks it first (full
        blocks shared, the partial one copied); sources without a
        continuation are freed."""
        firsts: set[int] = set()
        plan = []
        for cum, bi, t in nxt:
            plan.append((cum, bi, t, bi not in firsts))
            firsts.add(bi)
        for bi, b in enumerate(sources):
            if bi not in firsts and b.seq is not self.parent:
                kv.free(b.seq)
                b.seq.status = Status.FINISHED
        bs = kv.block_size
        need = sum(1 for _, bi, _, first in plan if not first and sources[bi].seq.num_computed_tokens % bs)
        if need > kv.num_free_blocks:
            raise OutOfBlocks(f"{need} blocks to fork beams, {kv.num_free_blocks} free")
        live: list[Beam | None] = [None] * len(plan)
        for i, (cum, bi, t, first) in enumerate(plan):
            if not first:
                src = sources[bi].seq
                child = self._row(src)
                dst = kv.fork(src, child)
                if dst is not None:
                    self.copies.append((src.block_ids[len(child.block_ids) - 1], dst))
                child.output_token_ids.append(t)
                live[i] = Beam(child, cum)
        for i, (cum, bi, t, first) in enumerate(plan):
            if first:
                seq = sources[bi].seq
                if seq is self.parent:
                    seq = self._row(self.parent)
                    seq.block_ids, self.parent.block_ids = self.parent.block_ids, []
                    seq.block_hashes = list(self.parent.block_hashes)
                    seq.num_computed_tokens = self.parent.num_computed_tokens
                seq.output_token_ids.append(t)
                live[i] = Beam(seq, cum)
        kv.free(self.parent)  # the prompt's blocks belong to the beams now (or to nobody)
        self.live = [b for b in live if b is not None]

    def _row(self, src: Request) -> Request:
        """A new beam row with ``src``'s tokens and no blocks."""
        p = self.parent
        row = Request(p.request_id, p.prompt_token_ids, self.row_params, p.eos_token_ids, p.max_model_len,
                      p.arrival_time)
        row.output_token_ids = list(src.output_token_ids)
        row.status = Status.RUNNING
        row.first_scheduled_time = p.first_scheduled_time
        return row
