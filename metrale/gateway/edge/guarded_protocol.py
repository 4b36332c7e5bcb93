"""uvicorn's HTTP protocols with read timeouts and the connection cap (``connection_guard.py``).

uvicorn times out only idle keep-alive connections: a request line sent halfway, or a body that stops
arriving, holds its socket for ever. ``guarded_protocol`` makes a subclass of uvicorn's httptools
protocol (h11's without httptools) bound to one server's ``ConnectionGuard``; over httptools it answers
``GET /health`` itself (``health_first.py``). Each connection:

- counts itself with the guard when it opens, and is refused (closed) when the guard says so;
- must send a request's line and headers within ``header_timeout_s`` of opening, or of the first
  byte of its next request on a kept-alive connection (uvicorn's keep-alive timer covers the silence
  before it);
- may then let its body stall at most ``body_timeout_s`` between two reads; time the server itself
  does not read (flow control, while the app has not taken what came) does not count.

A connection that runs out of time is closed; a route still reading its body sees the client gone.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, ClassVar

from uvicorn.protocols.http.h11_impl import H11Protocol

from metrale.gateway.edge.connection_guard import ConnectionGuard
from metrale.gateway.edge.health_first import HealthFirstHttpTools
from metrale.shared.settings import HttpLimits

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover (httptools is a dependency of uvicorn[standard])
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    _Base = H11Protocol  # the attributes both of uvicorn's protocols have
else:
    _Base = object

HEADERS = "headers"
BODY = "body"


class _Guarded(_Base):
    """The timers and the guard's bookkeeping, over either of uvicorn's protocols."""

    guard: ClassVar[ConnectionGuard]
    limits: ClassVar[HttpLimits]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._timer: asyncio.TimerHandle | None = None
        self._seen_cycle: object | None = None
        self._in_request = False
        if not self.guard.opened(self):
            transport.close()
            return
        self._arm(HEADERS)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.guard.closed(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._timer is None and not self._in_request:  # the first byte of a kept-alive connection's next request
            self._arm(HEADERS)
        super().data_received(data)
        self._follow_cycle()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        self._follow_cycle()  # h11 starts a pipelined request here
        if self.cycle.response_complete:
            self._in_request = False
            self.guard.idle(self)

    def evict(self) -> None:
        """Close this connection to make room for a new one (the guard has forgotten it already)."""
        self._disarm()
        self.transport.close()

    def _follow_cycle(self) -> None:
        """After a read: a new request's headers are complete once uvicorn has made its cycle; its body
        is complete once ``more_body`` is off."""
        cycle = self.cycle
        if cycle is None:
            return
        if cycle is not self._seen_cycle:
            self._seen_cycle = cycle
            self._in_request = True
            self.guard.in_request(self)
        elif not self._in_request:
            return  # still waiting for the next request's headers
        if cycle.more_body:
            self._arm(BODY)  # re-armed at every read: the body may stall this long between reads
        else:
            self._disarm()

    def _arm(self, phase: str) -> None:
        self._disarm()
        timeout_s = self.limits.header_timeout_s if phase == HEADERS else self.limits.body_timeout_s
        self._timer = self.loop.call_later(timeout_s, self._expired, phase)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self, phase: str) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if phase == BODY and self.flow.read_paused:  # the server is not reading: not the client's stall
            self._arm(BODY)
            return
        self.guard.timed_out(phase)
        self.transport.close()


def guarded_protocol(guard: ConnectionGuard, limits: HttpLimits, *, http: str = "auto") -> type[asyncio.Protocol]:
    """uvicorn's protocol class for ``http`` (``auto``: httptools if installed, else h11) with ``limits``'
    timeouts, counting its connections in ``guard``; pass it as ``uvicorn.Config(http=...)``."""
    httptools = http == "httptools" or (http == "auto" and HttpToolsProtocol is not None)
    bases: tuple[type, ...] = (HealthFirstHttpTools, HttpToolsProtocol) if httptools else (H11Protocol,)
    attributes = {"guard": guard, "limits": limits, "__doc__": f"{bases[-1].__name__} with read timeouts and a cap."}
    return type(f"Guarded{bases[-1].__name__}", (_Guarded, *bases), attributes)
