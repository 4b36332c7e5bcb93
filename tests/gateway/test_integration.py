"""The gateway against a real Redis (``MET_TEST_REDIS_URL``), with the fake worker."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio

from metrale.gateway.app import connect_redis
from metrale.gateway.streams.relay import TokenRelay
from metrale.shared.codec import encode
from metrale.shared.keys import Keys
from metrale.shared.messages import FinishReason, TokenEvent
from metrale.shared.record import append_tokens
from tests.gateway.harness import MODEL, REPLY_TEXT, gateway_harness, sse_payloads

pytestmark = [pytest.mark.anyio, pytest.mark.redis]


async def test_a_chat_round_trip_through_a_real_redis(real_redis_url: str) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    async with gateway_harness(redis_url=real_redis_url) as h:
        whole = await h.http.post("/v1/chat/completions", json=chat)
        streamed = await h.http.post("/v1/chat/completions", json={**chat, "stream": True, "n": 2})
    assert whole.json()["choices"][0]["message"]["content"] == REPLY_TEXT
    chunks = sse_payloads(streamed.text)
    text = "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"][0]["index"] == 0)
    assert text == REPLY_TEXT


async def test_the_relay_recovers_events_published_while_its_connection_was_down(real_redis_url: str) -> None:
    name = f"met-test-relay-{uuid.uuid4().hex[:8]}"
    keys = Keys(f"met-test-{uuid.uuid4().hex[:12]}")
    listener = connect_redis(real_redis_url)
    listener.connection_pool.connection_kwargs["client_name"] = name  # so that only its connection is killed
    publisher = redis.asyncio.Redis.from_url(real_redis_url)
    relay = TokenRelay(listener, keys)
    await relay.start()
    request_id = "chatcmpl-reconnect"

    async def emit(seq: int) -> None:
        last = seq == 3
        event = TokenEvent(
            request_id, 0, seq, [seq], "w-1", finished=last, finish_reason=FinishReason.STOP if last else None
        )
        async with publisher.pipeline(transaction=True) as pipe:
            pipe.publish(keys.token_channel(request_id), encode(event))
            append_tokens(pipe, event, keys=keys)
            await pipe.execute()

    try:
        async with relay.open(request_id) as stream, asyncio.timeout(3):  # well before an idle fill
            await emit(0)
            assert (await stream.next()).seq == 0
            (pubsub_connection,) = [c for c in await publisher.client_list(_type="pubsub") if c["name"] == name]
            await publisher.client_kill_filter(_id=pubsub_connection["id"])
            for seq in (1, 2, 3):
                await emit(seq)  # nobody of ours is subscribed right now: only the record keeps them
            assert [(await stream.next()).seq for _ in range(3)] == [1, 2, 3]
    finally:
        await relay.close()
        await listener.aclose()
        await publisher.aclose()
