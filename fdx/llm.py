"""Offline, in-process API: ``fdx.LLM(...).generate(...)`` / ``.chat(...)``.

The same :class:`~fdx.core.engine.Engine` as the server runs in this
process, and the same output path: engine outputs become text through
:class:`fdx.output_processor.OutputProcessor` over the token processor
chosen by name (``config.token_processor``), exactly as in the HTTP server.
Invariants: every submitted request ends with exactly one result (or a
:class:`RequestError` for the whole call); a stop string aborts the request
in the engine at once and ends it with ``finish_reason == "stop"``; no KV
block outlives the call.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Sequence

import attrs

from fdx.core.errors import FdxError, RequestError
from fdx.core.messages import AddRequest, SamplingParams, TokenLogprob
from fdx.output_processor import ChoiceState, OutputProcessor, choice_params

_ids = itertools.count()


@attrs.define
class Completion:
    """One generated sequence (one choice)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


@attrs.define
class RequestResult:
    """The result for one prompt.  ``text``/``token_ids``/``finish_reason``/
    ``logprobs`` are those of the first choice; ``outputs`` holds all ``n``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[Completion]
    num_cached_tokens: int = 0
    #: with ``SamplingParams(prompt_logprobs=k)``: ``None`` for the first prompt token, then each one's logprob
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs


class LLM:
    """An engine in this process.

    ``model``: ``None``/``"smollm2"`` (the embedded SmolLM2), a ``.gguf`` path
    or a Hugging Face folder.  Other keyword arguments are
    :class:`~fdx.config.EngineConfig` fields (``max_num_seqs=...``,
    ``num_kv_blocks=...``, ``scheduler="v0"``, ...).
    """

    def __init__(self, model: str | None = None, **config_kwargs: Any) -> None:
        from fdx.config import make_config
        from fdx.core.engine import Engine
        from fdx.core.plugins import get_plugins
        from fdx.model.loader import load_tokenizer

        config = make_config(model=model or "smollm2", **config_kwargs)
        plugins = get_plugins(config.disable_plugins)
        overrides: dict[str, Any] = {}
        for res in plugins.hook.fdx_adjust_config(config=config, args=None):
            if res:
                overrides.update(res)
        if overrides:
            config = config.replace(**overrides)
        self.config = config
        self.tokenizer = load_tokenizer(config.model)
        self.engine = Engine(config, plugins)
        self.processor = plugins.create("token_processor", config.token_processor, tokenizer=self.tokenizer, config=config)
        self.outputs = OutputProcessor(self.processor)
        from fdx.generation_config import load_generation_defaults

        #: the model's sampling defaults (``generation_config``, as ``fdx serve`` applies them)
        self.defaults = load_generation_defaults(config.generation_config, config.model,
                                                 config.override_generation_config)

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate``/``chat`` use without ``params`` (vLLM's name):
        the model's generation defaults (``--generation-config``; SmolLM2:
        temperature 0.2, top_p 0.9), ``max_tokens`` its ``max_new_tokens``
        else 16.  Explicit :class:`SamplingParams` are used as given."""
        d = self.defaults
        fields = {k: getattr(d, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
                  if getattr(d, k) is not None}
        return SamplingParams(max_tokens=d.max_tokens or 16, **fields)

    # ------------------------------------------------------------------ API

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestResult]:
        """Complete each prompt (text, or a list of token ids)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        items: list[tuple[str | None, list[int]]] = []
        for p in prompts:
            if isinstance(p, str):
                items.append((p, self.tokenizer.encode(p, add_special_tokens=True)))
            elif isinstance(p, Sequence) and all(isinstance(t, int) for t in p):
                items.append((None, [int(t) for t in p]))
            else:
                raise RequestError("prompts must be a string, a list of strings or a list of token-id lists")
        return self._run(items, params)

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestResult]:
        """Answer one conversation (a list of ``{"role", "content"}``) or a
        list of conversations, through the model's chat template."""
        if not messages:
            raise RequestError("messages is empty")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        items = []
        for conv in convs:
            text = self.tokenizer.apply_chat_template(list(conv), add_generation_prompt=add_generation_prompt)
            items.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        return self._run(items, params)

    # ------------------------------------------------------------------ loop

    def _run(
        self,
        items: list[tuple[str | None, list[int]]],
        params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[RequestResult]:
        if params is None or isinstance(params, SamplingParams):
            plist = [params or self.get_default_sampling_params()] * len(items)
        else:
            plist = list(params)
            if len(plist) != len(items):
                raise RequestError(f"{len(plist)} sampling params for {len(items)} prompts")
        if any(p.beam_width for p in plist):
            raise RequestError("beam_width: beam search is served by `fdx serve` (use_beam_search), not by fdx.LLM")
        results: list[RequestResult] = []
        live: dict[str, tuple[ChoiceState, Completion, RequestResult]] = {}
        now = time.time()
        try:
            for p_idx, ((text, ids), p) in enumerate(zip(items, plist)):
                base = f"llm-{next(_ids)}"
                res = RequestResult(base, text, ids, [])
                results.append(res)
                for k in range(max(1, p.n)):
                    rid = base if p.n <= 1 else f"{base}-{k}"
                    comp = Completion(k, "", [], None, [] if p.logprobs is not None else None)
                    res.outputs.append(comp)
                    sp = choice_params(p, k)
                    state = self.outputs.open(rid, k, p_idx, ids, sp)
                    self.engine.add_request(AddRequest(rid, tuple(ids), sp, now))
                    live[rid] = (state, comp, res)
            self._drive(live)
        except BaseException:
            self.engine.abort([rid for rid, (st, _, _) in live.items() if not st.finished])
            self._drain()
            raise
        return results

    def _drive(self, live: dict[str, tuple[ChoiceState, Completion, RequestResult]]) -> None:
        pending = len(live)
        while pending:
            if not self.engine.has_work():
                raise FdxError(f"engine went idle with {pending} request(s) unfinished")
            for out in self.engine.step():
                entry = live.get(out.request_id)
                if entry is None:
                    continue
                state, comp, res = entry
                ev = self.outputs.process(state, out)
                if ev is None:
                    continue
                if ev.abort_in_engine:
                    self.engine.abort([out.request_id])
                if ev.failure is not None:
                    raise RequestError(ev.failure.message, ev.failure.code)
                comp.token_ids.extend(ev.token_ids)
                if comp.logprobs is not None:
                    comp.logprobs.extend(ev.logprobs)
                comp.text += ev.text
                res.num_cached_tokens = max(res.num_cached_tokens, state.num_cached_tokens)
                if state.prompt_logprobs is not None and res.prompt_logprobs is None:
                    res.prompt_logprobs = [None, *state.prompt_logprobs]
                if ev.finish_reason is not None:
                    comp.finish_reason = ev.finish_reason
                    pending -= 1
        self._drain()

    def _drain(self) -> None:
        """Flush side outputs (aborts) so the engine is idle again."""
        for _ in range(1000):
            if not self.engine.has_work():
                return
            self.engine.step()

