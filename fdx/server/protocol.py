"""OpenAI request schemas, their validation, and the error envelope.

Parsing is two-stage: pydantic checks types (a wrong type is a 400, never
FastAPI's 422), then :func:`sampling_params` checks ranges and builds the
frozen :class:`~fdx.core.messages.SamplingParams` of one choice.  Every
rejection is a :class:`~fdx.core.errors.RequestError` carrying the HTTP
status and the offending parameter, rendered by :func:`error_body`.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from fdx.core.errors import RequestError
from fdx.core.messages import SamplingParams

# HTTP status -> OpenAI error ``type``
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


def error_body(message: str, code: int, param: str | None = None, err_type: str | None = None) -> dict[str, Any]:
    """The OpenAI error envelope ``{"error": {message, type, param, code}}``."""
    return {
        "error": {
            "message": message,
            "type": err_type or ERROR_TYPES.get(code, "invalid_request_error" if code < 500 else "internal_server_error"),
            "param": param,
            "code": code,
        }
    }


# --------------------------------------------------------------------------
# Schemas (types only; ranges are checked in sampling_params)
# --------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Common(BaseModel):
    """Fields shared by completions and chat completions.  Unknown fields
    are ignored (clients send many we don't implement)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = None
    min_tokens: int | None = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = False
    user: str | None = None
    request_id: str | None = None


class CompletionRequest(_Common):
    # smart-mode union: list[int] before list[str] is resolved by exactness
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """Bytes -> validated request model, or a 400 :class:`RequestError`."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"malformed JSON body: {exc}", 400) from None
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object", 400)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def validation_error(errors: Any) -> RequestError:
    """First pydantic / FastAPI validation error -> one-line 400."""
    errs = list(errors)
    if not errs:
        return RequestError("invalid request", 400)
    e = errs[0]
    # drop 'body' and pydantic's union-branch names (e.g. 'str', 'list[int]')
    skip = ("body", "query", "path", "header")
    loc = [str(x) for x in e.get("loc", ()) if x not in skip and not _is_type_name(x)]
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    if e.get("type") == "json_invalid":
        return RequestError(f"malformed JSON body: {e.get('msg')}", 400)
    if param == "prompt" and e.get("type") != "missing":
        return RequestError("'prompt' must be a string, a list of strings, a list of token ids or a list of "
                            "token-id lists", 400, param="prompt")
    if e.get("type") == "missing":
        return RequestError(f"missing required parameter '{where}'", 400, param=param)
    return RequestError(f"invalid value for '{where}': {e.get('msg')}", 400, param=param)


# --------------------------------------------------------------------------
# Range checks -> SamplingParams
# --------------------------------------------------------------------------


def _is_type_name(x: Any) -> bool:
    return isinstance(x, str) and (x in ("str", "int", "float", "bool", "list", "dict", "none") or "[" in x)


def _bad(msg: str, param: str) -> RequestError:
    return RequestError(msg, 400, param=param)


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
) -> SamplingParams:
    """Check ranges and build the params of choice 0 (``seed`` unshifted).

    ``max_tokens`` is the already-resolved output budget; ``num_logprobs``
    the number of top alternatives (``None``: no logprobs).
    """
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
    temperature = 1.0 if req.temperature is None else req.temperature
    if not temperature >= 0.0:
        raise _bad(f"'temperature' must be >= 0, got {temperature}", "temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0.0 < top_p <= 1.0:
        raise _bad(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    top_k = 0 if req.top_k is None else req.top_k
    if top_k < -1:
        raise _bad(f"'top_k' must be -1 (disabled), 0 (disabled) or >= 1, got {top_k}", "top_k")
    min_p = 0.0 if req.min_p is None else req.min_p
    if not 0.0 <= min_p <= 1.0:
        raise _bad(f"'min_p' must be in [0, 1], got {min_p}", "min_p")
    presence = 0.0 if req.presence_penalty is None else req.presence_penalty
    if not -2.0 <= presence <= 2.0:
        raise _bad(f"'presence_penalty' must be in [-2, 2], got {presence}", "presence_penalty")
    frequency = 0.0 if req.frequency_penalty is None else req.frequency_penalty
    if not -2.0 <= frequency <= 2.0:
        raise _bad(f"'frequency_penalty' must be in [-2, 2], got {frequency}", "frequency_penalty")
    repetition = 1.0 if req.repetition_penalty is None else req.repetition_penalty
    if not 0.0 < repetition <= 10.0:
        raise _bad(f"'repetition_penalty' must be in (0, 10], got {repetition}", "repetition_penalty")
    if num_logprobs is not None and not 0 <= num_logprobs <= max_logprobs:
        param = "top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs"
        raise _bad(f"'{param}' must be in [0, {max_logprobs}], got {num_logprobs}", param)
    stop_ids = tuple(req.stop_token_ids or ())
    for t in stop_ids:
        if not 0 <= t < vocab_size:
            raise _bad(f"stop_token_ids contains {t}, outside the vocabulary [0, {vocab_size})", "stop_token_ids")
    if req.seed is not None and not -(2**63) <= req.seed < 2**63:
        raise _bad("'seed' must fit in 64 bits", "seed")
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
    )


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as plain dicts for the chat template; list-of-parts content
    is flattened to its text parts."""
    if not req.messages:
        raise _bad("'messages' must contain at least one message", "messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        d = m.model_dump(exclude_none=False)
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _bad(f"messages[{i}].content: only text parts are supported", "messages")
                texts.append(part["text"])
            d["content"] = "".join(texts)
        elif content is None:
            d["content"] = ""
        out.append(d)
    return out


FinishReason = Literal["stop", "length", "abort"]
