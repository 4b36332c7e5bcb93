"""``GET /health`` answered before any other layer of the gateway runs.

The route in ``api/probes.py`` stays for the API description; this layer, outside load shedding and
the whole middleware stack, answers the same body in two sends, so a probe costs the event loop a few
microseconds and never waits on the layers a burst keeps busy (load shedding's settling, the
counters, routing). It still needs the event loop: ``arrivals.py`` lets a burst's requests go a few
per pass so that the loop reads its sockets between them.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

HEALTH_BODY = b'{"status":"ok"}'
_HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(HEALTH_BODY)).encode())]


class HealthFirst:
    """Answers ``GET /health`` itself; hands every other request to ``app``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/health" and scope["method"] == "GET":
            await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
            await send({"type": "http.response.body", "body": HEALTH_BODY})
            return
        await self.app(scope, receive, send)
