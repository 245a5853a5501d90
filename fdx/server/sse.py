"""A server-sent-events response that always runs its cleanup.

Starlette's ``StreamingResponse`` notices a client disconnect only through
``receive`` (ASGI < 2.4) or a failed ``send`` (>= 2.4) and then leaves the
generator to the garbage collector.  :class:`EventStreamResponse` listens for
``http.disconnect`` itself, stops the stream at once, closes the generator
and calls ``on_close`` exactly once in every case (normal end, disconnect,
error), so a disconnected client's engine requests are aborted immediately.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator, Callable

import anyio
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("fdx.server")

#: the scope key of the server's own ``send`` (:class:`ServerSend`)
SERVER_SEND = "fdx.server_send"


class ServerSend:
    """The outermost ASGI layer: keeps the server's own ``send`` in the
    scope, so an event stream sends its body chunks (one per token and
    stream) without going through Starlette's two exception wrappers,
    which only note whether the response started."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[SERVER_SEND] = send
        await self.app(scope, receive, send)


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], None], status_code: int = 200) -> None:
        self.body_iterator = body
        self.on_close = on_close
        self.status_code = status_code
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # the body past Starlette's exception wrappers (they watch only the start): the server's own send
        body_send = scope.get(SERVER_SEND, send)
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        async for chunk in self.body_iterator:
                            await body_send({"type": "http.response.body", "body": chunk, "more_body": True})
                        await body_send({"type": "http.response.body", "body": b"", "more_body": False})
                    finally:
                        tg.cancel_scope.cancel()

                async def listen() -> None:
                    while True:
                        message = await receive()
                        if message["type"] == "http.disconnect":
                            break
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                tg.start_soon(listen)
        except OSError:
            pass  # client went away mid-send
        finally:
            try:
                with anyio.CancelScope(shield=True):
                    await self.body_iterator.aclose()  # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001
                log.exception("error closing an event stream")
            self.on_close()
