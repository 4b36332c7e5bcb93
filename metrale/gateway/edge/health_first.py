"""``GET /health`` answered before any other part of the gateway runs.

Two places answer it, both with the same fixed body:

- ``HealthFirstHttpTools``, mixed into the gateway's httptools protocol (``guarded_protocol.py``):
  once a request's headers are parsed and it is ``GET /health``, the response is written on the
  socket right there, in the read's own callback: no task, no ASGI scope walked through the layers,
  no second loop pass. In a burst the loop's ready queue is long; a probe answered as a task waited
  for one more whole pass of it.
- ``HealthFirst``, the outermost ASGI layer but the access log, for servers on h11 and for the
  in-process clients of the tests. The route in ``api/probes.py`` stays for the API description.

Both log the probe in the access log as any response (``access_log.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Receive, Scope, Send

from metrale.gateway.edge.access_log import log_response

if TYPE_CHECKING:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    _HttpTools = HttpToolsProtocol
else:
    _HttpTools = object

HEALTH_PATH = "/health"
HEALTH_BODY = b'{"status":"ok"}'
_HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(HEALTH_BODY)).encode())]


def is_health(scope: Scope) -> bool:
    """Whether ``scope`` is the probe this module answers."""
    return scope["type"] == "http" and scope["path"] == HEALTH_PATH and scope["method"] == "GET"


def health_response(default_headers: list[tuple[bytes, bytes]], *, keep_alive: bool) -> bytes:
    """The whole HTTP/1.1 response to ``GET /health``, after the server's own headers (date, server)."""
    headers = [*default_headers, *_HEADERS]
    if not keep_alive:
        headers.append((b"connection", b"close"))
    lines = [b"HTTP/1.1 200 OK\r\n", *(name + b": " + value + b"\r\n" for name, value in headers), b"\r\n"]
    return b"".join(lines) + HEALTH_BODY


class HealthFirst:
    """Answers ``GET /health`` itself; hands every other request to ``app``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if is_health(scope):
            await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
            await send({"type": "http.response.body", "body": HEALTH_BODY})
            return
        await self.app(scope, receive, send)


class HealthFirstHttpTools(_HttpTools):
    """Over uvicorn's httptools protocol: ``GET /health`` answered when its headers are complete."""

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        if not is_health(cycle.scope):
            super()._start_asgi_task(cycle, app)
            return
        self.transport.write(health_response(self.server_state.default_headers, keep_alive=cycle.keep_alive))
        log_response(cycle.scope, 200)
        # The cycle is done: a body the probe sent is read and dropped (uvicorn's parser callbacks skip a
        # complete cycle), and the connection's timers see a request whose body is read.
        cycle.response_started = cycle.response_complete = True
        cycle.more_body = False
        cycle.message_event.set()
        if not cycle.keep_alive:
            self.transport.close()
        self.on_response_complete()
