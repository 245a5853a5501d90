"""``POST /v1/chat/completions``: the chat template (rendered and encoded off
the event loop), the completion budget, and the chat-style rendering of
choices (``message`` / ``delta``) and logprobs (``content`` entries)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import attrs
from starlette.requests import Request
from starlette.responses import Response

from fdx import structured_outputs, tool_calling
from fdx.chat_template import chat_options, echo_text
from fdx.core.errors import RequestError
from fdx.core.interfaces import ToolCallStream
from fdx.core.messages import TokenLogprob
from fdx.output_processor import OutputEvent
from fdx.server.protocol import BatchChatCompletionRequest, ChatCompletionRequest, chat_messages, parse_body
from fdx.server.serving.generation import ChoiceResult, Generation, Prompt, json_logprob, json_string
from fdx.tool_calling import ToolCalling, merge, new_call_id

if TYPE_CHECKING:
    from fdx.server.serving.endpoints import OpenAIServing


class ChatEndpoint:
    """Renders chat choices; with tools, each choice's text goes through its
    tool-call stream (content and ``tool_calls``, see ``fdx/tool_calling.py``)."""

    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(self, calling: ToolCalling | None = None, echo: Sequence[str] = ("",), batch: bool = False) -> None:
        self.calling = calling
        self.echo = list(echo)  # per prompt: vLLM's chat echo, the last (assistant) message's content leads the reply
        self.batch = batch  # /v1/chat/completions/batch: one choice per conversation, no response-level prompt fields
        self.streams: dict[int, ToolCallStream] = {}
        self.called: set[int] = set()  # choices that produced a tool call

    def _tool_delta(self, ev: OutputEvent) -> tuple[dict[str, Any], str | None]:
        """A streamed choice's delta and finish reason with tools."""
        assert self.calling is not None
        stream = self.streams.get(ev.index)
        if stream is None:
            stream = self.streams[ev.index] = self.calling.open_stream()
        text, deltas = stream.feed(ev.text, ev.finish_reason is not None)
        d: dict[str, Any] = {}
        if text and not (ev.index in self.called and not text.strip()):
            d["content"] = text
        deltas = self.calling.keep(deltas)
        if deltas:
            self.called.add(ev.index)
            d["tool_calls"] = [
                {"index": x.index, "id": new_call_id(), "type": "function",
                 "function": {"name": x.name, "arguments": x.arguments}} if x.name is not None
                else {"index": x.index, "function": {"arguments": x.arguments}} for x in deltas]
        reason = ev.finish_reason
        return d, ("tool_calls" if reason == "stop" and ev.index in self.called else reason)

    def head(self, gen: Generation) -> list[dict[str, Any]]:
        return [{"index": s.index, "delta": {"role": "assistant", "content": self.echo[s.prompt_index]},
                 "logprobs": None, "finish_reason": None} for s in gen.states]

    def delta(self, gen: Generation, ev: OutputEvent) -> dict[str, Any] | None:
        ids = gen.return_token_ids and ev.token_ids
        delta, reason = ({"content": ev.text} if ev.text else {}), ev.finish_reason
        if self.calling is not None:
            delta, reason = self._tool_delta(ev)
        if not delta and not ev.logprobs and reason is None and not ids:
            return None
        c = {
            "index": ev.index,
            "delta": delta,
            "logprobs": self.logprobs(gen, ev.logprobs) if gen.want_logprobs and ev.logprobs else None,
            "finish_reason": reason,
        }
        if gen.return_token_ids:
            c["token_ids"] = list(ev.token_ids)
        return c

    def text_only(self, gen: Generation) -> bool:
        return self.calling is None and not gen.want_logprobs and not gen.return_token_ids

    def text_choice(self, index: int, text: str, finish_reason: str | None) -> str | None:
        if not text and finish_reason is None:
            return None
        delta = f'{{"content": {json_string(text)}}}' if text else "{}"
        reason = "null" if finish_reason is None else json_string(finish_reason)
        return f'{{"index": {index}, "delta": {delta}, "logprobs": null, "finish_reason": {reason}}}'

    def full(self, gen: Generation, res: ChoiceResult) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(res.text)}
        reason = res.finish_reason
        if self.calling is not None:
            text, deltas = self.calling.open_stream().feed(message["content"], True)
            calls = merge(self.calling.keep(deltas))
            if calls:
                message = {"role": "assistant", "content": text.strip() or None, "tool_calls": calls}
                reason = "tool_calls" if reason == "stop" else reason
            else:
                message["content"] = text
        echo = self.echo[res.prompt_index]
        if echo:
            message["content"] = echo + (message["content"] or "")
        c = {
            "index": res.index,
            "message": message,
            "logprobs": self.logprobs(gen, res.logprobs) if gen.want_logprobs else None,
            "finish_reason": reason,
        }
        if gen.return_token_ids:
            c["token_ids"] = res.token_ids
        return c

    def top_fields(self, gen: Generation, first_chunk: bool) -> dict[str, Any]:
        """vLLM: the prompt's ids (``return_token_ids``) and
        ``prompt_logprobs`` at the response level (the first chunk's, streaming)."""
        top: dict[str, Any] = {} if first_chunk else {"prompt_logprobs": None}  # vLLM: null unless asked
        if self.batch:
            return top
        if gen.return_token_ids:
            top["prompt_token_ids"] = list(gen.prompts[0].ids)
        if gen.params.prompt_logprobs is not None:
            top["prompt_logprobs"] = gen.prompt_logprobs(0)
        return top

    @staticmethod
    def logprobs(gen: Generation, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
        k = gen.params.logprobs or 0
        tok = gen.token_text
        content = []
        for lp in lps:
            t = tok(lp.token_id)
            content.append({
                "token": t,
                "logprob": json_logprob(lp.logprob),
                "bytes": list(t.encode("utf-8")),
                "top_logprobs": [
                    {"token": (tt := tok(tid)), "logprob": json_logprob(v), "bytes": list(tt.encode("utf-8"))}
                    for tid, v in lp.top[:k]
                ],
            })
        return {"content": content}


@attrs.define
class Rendered:
    """One conversation of a chat request, rendered and encoded."""

    ids: list[int]
    num_tokens: int
    messages: list[dict[str, Any]]
    calling: ToolCalling | None
    explicit: int | None  # max_completion_tokens, else max_tokens, else None
    param: str  # the field that set the budget


async def render(serving: OpenAIServing, req: ChatCompletionRequest) -> Rendered:
    """The request's messages through the tools and the chat template,
    encoded off the event loop (a bad template call is a 400)."""
    messages = chat_messages(req)
    explicit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    mml = serving.client.max_model_len
    add_gen, cont, template_vars = chat_options(req)
    messages, calling = tool_calling.prepare(serving.config, serving.tokenizer, req, messages, template_vars)
    try:
        tok = await serving.prompts.encode_chat(messages, add_gen, mml - (explicit or 1), cont, template_vars)
    except RequestError:
        raise
    except Exception as exc:  # noqa: BLE001 - template errors are the caller's input
        raise RequestError(f"cannot apply the chat template: {exc}", 400, param="messages") from None
    n_prompt = tok.num_tokens
    if n_prompt == 0:
        raise RequestError("the chat template produced an empty prompt", 400, param="messages")
    if explicit is None and n_prompt >= mml:
        raise RequestError(
            f"This model's maximum context length is {mml} tokens, but the prompt has {n_prompt} tokens "
            f"(no room for the completion)", 400, param="messages")
    ids = tok.ids if tok.ids is not None else []  # within the limit, or the caller's check_length raises
    return Rendered(ids, n_prompt, messages, calling, explicit, param_name)


def _num_logprobs(req: ChatCompletionRequest) -> int | None:
    if req.top_logprobs is not None and not req.logprobs:
        raise RequestError("'top_logprobs' requires 'logprobs' to be true", 400, param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def _default_max_tokens(serving: OpenAIServing, n_prompt: int) -> int:
    """A chat request's ``max_tokens`` when it sets none: the rest of the
    context (vLLM's rule), or the model's default if smaller."""
    rest = serving.client.max_model_len - n_prompt
    return rest if serving.defaults.max_tokens is None else min(rest, serving.defaults.max_tokens)


async def chat(serving: OpenAIServing, request: Request, arrival: float) -> Response:
    req: ChatCompletionRequest = parse_body(await request.body(), ChatCompletionRequest)
    serving.check_model(req.model)
    serving.check_ready()
    num_lp = _num_logprobs(req)
    r = await render(serving, req)
    max_tokens = r.explicit if r.explicit is not None else _default_max_tokens(serving, r.num_tokens)
    params = serving.params(req, max_tokens, num_lp)
    params = await structured_outputs.constrain(serving.config, serving.tokenizer.vocab_size, req, params,
                                                r.calling.spec if r.calling else None)
    serving.check_length(r.num_tokens, max_tokens, r.param)
    return await serving.generate(request, "chatcmpl", req, [Prompt(r.ids, None)], params, arrival,
                                  ChatEndpoint(r.calling, [echo_text(req, r.messages)]))


async def chat_batch(serving: OpenAIServing, request: Request, arrival: float) -> Response:
    """vLLM's ``POST /v1/chat/completions/batch``: each conversation of
    ``messages`` is one prompt of one generation (one choice each, indexed by
    position), so they run together and answer in one chat.completion body.
    Without ``max_tokens`` every conversation may use what the longest prompt
    leaves of the context."""
    batch: BatchChatCompletionRequest = parse_body(await request.body(), BatchChatCompletionRequest)
    serving.check_model(batch.model)
    serving.check_ready()
    for name, bad in (("stream", bool(batch.stream)), ("tools", batch.tools is not None),
                      ("tool_choice", batch.tool_choice not in (None, "none")), ("n", (batch.n or 1) != 1),
                      ("prompt_logprobs", batch.prompt_logprobs is not None)):
        if bad:
            raise RequestError(f"'{name}' is not supported by /v1/chat/completions/batch (as in vLLM: no streaming, "
                               "no tools, n 1, no prompt_logprobs)", 400, param=name)
    num_lp = _num_logprobs(batch)
    convs = [batch.model_copy(update={"messages": m}) for m in batch.messages]
    rendered = [await render(serving, c) for c in convs]
    longest = max(r.num_tokens for r in rendered)
    r0 = rendered[0]
    max_tokens = r0.explicit if r0.explicit is not None else _default_max_tokens(serving, longest)
    params = serving.params(batch, max_tokens, num_lp)
    params = await structured_outputs.constrain(serving.config, serving.tokenizer.vocab_size, batch, params)
    serving.check_length(longest, max_tokens, r0.param)
    prompts = [Prompt(r.ids, None) for r in rendered]
    echoes = [echo_text(c, r.messages) for c, r in zip(convs, rendered)]
    return await serving.generate(request, "chatcmpl", batch, prompts, params, arrival,
                                  ChatEndpoint(None, echoes, batch=True))
