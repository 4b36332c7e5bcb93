"""Huge prompts cost the gateway nothing it needs for others: refused by their characters before any
rendering or tokenizing, or tokenized off the event loop (the GIL released), while ``/health`` answers."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import pytest

from tests.gateway.harness import MODEL, announcement, gateway_harness

pytestmark = pytest.mark.anyio

EIGHT_MB = 8_000_000
HEALTH_P99_S = 0.050
REFUSED_WITHIN_S = 1.0
SENTENCE = "The keeper of the light walked along the shore counting waves. "


def _text(chars: int) -> str:
    return (SENTENCE * (chars // len(SENTENCE) + 1))[:chars]


async def _health_while(request: Any, h: Any) -> tuple[Any, float, list[float]]:
    """Send ``request`` while probing ``/health`` every 5 ms: its answer, its latency, the probes' latencies."""
    probes: list[float] = []
    done = asyncio.Event()

    async def probe() -> None:
        while not done.is_set():
            started = time.perf_counter()
            assert (await h.http.get("/health")).status_code == 200
            probes.append(time.perf_counter() - started)
            await asyncio.sleep(0.005)

    prober = asyncio.create_task(probe())
    await asyncio.sleep(0.02)
    started = time.perf_counter()
    answer = await request
    took = time.perf_counter() - started
    done.set()
    await prober
    return answer, took, probes


def _p99(values: list[float]) -> float:
    ranked = sorted(values)
    return ranked[min(len(ranked) - 1, int(len(ranked) * 0.99))]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": _text(EIGHT_MB)}]}),
        ("/v1/completions", {"model": MODEL, "prompt": _text(EIGHT_MB)}),
    ],
    ids=["chat", "completion"],
)
async def test_an_8_mb_prompt_is_refused_within_a_second_and_health_stays_fast(path: str, body: dict[str, Any]) -> None:
    async with gateway_harness() as h:
        answer, took, probes = await _health_while(h.http.post(path, json=body), h)
    print(f"{path}: 400 after {took * 1e3:.0f} ms; /health p99 {_p99(probes) * 1e3:.1f} ms over {len(probes)}")
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "context_length_exceeded"
    assert took < REFUSED_WITHIN_S
    assert _p99(probes) < HEALTH_P99_S
    assert h.worker.requests == []


async def test_a_prompt_that_must_be_tokenized_leaves_the_event_loop_free() -> None:
    """A context too large for the character bound to refuse anything: the prompt is tokenized for real,
    in a thread through the GIL-releasing call, and /health keeps answering meanwhile."""
    async with gateway_harness(request_timeout_s=120.0) as h:
        h.worker.announcement = dataclasses.replace(announcement(), max_model_len=50_000_000)
        await h.worker.announce()
        body = {"model": MODEL, "prompt": _text(2_000_000), "max_tokens": 4}
        answer, took, probes = await _health_while(h.http.post("/v1/completions", json=body), h)
    print(f"tokenized 2 MB in {took:.1f} s; /health p99 {_p99(probes) * 1e3:.1f} ms over {len(probes)} probes")
    assert answer.status_code == 200, answer.json()
    (request,) = h.worker.requests
    assert len(request.prompt_token_ids) > 100_000
    assert len(probes) >= 20
    assert _p99(probes) < HEALTH_P99_S
