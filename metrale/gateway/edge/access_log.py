"""The gateway's HTTP access log: a line per response, except 429s, which are counted.

A burst the fleet cannot take is answered with hundreds of 429s within milliseconds. uvicorn's own
access log (off in ``met gateway`` and ``met serve``) writes a line for each: ~45 µs a response here,
which doubled the time the last refusal of a 300-request burst waited for its answer, and filled the
log with one line repeated. ``AccessLog`` is the outermost layer of the app (``GatewayApp``): it logs
each response's status line in uvicorn's format on the ``metrale.gateway.access`` logger when the
response starts, and for a 429 only counts it; ``report`` logs the count once per interval while there
are any, so the log still says how much was refused, and when. Every refusal is also counted in
``metrale_requests_total``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import logging.handlers
import queue
import time
from collections.abc import Iterator

from starlette.types import ASGIApp, Message, Receive, Scope, Send

REPORT_EVERY_S = 10.0

access_logger = logging.getLogger("metrale.gateway.access")


@contextlib.contextmanager
def written_by_a_thread() -> Iterator[None]:
    """While open, the access log's lines are written by a thread of their own: the event loop only
    queues each record (``QueueHandler``); a ``QueueListener`` thread hands it to the handlers the line
    would have reached (the parents', as when it propagates). Closing writes what is queued."""
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    listener = logging.handlers.QueueListener(records, _Propagated(access_logger))
    handler = logging.handlers.QueueHandler(records)
    listener.start()
    access_logger.addHandler(handler)
    access_logger.propagate = False
    try:
        yield
    finally:
        access_logger.propagate = True
        access_logger.removeHandler(handler)
        listener.stop()


class _Propagated(logging.Handler):
    """Hands a record to the handlers above ``logger`` (what propagating it would have reached)."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self._logger = logger

    def emit(self, record: logging.LogRecord) -> None:
        if self._logger.parent is not None:
            self._logger.parent.callHandlers(record)


class AccessLog:
    """The 429s answered since the last report (``pending``), and the reports of them."""

    def __init__(self) -> None:
        self.pending = 0
        self._since = time.monotonic()

    def refused(self) -> None:
        """Count one 429."""
        if not self.pending:
            self._since = time.monotonic()
        self.pending += 1

    def flush(self) -> None:
        """Log the 429s counted since the last report, if any."""
        if self.pending:
            seconds = time.monotonic() - self._since
            access_logger.info("answered %d requests with 429 (busy or over a limit) in %.1f s", self.pending, seconds)
            self.pending = 0

    async def report(self, every_s: float = REPORT_EVERY_S) -> None:
        """Log the count every ``every_s`` while 429s are counted; once more when cancelled."""
        try:
            while True:
                await asyncio.sleep(every_s)
                self.flush()
        finally:
            self.flush()

    async def stop(self, reports: asyncio.Task[None]) -> None:
        """Stop ``reports`` (a task running ``report``), logging what it counted last."""
        reports.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reports


class AccessLogged:
    """An ASGI layer logging each HTTP response of ``app`` into ``log``."""

    def __init__(self, app: ASGIApp, *, log: AccessLog) -> None:
        self._app = app
        self._log = log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not access_logger.isEnabledFor(logging.INFO):
            await self._app(scope, receive, send)
            return

        async def logged_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self._note(scope, message["status"])
            await send(message)

        await self._app(scope, receive, logged_send)

    def _note(self, scope: Scope, status: int) -> None:
        if status == 429:
            self._log.refused()
            return
        log_response(scope, status)


def log_response(scope: Scope, status: int) -> None:
    """One line for the response to ``scope``, in uvicorn's access log format."""
    if not access_logger.isEnabledFor(logging.INFO):
        return
    client = scope.get("client")
    where = f"{client[0]}:{client[1]}" if client else "-"
    query = scope.get("query_string", b"")
    path = scope["path"] + ("?" + query.decode("latin-1") if query else "")
    access_logger.info('%s - "%s %s HTTP/%s" %d', where, scope["method"], path, scope["http_version"], status)
