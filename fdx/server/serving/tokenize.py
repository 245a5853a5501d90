"""``POST /tokenize`` and ``POST /detokenize`` with vLLM's shapes: a prompt
(encoded as ``/v1/completions`` encodes it) or chat messages (rendered as
``/v1/chat/completions`` renders them) -> ``{count, max_model_len, tokens,
token_strs}``; token ids -> ``{prompt}``.  Both need only the tokenizer,
not the engine; like vLLM they sit outside ``/v1`` (no API key)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from fdx.core.errors import RequestError
from fdx.chat_template import render_chat
from fdx.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    chat_messages,
    error_responses,
    openapi_body,
    parse_body,
)

if TYPE_CHECKING:
    from fdx.server.serving.endpoints import OpenAIServing


def _tokenizer(serving: OpenAIServing, model: str | None) -> Any:
    serving.check_model(model)
    if serving.tokenizer is None:
        raise RequestError("server is starting (loading the tokenizer)", 503)
    return serving.tokenizer


async def tokenize(serving: OpenAIServing, request: Request) -> Response:
    req: TokenizeRequest = parse_body(await request.body(), TokenizeRequest)
    tok = _tokenizer(serving, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise RequestError("give exactly one of 'prompt' and 'messages'", 400,
                           param="prompt" if req.prompt is not None else "messages")
    if req.prompt is not None:
        ids = (await serving.prompts.encode([req.prompt], req.add_special_tokens is not False, 1 << 62))[0].ids
    else:
        cont = bool(req.continue_final_message)
        if cont and "add_generation_prompt" in req.model_fields_set and req.add_generation_prompt:
            raise RequestError("'continue_final_message' and 'add_generation_prompt' cannot both be true", 400,
                               param="continue_final_message")
        messages = chat_messages(req)  # type: ignore[arg-type]  # the same message model as chat completions
        try:
            text = render_chat(tok, messages, req.add_generation_prompt is not False, cont,
                               dict(req.chat_template_kwargs or {}))
        except Exception as exc:  # noqa: BLE001 - template errors are the caller's input
            raise RequestError(f"cannot apply the chat template: {exc}", 400, param="messages") from None
        ids = tok.encode(text, add_special_tokens=bool(req.add_special_tokens))
    ids = list(ids or [])
    body: dict[str, Any] = {"count": len(ids), "max_model_len": serving.client.max_model_len, "tokens": ids,
                            "token_strs": None}
    if req.return_token_strs:
        body["token_strs"] = [serving.outputs.token_text(t) if serving.outputs else tok.id_to_token(t) for t in ids]
    return JSONResponse(body)


async def detokenize(serving: OpenAIServing, request: Request) -> Response:
    req: DetokenizeRequest = parse_body(await request.body(), DetokenizeRequest)
    tok = _tokenizer(serving, req.model)
    vocab = tok.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab})", 400, param="tokens")
    return JSONResponse({"prompt": tok.decode(req.tokens, skip_special_tokens=False)})


def add_tokenize_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """Declare ``/tokenize`` and ``/detokenize`` (bodies, responses, errors)."""
    errors = error_responses(400, 404, 413, 503)

    @app.post("/tokenize", openapi_extra=openapi_body(TokenizeRequest),
              responses={200: {"model": TokenizeResponse, "description": "the prompt's token ids"}, **errors})
    async def tokenize_route(request: Request) -> Response:
        return await tokenize(serving, request)

    @app.post("/detokenize", openapi_extra=openapi_body(DetokenizeRequest),
              responses={200: {"model": DetokenizeResponse, "description": "the text of the token ids"},
                         **errors})
    async def detokenize_route(request: Request) -> Response:
        return await detokenize(serving, request)
