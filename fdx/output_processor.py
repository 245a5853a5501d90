"""The one output path shared by both front ends (``fdx.LLM`` and the HTTP server).

An :class:`OutputProcessor` turns the engine's
:class:`~fdx.core.messages.RequestOutput` messages into typed
:class:`OutputEvent` values, one per output of one choice, through the token
processor plugin chosen by name (``--token-processor``): incremental
detokenization, stop strings, logprobs (prompt logprobs kept on the choice)
passed through, finish reasons, token counts for usage.  The offline API folds the events into results; the
server formats them as SSE chunks or folds them into one JSON body.  The
design follows vLLM's ``v1/engine/output_processor.py``: one processor, two
front ends, so they cannot disagree on text, logprobs or finish reasons.

Invariants:

* a choice yields events until exactly one of them has ``finish_reason``
  set (``stop``, ``length``, ``abort`` or ``error``); after that
  :meth:`OutputProcessor.process` returns ``None`` for it;
* an event with ``abort_in_engine`` ended a choice that the engine still
  runs (a stop string matched, or the token processor failed): the caller
  must abort that engine request at once, so its KV blocks are freed;
* a token processor that raises for one request ends only that request,
  with ``finish_reason == "error"`` and a :class:`RequestFailure` whose
  message names no Python exception or path (the traceback is logged).

Cost per output: one ``TokenStream.feed`` call and one small frozen object;
no plugin dispatch.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterable, Sequence

import attrs

from fdx.core.errors import RequestError

if TYPE_CHECKING:
    from fdx.core.interfaces import TokenProcessor, TokenStream
    from fdx.core.messages import RequestOutput, SamplingParams, TokenLogprob

log = logging.getLogger("fdx.outputs")

#: message of a request whose token processor failed while detokenizing
DETOKENIZE_FAILED = "the token processor failed while detokenizing this request's output"
#: message of a request whose token processor failed to open its stream
OPEN_FAILED = "the token processor failed to start this request"


@attrs.frozen(slots=True)
class RequestFailure:
    """Why a choice ended with ``finish_reason == "error"``; ``code`` is an HTTP status."""

    message: str
    code: int = 500


@attrs.frozen(slots=True)
class OutputEvent:
    """What one engine output meant for one choice.

    ``text`` is the text that became final (stop strings cut, a partial
    UTF-8 character held back), ``token_ids`` and ``logprobs`` the engine's
    new tokens (the terminating stop token id included, as the engine sent
    it).  ``finish_reason`` is set on the choice's last event only.
    """

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    failure: RequestFailure | None = None
    abort_in_engine: bool = False


@attrs.define(eq=False, slots=True)
class ChoiceState:
    """One engine request (one choice of one prompt) in a front end."""

    request_id: str
    index: int
    prompt_index: int
    num_prompt_tokens: int
    stream: TokenStream
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    failure: RequestFailure | None = None
    #: logprobs of prompt tokens 1.. when the request asked for them (with its first output)
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@attrs.frozen
class Usage:
    """Token counts of a group of choices (OpenAI ``usage``)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @classmethod
    def of(cls, choices: Iterable[ChoiceState]) -> Usage:
        """Prompt and cached tokens count once per prompt (its first choice);
        completion tokens once per choice."""
        prompt = cached = completion = 0
        seen: set[int] = set()
        for c in choices:
            completion += c.num_output_tokens
            if c.prompt_index not in seen:
                seen.add(c.prompt_index)
                prompt += c.num_prompt_tokens
                cached += c.num_cached_tokens
        return cls(prompt, completion, cached)


def choice_params(params: SamplingParams, j: int) -> SamplingParams:
    """The engine params of choice ``j`` of a request asking for
    ``params.n`` choices: one sequence each, seed ``seed + j`` (so seeded
    choices differ from each other and are reproducible), as in vLLM."""
    if params.n == 1 and j == 0:
        return params
    seed = None if params.seed is None else params.seed + j
    return attrs.evolve(params, n=1, seed=seed)


class OutputProcessor:
    """Engine outputs -> :class:`OutputEvent`, through one token processor."""

    def __init__(self, token_processor: TokenProcessor) -> None:
        self.token_processor = token_processor

    def open(
        self,
        request_id: str,
        index: int,
        prompt_index: int,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
    ) -> ChoiceState:
        """Start one choice.  Raises :class:`RequestError` (500) when the
        token processor cannot open its stream; nothing is then submitted."""
        try:
            stream = self.token_processor.open_stream(prompt_token_ids, params)
        except Exception:  # noqa: BLE001 - a plugin bug fails this request only
            log.exception("token processor failed to open a stream for request %s", request_id)
            raise RequestError(OPEN_FAILED, 500) from None
        return ChoiceState(request_id, index, prompt_index, len(prompt_token_ids), stream)

    def process(self, state: ChoiceState, out: RequestOutput) -> OutputEvent | None:
        """Apply one engine output to its choice; ``None`` when the choice
        had already ended (a stale output after a stop string)."""
        if state.finish_reason is not None:
            return None
        if out.num_output_tokens > state.num_output_tokens:
            state.num_output_tokens = out.num_output_tokens
        if out.num_cached_tokens > state.num_cached_tokens:
            state.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            state.prompt_logprobs = out.prompt_logprobs
        reason = out.finish_reason
        lps = out.logprobs or ()
        if reason == "error":
            return self._end(state, out, "", lps, RequestFailure(out.error or "request failed in the engine",
                                                                 out.error_code or 500), abort=False)
        finished = reason is not None
        try:
            delta = state.stream.feed(out.new_token_ids, finished)
        except Exception:  # noqa: BLE001 - a plugin bug fails this request only
            log.exception("token processor failed on request %s", state.request_id)
            return self._end(state, out, "", lps, RequestFailure(DETOKENIZE_FAILED, 500), abort=not finished)
        if delta.stopped:
            state.finish_reason = "stop"
            ids, kept = out.new_token_ids, delta.tokens
            if kept is not None and kept < len(ids):  # the tokens after the stop string's are not output
                state.num_output_tokens -= len(ids) - kept
                ids, lps = ids[:kept], lps[:kept]
            return OutputEvent(state.index, delta.text, ids, lps, "stop", None, not finished)
        state.finish_reason = reason
        return OutputEvent(state.index, delta.text, out.new_token_ids, lps, reason)

    def token_text(self, token_id: int) -> str:
        """Text of one token (special tokens included), for logprobs.
        Raises :class:`RequestError` (500) when the token processor fails."""
        try:
            return self.token_processor.token_text(token_id)
        except Exception:  # noqa: BLE001 - a plugin bug fails this request only
            log.exception("token processor failed on the text of token %d", token_id)
            raise RequestError(DETOKENIZE_FAILED, 500) from None

    @staticmethod
    def _end(state: ChoiceState, out: RequestOutput, text: str, lps: tuple[TokenLogprob, ...],
             failure: RequestFailure, abort: bool) -> OutputEvent:
        state.finish_reason = "error"
        state.failure = failure
        return OutputEvent(state.index, text, out.new_token_ids, lps, "error", failure, abort)
