"""Connections that never finish a request: half-sent request lines are closed after the header
timeout, thousands of half-open sockets past the connection cap give way to fresh ones, and ``/health``
answers on a fresh connection throughout. (``python -m bench.half_open`` holds 20,000.)"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from tests.gateway.edge.test_http_server import closed_by_server
from tests.hostile.conftest import Server, hostile_serve
from tests.hostile.health_watch import watching_health

pytestmark = [pytest.mark.slow]

HEADER_TIMEOUT_S = 2
MAX_CONNECTIONS = 1000
HALF_OPEN = 3000
OPENING_WAVE = 100
"""Sockets opened together, then a pause of ``OPENING_PAUSE_S``: 2,000 a second, as a ramping attacker
opens them (all at once, the gateway accepts a whole backlog in one turn of its loop)."""
OPENING_PAUSE_S = 0.05
HALF_SENT = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: applic"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    settings = {"MET_HTTP_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S), "MET_HTTP_MAX_CONNECTIONS": str(MAX_CONNECTIONS)}
    with hostile_serve(tmp_path_factory.mktemp("connections"), settings) as served:
        yield served


def _address(server: Server) -> tuple[str, int]:
    parts = urlsplit(server.base_url)
    return parts.hostname or "127.0.0.1", parts.port or 80


@contextlib.contextmanager
def _half_open(server: Server, count: int) -> Iterator[list[socket.socket]]:
    sockets: list[socket.socket] = []
    try:
        for opened in range(count):
            sock = socket.create_connection(_address(server), timeout=5)
            sock.sendall(HALF_SENT)
            sockets.append(sock)
            if opened % OPENING_WAVE == OPENING_WAVE - 1:
                time.sleep(OPENING_PAUSE_S)
        yield sockets
    finally:
        for sock in sockets:
            sock.close()


def test_a_half_sent_request_is_closed_after_the_header_timeout(guarded: Server) -> None:
    with _half_open(guarded, 1) as (sock,):
        started = time.monotonic()
        assert closed_by_server(sock, HEADER_TIMEOUT_S + 5), "a half-sent request stayed open"
    assert time.monotonic() - started >= HEADER_TIMEOUT_S - 0.5


def test_thousands_of_half_open_sockets_leave_health_answering(guarded: Server) -> None:
    with watching_health(guarded.base_url) as health, _half_open(guarded, HALF_OPEN) as sockets:
        time.sleep(1.0)
        still_open = sum(not closed_by_server(sock, 0.001) for sock in sockets[-100:])
    health[0].assert_responsive()
    assert still_open > 0, "the newest half-open sockets were closed at once: the cap evicts the oldest"
