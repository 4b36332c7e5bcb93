"""Requests whose work grows with their size: refused at the edge, before any of that work, and never
a stall for the other tenants."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from tests.hostile.conftest import BETA, GAMMA, Server, error_of
from tests.hostile.health_watch import watching_health

pytestmark = [pytest.mark.slow]

QUICK_REFUSAL_S = 10.0
"""A refusal of a request the gateway must not work on comes this fast (seconds), on two busy cores
(before, the 80,000 stop strings took 65 s and 25,000 tools 43.7 s)."""


def _chat(server: Server, **fields: Any) -> dict[str, Any]:
    return {"model": server.model, "messages": [{"role": "user", "content": "def f("}], **fields}


def _tool(index: int, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    schema = parameters or {"type": "object", "properties": {"x": {"type": "string"}}}
    return {"type": "function", "function": {"name": f"tool_{index}", "parameters": schema}}


def _refused_quickly(server: Server, body: dict[str, Any], param: str, key: str = GAMMA) -> None:
    payload = json.dumps(body).encode()
    with watching_health(server.base_url) as health, server.client(key) as client:
        started = time.monotonic()
        response = client.post("/v1/chat/completions", content=payload, headers={"Content-Type": "application/json"})
        elapsed = time.monotonic() - started
    assert response.status_code in (400, 413, 429), response.text[:500]
    if response.status_code == 400:
        error = error_of(response)
        assert param in (error["param"], error["message"]) or param in error["message"], response.text[:500]
    assert elapsed < QUICK_REFUSAL_S, f"refused after {elapsed:.1f} s"
    health[0].assert_responsive()


def test_eighty_thousand_stop_strings(server: Server) -> None:
    _refused_quickly(server, _chat(server, stop=[f"stop{i}" for i in range(80_000)], max_tokens=300), "stop")


def test_ten_thousand_stop_strings(server: Server) -> None:
    _refused_quickly(server, _chat(server, stop=[f"s{i}" for i in range(10_000)], max_tokens=50), "stop")


def test_twenty_five_thousand_tools(server: Server) -> None:
    _refused_quickly(server, _chat(server, tools=[_tool(i) for i in range(25_000)]), "tools")


def test_ten_thousand_tools_from_a_tenant_at_its_limit(server: Server) -> None:
    """The rate-limited tenant holds its one place with a stream, then sends a huge tool list."""
    holding = threading.Event()
    done = threading.Event()

    def hold_a_place() -> None:
        body = {"model": server.model, "prompt": "def f(", "max_tokens": 400, "stream": True, "ignore_eos": True}
        with server.client(BETA) as client, client.stream("POST", "/v1/completions", json=body) as stream:
            for _ in stream.iter_lines():
                holding.set()
                if done.is_set():
                    break

    holder = threading.Thread(target=hold_a_place, daemon=True)
    holder.start()
    try:
        assert holding.wait(30), "the holding stream never started"
        _refused_quickly(server, _chat(server, tools=[_tool(i) for i in range(10_000)]), "tools", key=BETA)
    finally:
        done.set()
        holder.join(30)


def test_a_hundred_thousand_value_enum(server: Server) -> None:
    schema = {"type": "object", "properties": {"x": {"enum": [f"v{i}" for i in range(100_000)]}}}
    body = _chat(server, response_format={"type": "json_schema", "json_schema": {"name": "big", "schema": schema}})
    _refused_quickly(server, body, "response_format")


def test_a_small_request_asking_for_gigabytes(server: Server) -> None:
    """n 128 × 600 tokens × (1 + 20 alternatives): a 200-byte body asking for a 100 MB answer."""
    body = _chat(server, n=128, logprobs=True, top_logprobs=20, max_tokens=600)
    _refused_quickly(server, body, "max_tokens")
