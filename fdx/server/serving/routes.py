"""The generation routes' handlers: each hands the request to its endpoint
module (``completions.py``, ``chat.py``) with the shared
:class:`~fdx.server.serving.endpoints.OpenAIServing` state.  Kept apart from
``endpoints.py`` so the endpoint modules, which use that state, and the
state itself import each other in one direction only."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from fdx.core.errors import RequestError
from fdx.server.protocol import loads_object
from fdx.server.serving import chat as chat_endpoint
from fdx.server.serving import completions as completions_endpoint
from fdx.server.serving.endpoints import OpenAIServing


async def completions(serving: OpenAIServing, request: Request) -> Response:
    return await completions_endpoint.completions(serving, request, time.time())


async def chat(serving: OpenAIServing, request: Request) -> Response:
    return await chat_endpoint.chat(serving, request, time.time())


async def chat_batch(serving: OpenAIServing, request: Request) -> Response:
    return await chat_endpoint.chat_batch(serving, request, time.time())


async def invocations(serving: OpenAIServing, request: Request) -> Response:
    """SageMaker's ``POST /invocations`` as vLLM serves it: the body's
    shape picks the endpoint -- ``messages`` a chat completion, ``prompt``
    a completion (vLLM tries its request types in that order); anything
    else is a 400 naming the shapes."""
    data = loads_object(await request.body())  # starlette keeps the body: the endpoint reads it again
    if "messages" in data:
        return await chat(serving, request)
    if "prompt" in data:
        return await completions(serving, request)
    raise RequestError("cannot find a suitable handler for this /invocations body: send a chat completion "
                       "('messages') or a completion ('prompt') request", 400)
