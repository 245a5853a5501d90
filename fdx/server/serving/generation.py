"""One HTTP request's generation, shared by both endpoints.

:class:`Generation` submits a request's ``len(prompts) * n`` engine
requests (choice ``j`` of prompt ``p`` has index ``p * n + j`` and seed
``seed + j``; a beam search: one engine request per prompt, whose ``n``
beams are its choices, :mod:`fdx.beam_search`), all feeding one sink queue, and turns what arrives into
batches of :class:`~fdx.output_processor.OutputEvent` through the shared
:class:`~fdx.output_processor.OutputProcessor` (the same one ``fdx.LLM``
uses).  :func:`respond` builds the reply from that one event stream: SSE
chunks as the events come, or, for a non-streaming request, the same events
collected into one JSON body, so the two cannot drift apart.  An
:class:`Endpoint` says how each endpoint renders a choice.

Invariants: every engine request submitted is finished, aborted or failed
before the handler returns or the stream closes (no leaked KV blocks); a
choice the front end ends itself (a stop string, a token-processor failure)
is aborted in the engine at once; one failed choice fails its HTTP request
only (a 5xx envelope, or an error event in a stream), never another one.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Protocol, Sequence

import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fdx.beam_search import BeamChoices, beam_events
from fdx.core.errors import RequestError
from fdx.core.messages import ALL_LOGPROBS, KVTransferParams, RequestOutput, SamplingParams, TokenLogprob
from fdx.deploy.frontend import Sink
from fdx.output_processor import ChoiceState, OutputEvent, OutputProcessor, Usage, choice_params
from fdx.server.protocol import error_body
from fdx.server.sse import EventStreamResponse

if TYPE_CHECKING:
    from fdx.config import EngineConfig
    from fdx.deploy.frontend import EngineFrontend, RequestHandle
    from fdx.tracing import RequestTrace


#: a str as JSON text, non-ASCII kept (``json.dumps(s, ensure_ascii=False)``; the C encoder's)
json_string = json.encoder.encode_basestring


def json_logprob(v: float) -> float:
    """A JSON-safe logprob (-inf, as from a masked token, becomes -9999.0 as in vLLM)."""
    return v if math.isfinite(v) else -9999.0


class ClientGone(Exception):
    """Put on a sink when the client of a non-streaming request disconnects."""


class TimedOut(Exception):
    """Put on a sink when a non-streaming request runs past ``request_timeout``."""


@attrs.define
class Prompt:
    """One prompt of a request: its token ids and, for echo, its text."""

    ids: list[int]
    text: str | None


@attrs.define
class ChoiceResult:
    """The events of one choice collected (a non-streaming reply)."""

    index: int
    prompt_index: int
    text: list[str] = attrs.field(factory=list)
    logprobs: list[TokenLogprob] = attrs.field(factory=list)
    token_ids: list[int] = attrs.field(factory=list)
    finish_reason: str | None = None

    def add(self, ev: OutputEvent) -> None:
        if ev.text:
            self.text.append(ev.text)
        self.logprobs.extend(ev.logprobs)
        self.token_ids.extend(ev.token_ids)
        if ev.finish_reason is not None:
            self.finish_reason = ev.finish_reason


class Endpoint(Protocol):
    """How one endpoint renders its choices (see ``completions``/``chat``)."""

    object_full: str  # "text_completion" / "chat.completion"
    object_chunk: str  # "text_completion" / "chat.completion.chunk"

    def head(self, gen: Generation) -> list[dict[str, Any]]:
        """Choices of the first SSE chunk (role, echo), possibly none."""

    def delta(self, gen: Generation, ev: OutputEvent) -> dict[str, Any] | None:
        """One SSE choice for one event, or ``None`` when it says nothing."""

    def text_only(self, gen: Generation) -> bool:
        """Whether every SSE choice of ``gen`` is just an event's text and
        finish reason (no logprobs, token ids, tool calls): then
        :meth:`text_choice` writes them, without a dict per token."""

    def text_choice(self, index: int, text: str, finish_reason: str | None) -> str | None:
        """The JSON of :meth:`delta`'s choice for a text-only event (the same
        text ``json.dumps(..., ensure_ascii=False)`` gives), or ``None``."""

    def full(self, gen: Generation, res: ChoiceResult) -> dict[str, Any]:
        """One choice of the non-streaming body."""

    def top_fields(self, gen: Generation, first_chunk: bool) -> dict[str, Any]:
        """Response-level fields beyond the standard ones (chat's
        ``prompt_token_ids`` / ``prompt_logprobs``): of the body, or
        (``first_chunk``) of the first SSE chunk."""


class Generation:
    """The engine requests of one HTTP request and their event stream."""

    def __init__(
        self,
        config: EngineConfig,
        client: EngineFrontend,
        outputs: OutputProcessor,
        request_id: str,
        prompts: list[Prompt],
        params: SamplingParams,
        model_name: str,
    ) -> None:
        self.config = config
        self.client = client
        self.outputs = outputs
        self.id = request_id
        self.prompts = prompts
        self.params = params
        self.model = model_name
        self.created = int(time.time())
        self.sink = Sink()
        self.states: list[ChoiceState] = []
        self.handles: list[RequestHandle] = []
        #: splitwise decode instance: the prefill instance computing the prompt (AddRequest.kv_transfer_params)
        self.kv_transfer: KVTransferParams | None = None
        #: vLLM's return_token_ids: prompt and completion token ids in the reply
        self.return_token_ids = False
        #: stream_options.include_usage + continuous_usage_stats: usage so far on every chunk
        self.continuous_usage = False
        #: vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
        self.tokens_as_ids = False
        #: completion tokens of each choice sent to the client so far (continuous usage stats)
        self.shown: list[int] = []
        #: the request's spans (``--otlp-traces-endpoint``; ``None``: not traced)
        self.trace: RequestTrace | None = None

    @property
    def want_logprobs(self) -> bool:
        return self.params.logprobs is not None

    def submit(self, arrival: float) -> None:
        """Open every choice and send it to the engine; on any failure the
        ones already sent are aborted and the error propagates."""
        n = self.params.n
        total = len(self.prompts) * n
        kv: dict[str, Any] = {"kv_transfer_params": self.kv_transfer} if self.kv_transfer is not None else {}
        if self.trace is not None:
            kv["trace_context"] = self.trace.context
        try:
            for p_idx, prompt in enumerate(self.prompts):
                if self.params.beam_width:  # one engine request, its n beams are the n choices
                    rid = self.id if len(self.prompts) == 1 else f"{self.id}-{p_idx}"
                    states = [self.outputs.open(rid, p_idx * n + j, p_idx, prompt.ids, self.params) for j in range(n)]
                    self.handles.append(self.client.submit(rid, prompt.ids, self.params, arrival, self.sink,
                                                           tag=BeamChoices(states), **kv))
                    self.states.extend(states)
                    continue
                for j in range(n):
                    idx = p_idx * n + j
                    sp = choice_params(self.params, j)
                    rid = self.id if total == 1 else f"{self.id}-{idx}"
                    state = self.outputs.open(rid, idx, p_idx, prompt.ids, sp)
                    self.handles.append(self.client.submit(rid, prompt.ids, sp, arrival, self.sink, tag=state, **kv))
                    self.states.append(state)
        except BaseException as exc:
            if self.trace is not None:
                self.trace.error = str(exc) or type(exc).__name__
            self.abort("request rejected")
            raise
        self.shown = [0] * len(self.states)  # one count per choice, beam choices included

    def abort(self, reason: str) -> None:
        """Abort every choice still running in the engine (every way out of
        a request ends here: its trace, if any, ends too)."""
        trace = self.trace
        if trace is not None and not trace.ended:
            if trace.error is None and any(not h.done for h in self.handles):
                trace.error = reason
            self.client.abort(self.handles, reason)
            u = self.usage()
            trace.end(self.handles, self.model, [s.finish_reason for s in self.states if s.finish_reason],
                      u.prompt_tokens, u.completion_tokens)
            return
        self.client.abort(self.handles, reason)

    def usage(self) -> Usage:
        return Usage.of(self.states)

    def usage_shown(self) -> Usage:
        """The usage of what the client was sent so far: the prompts, and
        the completion tokens of the events rendered (continuous usage stats
        count per chunk, not per engine batch)."""
        u = self.usage()
        return Usage(u.prompt_tokens, sum(self.shown), u.cached_tokens)

    async def events(self) -> AsyncIterator[list[OutputEvent]]:
        """Batches of events (everything that arrived together) until every
        choice ended.  Raises :class:`RequestError` when a choice failed or
        the request was cut short (client gone, timeout, engine down); the
        events before the failure in its batch are yielded first."""
        pending = len(self.states)
        sink = self.sink
        process = self.outputs.process if self.trace is None else self.trace.timed(self.outputs.process)
        while pending > 0:
            items = [await sink.get()]
            while not sink.empty():
                items.append(sink.get_nowait())
            batch: list[OutputEvent] = []
            error: RequestError | None = None
            for h, x in items:
                if not isinstance(x, RequestOutput):
                    error = self._cut_short(x)
                    break
                evs = beam_events(process, h.tag, x) if isinstance(h.tag, BeamChoices) else (process(h.tag, x),)
                for ev in evs:
                    if ev is None:
                        continue
                    if ev.failure is not None:
                        if ev.abort_in_engine:
                            self.client.abort([h], ev.failure.message)
                        error = RequestError(ev.failure.message, ev.failure.code)
                        break
                    if ev.abort_in_engine:  # a stop string: ends normally, the engine is told to stop
                        self.client.finish(h, "stop")
                    if ev.finish_reason is not None:
                        pending -= 1
                    batch.append(ev)
                if error is not None:
                    break
            if batch:
                yield batch
            if error is not None:
                if self.trace is not None:
                    self.trace.error = str(error)
                raise error

    def _cut_short(self, x: Any) -> RequestError:
        if isinstance(x, ClientGone):
            return RequestError("client disconnected", 499)
        if isinstance(x, TimedOut):
            return RequestError(f"request timed out after {self.config.request_timeout:g}s", 504)
        if isinstance(x, RequestError):
            return x
        return RequestError("internal error while generating", 500)

    # -- logprobs, both endpoints ----------------------------------------

    def token_text(self, token_id: int) -> str:
        """A token as logprobs name it: its text, or ``token_id:<id>``."""
        if self.tokens_as_ids:
            return f"token_id:{token_id}"
        return self.outputs.token_text(token_id)

    def prompt_logprobs(self, prompt_index: int) -> list[dict[str, Any] | None] | None:
        """vLLM's ``prompt_logprobs`` of one prompt (``None`` unless asked):
        ``None`` for the first token, then per token
        ``{token_id: {logprob, rank, decoded_token}}`` for the prompt token
        and the top alternatives."""
        k = self.params.prompt_logprobs
        if k is None:
            return None
        if k == ALL_LOGPROBS:
            k = None  # the whole vocabulary: every alternative the engine sent
        lps = next((s.prompt_logprobs for s in self.states
                    if s.prompt_index == prompt_index and s.prompt_logprobs is not None), None)
        if lps is None:
            return None
        tok = self.outputs.token_text  # decoded_token is always the text
        out: list[dict[str, Any] | None] = [None]
        for lp in lps:
            d = {str(lp.token_id): {"logprob": json_logprob(lp.logprob), "rank": lp.rank,
                                    "decoded_token": tok(lp.token_id)}}
            for rank, (tid, v) in enumerate(lp.top[:k], 1):
                d.setdefault(str(tid), {"logprob": json_logprob(v), "rank": rank, "decoded_token": tok(tid)})
            out.append(d)
        return out

    def echo_text(self, prompt_index: int) -> str:
        p = self.prompts[prompt_index]
        if p.text is None:
            p.text = self.outputs.token_processor.tokenizer.decode(p.ids, skip_special_tokens=False)
        return p.text


async def watch(request: Request, sink: Sink, timeout: float) -> None:
    """Put a sentinel on ``sink`` when the client disconnects or the request
    runs past ``timeout`` seconds (non-streaming requests)."""
    try:
        async with asyncio.timeout(timeout):
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    sink.put_nowait((None, ClientGone()))
                    return
    except TimeoutError:
        sink.put_nowait((None, TimedOut()))


def usage_body(u: Usage, details: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
    }
    if details:
        body["prompt_tokens_details"] = {"cached_tokens": u.cached_tokens}
    return body


async def respond(request: Request, gen: Generation, endpoint: Endpoint, stream: bool,
                  include_usage: bool) -> Response:
    """The reply of a submitted generation, streaming or not, from
    ``gen.events()``.  Every choice still running when this fails or the
    stream closes is aborted."""
    agen = gen.events()
    if not stream:
        watcher = asyncio.get_running_loop().create_task(watch(request, gen.sink, gen.config.request_timeout))
        try:
            results = [ChoiceResult(s.index, s.prompt_index) for s in gen.states]
            async for batch in agen:
                for ev in batch:
                    results[ev.index].add(ev)
        finally:
            watcher.cancel()
            gen.abort("request failed")
        return JSONResponse({
            "id": gen.id,
            "object": endpoint.object_full,
            "created": gen.created,
            "model": gen.model,
            "choices": [endpoint.full(gen, r) for r in results],
            "usage": usage_body(gen.usage()),
            "system_fingerprint": None,
            **endpoint.top_fields(gen, False),
        })
    first: list[OutputEvent] = []
    if not gen.params.beam_width:  # (a beam search's beams come at its end: the stream opens at once)
        try:
            first = await agen.__anext__()  # an error before any output -> a plain HTTP error
        except BaseException:
            gen.abort("request failed")
            raise
    return EventStreamResponse(_sse(gen, endpoint, agen, first, include_usage),
                               lambda: gen.abort("client disconnected"))


#: ``json.dumps(x, ensure_ascii=False)`` without building an encoder per call
_encode_json = json.JSONEncoder(ensure_ascii=False).encode


class _ChunkTemplate:
    """The constant bytes of a request's SSE chunks around its one choice
    (id, object, created, model; ``"usage": null``), encoded once: each
    chunk then encodes only its choice.  The bytes equal ``json.dumps`` of
    the whole chunk."""

    __slots__ = ("head", "tail")

    def __init__(self, gen: Generation, endpoint: Endpoint, include_usage: bool) -> None:
        d = json.dumps
        self.head = (f'data: {{"id": {d(gen.id, ensure_ascii=False)}, "object": {d(endpoint.object_chunk)}, '
                     f'"created": {gen.created}, "model": {d(gen.model, ensure_ascii=False)}, "choices": [').encode()
        self.tail = b'], "usage": null}\n\n' if include_usage else b"]}\n\n"

    def chunk(self, choice: dict[str, Any]) -> bytes:
        return self.wrap(_encode_json(choice))

    def wrap(self, choice_json: str) -> bytes:
        """The chunk of a choice already written as JSON text."""
        return self.head + choice_json.encode() + self.tail


def _chunk(gen: Generation, endpoint: Endpoint, choices: list[dict[str, Any]], include_usage: bool,
           top: dict[str, Any] | None = None) -> bytes:
    body = {
        "id": gen.id,
        "object": endpoint.object_chunk,
        "created": gen.created,
        "model": gen.model,
        "choices": choices,
    }
    if top:
        body.update(top)
    if gen.continuous_usage:  # vLLM: the usage so far on every chunk
        body["usage"] = usage_body(gen.usage_shown(), details=False)
    elif include_usage:
        body["usage"] = None
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"


async def _sse(gen: Generation, endpoint: Endpoint, agen: AsyncIterator[list[OutputEvent]],
               first: list[OutputEvent], include_usage: bool) -> AsyncIterator[bytes]:
    try:
        head = endpoint.head(gen)
        top: dict[str, Any] | None = endpoint.top_fields(gen, True)
        if head:
            yield _chunk(gen, endpoint, head, include_usage, top)
            top = None
        batch: Sequence[OutputEvent] | None = first
        tpl = None if gen.continuous_usage else _ChunkTemplate(gen, endpoint, include_usage)
        text_only, text_choice = tpl is not None and endpoint.text_only(gen), endpoint.text_choice
        try:
            while batch is not None:
                # one chunk per choice event keeps clients that read choices[0] correct
                out = []
                for ev in batch:
                    gen.shown[ev.index] += len(ev.token_ids)
                    if text_only and not top:  # the usual chunk: no dict built, no JSON encoder run
                        j = text_choice(ev.index, ev.text, ev.finish_reason)
                        if j is not None:
                            out.append(tpl.wrap(j))  # type: ignore[union-attr]
                        continue
                    c = endpoint.delta(gen, ev)
                    if c is None:
                        continue
                    if top or tpl is None:
                        out.append(_chunk(gen, endpoint, [c], include_usage, top))
                    else:
                        out.append(tpl.chunk(c))
                    top = None
                if out:
                    yield b"".join(out)
                try:
                    batch = await agen.__anext__()
                except StopAsyncIteration:
                    batch = None
        except RequestError as exc:  # a failed choice, or the request cut short: one error event
            yield b"data: " + json.dumps(error_body(str(exc), exc.code, exc.param)).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
            return
        if include_usage:
            body = {
                "id": gen.id,
                "object": endpoint.object_chunk,
                "created": gen.created,
                "model": gen.model,
                "choices": [],
                "usage": usage_body(gen.usage()),
            }
            yield b"data: " + json.dumps(body).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:
        gen.abort("stream closed")
        await agen.aclose()  # type: ignore[attr-defined]
