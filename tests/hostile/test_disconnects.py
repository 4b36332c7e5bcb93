"""Clients that leave: mid-body, or while a non-streamed answer is generated."""

from __future__ import annotations

import re
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
import redis

from metrale.shared.keys import Keys
from metrale.shared.record import RunStatus, read_record
from tests.hostile.conftest import GAMMA, Server
from tests.hostile.health_watch import watching_health

pytestmark = [pytest.mark.slow]

CUT_BODIES = 11
MAX_TOKENS = 3000
"""Far more than the tiny model makes before the test's client gives up (1 s)."""


def _embedded_redis(server: Server) -> redis.Redis:
    found = re.search(r"embedded Redis \([^)]*\) at (redis://\S+)", server.log())
    assert found is not None, server.log()[-2000:]
    return redis.Redis.from_url(found.group(1))


def _send_part_of_a_body(server: Server) -> None:
    parts = urlsplit(server.base_url)
    with socket.create_connection((parts.hostname, parts.port), timeout=5) as connection:
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {GAMMA}\r\nContent-Length: 100000\r\n\r\n"
        )
        connection.sendall(head.encode() + b'{"model": "metrale-tiny", "messages": [' + b" " * 1000)
        time.sleep(0.05)


def test_bodies_cut_off_mid_read_are_no_server_errors(server: Server) -> None:
    with watching_health(server.base_url) as health:
        for _ in range(CUT_BODIES):
            _send_part_of_a_body(server)
        time.sleep(0.5)
    health[0].assert_responsive()
    log = server.log()
    for sign in ("Traceback", "ClientDisconnect"):
        at = log.find(sign)
        assert at < 0, f"{sign} in the server's log: {log[max(0, at - 500) : at + 1500]}"
    exposition = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    assert not re.search(r'metrale_requests_total\{[^}]*status="500"', exposition), exposition


def test_a_non_streamed_request_whose_client_left_is_cancelled(server: Server) -> None:
    body = {"model": server.model, "prompt": "def f(", "max_tokens": MAX_TOKENS, "ignore_eos": True}
    client = _embedded_redis(server)
    keys = Keys()
    before = set(client.zrange(keys.running_index(), 0, -1))
    with watching_health(server.base_url) as health:
        with pytest.raises(httpx.TimeoutException):
            server.post("/v1/completions", body, key=GAMMA, timeout_s=1.5)
        left_at = time.monotonic()
        running = [rid.decode() for rid in client.zrange(keys.running_index(), 0, -1) if rid not in before]
        assert len(running) == 1, running
        while (record := read_record(client, running[0], keys=keys)) is None or record.status is not RunStatus.FINISHED:
            assert time.monotonic() - left_at < 10, "the request was still running 10 s after its client left"
            time.sleep(0.05)
    health[0].assert_responsive()
    assert len(record.events) < MAX_TOKENS / 2, f"{len(record.events)} tokens made for a client that had left"
    assert time.monotonic() - left_at < 5
