"""Runtime state of one request inside the engine (mutable, never sent)."""

from __future__ import annotations

import enum
import math
import time
from typing import Any

import attrs

from fdx.core.grammar import GrammarMatcher
from fdx.core.messages import (ALL_LOGPROBS, MAX_ALL_LOGPROBS_PROMPT, AddRequest, BeamSequence, KVTransferParams,
                               SamplingParams, TokenLogprob)

INT64_MAX = 2**63 - 1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@attrs.define(eq=False)
class Request:
    """One sequence being generated.

    Token layout: ``all_token_ids = prompt_token_ids + output_token_ids``.
    ``num_computed_tokens`` of them have KV in ``block_ids`` (the request's
    block table, in order).  The model samples a new token whenever a step
    brings ``num_computed_tokens`` up to ``num_tokens``.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 2048
    arrival_time: float = attrs.field(factory=time.time)

    output_token_ids: list[int] = attrs.field(factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from a prefix cache (any tier)
    block_ids: list[int] = attrs.field(factory=list)
    block_hashes: list[int] = attrs.field(factory=list)  # prefix hash chain of full blocks
    status: Status = Status.WAITING
    finish_reason: str | None = None
    #: why the request failed (``finish_reason == "error"``) and the HTTP-like
    #: status of that failure (400: the request itself, 5xx: the engine)
    error: str | None = None
    error_code: int = 0
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    queue_time_sent: bool = False
    # tokens produced since the last RequestOutput was emitted
    pending_token_ids: list[int] = attrs.field(factory=list)
    pending_logprobs: list[TokenLogprob] = attrs.field(factory=list)
    # per-request sampler state (seeded generator), owned by the model runner
    sampler_state: Any = None
    #: where the output is in its grammar (``params.structured``), set by the engine
    grammar: GrammarMatcher | None = None
    #: the KV storage tier was already asked for this admission's prefix
    storage_probed: bool = False
    #: splitwise decode instance: the prefill instance computes the prompt
    kv_transfer: KVTransferParams | None = None
    #: ``AddRequest.trace_context`` (for plugins that record spans, e.g. splitwise)
    trace_context: str = ""
    #: logprobs of prompt tokens 1.. (``params.prompt_logprobs``), filled by the model runner, sent once
    prompt_logprobs: list[TokenLogprob] = attrs.field(factory=list)
    prompt_logprobs_sent: bool = False
    #: a beam-search request's best sequences, set by the scheduler when it finishes
    beams: tuple[BeamSequence, ...] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_token(self, token_id: int, logprob: TokenLogprob | None = None) -> str | None:
        """Record a sampled token; return the finish reason if it ends the
        request (``stop`` or ``length``), else ``None``."""
        self.output_token_ids.append(token_id)
        self.pending_token_ids.append(token_id)
        if logprob is not None:
            self.pending_logprobs.append(logprob)
        p = self.params
        n_out = len(self.output_token_ids)
        reason: str | None = None
        if n_out >= p.min_tokens:
            if (not p.ignore_eos and token_id in self.eos_token_ids) or token_id in p.stop_token_ids:
                reason = "stop"
        if reason is None and (n_out >= p.max_tokens or self.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            self.finish_reason = reason
        return reason

    def fail(self, error: str, code: int) -> None:
        """End the request with an error (the caller frees its blocks)."""
        self.status = Status.FINISHED
        self.finish_reason = "error"
        self.error = error
        self.error_code = code

    def take_prompt_logprobs(self) -> tuple[TokenLogprob, ...] | None:
        """The prompt logprobs once they are complete, the first time asked."""
        if (self.params.prompt_logprobs is None or self.prompt_logprobs_sent
                or len(self.prompt_logprobs) < self.num_prompt_tokens - 1):
            return None
        self.prompt_logprobs_sent = True
        return tuple(self.prompt_logprobs)

    def take_pending(self) -> tuple[tuple[int, ...], tuple[TokenLogprob, ...] | None]:
        toks = tuple(self.pending_token_ids)
        lps = tuple(self.pending_logprobs) if self.params.logprobs is not None else None
        self.pending_token_ids.clear()
        self.pending_logprobs.clear()
        return toks, lps


#: NaN-safe bounds of the float sampling params: ``lo <= x <= hi`` (``lo < x`` where ``open_lo``)
FLOAT_BOUNDS = {
    "temperature": (0.0, math.inf, False), "top_p": (0.0, 1.0, True), "min_p": (0.0, 1.0, False),
    "presence_penalty": (-math.inf, math.inf, True), "frequency_penalty": (-math.inf, math.inf, True),
    "repetition_penalty": (0.0, math.inf, True), "length_penalty": (-math.inf, math.inf, True),
}


def check_request(msg: AddRequest, max_model_len: int, vocab_size: int, max_logprobs: int) -> str | None:
    """Why the engine cannot run ``msg`` (a message naming the field), or
    ``None``.  These are the bounds of what the sampler and the model can
    take; the API edge is stricter (OpenAI ranges), but clients that bypass
    it (``fdx.LLM``, the IPC) meet these.  Every float is finite.  Seeds are
    refused when negative (not wrapped): a seed is ``None`` or an integer in
    ``[0, 2**64)``.  A ``top_k`` at or above the vocabulary disables top-k."""
    p, ids = msg.params, msg.prompt_token_ids
    if not ids:
        return "prompt is empty"
    if not 0 <= min(ids) <= max(ids) < vocab_size:
        return f"prompt token ids must be in [0, {vocab_size})"
    if p.max_tokens < 1:
        return f"max_tokens must be >= 1, got {p.max_tokens}"
    if len(ids) + p.max_tokens > max_model_len:
        return f"prompt ({len(ids)} tokens) + max_tokens ({p.max_tokens}) exceeds max_model_len ({max_model_len})"
    if not 0 <= p.min_tokens <= p.max_tokens:
        return f"min_tokens must be in [0, max_tokens={p.max_tokens}], got {p.min_tokens}"
    for name, (lo, hi, open_lo) in FLOAT_BOUNDS.items():
        x = getattr(p, name)
        if not (lo < x if open_lo else lo <= x) or not x <= hi or math.isinf(x):
            return f"{name} must be a finite number in {'(' if open_lo else '['}{lo}, {hi}], got {x}"
    checks = (
        ("top_k", -1 <= p.top_k <= INT64_MAX, "-1 or 0 (disabled) or a positive 64-bit integer"),
        ("seed", p.seed is None or 0 <= p.seed < 2**64, "an integer in [0, 2**64)"),
        ("logprobs", p.logprobs is None or 0 <= p.logprobs <= max_logprobs, f"in [0, {max_logprobs}]"),
        ("prompt_logprobs", p.prompt_logprobs is None or 0 <= p.prompt_logprobs <= max_logprobs
         or (p.prompt_logprobs == ALL_LOGPROBS and len(ids) <= MAX_ALL_LOGPROBS_PROMPT),
         f"in [0, {max_logprobs}], or -1 (the whole vocabulary) for a prompt of at most "
         f"{MAX_ALL_LOGPROBS_PROMPT} tokens"),
        ("stop_token_ids", all(0 <= t < vocab_size for t in p.stop_token_ids), f"token ids in [0, {vocab_size})"),
        ("logit_bias", all(0 <= t < vocab_size and abs(b) <= 100 for t, b in p.logit_bias), "ids < vocab, |bias|<=100"),
        ("beam_width", 0 <= p.beam_width <= 128, "in [0, 128] (0: no beam search)"),
        ("early_stopping", p.early_stopping in ("true", "false", "never"), '"true", "false" or "never"'),
    )
    for name, ok, what in checks:
        if not ok:
            return f"{name} must be {what}, got {getattr(p, name)}"
    return None
