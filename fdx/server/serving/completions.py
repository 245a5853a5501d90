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
from fdx import structured_outputs
from fdx.server.protocol import CompletionRequest, parse_body
from fdx.server.serving.generation import ChoiceResult, Generation, Prompt, json_logprob, json_string

if TYPE_CHECKING:
    from fdx.server.serving.endpoints import OpenAIServing

#: most choices (prompts x n) in one request
MAX_CHOICES = 1024


class CompletionEndpoint:
    """Renders completion choices; keeps each choice's ``text_offset``.

    With ``echo`` the prompt leads each choice: in the first chunk on its
    own, or -- with ``logprobs`` -- together with its prompt logprobs in the
    choice's first delta (vLLM's shape: the first prompt token has ``null``
    logprobs)."""

    object_full = "text_completion"
    object_chunk = "text_completion"

    def __init__(self, echo: bool, num_choices: int) -> None:
        self.echo = echo
        self.offsets = [0] * num_choices
        self.started = [False] * num_choices

    def head(self, gen: Generation) -> list[dict[str, Any]]:
        if not self.echo or gen.want_logprobs:
            return []
        return [{"index": s.index, "text": gen.echo_text(s.prompt_index), "logprobs": None, "finish_reason": None}
                for s in gen.states]

    def delta(self, gen: Generation, ev: OutputEvent) -> dict[str, Any] | None:
        first = not self.started[ev.index]
        self.started[ev.index] = True
        p_idx = gen.states[ev.index].prompt_index
        text = ev.text
        lp = self.logprobs(gen, ev.index, ev.logprobs) if gen.want_logprobs and ev.logprobs else None
        if first and self.echo and gen.want_logprobs:
            text = gen.echo_text(p_idx) + text
            lp = self.prompt_part(gen, ev.index, p_idx, ev.logprobs)
        extras = first and (gen.return_token_ids or gen.params.prompt_logprobs is not None)
        if not text and not lp and ev.finish_reason is None and not extras and not (
                gen.return_token_ids and ev.token_ids):
            return None
        c: dict[str, Any] = {"index": ev.index, "text": text, "logprobs": lp, "finish_reason": ev.finish_reason}
        self._extras(gen, c, p_idx, list(ev.token_ids), first)
        return c

    def text_only(self, gen: Generation) -> bool:
        # (echo without logprobs leads with its own head chunk; the deltas stay plain)
        return not gen.want_logprobs and not gen.return_token_ids and gen.params.prompt_logprobs is None

    def text_choice(self, index: int, text: str, finish_reason: str | None) -> str | None:
        if not text and finish_reason is None:
            return None
        reason = "null" if finish_reason is None else json_string(finish_reason)
        return f'{{"index": {index}, "text": {json_string(text)}, "logprobs": null, "finish_reason": {reason}}}'

    def full(self, gen: Generation, res: ChoiceResult) -> dict[str, Any]:
        text = "".join(res.text)
        lp = None
        if self.echo:
            text = gen.echo_text(res.prompt_index) + text
        if gen.want_logprobs:
            lp = (self.prompt_part(gen, res.index, res.prompt_index, res.logprobs) if self.echo
                  else self.logprobs(gen, res.index, res.logprobs))
        c: dict[str, Any] = {"index": res.index, "text": text, "logprobs": lp, "finish_reason": res.finish_reason,
                             "prompt_logprobs": None}  # vLLM: the key is always there (null unless asked)
        self._extras(gen, c, res.prompt_index, res.token_ids, True)
        return c

    def top_fields(self, gen: Generation, first_chunk: bool) -> dict[str, Any]:
        return {}

    @staticmethod
    def _extras(gen: Generation, c: dict[str, Any], p_idx: int, token_ids: list[int], first: bool) -> None:
        """vLLM's per-choice ``prompt_token_ids`` / ``token_ids``
        (``return_token_ids``) and ``prompt_logprobs`` (once per choice)."""
        if gen.return_token_ids:
            if first:
                c["prompt_token_ids"] = list(gen.prompts[p_idx].ids)
            c["token_ids"] = token_ids
        if first and gen.params.prompt_logprobs is not None:
            c["prompt_logprobs"] = gen.prompt_logprobs(p_idx)

    def prompt_part(self, gen: Generation, index: int, p_idx: int, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
        """Logprobs of the echoed prompt (``null`` for its first token, and
        for every token if the engine sent none), then of ``lps``."""
        k = gen.params.logprobs or 0
        tok = gen.token_text
        ids = gen.prompts[p_idx].ids
        state = gen.states[index]
        plps = state.prompt_logprobs or ()
        tokens: list[str] = []
        token_lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        off = 0
        for i, tid in enumerate(ids):
            t = tok(tid)
            lp = plps[i - 1] if 0 < i <= len(plps) else None
            tokens.append(t)
            offsets.append(off)
            off += len(t)
            if lp is None:
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(json_logprob(lp.logprob))
            tops.append(_top_logprobs(tok, t, lp, k))
        self.offsets[index] = off
        rest = self.logprobs(gen, index, lps)
        return {"tokens": tokens + rest["tokens"], "token_logprobs": token_lps + rest["token_logprobs"],
                "top_logprobs": tops + rest["top_logprobs"], "text_offset": offsets + rest["text_offset"]}

    def logprobs(self, gen: Generation, index: int, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
        k = gen.params.logprobs or 0
        tok = gen.token_text
        tokens, token_lps, tops, offsets = [], [], [], []
        off = self.offsets[index]
        for lp in lps:
            t = tok(lp.token_id)
            tokens.append(t)
            token_lps.append(json_logprob(lp.logprob))
            tops.append(_top_logprobs(tok, t, lp, k))
            offsets.append(off)
            off += len(t)
        self.offsets[index] = off
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _top_logprobs(tok: Any, text: str, lp: TokenLogprob, k: int) -> dict[str, float]:
    """A completion's ``top_logprobs`` entry: the chosen token first (as in
    vLLM, so the first key names the token of ``tokens``), then the ``k``
    alternatives by text (the first of equal texts wins)."""
    top: dict[str, float] = {text: json_logprob(lp.logprob)}
    for tid, v in lp.top[:k]:
        top.setdefault(tok(tid), json_logprob(v))
    return top


async def completions(serving: OpenAIServing, request: Request, arrival: float) -> Response:
    req: CompletionRequest = parse_body(await request.body(), CompletionRequest)
    serving.check_model(req.model)
    serving.check_ready()
    if req.suffix:
        raise RequestError("'suffix' is not supported", 400, param="suffix")
    max_tokens = req.max_tokens if req.max_tokens is not None else min(16, serving.defaults.max_tokens or 16)
    params = serving.params(req, max_tokens, req.logprobs)
    # response_format / guided_* / logit_bias
    params = await structured_outputs.constrain(serving.config, serving.tokenizer.vocab_size, req, params)
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
