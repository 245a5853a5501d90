""":class:`OpenAIServing`: what the two OpenAI endpoints share in the API
process (the tokenizer, the :class:`~fdx.output_processor.OutputProcessor`
over the chosen token processor, the off-loop prompt tokenizer), the checks
both make (model name, readiness, context length, overload).  The route
handlers that hand over to ``completions.py`` and ``chat.py`` are in
``routes.py``."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from fdx.beam_search import beam_params
from fdx.config import EngineConfig
from fdx.core.errors import ModelLoadError, RequestError
from fdx.core.messages import ALL_LOGPROBS, MAX_ALL_LOGPROBS_PROMPT, KVTransferParams, SamplingParams
from fdx.deploy.frontend import EngineFrontend, EngineUnavailable
from fdx.generation_config import GenerationDefaults, load_generation_defaults
from fdx.output_processor import OutputProcessor
from fdx.prompt_tokenizer import PromptTokenizer
from fdx.request_params import sampling_params
from fdx.server.serving.generation import Endpoint, Generation, Prompt, respond
from fdx.tracing import RequestTrace, config_tracer, refused_span

log = logging.getLogger("fdx.server")


#: the paths whose requests get a trace span, accepted or refused
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch", "/invocations"})


def generation_defaults(config: EngineConfig) -> GenerationDefaults:
    """The served model's sampling defaults, logged once (a model that
    cannot be found gets none: the engine reports that failure itself)."""
    try:
        d = load_generation_defaults(config.generation_config, config.model, config.override_generation_config)
    except ModelLoadError:
        return GenerationDefaults()
    log.info("generation defaults: %s", d.describe())
    if d.ignored:
        log.warning("%s: not sampling defaults, not used: %s", d.source, ", ".join(d.ignored))
    return d


class OpenAIServing:
    """Holds the tokenizer / token processor and serves the two endpoints."""

    def __init__(self, config: EngineConfig, client: EngineFrontend, metrics: Any = None) -> None:
        self.config = config
        self.client = client
        self.metrics = metrics
        self.tokenizer: Any = None
        self.processor: Any = None
        self.outputs: OutputProcessor | None = None
        self.prompts: PromptTokenizer = None  # type: ignore[assignment]  # set with the tokenizer
        self.defaults = generation_defaults(config)
        #: the OpenTelemetry tracer (``--otlp-traces-endpoint``), ``None`` when tracing is off
        self.tracer = config_tracer(config, "api") if config.otlp_traces_endpoint else None

    @property
    def model_name(self) -> str:
        return self.config.model_name

    def set_tokenizer(self, tokenizer: Any, processor: Any) -> None:
        self.tokenizer = tokenizer
        self.processor = processor
        self.outputs = OutputProcessor(processor)
        self.prompts = PromptTokenizer(tokenizer)

    def unavailable_reason(self) -> str | None:
        r = self.client.unavailable_reason()
        if r is None and self.tokenizer is None:
            r = "server is starting (loading the tokenizer)"
        return r

    # -- checks both endpoints make ---------------------------------------

    def check_model(self, name: str | None) -> None:
        if name and name not in (self.config.model_name, self.config.model):
            raise RequestError(f"The model '{name}' does not exist (this server serves '{self.model_name}')",
                               404, param="model")

    def check_ready(self) -> None:
        reason = self.unavailable_reason()
        if reason is not None:
            raise EngineUnavailable(reason)

    def params(self, req: Any, max_tokens: int, num_logprobs: int | None) -> SamplingParams:
        cfg = self.config
        params = sampling_params(req, max_tokens=max_tokens, num_logprobs=num_logprobs,
                                 max_logprobs=cfg.max_logprobs, vocab_size=self.tokenizer.vocab_size,
                                 defaults=self.defaults)
        return beam_params(req, params, cfg.max_logprobs, frozenset(self.tokenizer.eos_token_ids))

    def check_length(self, n_prompt: int, max_tokens: int, param: str) -> None:
        mml = self.client.max_model_len
        if n_prompt + max_tokens > mml:
            raise RequestError(
                f"This model's maximum context length is {mml} tokens. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the completion). "
                f"Please reduce the prompt or {param}.", 400, param=param)

    def trace_refused(self, request: Request, code: int, error_type: str, message: str) -> None:
        """With tracing on, record a refused generation request's span
        (:func:`fdx.tracing.refused_span`); other paths record none."""
        path = request.url.path
        traced = getattr(request.state, "traced", False)  # refused after its RequestTrace began: that span tells
        if self.tracer is not None and not traced and request.method == "POST" and path in GENERATION_PATHS:
            operation = "chat" if path.startswith("/v1/chat/") else "text_completion"
            refused_span(self.tracer, request.headers, operation, self.model_name, code, error_type, message)

    # -- generation -------------------------------------------------------

    async def generate(self, request: Request, prefix: str, req: Any, prompts: list[Prompt],
                       params: SamplingParams, arrival: float, endpoint: Endpoint) -> Response:
        """Submit the request's choices and reply (streaming or not)."""
        total = len(prompts) * params.n
        waiting = self.client.num_waiting()
        if waiting + total > self.config.max_waiting:
            raise RequestError(
                f"server is overloaded: {waiting} requests waiting (limit --max-waiting {self.config.max_waiting})",
                429)
        if params.prompt_logprobs == ALL_LOGPROBS:
            longest = max(len(p.ids) for p in prompts)
            if longest > MAX_ALL_LOGPROBS_PROMPT:
                raise RequestError(
                    f"'prompt_logprobs': -1 (the whole vocabulary at every prompt position) is limited to prompts of "
                    f"at most {MAX_ALL_LOGPROBS_PROMPT} tokens; this prompt has {longest} (ask for at most "
                    f"{self.config.max_logprobs} alternatives instead)", 400, param="prompt_logprobs")
        assert self.outputs is not None  # check_ready() passed: the tokenizer is set
        gen = Generation(self.config, self.client, self.outputs, req.request_id or f"{prefix}-{uuid.uuid4().hex}",
                         prompts, params, self.model_name)
        if req.kv_transfer_params is not None:  # splitwise (docs/SPLITWISE.md): the router chose the prefill instance
            if self.config.splitwise_role != "decode":
                raise RequestError("kv_transfer_params is accepted only by a --splitwise-role decode instance", 400,
                                   param="kv_transfer_params")
            kp = req.kv_transfer_params
            gen.kv_transfer = KVTransferParams(kp.prefill_addr, kp.prefill_url or "")
        so = req.stream_options
        gen.return_token_ids = bool(req.return_token_ids)
        as_ids = req.return_tokens_as_token_ids
        gen.tokens_as_ids = self.config.return_tokens_as_token_ids if as_ids is None else bool(as_ids)
        gen.continuous_usage = bool(req.stream and so and so.include_usage and so.continuous_usage_stats)  # as vLLM
        if self.tracer is not None:
            operation = "chat" if endpoint.object_full.startswith("chat") else "text_completion"
            gen.trace = RequestTrace(self.tracer, request.headers, operation, self.model_name, params, gen.id, arrival)
            request.state.traced = True
        gen.submit(arrival)
        return await respond(request, gen, endpoint, bool(req.stream), bool(req.stream and so and so.include_usage))
