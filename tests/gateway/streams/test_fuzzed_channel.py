"""Arbitrary bytes on the channel a request's events come on (its relay's), or in its record, never crash
the gateway: each one is dead-lettered with a reason, and the stream still completes from the worker's
real events."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.shared.codec import decode
from tests.gateway.fake_worker import FakeWorkerScript
from tests.gateway.harness import MODEL, REPLY_TEXT, eventually, gateway_harness, reply_with_eos, sse_payloads

pytestmark = pytest.mark.anyio

COMPLETION = {"model": MODEL, "prompt": "Numbers mattered in her work.", "max_tokens": 50, "stream": True}


def _garbage() -> list[bytes]:
    """Payloads a broken or hostile publisher could send: random bytes (hypothesis), valid msgpack of
    the wrong shape, other messages' kinds, a token event with a broken invariant."""
    drawn: list[bytes] = []

    @settings(max_examples=150, database=None, derandomize=True)
    @given(st.binary(max_size=200))
    def collect(data: bytes) -> None:
        drawn.append(data)

    collect()
    crafted = [
        msgpack.packb({"kind": "token", "v": 1}),
        msgpack.packb({"kind": "cancel", "v": 1, "request_id": "x", "reason": "y"}),
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"kind": "token", "v": 99}),
        b"",
    ]
    return [payload for payload in [*drawn, *crafted] if not _is_events(payload)]


def _is_events(payload: bytes) -> bool:
    return type(decode(payload)).__name__ in ("TokenEvent", "TokenEventGroup")


async def test_garbage_on_the_channel_is_dead_lettered_and_the_stream_completes() -> None:
    garbage = _garbage()
    script = FakeWorkerScript(reply_with_eos, step_s=0.05)
    async with gateway_harness(script) as h:
        answer = asyncio.create_task(h.http.post("/v1/completions", json=COMPLETION))
        await eventually(lambda: _taken(h))
        reply_to = h.worker.requests[0].reply_to
        assert reply_to is not None
        channel = h.keys.reply_channel(reply_to)
        for payload in garbage:
            await h.redis.publish(channel, payload)
        response = await answer
        dead = await h.redis.xrange(h.keys.dead_letter())
    assert response.status_code == 200
    chunks = sse_payloads(response.text)
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks if chunk["choices"]) == REPLY_TEXT
    assert len(dead) == len(garbage)
    assert {fields[b"raw"] for _, fields in dead} == set(garbage)
    assert all(fields[b"reason"] and fields[b"source"].startswith(b"reply channel of relay ") for _, fields in dead)


async def test_a_damaged_record_entry_is_dead_lettered_when_the_gateway_reads_the_record() -> None:
    script = FakeWorkerScript(reply_with_eos, step_s=0.02, unpublished_seqs=frozenset({2}))
    async with gateway_harness(script) as h:
        answer = asyncio.create_task(h.http.post("/v1/completions", json=COMPLETION))
        await eventually(lambda: _taken(h))
        await h.redis.rpush(h.keys.run_events(h.worker.requests[0].request_id), b"\xc1 not an event")
        response = await answer
        dead = await h.redis.xrange(h.keys.dead_letter())
    assert response.status_code == 200  # the gap at seq 2 was filled from the record
    assert dead and all(fields[b"source"].startswith(b"record of ") for _, fields in dead)
    assert {fields[b"raw"] for _, fields in dead} == {b"\xc1 not an event"}


async def _taken(h: object) -> bool:
    return bool(h.worker.requests)  # type: ignore[attr-defined]
