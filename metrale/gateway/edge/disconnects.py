"""A generation request whose client has gone is cancelled, streamed or not.

A streamed answer hears the disconnect when it writes (Starlette cancels the stream, and
``start_generation`` publishes the cancel). A request answered whole writes only at its end, so
without this layer it kept its slot on the worker until then (2,000 tokens for a ``curl -m1``).
``DisconnectCancels`` waits, once the route has read the whole body, for the server's next ASGI
message: ``http.disconnect`` before the response has started cancels the route, which ends its
generation on the worker within a step (``generation.py``); the request is then answered, to nobody,
with 499, so the access log and ``metrale_requests_total`` count it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from metrale.gateway.errors import CLIENT_CLOSED_REQUEST


class DisconnectCancels:
    """ASGI middleware cancelling requests to ``paths`` whose client disconnects before the answer."""

    def __init__(self, app: ASGIApp, *, paths: Collection[str]) -> None:
        self._app = app
        self._paths = frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self._paths:
            await self._app(scope, receive, send)
            return
        body_read = asyncio.Event()
        response_started = False

        async def app_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                body_read.set()
            return message

        async def app_send(message: Message) -> None:
            nonlocal response_started
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        async def watch(scope_to_cancel: anyio.CancelScope) -> None:
            await body_read.wait()
            message = await receive()  # the server's next message after a whole body: a disconnect
            if message["type"] == "http.disconnect" and not response_started:
                scope_to_cancel.cancel()

        with anyio.CancelScope() as cancel_scope:
            watcher = asyncio.create_task(watch(cancel_scope), name="disconnect watch")
            try:
                await self._app(scope, app_receive, app_send)
            finally:
                watcher.cancel()
        if cancel_scope.cancelled_caught and not response_started:
            await send({"type": "http.response.start", "status": CLIENT_CLOSED_REQUEST, "headers": []})
            await send({"type": "http.response.body", "body": b""})
