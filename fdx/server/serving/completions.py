"""``POST /v1/completions``: prompts (text, token ids, or lists of either),
echo, and the completion-style rendering of choices and logprobs
(``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from starlette.requests import Request
from starlette.responses import Response

from fdx.core.errors import RequestError
from fdx.core.messages import TokenLogprob
from fdx.output_processor import OutputEvent
from fdx.server.protocol import CompletionRequest, parse_body
from fdx.server.serving.generation import ChoiceResult, Generation, Prompt, json_logprob

if TYPE_CHECKING:
    from fdx.server.serving.endpoints import OpenAIServing

#: most choices (prompts x n) in one request
MAX_CHOICES = 1024


class CompletionEndpoint:
    """Renders completion choices; keeps each choice's ``text_offset``."""

    object_full = "text_completion"
    object_chunk = "text_completion"

    def __init__(self, echo: bool, num_choices: int) -> None:
        self.echo = echo
        self.offsets = [0] * num_choices

    def head(self, gen: Generation) -> list[dict[str, Any]]:
        if not self.echo:
            return []
        return [{"index": s.index, "text": gen.echo_text(s.prompt_index), "logprobs": None, "finish_reason": None}
                for s in gen.states]

    def delta(self, gen: Generation, ev: OutputEvent) -> dict[str, Any] | None:
        if not ev.text and not ev.logprobs and ev.finish_reason is None:
            return None
        return {
            "index": ev.index,
            "text": ev.text,
            "logprobs": self.logprobs(gen, ev.index, ev.logprobs) if gen.want_logprobs and ev.logprobs else None,
            "finish_reason": ev.finish_reason,
        }

    def full(self, gen: Generation, res: ChoiceResult) -> dict[str, Any]:
        text = "".join(res.text)
        if self.echo:
            text = gen.echo_text(res.prompt_index) + text
        return {
            "index": res.index,
            "text": text,
            "logprobs": self.logprobs(gen, res.index, res.logprobs) if gen.want_logprobs else None,
            "finish_reason": res.finish_reason,
        }

    def logprobs(self, gen: Generation, index: int, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
        k = gen.params.logprobs or 0
        tok = gen.token_text
        tokens, token_lps, tops, offsets = [], [], [], []
        off = self.offsets[index]
        for lp in lps:
            t = tok(lp.token_id)
            tokens.append(t)
            token_lps.append(json_logprob(lp.logprob))
            top: dict[str, float] = {}
            for tid, v in lp.top[:k]:
                top.setdefault(tok(tid), json_logprob(v))
            top.setdefault(t, json_logprob(lp.logprob))
            tops.append(top)
            offsets.append(off)
            off += len(t)
        self.offsets[index] = off
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


async def completions(serving: OpenAIServing, request: Request, arrival: float) -> Response:
    req: CompletionRequest = parse_body(await request.body(), CompletionRequest)
    serving.check_model(req.model)
    serving.check_ready()
    if req.suffix:
        raise RequestError("'suffix' is not supported", 400, param="suffix")
    if req.echo and req.logprobs is not None:
        raise RequestError("'echo' together with 'logprobs' is not supported (no prompt logprobs)", 400,
                           param="echo")
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    params = serving.params(req, max_tokens, req.logprobs)
    prompts = await _prompts(serving, req, max_tokens)
    for p in prompts:
        serving.check_length(len(p.ids), max_tokens, "max_tokens")
    endpoint = CompletionEndpoint(bool(req.echo), len(prompts) * params.n)
    return await serving.generate(request, "cmpl", req, prompts, params, arrival, endpoint)


async def _prompts(serving: OpenAIServing, req: CompletionRequest, max_tokens: int) -> list[Prompt]:
    p = req.prompt
    vocab = serving.tokenizer.vocab_size
    if isinstance(p, str):
        items: list[Any] = [p]
    elif not p:
        raise RequestError("'prompt' must not be empty", 400, param="prompt")
    elif isinstance(p[0], int):
        items = [p]
    else:
        items = list(p)
    if len(items) * (req.n or 1) > MAX_CHOICES:
        raise RequestError(f"too many prompts x n in one request (max {MAX_CHOICES})", 400, param="prompt")
    limit = max(serving.client.max_model_len - max_tokens, 0)
    encoded = iter(await serving.prompts.encode([x for x in items if isinstance(x, str)], True, limit))
    out: list[Prompt] = []
    for item in items:
        if isinstance(item, str):
            tok = next(encoded)
            if tok.ids is None:
                serving.check_length(tok.num_tokens, max_tokens, "max_tokens")
            ids = tok.ids or []
            text: str | None = item
        else:
            ids = list(item)
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})", 400,
                                   param="prompt")
            text = None
        if not ids:
            raise RequestError("'prompt' must not be empty", 400, param="prompt")
        out.append(Prompt(ids, text))
    return out
