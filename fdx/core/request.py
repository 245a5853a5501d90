"""Runtime state of one request inside the engine (mutable, never sent)."""

from __future__ import annotations

import enum
import time
from typing import Any

import attrs

from fdx.core.messages import SamplingParams, TokenLogprob


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
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    queue_time_sent: bool = False
    # tokens produced since the last RequestOutput was emitted
    pending_token_ids: list[int] = attrs.field(factory=list)
    pending_logprobs: list[TokenLogprob] = attrs.field(factory=list)
    # per-request sampler state (seeded generator), owned by the model runner
    sampler_state: Any = None
    # scheduler-private scratch (e.g. v0's chunk plan)
    extra: dict[str, Any] = attrs.field(factory=dict)

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

    def take_pending(self) -> tuple[tuple[int, ...], tuple[TokenLogprob, ...] | None]:
        toks = tuple(self.pending_token_ids)
        lps = tuple(self.pending_logprobs) if self.params.logprobs is not None else None
        self.pending_token_ids.clear()
        self.pending_logprobs.clear()
        return toks, lps
