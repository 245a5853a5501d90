"""A request's sampling fields -> the engine's
:class:`~fdx.core.messages.SamplingParams` of one choice: the range checks
that depend on the server (vocabulary, ``--max-logprobs``), each a 400
naming the field, and the model's defaults (``--generation-config``) for
the fields a request leaves out.  Shared by the server's endpoints and
``fdx run-batch``; beam search's fields are :mod:`fdx.beam_search`'s."""

from __future__ import annotations

import math
from typing import Any

from fdx.core.errors import RequestError
from fdx.core.messages import ALL_LOGPROBS, SamplingParams
from fdx.generation_config import GenerationDefaults
from fdx.server.protocol import INT64_MAX, ChatCompletionRequest, CompletionRequest


def _bad(msg: str, param: str) -> RequestError:
    return RequestError(msg, 400, param=param)


def _pick(value: Any, defaults: GenerationDefaults | None, name: str, fallback: Any) -> Any:
    """The request's value, else the model default, else the API's."""
    if value is not None:
        return value
    default = getattr(defaults, name, None) if defaults is not None else None
    return fallback if default is None else default


def stop_list(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else list(stop)
    if any(not s for s in stops):
        raise _bad("'stop' strings must be non-empty", "stop")
    if len(stops) > 16:
        raise _bad(f"at most 16 stop strings are allowed, got {len(stops)}", "stop")
    return tuple(stops)


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    *,
    max_tokens: int,
    num_logprobs: int | None,
    max_logprobs: int,
    vocab_size: int,
    defaults: GenerationDefaults | None = None,
) -> SamplingParams:
    """Check ranges and build the params of choice 0 (``seed`` unshifted).

    A sampling field the request leaves out takes the model's default
    (``defaults``: ``--generation-config``), else the OpenAI one.

    ``max_tokens`` is the already-resolved output budget; ``num_logprobs``
    the number of top alternatives (``None``: no logprobs).  Seeds are
    never wrapped: a seed outside [0, 2^63-1] (or whose ``seed + n - 1``
    for the last choice is) is refused.
    """
    if req.stream_options is not None and not req.stream:
        raise _bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    n = 1 if req.n is None else req.n
    if n < 1:
        raise _bad(f"'n' must be >= 1, got {n}", "n")
    if n > 128:
        raise _bad(f"'n' must be <= 128, got {n}", "n")
    if max_tokens < 1:
        raise _bad(f"'max_tokens' must be >= 1, got {max_tokens}", "max_tokens")
    min_tokens = req.min_tokens or 0
    if min_tokens < 0:
        raise _bad(f"'min_tokens' must be >= 0, got {min_tokens}", "min_tokens")
    if min_tokens > max_tokens:
        raise _bad(f"'min_tokens' ({min_tokens}) must be <= max_tokens ({max_tokens})", "min_tokens")
    temperature = _pick(req.temperature, defaults, "temperature", 1.0)
    if not (math.isfinite(temperature) and temperature >= 0.0):
        raise _bad(f"'temperature' must be a finite number >= 0, got {temperature}", "temperature")
    top_p = _pick(req.top_p, defaults, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise _bad(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    top_k = _pick(req.top_k, defaults, "top_k", 0)
    if top_k < -1:
        raise _bad(f"'top_k' must be -1 (disabled), 0 (disabled) or >= 1, got {top_k}", "top_k")
    if top_k > vocab_size:
        raise _bad(f"'top_k' must be at most the vocabulary size ({vocab_size}), got {top_k}", "top_k")
    min_p = _pick(req.min_p, defaults, "min_p", 0.0)
    if not 0.0 <= min_p <= 1.0:
        raise _bad(f"'min_p' must be in [0, 1], got {min_p}", "min_p")
    presence = 0.0 if req.presence_penalty is None else req.presence_penalty
    if not -2.0 <= presence <= 2.0:
        raise _bad(f"'presence_penalty' must be in [-2, 2], got {presence}", "presence_penalty")
    frequency = 0.0 if req.frequency_penalty is None else req.frequency_penalty
    if not -2.0 <= frequency <= 2.0:
        raise _bad(f"'frequency_penalty' must be in [-2, 2], got {frequency}", "frequency_penalty")
    repetition = _pick(req.repetition_penalty, defaults, "repetition_penalty", 1.0)
    if not 0.0 < repetition <= 10.0:
        raise _bad(f"'repetition_penalty' must be in (0, 10], got {repetition}", "repetition_penalty")
    if num_logprobs is not None and not 0 <= num_logprobs <= max_logprobs:
        param = "top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs"
        raise _bad(f"'{param}' must be in [0, {max_logprobs}], got {num_logprobs}", param)
    prompt_lp = req.prompt_logprobs
    if prompt_lp is not None and prompt_lp != ALL_LOGPROBS and not 0 <= prompt_lp <= max_logprobs:
        raise _bad(f"'prompt_logprobs' must be -1 (the whole vocabulary) or in [0, {max_logprobs}], got {prompt_lp}",
                   "prompt_logprobs")
    if isinstance(req, CompletionRequest) and req.echo and num_logprobs is not None and prompt_lp != ALL_LOGPROBS:
        prompt_lp = max(prompt_lp or 0, num_logprobs)  # echo + logprobs: the echoed prompt has logprobs too
    stop_ids = tuple(req.stop_token_ids or ())
    for t in stop_ids:
        if not 0 <= t < vocab_size:
            raise _bad(f"stop_token_ids contains {t}, outside the vocabulary [0, {vocab_size})", "stop_token_ids")
    if req.seed is not None:
        if not 0 <= req.seed <= INT64_MAX:
            raise _bad(f"'seed' must be an integer in [0, 2^63-1], got {req.seed}", "seed")
        if req.seed + n - 1 > INT64_MAX:
            raise _bad(f"'seed' + n - 1 must be <= 2^63-1 (choice j uses seed + j), got seed {req.seed} with n {n}",
                       "seed")
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=max(top_k, 0),
        min_p=float(min_p),
        seed=req.seed,
        presence_penalty=float(presence),
        frequency_penalty=float(frequency),
        repetition_penalty=float(repetition),
        stop=stop_list(req.stop),
        stop_token_ids=stop_ids,
        ignore_eos=bool(req.ignore_eos),
        logprobs=num_logprobs,
        n=n,
        prompt_logprobs=prompt_lp,
    )
