"""Work that grows with a request runs off the event loop: other requests and probes keep being served."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

import pytest

from metrale.gateway.request_limits import measure_json
from tests.gateway.harness import MODEL, announcement, gateway_harness

pytestmark = pytest.mark.anyio

BUILTIN = dataclasses.replace(announcement(), max_model_len=50_000)
"""The built-in tokenizer (its template declares tools) with a context a long tools list overflows
once rendered: the gateway does all its work on the prompt, then refuses it (the fake worker shares
the test's event loop, so a prompt it decoded would stall the loop measured)."""


def tool(index: int) -> dict[str, Any]:
    """A function of ~3 KiB of JSON (a large real one) with an enum in each of its 20 parameters."""
    properties = {
        f"p{j}": {"type": "string", "description": f"field {j} of f{index}: " + "d" * 80, "enum": ["a", "b", "c"]}
        for j in range(20)
    }
    parameters = {"type": "object", "properties": properties}
    return {"type": "function", "function": {"name": f"f{index}", "description": "x", "parameters": parameters}}


async def _worst_lag(until: asyncio.Event) -> float:
    worst = 0.0
    while not until.is_set():
        start = time.perf_counter()
        await asyncio.sleep(0.005)
        worst = max(worst, time.perf_counter() - start - 0.005)
    return worst


async def test_the_most_tools_allowed_leave_the_loop_responsive() -> None:
    """128 tools (the default limit) of ~3 KiB each: measured, planned, rendered and tokenized (~400k
    characters) while the loop answers every 5 ms sleep within a generous bound (0.75 s, for a machine
    shared with other test runs; on the loop, rendering and tokenizing stalled it 1.7 s unloaded), then
    refused for the context."""
    tools = [tool(index) for index in range(128)]
    assert 2_500 < measure_json(tools[0], stop_after=10**6).chars < 4_000
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi."}], "tools": tools, "max_tokens": 4}
    body = json.dumps(chat).encode()  # encoded here, not by the client on the loop measured
    async with gateway_harness(model=BUILTIN) as h:
        done = asyncio.Event()
        lag = asyncio.create_task(_worst_lag(done))
        start = time.perf_counter()
        response = await h.http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        took = time.perf_counter() - start
        done.set()
        worst = await lag
        assert h.worker.requests == []
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages", response.text
    assert "50000" in response.json()["error"]["message"]
    assert worst < 0.75, f"the loop stalled {worst:.3f} s while the request took {took:.2f} s"
