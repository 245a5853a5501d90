"""OpenAI request and response schemas, the strict JSON reader, validation
and the error envelope.

Parsing has three stages, each a 400 naming the field when it fails:

1. :func:`loads_strict` reads the bytes as strict JSON within declared
   limits: UTF-8 only, nesting at most :data:`MAX_JSON_DEPTH` deep, no
   ``NaN``/``Infinity`` literals or overflowing floats, no integer of
   2^64 or more, no lone UTF-16 surrogate in any string or key.
2. pydantic checks types strictly (booleans are not numbers, numbers are
   not booleans, strings are not numbers) and the ranges every consumer
   can take: integers fit in int64, seeds in [0, 2^63-1], floats are
   finite.  A wrong type is a 400, never FastAPI's 422.
3. :func:`fdx.request_params.sampling_params` checks what depends on the
   server (vocabulary, ``--max-logprobs``) and builds the frozen
   :class:`~fdx.core.messages.SamplingParams` of one choice.

Every rejection is a :class:`~fdx.core.errors.RequestError` carrying the
HTTP status and the offending parameter, rendered by :func:`error_body`.
The same pydantic models document ``/openapi.json`` (:func:`openapi_body`,
:data:`ERROR_RESPONSES`), so the schema describes what the server takes.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Iterator, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool, StrictStr, ValidationError

from fdx.core.errors import RequestError

# HTTP status -> OpenAI error ``type``
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}

#: deepest JSON nesting accepted in a request body (objects and arrays)
MAX_JSON_DEPTH = 64
#: default of ``--max-request-bytes``
DEFAULT_MAX_REQUEST_BYTES = 4 << 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: most prompts in one completions request (and most prompts x n)
MAX_PROMPTS = 1024
#: integers in a body must lie in [-2^63, 2^64) wherever they appear
#: (known fields are bounded tighter by their schema)
JSON_INT_LIMIT = 2**64


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
# Strict JSON
# --------------------------------------------------------------------------

_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")
_LONG_INT = re.compile(r"\d{19,}")
_BIG_EXPONENT = re.compile(r"[0-9.][eE]\+?\d{3,}")


def json_depth_exceeds(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text ``raw`` nests objects/arrays deeper than
    ``limit`` (brackets inside strings do not count).  Cheap: a count
    answers most bodies; only a body with more than ``limit`` opening
    brackets is scanned."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    brackets = _STRINGS.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if len(brackets) <= limit:
        return False
    import numpy as np

    steps = np.frombuffer(brackets, dtype=np.uint8)
    delta = np.where((steps == ord("[")) | (steps == ord("{")), 1, -1).astype(np.int32)
    return int(np.cumsum(delta).max()) > limit


def _walk(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(path, value) for every value and every key of a parsed JSON tree,
    iteratively; paths look like ``messages[0].content``."""
    stack: list[tuple[str, Any]] = [(path, obj)]
    while stack:
        p, o = stack.pop()
        yield p, o
        if isinstance(o, dict):
            for k, v in o.items():
                kp = f"{p}.{k}" if p else str(k)
                yield kp, k
                stack.append((kp, v))
        elif isinstance(o, list):
            stack.extend((f"{p}[{i}]", v) for i, v in enumerate(o))


def _top(path: str) -> str | None:
    return re.split(r"[.\[]", path, maxsplit=1)[0] or None if path else None


def _printable(path: str) -> str:
    return path.encode("ascii", "backslashreplace").decode("ascii")


def loads_strict(raw: bytes | str, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse a request body as strict JSON, or raise a 400
    :class:`RequestError` that says what is wrong and where."""
    if isinstance(raw, bytes):
        if json_depth_exceeds(raw, max_depth):
            raise RequestError(f"JSON body is nested deeper than {max_depth} levels", 400)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(f"request body is not valid UTF-8 (byte {exc.start})", 400) from None
    else:
        text = raw
        if json_depth_exceeds(text.encode("utf-8", "surrogatepass"), max_depth):
            raise RequestError(f"JSON body is nested deeper than {max_depth} levels", 400)
    constants: list[str] = []

    def constant(name: str) -> float:
        constants.append(name)
        return float(name.replace("Infinity", "inf"))

    try:
        data = json.loads(text, parse_constant=constant)
    except json.JSONDecodeError as exc:
        raise RequestError(f"malformed JSON body: {exc.msg} at line {exc.lineno} column {exc.colno}", 400) from None
    except RecursionError:
        raise RequestError(f"JSON body is nested deeper than {max_depth} levels", 400) from None
    except ValueError:  # an integer literal of more than 4300 digits
        raise RequestError("JSON body holds an integer that is too large (integers must be below 2^64)", 400) \
            from None
    if constants or _BIG_EXPONENT.search(text):
        for p, v in _walk(data):
            if isinstance(v, float) and not math.isfinite(v):
                what = constants[0] if constants else "a number too large for a 64-bit float"
                raise RequestError(f"'{_printable(p) or 'body'}' is {what}: numbers must be finite "
                                   "(NaN and Infinity are not JSON)", 400, param=_top(p))
    if _LONG_INT.search(text):
        for p, v in _walk(data):
            if type(v) is int and not INT64_MIN <= v < JSON_INT_LIMIT:
                raise RequestError(f"'{_printable(p) or 'body'}' is an integer out of range "
                                   "(integers must lie in [-2^63, 2^64))", 400, param=_top(p))
    if _SURROGATE_ESCAPE.search(text):
        for p, v in _walk(data):
            if isinstance(v, str) and _SURROGATE.search(v):
                raise RequestError(f"'{_printable(p) or 'body'}' holds a lone UTF-16 surrogate escape "
                                   "(\\ud800-\\udfff without its pair): strings must be valid Unicode", 400,
                                   param=_top(_printable(p)))
    return data


def loads_object(raw: bytes | str, *, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """:func:`loads_strict`, and the result must be a JSON object."""
    data = loads_strict(raw, max_depth=max_depth)
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object", 400)
    return data


# --------------------------------------------------------------------------
# Field types
# --------------------------------------------------------------------------

Int64 = Annotated[int, Strict(), Field(ge=INT64_MIN, le=INT64_MAX)]
NonNegInt = Annotated[int, Strict(), Field(ge=0, le=INT64_MAX)]
PosInt = Annotated[int, Strict(), Field(ge=1, le=INT64_MAX)]
Finite = Annotated[float, Strict(), Field(allow_inf_nan=False)]

#: what a field takes, appended to pydantic's message for that field
FIELD_HINTS: dict[str, str] = {
    "seed": "an integer in [0, 2^63-1]",
    "top_k": "-1 or 0 (disabled) or an integer from 1 to the vocabulary size",
    "n": "an integer in [1, 128]",
    "max_tokens": "an integer >= 1",
    "max_completion_tokens": "an integer >= 1",
    "min_tokens": "an integer >= 0",
    "temperature": "a finite number >= 0",
    "top_p": "a number in (0, 1]",
    "min_p": "a number in [0, 1]",
    "presence_penalty": "a number in [-2, 2]",
    "frequency_penalty": "a number in [-2, 2]",
    "repetition_penalty": "a number in (0, 10]",
    "stream": "true or false",
    "echo": "true or false",
    "ignore_eos": "true or false",
    "add_generation_prompt": "true or false",
    "stop": "a string or a list of at most 16 strings",
    "stop_token_ids": "a list of token ids",
    "logprobs": "for completions an integer >= 0; for chat true or false",
    "top_logprobs": "an integer in [0, 20]",
    "prompt_logprobs": "-1 (the whole vocabulary) or an integer >= 0 (at most --max-logprobs)",
    "return_token_ids": "true or false",
    "continue_final_message": "true or false",
    "request_id": "a string of at most 256 characters",
    "use_beam_search": "true or false",
    "length_penalty": "a finite number",
    "early_stopping": "true, false or \"never\"",
}


#: fields OpenAI clients send that change nothing fdx computes: accepted
#: (their type is checked) and documented as having no effect.  Every other
#: field a request model does not declare is refused with a 400 naming it
#: (:func:`unknown_field`): fdx never silently ignores what a client asks for.
NO_EFFECT_FIELDS: dict[str, str] = {
    "user": "an end-user id for the provider's abuse monitoring",
    "metadata": "key-value tags for the provider's stored completions",
    "store": "whether the provider stores the completion (fdx stores nothing)",
    "service_tier": "the provider's processing tier (fdx has one)",
    "safety_identifier": "an end-user id for the provider's safety monitoring",
    "prompt_cache_key": "a routing hint for the provider's prompt cache (fdx caches prefixes by content)",
    "prompt_cache_retention": "how long the provider keeps a cached prompt",
}


#: fields that routers in front of fdx (vllm-router, sglang-router) add to
#: every request they forward, at the value that asks for what fdx does
#: anyway.  Accepted at exactly that value (and then dropped); any other value
#: is a 400 naming the field, so none of them is silently ignored.
DEFAULT_ONLY_FIELDS: dict[str, bool] = {
    "no_stop_trim": False,          # fdx trims the stop string from the text
    "skip_special_tokens": True,    # fdx never puts special tokens in the text
    "return_hidden_states": False,  # fdx returns no hidden states
    "separate_reasoning": True,     # no reasoning parser: nothing to separate
    "stream_reasoning": True,
    "include_reasoning": True,
}


class _Strict(BaseModel):
    # unknown fields are refused: by unknown_field() at the top level (a
    # clear message), by pydantic inside nested objects
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: StrictBool | None = Field(False, description="a last chunk with the request's usage")
    continuous_usage_stats: StrictBool | None = Field(
        False, description="with include_usage: the usage so far on every chunk (vLLM)")


class JsonSchemaSpec(_Strict):
    """``response_format.json_schema``."""

    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: Union[dict[str, Any], StrictBool, None] = Field(None, alias="schema", description="a JSON schema")
    strict: StrictBool | None = Field(None, description="accepted; fdx always enforces the schema")


class ResponseFormat(_Strict):
    """OpenAI ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputsParams(_Strict):
    """vLLM's ``structured_outputs``: exactly one of the constraints."""

    json_: Union[dict[str, Any], StrictStr, None] = Field(None, alias="json", description="a JSON schema")
    regex: StrictStr | None = None
    choice: Annotated[list[StrictStr], Field(min_length=1)] | None = None
    grammar: StrictStr | None = Field(None, description="a Lark or GBNF grammar")
    json_object: StrictBool | None = None


class FunctionSpec(_Strict):
    name: Annotated[str, Strict(), Field(min_length=1, max_length=256)]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments")
    strict: StrictBool | None = None


class ToolSpec(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Strict):
    name: StrictStr


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class KVTransferParamsBody(_Strict):
    """``kv_transfer_params`` (splitwise, set by ``fdx router``)."""

    prefill_addr: Annotated[str, Strict(), Field(min_length=1, max_length=512)] = Field(
        description="the prefill instance's kv_addr (from its /v1/splitwise/info)")
    prefill_url: Annotated[str, Strict(), Field(max_length=512)] | None = Field(
        None, description="the prefill instance's base URL (for logs)")


class _Common(_Strict):
    """Fields shared by completions and chat completions.  A field not
    declared here (or by an endpoint's model) is refused with a 400; the
    no-effect fields of :data:`NO_EFFECT_FIELDS` are declared."""

    model: StrictStr | None = Field(None, description="the served model name (optional)")
    n: Annotated[int, Strict(), Field(ge=1, le=128)] | None = Field(1, description="choices per prompt")
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    stop: Union[StrictStr, Annotated[list[StrictStr], Field(max_length=16)], None] = Field(
        None, description="up to 16 stop strings")
    stop_token_ids: list[NonNegInt] | None = Field(None, description="token ids that end the output")
    max_tokens: PosInt | None = None
    min_tokens: NonNegInt | None = 0
    temperature: Annotated[float, Strict(), Field(ge=0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Strict(), Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Strict(), Field(ge=-1, le=INT64_MAX)] | None = Field(
        None, description="-1 or 0: disabled; otherwise at most the vocabulary size")
    min_p: Annotated[float, Strict(), Field(ge=0, le=1, allow_inf_nan=False)] | None = None
    seed: Annotated[int, Strict(), Field(ge=0, le=INT64_MAX)] | None = Field(
        None, description="seeds are non-negative 64-bit integers; choice j of n uses seed + j")
    presence_penalty: Annotated[float, Strict(), Field(ge=-2, le=2, allow_inf_nan=False)] | None = None
    frequency_penalty: Annotated[float, Strict(), Field(ge=-2, le=2, allow_inf_nan=False)] | None = None
    repetition_penalty: Annotated[float, Strict(), Field(gt=0, le=10, allow_inf_nan=False)] | None = None
    ignore_eos: StrictBool | None = False
    prompt_logprobs: Annotated[int, Strict(), Field(ge=-1)] | None = Field(
        None, description="logprobs of each prompt token with this many top alternatives, -1 for the whole "
                          "vocabulary (vLLM): a list with null for the first token, then "
                          "{token_id: {logprob, rank, decoded_token}}")
    return_token_ids: StrictBool | None = Field(
        False, description="add prompt_token_ids and each choice's token_ids to the response (vLLM)")
    return_tokens_as_token_ids: StrictBool | None = Field(
        None, description="in logprobs, name each token 'token_id:<id>' instead of its text (vLLM; "
                          "default: --return-tokens-as-token-ids)")
    # structured outputs (fdx/structured_outputs.py): at most one of these
    response_format: ResponseFormat | None = None
    guided_json: Union[dict[str, Any], StrictStr, None] = Field(None, description="a JSON schema (vLLM)")
    guided_regex: StrictStr | None = Field(None, description="a regular expression (vLLM)")
    guided_choice: Annotated[list[StrictStr], Field(min_length=1)] | None = Field(
        None, description="the output is one of these strings (vLLM)")
    guided_grammar: StrictStr | None = Field(None, description="a Lark or GBNF grammar (vLLM)")
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[StrictStr, Finite] | None = Field(
        None, description="token id (a string) -> bias in [-100, 100] added to its logit")
    # beam search (vLLM's fields; fdx/beam_search.py)
    use_beam_search: StrictBool | None = Field(
        False, description="beam search with n beams: the n best sequences as n choices, best first (vLLM)")
    length_penalty: Finite | None = Field(
        1.0, description="beam search: a sequence scores sum_logprobs / len ** length_penalty (HF)")
    early_stopping: Union[StrictBool, Literal["never"], None] = Field(
        False, description="beam search: stop at n finished (true), by HF's heuristic (false) or its exact bound "
                           "(\"never\")")
    # no effect (NO_EFFECT_FIELDS)
    user: StrictStr | None = None
    metadata: dict[str, StrictStr] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    prompt_cache_retention: StrictStr | None = None
    request_id: Annotated[str, Strict(), Field(max_length=256)] | None = Field(
        None, description="your id for the request (used by /v1/abort_requests); default: generated")
    kv_transfer_params: KVTransferParamsBody | None = Field(
        None, description="splitwise: the prefill instance that computes the prompt (accepted only by a "
                          "--splitwise-role decode instance; the router sets it)")


class CompletionRequest(_Common):
    # smart-mode union: list[int] before list[str] is resolved by exactness
    prompt: Union[StrictStr, list[Int64], Annotated[list[StrictStr], Field(max_length=MAX_PROMPTS)],
                  Annotated[list[list[Int64]], Field(max_length=MAX_PROMPTS)]] = Field(
        description=f"a string, a list of strings, a list of token ids or a list of token-id lists (at most "
                    f"{MAX_PROMPTS} prompts, and prompts x n at most {MAX_PROMPTS})")
    echo: StrictBool | None = False
    logprobs: NonNegInt | None = None
    suffix: StrictStr | None = None


class TextPart(BaseModel):
    """One part of a message's content; only text parts are supported."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    role: StrictStr
    content: Union[StrictStr, list[TextPart], None] = Field(
        None, description="a string or a list of {'type': 'text', 'text': ...} parts")


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PosInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: Annotated[int, Strict(), Field(ge=0, le=20)] | None = Field(
        None, description="0-20 (at most --max-logprobs) alternatives per token; needs logprobs=true")
    add_generation_prompt: StrictBool | None = Field(
        True, description="end the prompt with the assistant turn's opening (the chat template's generation prompt)")
    continue_final_message: StrictBool | None = Field(
        False, description="continue the last (assistant) message instead of starting a new one; "
                           "excludes add_generation_prompt")
    echo: StrictBool | None = Field(
        False, description="vLLM: the reply starts with the last message's content when that message is the "
                           "assistant's (with continue_final_message)")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="extra variables for the chat template (e.g. enable_thinking)")
    # tool calling (fdx/tool_calling.py)
    tools: Annotated[list[ToolSpec], Field(max_length=128)] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = Field(
        None, description="none, auto (the default with tools), required, or a named function")
    parallel_tool_calls: StrictBool | None = Field(None, description="allow several calls in one reply (default true)")


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM's shape): a ``prompt`` (encoded as
    completions encode it) or chat ``messages`` (through the chat template,
    as chat completions render them), exactly one of the two."""

    model: StrictStr | None = None
    prompt: StrictStr | None = Field(None, description="a text to encode (completions style)")
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = Field(
        None, description="a conversation, rendered by the chat template first")
    add_special_tokens: StrictBool | None = Field(
        None, description="add the tokenizer's special tokens (BOS); default true for a prompt, false for messages")
    add_generation_prompt: StrictBool | None = True
    continue_final_message: StrictBool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: StrictBool | None = Field(False, description="also return each token's text")


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM's shape)."""

    model: StrictStr | None = None
    tokens: list[Int64] = Field(description="token ids to decode")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


def unknown_field(data: dict[str, Any], model: type[BaseModel]) -> RequestError | None:
    """A 400 naming the first field of ``data`` that ``model`` does not
    declare (``None`` when every field is known)."""
    fields = set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
    for key in data:
        if key not in fields:
            name = _printable(str(key))
            return RequestError(f"'{name}' is not supported by this server: fdx refuses a field it does not "
                                f"implement rather than ignore it (remove it from the request)", 400, param=name)
    return None


def drop_default_only_fields(data: dict[str, Any], model: type[BaseModel]) -> None:
    """Remove the :data:`DEFAULT_ONLY_FIELDS` that ``model`` does not declare
    and that carry their one accepted value; a 400 naming the field for any
    other value."""
    for key in [k for k in data if k in DEFAULT_ONLY_FIELDS and k not in model.model_fields]:
        want = DEFAULT_ONLY_FIELDS[key]
        if data[key] is not want:
            raise RequestError(f"'{key}' is only accepted as {json.dumps(want)} (what fdx does); "
                               f"other values are not supported by this server", 400, param=key)
        del data[key]


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """Bytes -> validated request model, or a 400 :class:`RequestError`
    (an unknown field, a wrong type or range, naming the field)."""
    data = loads_object(raw)
    drop_default_only_fields(data, model)
    unknown = unknown_field(data, model)
    if unknown is not None:
        raise unknown
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
        return RequestError("malformed JSON body", 400)
    if param == "prompt" and any(x.get("type") == "too_long" for x in errs):
        return RequestError(f"'prompt' may hold at most {MAX_PROMPTS} prompts", 400, param="prompt")
    if param == "prompt" and e.get("type") != "missing":
        return RequestError("'prompt' must be a string, a list of strings, a list of token ids or a list of "
                            "token-id lists (token ids are integers)", 400, param="prompt")
    if e.get("type") == "missing":
        return RequestError(f"missing required parameter '{where}'", 400, param=param)
    if param == "messages" and len(loc) == 1 and e.get("type") == "too_short":
        return RequestError("'messages' must contain at least one message", 400, param="messages")
    if param == "messages" and len(loc) >= 3 and loc[2] == "content":
        return RequestError(f"'{'.'.join(loc[:3])}' must be a string or a list of text parts "
                            "({'type': 'text', 'text': ...}); only text parts are supported", 400, param="messages")
    hint = FIELD_HINTS.get(param or "")
    msg = f"invalid value for '{where}': {e.get('msg')}"
    if hint:
        msg += f" ({param} takes {hint})"
    return RequestError(msg, 400, param=param)


def _is_type_name(x: Any) -> bool:
    return isinstance(x, str) and (x in ("str", "int", "float", "bool", "list", "dict", "none") or "[" in x
                                   or x.startswith(("constrained-", "function-")))


def _bad(msg: str, param: str) -> RequestError:
    return RequestError(msg, 400, param=param)


class BatchChatCompletionRequest(ChatCompletionRequest):
    """vLLM's ``POST /v1/chat/completions/batch``: the chat fields, with
    ``messages`` a list of conversations; one choice per conversation
    (index = its position).  Not streamed, no tools, ``n`` 1, no
    ``prompt_logprobs`` (as in vLLM)."""

    messages: Annotated[list[Annotated[list[ChatMessage], Field(min_length=1)]],  # type: ignore[assignment]
                        Field(min_length=1, max_length=MAX_PROMPTS)]


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as plain dicts for the chat template; list-of-parts content
    is flattened to its text parts."""
    if not req.messages:
        raise _bad("'messages' must contain at least one message", "messages")
    out: list[dict[str, Any]] = []
    for m in req.messages:
        d = m.model_dump(exclude_none=False)
        content = m.content
        if isinstance(content, list):
            d["content"] = "".join(part.text for part in content)
        elif content is None:
            d["content"] = ""
        out.append(d)
    return out


FinishReason = Literal["stop", "length", "abort", "tool_calls"]


# --------------------------------------------------------------------------
# Response schemas (for /openapi.json; the handlers build plain dicts)
# --------------------------------------------------------------------------


class _Doc(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Doc):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(_Doc):
    """The OpenAI error envelope every 4xx/5xx carries."""

    error: ErrorDetail


class Usage(_Doc):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class CompletionChoice(_Doc):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: Union[FinishReason, None] = None
    prompt_logprobs: list[dict[str, Any] | None] | None = Field(
        None, description="vLLM: the prompt's logprobs when prompt_logprobs was asked for, else null")


class CompletionResponse(_Doc):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ChatResponseMessage(_Doc):
    role: Literal["assistant"]
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(
        None, description="[{id, type: function, function: {name, arguments (JSON text)}}]")


class ChatChoice(_Doc):
    index: int
    message: ChatResponseMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: Union[FinishReason, None] = None


class ChatCompletionResponse(_Doc):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = Field(
        None, description="vLLM: the prompt's logprobs when prompt_logprobs was asked for, else null")


class ModelCard(_Doc):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    version: str | None = None
    generation_defaults: dict[str, Any] | None = Field(
        None, description="sampling defaults a request that leaves the field out gets (--generation-config)")
    generation_defaults_source: str | None = None


class ModelList(_Doc):
    object: Literal["list"]
    data: list[ModelCard]


class HealthResponse(_Doc):
    """``status`` is ``ok`` (200), ``starting`` or ``unavailable`` (503,
    with the error envelope and ``reason``)."""

    status: Literal["ok", "starting", "unavailable"]
    engine_pid: int | None = None
    api_pid: int | None = None
    model: str | None = None
    reason: str | None = None
    error: ErrorDetail | None = None


class VersionResponse(_Doc):
    version: str
    engine_pid: int | None = None
    api_pid: int | None = None
    model: str | None = None


_ERROR_TEXT = {
    400: "a bad request: the message names the field",
    401: "missing or wrong API key",
    403: "refused (a cross-origin browser request, an unkeyed control call addressed by name, or a path "
         "outside --allowed-weights-dir)",
    404: "unknown model or route",
    413: "the body exceeds --max-request-bytes",
    415: "the body is not application/json",
    429: "too many requests waiting (--max-waiting)",
    500: "the server failed (the message says what failed, never how)",
    503: "the engine is unavailable, paused or starting",
    504: "no reply in time",
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI ``responses=`` entries declaring the error envelope."""
    return {c: {"model": ErrorResponse, "description": _ERROR_TEXT.get(c, "error")} for c in codes}


def openapi_body(model: type[BaseModel], *, required: bool = True, description: str | None = None) -> dict[str, Any]:
    """``openapi_extra`` declaring ``model`` as the JSON request body of a
    route that parses its body itself (strictly, via :func:`parse_body`).
    :func:`add_component_schemas` puts the schema under components."""
    _BODY_MODELS[model.__name__] = model
    body: dict[str, Any] = {
        "required": required,
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
    }
    if description:
        body["description"] = description
    return {"requestBody": body}


_BODY_MODELS: dict[str, type[BaseModel]] = {}


def add_component_schemas(spec: dict[str, Any]) -> dict[str, Any]:
    """Put the JSON schema of every model named by :func:`openapi_body`
    (and its nested models) under ``components.schemas`` of ``spec``."""
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    for name, model in _BODY_MODELS.items():
        js = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="validation")
        for sub, sub_js in js.pop("$defs", {}).items():
            schemas.setdefault(sub, sub_js)
        schemas[name] = js
    return spec


SSE_RESPONSE: dict[str, Any] = {
    "text/event-stream": {
        # OpenAPI 3.1: the schema of a text/event-stream describes one event
        "schema": {
            "type": "object",
            "description": "with stream=true, one server-sent event per chunk: data is a chunk JSON "
                           "(text_completion / chat.completion.chunk), an error envelope JSON "
                           "({\"error\": {...}}) when the request fails mid-stream, or [DONE] at the end",
            "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}},
            "required": ["data"],
        }
    }
}

__all__ = [
    "ChatCompletionRequest", "CompletionRequest", "ErrorResponse", "MAX_JSON_DEPTH", "add_component_schemas",
    "chat_messages", "error_body", "error_responses", "loads_object", "loads_strict", "openapi_body", "parse_body",
    "validation_error",
]
