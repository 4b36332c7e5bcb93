"""The gateway's uvicorn server (``http_server.uvicorn_config``) on a real socket: slow headers and
stalled bodies are closed, and 2,000 half-open sockets against a cap of 500 leave ``/health``
answering on fresh connections."""

from __future__ import annotations

import contextlib
import http.client
import resource
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import fakeredis
import pytest
import uvicorn

from metrale.gateway.app import create_app
from metrale.gateway.edge.http_server import FD_RESERVE, connection_cap, raise_open_file_limit, uvicorn_config
from metrale.shared.settings import GatewaySettings, HttpLimits
from tests.gateway.threaded_server import port_of, running_in_thread

HALF_SENT = b"GET /health HTTP/1.1\r\nHost: gateway\r\n"  # no blank line: the headers never end


@dataclass
class Served:
    port: int
    server: uvicorn.Server


@contextlib.contextmanager
def serving(limits: HttpLimits) -> Iterator[Served]:
    """The gateway app (on fakeredis) served with ``limits`` on a free loopback port, in a thread."""
    settings = GatewaySettings(
        redis_url=None, api_keys={}, request_timeout_s=5, max_queue=10, heartbeat_ttl_s=10, http=limits
    )
    app = create_app(settings, redis=fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer()))
    config = uvicorn_config(app, settings, host="127.0.0.1", port=0)
    with running_in_thread(config, name="gateway under test") as server:
        yield Served(port_of(server), server)


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closes ``sock`` (EOF or reset) within ``within_s`` seconds."""
    sock.settimeout(within_s)
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def health_latency_s(port: int) -> float:
    """Seconds for ``GET /health`` on a fresh connection; fails unless it answers 200."""
    start = time.monotonic()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", "/health")
        response = connection.getresponse()
        assert response.status == 200 and response.read() == b'{"status":"ok"}'
    finally:
        connection.close()
    return time.monotonic() - start


def test_a_half_sent_request_is_closed_after_the_header_timeout() -> None:
    with serving(HttpLimits(header_timeout_s=1.0)) as served:
        with (
            socket.create_connection(("127.0.0.1", served.port)) as silent,
            socket.create_connection(("127.0.0.1", served.port)) as half_sent,
        ):
            half_sent.sendall(HALF_SENT)
            start = time.monotonic()
            assert closed_by_server(half_sent, within_s=5)
            assert closed_by_server(silent, within_s=5)
            assert 0.8 < time.monotonic() - start < 5
        assert health_latency_s(served.port) < 5  # a request sent whole is answered


def test_a_stalled_body_is_closed_after_the_body_timeout() -> None:
    limits = HttpLimits(header_timeout_s=1.0, body_timeout_s=1.5)
    with serving(limits) as served, socket.create_connection(("127.0.0.1", served.port)) as stalled:
        stalled.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n" + b'{"model": "x", '
        )
        for _ in range(3):  # a body that trickles in is not stalled, however long it takes in all
            time.sleep(0.8)
            stalled.sendall(b" ")
        assert not closed_by_server(stalled, within_s=0.5)
        start = time.monotonic()
        assert closed_by_server(stalled, within_s=5)
        assert 0.5 < time.monotonic() - start < 5


def test_half_open_sockets_past_the_cap_leave_health_answering() -> None:
    with serving(HttpLimits(header_timeout_s=60.0, max_connections=500)) as served:
        sockets = []
        try:
            for _ in range(2000):
                sock = socket.create_connection(("127.0.0.1", served.port), timeout=10)
                sock.sendall(HALF_SENT)
                sockets.append(sock)
            latencies = sorted(health_latency_s(served.port) for _ in range(50))
            closed = sum(closed_by_server(sock, within_s=0.001) for sock in sockets[:1500])
            still_open = sum(not closed_by_server(sock, within_s=0.001) for sock in sockets[-400:])
        finally:
            for sock in sockets:
                sock.close()
    assert latencies[-1] < 2.0, latencies[-5:]  # generous: the bench measures p99 < 50 ms
    assert closed >= 1450  # the oldest made room for the newer (a few may still be in flight)
    assert still_open == 400  # the newest are the ones kept


def test_a_new_connection_is_refused_when_every_one_is_in_a_request() -> None:
    with serving(HttpLimits(body_timeout_s=30.0, max_connections=5)) as served:
        busy = []
        try:
            for _ in range(5):
                sock = socket.create_connection(("127.0.0.1", served.port))
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Length: 100\r\n\r\n{")
                busy.append(sock)
            time.sleep(0.3)
            with socket.create_connection(("127.0.0.1", served.port)) as refused:
                assert closed_by_server(refused, within_s=5)
            assert not any(closed_by_server(sock, within_s=0.01) for sock in busy)
        finally:
            for sock in busy:
                sock.close()


@pytest.mark.parametrize("http_impl", ["h11", "httptools"])
def test_both_protocols_time_out_half_sent_requests(http_impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import metrale.gateway.edge.http_server as http_server

    real = http_server.guarded_protocol
    monkeypatch.setattr(http_server, "guarded_protocol", lambda guard, limits: real(guard, limits, http=http_impl))
    with serving(HttpLimits(header_timeout_s=1.0)) as served:
        assert served.server.config.http_protocol_class.__name__.lower().startswith(f"guarded{http_impl}")
        with socket.create_connection(("127.0.0.1", served.port)) as half_sent:
            half_sent.sendall(HALF_SENT)
            assert closed_by_server(half_sent, within_s=5)
        assert health_latency_s(served.port) < 5


def test_the_cap_stays_below_what_the_process_can_open() -> None:
    assert connection_cap(10_000, open_files=20_000) == 10_000
    assert connection_cap(30_000, open_files=20_000) == 20_000 - FD_RESERVE
    assert connection_cap(5, open_files=1024) == 5
    assert connection_cap(1000, open_files=1024) == 64  # a floor where the limit leaves almost nothing


def test_the_open_file_limit_is_raised_to_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 1024), hard))
        assert raise_open_file_limit() == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] in (hard, 1 << 20)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
