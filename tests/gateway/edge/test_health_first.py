"""``GET /health`` is answered without the app behind it: by the gateway's httptools protocol itself when
its headers are complete, by the outermost ASGI layer otherwise (h11, in-process clients)."""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

import httpx
import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from metrale.gateway.edge.access_log import access_logger
from metrale.gateway.edge.connection_guard import ConnectionGuard
from metrale.gateway.edge.guarded_protocol import guarded_protocol
from metrale.gateway.edge.health_first import HEALTH_BODY, HealthFirst
from metrale.gateway.edge.http_server import uvicorn_config
from metrale.shared.settings import GatewaySettings, HttpLimits
from tests.gateway.threaded_server import port_of, running_in_thread


async def stuck_app(scope: Scope, receive: Receive, send: Send) -> None:
    """An app busy elsewhere: anything that reaches it fails."""
    raise AssertionError(f"{scope['method']} {scope['path']} reached the app")


@pytest.mark.anyio
async def test_health_is_answered_without_the_app() -> None:
    transport = httpx.ASGITransport(app=HealthFirst(stuck_app))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        response = await client.get("/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}
    assert response.headers["content-type"] == "application/json"


@pytest.mark.anyio
async def test_every_other_request_goes_to_the_app() -> None:
    transport = httpx.ASGITransport(app=HealthFirst(stuck_app))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        for method, path in [("POST", "/health"), ("GET", "/ready"), ("GET", "/healthz")]:
            with pytest.raises(AssertionError, match="reached the app"):
                await client.request(method, path)


@contextlib.contextmanager
def served(app: ASGIApp, http_impl: str, limits: HttpLimits | None = None) -> Iterator[int]:
    """``app`` behind the gateway's own protocol for ``http_impl`` on a free loopback port: the port."""
    settings = GatewaySettings(
        redis_url=None, api_keys={}, request_timeout_s=5, max_queue=10, heartbeat_ttl_s=10, http=limits or HttpLimits()
    )
    config = uvicorn_config(app, settings, host="127.0.0.1", port=0)
    config.http = guarded_protocol(ConnectionGuard(100), settings.http, http=http_impl)
    with running_in_thread(config, name="health under test") as server:
        yield port_of(server)


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


def exchange(sock: socket.socket, request: bytes, answers: int) -> list[Answer]:
    """Send ``request`` (one or more pipelined requests) on ``sock``; the next ``answers`` responses."""
    sock.sendall(request)
    reader = sock.makefile("rb")
    return [read_answer(reader) for _ in range(answers)]


def read_answer(reader: BinaryIO) -> Answer:
    """One response from ``reader`` (its body when it has a ``content-length``)."""
    status = int(reader.readline().split()[1])
    headers = {}
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return Answer(status, headers, reader.read(int(headers.get("content-length", 0))))


GET_HEALTH = b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n"


@pytest.mark.parametrize("http_impl", ["h11", "httptools"])
def test_a_kept_alive_connection_gets_health_then_its_next_requests(http_impl: str) -> None:
    limits = HttpLimits(header_timeout_s=1.0, body_timeout_s=0.5)
    with (
        served(HealthFirst(refusing_app), http_impl, limits) as port,
        socket.create_connection(("127.0.0.1", port)) as sock,
    ):
        sock.settimeout(10)
        first = exchange(sock, GET_HEALTH + GET_HEALTH + b"GET /ready HTTP/1.1\r\nHost: gateway\r\n\r\n", 3)
        time.sleep(1.5)  # past both read timeouts: an idle kept-alive connection waits for keep-alive's
        (again,) = exchange(sock, b"GET /health HTTP/1.1\r\nHost: gateway\r\nContent-Length: 3\r\n\r\nabc", 1)
        (last,) = exchange(sock, b"GET /health HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n\r\n", 1)
        assert sock.recv(1) == b""  # closed, as asked
    assert [(r.status, r.body) for r in first] == [(200, HEALTH_BODY), (200, HEALTH_BODY), (503, b"busy")]
    assert first[0].headers["content-type"] == "application/json" and "date" in first[0].headers
    assert (again.status, again.body) == (200, HEALTH_BODY)
    assert (last.status, last.headers.get("connection")) == (200, "close")


def test_over_httptools_health_is_answered_without_an_asgi_task(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=access_logger.name)
    with served(stuck_app, "httptools") as port, socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(10)
        responses = exchange(sock, GET_HEALTH * 3, 3)
    assert [(r.status, r.body) for r in responses] == [(200, HEALTH_BODY)] * 3
    lines = [record.getMessage() for record in caplog.records if record.name == access_logger.name]
    assert len(lines) == 3 and all('"GET /health HTTP/1.1" 200' in line for line in lines), lines


def test_over_h11_health_is_answered_by_the_asgi_layer() -> None:
    with served(stuck_app, "h11") as port, socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(10)
        (response,) = exchange(sock, GET_HEALTH, 1)
    assert response.status == 500  # the app was called: only HealthFirst answers /health over h11


async def refusing_app(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers every request 503 ``busy``."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 503, "headers": [(b"content-length", b"4")]})
    await send({"type": "http.response.body", "body": b"busy"})
