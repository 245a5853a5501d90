"""The OpenAI completions and chat-completions handlers.

A request becomes ``len(prompts) * n`` engine requests (choice ``j`` of
prompt ``p`` has index ``p * n + j`` and seed ``seed + j``), all feeding one
sink queue.  Each choice owns a token stream from the token processor; when
it reports ``stopped`` (a stop string) the choice finishes with ``stop`` and
its engine request is aborted.  Invariants: every engine request submitted is
finished, aborted or failed before the handler returns or the stream closes
(no leaked KV blocks); a failed request never affects another one.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from typing import Any, AsyncIterator, Sequence

import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fdx.core.config import EngineConfig
from fdx.core.errors import RequestError
from fdx.core.messages import RequestOutput, SamplingParams, TokenLogprob
from fdx.server.client import EngineClient, EngineUnavailable, RequestHandle
from fdx.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    error_body,
    parse_body,
    sampling_params,
)
from fdx.server.sse import EventStreamResponse


def _lp(v: float) -> float:
    """A JSON-safe logprob (-inf, as from a masked token, becomes -9999.0 as in vLLM)."""
    return v if math.isfinite(v) else -9999.0


class _ClientGone(Exception):
    pass


class _TimedOut(Exception):
    pass


@attrs.define(eq=False)
class _Choice:
    index: int
    prompt_idx: int
    stream: Any  # TokenStream
    handle: RequestHandle | None = None
    text: list[str] = attrs.field(factory=list)
    logprobs: list[TokenLogprob] = attrs.field(factory=list)
    finish_reason: str | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


@attrs.define
class _Prompt:
    ids: list[int]
    text: str | None  # for echo


class OpenAIServing:
    """Holds the tokenizer / token processor and serves the two endpoints."""

    def __init__(self, config: EngineConfig, client: EngineClient, metrics: Any = None) -> None:
        self.config = config
        self.client = client
        self.metrics = metrics
        self.tokenizer: Any = None
        self.processor: Any = None

    @property
    def model_name(self) -> str:
        return self.config.model_name

    def set_tokenizer(self, tokenizer: Any, processor: Any) -> None:
        self.tokenizer = tokenizer
        self.processor = processor

    def unavailable_reason(self) -> str | None:
        r = self.client.unavailable_reason()
        if r is None and self.tokenizer is None:
            r = "server is starting (loading the tokenizer)"
        return r

    # ------------------------------------------------------------------
    # endpoints
    # ------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        arrival = time.time()
        req: CompletionRequest = parse_body(await request.body(), CompletionRequest)
        self._check_model(req.model)
        self._check_ready()
        if req.suffix:
            raise RequestError("'suffix' is not supported", 400, param="suffix")
        if req.echo and req.logprobs is not None:
            raise RequestError("'echo' together with 'logprobs' is not supported (no prompt logprobs)", 400,
                               param="echo")
        prompts = self._completion_prompts(req)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        params = self._params(req, max_tokens, req.logprobs)
        for p in prompts:
            self._check_length(len(p.ids), max_tokens, "max_tokens")
        return await self._run(request, "cmpl", req, prompts, params, arrival, chat=False)

    async def chat(self, request: Request) -> Response:
        arrival = time.time()
        req: ChatCompletionRequest = parse_body(await request.body(), ChatCompletionRequest)
        self._check_model(req.model)
        self._check_ready()
        messages = chat_messages(req)
        try:
            ids = self.tokenizer.encode(
                self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt
                                                   if req.add_generation_prompt is not None else True),
                add_special_tokens=False,
            )
        except RequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - template errors are the caller's input
            raise RequestError(f"cannot apply the chat template: {type(exc).__name__}: {exc}", 400,
                               param="messages") from None
        if not ids:
            raise RequestError("the chat template produced an empty prompt", 400, param="messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise RequestError("'top_logprobs' requires 'logprobs' to be true", 400, param="top_logprobs")
        num_lp = (req.top_logprobs or 0) if req.logprobs else None
        explicit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        mml = self.client.max_model_len
        if explicit is None:
            if len(ids) >= mml:
                raise RequestError(
                    f"This model's maximum context length is {mml} tokens, but the prompt has {len(ids)} tokens "
                    f"(no room for the completion)", 400, param="messages")
            max_tokens = mml - len(ids)
        else:
            max_tokens = explicit
        params = self._params(req, max_tokens, num_lp)
        self._check_length(len(ids), max_tokens, param_name)
        return await self._run(request, "chatcmpl", req, [_Prompt(ids, None)], params, arrival, chat=True)

    # ------------------------------------------------------------------
    # validation
    # ------------------------------------------------------------------

    def _check_model(self, name: str | None) -> None:
        if name and name not in (self.config.model_name, self.config.model):
            raise RequestError(f"The model '{name}' does not exist (this server serves '{self.model_name}')",
                               404, param="model")

    def _check_ready(self) -> None:
        reason = self.unavailable_reason()
        if reason is not None:
            raise EngineUnavailable(reason)

    def _params(self, req: Any, max_tokens: int, num_logprobs: int | None) -> SamplingParams:
        return sampling_params(req, max_tokens=max_tokens, num_logprobs=num_logprobs,
                               max_logprobs=self.config.max_logprobs, vocab_size=self.tokenizer.vocab_size)

    def _check_length(self, n_prompt: int, max_tokens: int, param: str) -> None:
        mml = self.client.max_model_len
        if n_prompt + max_tokens > mml:
            raise RequestError(
                f"This model's maximum context length is {mml} tokens. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the completion). "
                f"Please reduce the prompt or {param}.", 400, param=param)

    def _completion_prompts(self, req: CompletionRequest) -> list[_Prompt]:
        p = req.prompt
        vocab = self.tokenizer.vocab_size
        if isinstance(p, str):
            items: list[Any] = [p]
        elif not p:
            raise RequestError("'prompt' must not be empty", 400, param="prompt")
        elif isinstance(p[0], int):
            items = [p]
        else:
            items = list(p)
        out: list[_Prompt] = []
        for item in items:
            if isinstance(item, str):
                ids = self.tokenizer.encode(item, add_special_tokens=True)
                text = item
            else:
                ids = list(item)
                bad = next((t for t in ids if not 0 <= t < vocab), None)
                if bad is not None:
                    raise RequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})", 400,
                                       param="prompt")
                text = None
            if not ids:
                raise RequestError("'prompt' must not be empty", 400, param="prompt")
            out.append(_Prompt(ids, text))
        if len(out) * (req.n or 1) > 1024:
            raise RequestError("too many prompts x n in one request (max 1024)", 400, param="prompt")
        return out

    # ------------------------------------------------------------------
    # generation
    # ------------------------------------------------------------------

    async def _run(
        self,
        request: Request,
        prefix: str,
        req: Any,
        prompts: list[_Prompt],
        params: SamplingParams,
        arrival: float,
        chat: bool,
    ) -> Response:
        n = params.n
        total = len(prompts) * n
        waiting = self.client.num_waiting()
        if waiting + total > self.config.max_waiting:
            raise RequestError(
                f"server is overloaded: {waiting} requests waiting (limit --max-waiting {self.config.max_waiting})",
                429)
        base = req.request_id or f"{prefix}-{uuid.uuid4().hex}"
        sink: asyncio.Queue[tuple[Any, Any]] = asyncio.Queue()
        choices: list[_Choice] = []
        engine_params = attrs.evolve(params, n=1)
        try:
            for p_idx, prompt in enumerate(prompts):
                for j in range(n):
                    idx = p_idx * n + j
                    sp = engine_params if params.seed is None else attrs.evolve(engine_params, seed=params.seed + j)
                    ch = _Choice(idx, p_idx, self.processor.open_stream(prompt.ids, sp))
                    rid = base if total == 1 else f"{base}-{idx}"
                    ch.handle = self.client.submit(rid, prompt.ids, sp, arrival, sink, tag=ch)
                    choices.append(ch)
        except BaseException:
            self.client.abort([c.handle for c in choices if c.handle is not None], "request rejected")
            raise
        handles = [c.handle for c in choices if c.handle is not None]
        watcher = asyncio.get_running_loop().create_task(self._watch(request, sink))
        ctx = _Ctx(self, base, prefix, chat, req, prompts, choices, params, watcher)
        try:
            if not req.stream:
                return await ctx.collect()
            first = await sink.get()
            ctx.check_failure(first)  # an error before any output -> a plain HTTP error
        except BaseException:
            watcher.cancel()
            self.client.abort(handles, "request failed")
            raise
        watcher.cancel()  # the event-stream response listens for the disconnect itself
        ctx.stream_options(req)

        def on_close() -> None:
            self.client.abort([c.handle for c in choices if c.handle is not None and c.finish_reason is None],
                              "client disconnected")

        return EventStreamResponse(ctx.stream(first, sink), on_close)

    async def _watch(self, request: Request, sink: asyncio.Queue[tuple[Any, Any]]) -> None:
        """Put a sentinel on the sink when the client disconnects or the
        request runs past ``config.request_timeout``."""
        try:
            async with asyncio.timeout(self.config.request_timeout):
                while True:
                    message = await request.receive()
                    if message["type"] == "http.disconnect":
                        sink.put_nowait((None, _ClientGone()))
                        return
        except TimeoutError:
            sink.put_nowait((None, _TimedOut()))


class _Ctx:
    """State of one HTTP request's generation."""

    def __init__(self, serving: OpenAIServing, base: str, prefix: str, chat: bool, req: Any,
                 prompts: list[_Prompt], choices: list[_Choice], params: SamplingParams,
                 watcher: asyncio.Task[None]) -> None:
        self.s = serving
        self.client = serving.client
        self.proc = serving.processor
        self.id = base
        self.chat = chat
        self.req = req
        self.prompts = prompts
        self.choices = choices
        self.params = params
        self.watcher = watcher
        self.created = int(time.time())
        self.model = serving.model_name
        self.echo = bool(getattr(req, "echo", False))
        self.include_usage = False
        self.pending = len(choices)
        self.offsets = [0] * len(choices)

    # -- shared --------------------------------------------------------

    def check_failure(self, item: tuple[Any, Any]) -> None:
        """Raise the error carried by a sink item, if any."""
        _, x = item
        if isinstance(x, _ClientGone):
            raise RequestError("client disconnected", 499)
        if isinstance(x, _TimedOut):
            raise RequestError(f"request timed out after {self.s.config.request_timeout:g}s", 504)
        if isinstance(x, RequestError):
            raise x
        if isinstance(x, BaseException):
            raise RequestError(f"internal error: {type(x).__name__}: {x}", 500)
        if isinstance(x, RequestOutput) and x.finish_reason == "error":
            raise RequestError(x.error or "request failed in the engine", x.error_code or 500)

    def apply(self, item: tuple[Any, Any]) -> tuple[_Choice, str, list[TokenLogprob]] | None:
        """Feed one engine output into its choice.  Returns (choice, new
        text, new logprobs), or ``None`` for a stale item."""
        self.check_failure(item)
        h, out = item
        ch: _Choice = h.tag
        if ch.finish_reason is not None:
            return None
        finished = out.finish_reason is not None
        delta = ch.stream.feed(out.new_token_ids, finished)
        lps = list(out.logprobs) if out.logprobs else []
        ch.num_output_tokens = max(ch.num_output_tokens, out.num_output_tokens)
        ch.num_cached_tokens = max(ch.num_cached_tokens, out.num_cached_tokens)
        if delta.stopped:
            ch.finish_reason = "stop"
            self.client.finish(h, "stop")
        elif finished:
            ch.finish_reason = out.finish_reason
        if ch.finish_reason is not None:
            self.pending -= 1
        if delta.text:
            ch.text.append(delta.text)
        ch.logprobs.extend(lps)
        return ch, delta.text, lps

    def usage(self) -> dict[str, Any]:
        n = self.params.n
        prompt_tokens = sum(len(p.ids) for p in self.prompts)
        completion = sum(c.num_output_tokens for c in self.choices)
        cached = sum(c.num_cached_tokens for c in self.choices if c.index % n == 0)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def echo_text(self, ch: _Choice) -> str:
        p = self.prompts[ch.prompt_idx]
        if p.text is None:
            p.text = self.s.tokenizer.decode(p.ids, skip_special_tokens=False)
        return p.text

    # -- logprobs ------------------------------------------------------

    def _tok(self, tid: int) -> str:
        return self.proc.token_text(tid)

    def chat_logprobs(self, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
        k = self.params.logprobs or 0
        content = []
        for lp in lps:
            t = self._tok(lp.token_id)
            content.append({
                "token": t,
                "logprob": _lp(lp.logprob),
                "bytes": list(t.encode("utf-8")),
                "top_logprobs": [
                    {"token": (tt := self._tok(tid)), "logprob": _lp(v), "bytes": list(tt.encode("utf-8"))}
                    for tid, v in lp.top[:k]
                ],
            })
        return {"content": content}

    def completion_logprobs(self, ch: _Choice, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
        k = self.params.logprobs or 0
        tokens, token_lps, tops, offsets = [], [], [], []
        off = self.offsets[ch.index]
        for lp in lps:
            t = self._tok(lp.token_id)
            tokens.append(t)
            token_lps.append(_lp(lp.logprob))
            top: dict[str, float] = {}
            for tid, v in lp.top[:k]:
                top.setdefault(self._tok(tid), _lp(v))
            top.setdefault(t, _lp(lp.logprob))
            tops.append(top)
            offsets.append(off)
            off += len(t)
        self.offsets[ch.index] = off
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    # -- non-streaming -------------------------------------------------

    async def collect(self) -> Response:
        sink = self.choices[0].handle.sink if self.choices else None  # type: ignore[union-attr]
        try:
            while self.pending > 0:
                self.apply(await sink.get())  # type: ignore[union-attr]
        finally:
            self.watcher.cancel()
        want_lp = self.params.logprobs is not None
        out_choices = []
        for ch in self.choices:
            text = "".join(ch.text)
            if self.chat:
                out_choices.append({
                    "index": ch.index,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": self.chat_logprobs(ch.logprobs) if want_lp else None,
                    "finish_reason": ch.finish_reason,
                })
            else:
                if self.echo:
                    text = self.echo_text(ch) + text
                out_choices.append({
                    "index": ch.index,
                    "text": text,
                    "logprobs": self.completion_logprobs(ch, ch.logprobs) if want_lp else None,
                    "finish_reason": ch.finish_reason,
                })
        body = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": out_choices,
            "usage": self.usage(),
            "system_fingerprint": None,
        }
        return JSONResponse(body)

    # -- streaming -----------------------------------------------------

    def stream_options(self, req: Any) -> None:
        so = req.stream_options
        self.include_usage = bool(so and so.include_usage)

    def _chunk(self, choices: list[dict[str, Any]]) -> bytes:
        body = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            body["usage"] = None
        return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"

    def _event(self, applied: tuple[_Choice, str, list[TokenLogprob]]) -> dict[str, Any] | None:
        ch, text, lps = applied
        want_lp = self.params.logprobs is not None and bool(lps)
        if not text and not lps and ch.finish_reason is None:
            return None
        if self.chat:
            return {
                "index": ch.index,
                "delta": {"content": text} if text else {},
                "logprobs": self.chat_logprobs(lps) if want_lp else None,
                "finish_reason": ch.finish_reason,
            }
        return {
            "index": ch.index,
            "text": text,
            "logprobs": self.completion_logprobs(ch, lps) if want_lp else None,
            "finish_reason": ch.finish_reason,
        }

    async def stream(self, first: tuple[Any, Any], sink: asyncio.Queue[tuple[Any, Any]]) -> AsyncIterator[bytes]:
        try:
            head: list[dict[str, Any]] = []
            for ch in self.choices:
                if self.chat:
                    head.append({"index": ch.index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None})
                elif self.echo:
                    head.append({"index": ch.index, "text": self.echo_text(ch), "logprobs": None,
                                 "finish_reason": None})
            if head:
                yield self._chunk(head)
            items = [first]
            while True:
                while not sink.empty():
                    items.append(sink.get_nowait())
                events: list[dict[str, Any]] = []
                try:
                    for item in items:
                        applied = self.apply(item)
                        if applied is not None and (ev := self._event(applied)) is not None:
                            events.append(ev)
                except RequestError as exc:
                    if events:
                        yield self._chunk(events)
                    yield b"data: " + json.dumps(error_body(str(exc), exc.code, exc.param)).encode() + b"\n\n"
                    yield b"data: [DONE]\n\n"
                    return
                if events:
                    # one chunk per choice event keeps clients that read choices[0] correct
                    yield b"".join(self._chunk([ev]) for ev in events)
                if self.pending <= 0:
                    break
                items = [await sink.get()]
            if self.include_usage:
                body = {
                    "id": self.id,
                    "object": "chat.completion.chunk" if self.chat else "text_completion",
                    "created": self.created,
                    "model": self.model,
                    "choices": [],
                    "usage": self.usage(),
                }
                yield b"data: " + json.dumps(body).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            self.client.abort([c.handle for c in self.choices if c.handle is not None and c.finish_reason is None],
                              "stream closed")
