"""The drained relay (every buffered pub/sub reply per wake-up) against the one-message-per-read relay,
its reference twin, on a real Redis: the same events reach every stream, in the same order, whether they
come one by one on each request's channel or grouped on the relay's reply channel."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio

from metrale.gateway.streams.event_stream import EventStream
from metrale.gateway.streams.pubsub_drain import buffered_replies, can_drain
from metrale.gateway.streams.relay import TokenRelay
from metrale.shared.codec import encode
from metrale.shared.keys import Keys
from metrale.shared.messages import FinishReason, TokenEvent, TokenEventGroup
from metrale.shared.record import append_tokens
from metrale.shared.redis_connect import async_client

pytestmark = pytest.mark.anyio

STREAMS = 8
EVENTS = 40


def event(request_id: str, seq: int) -> TokenEvent:
    last = seq == EVENTS - 1
    reason = FinishReason.LENGTH if last else None
    return TokenEvent(request_id, 0, seq, [1000 + seq], "w-1", finished=last, finish_reason=reason)


@pytest.fixture
async def client(real_redis_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    client = async_client(real_redis_url)
    yield client
    await client.aclose()


async def publish_burst(
    client: redis.asyncio.Redis, keys: Keys, request_ids: list[str], relay_id: str | None = None
) -> None:
    """Every stream's events in one pipeline (so they arrive together), interleaved across streams and
    out of order within each, with duplicates, a message that is not an event, and a lost one (in the
    record only). With ``relay_id``, on that relay's reply channel in groups of up to 7 (as workers
    would send them, one per step), with a group that is not one, an undecodable event inside a group
    and an event of a request not open there."""
    rng = random.Random(7)
    sends = [(rid, seq) for rid in request_ids for seq in range(EVENTS)]
    rng.shuffle(sends)
    sends += [(request_ids[0], 3), (request_ids[1], 0)]  # duplicates
    async with client.pipeline(transaction=False) as pipe:
        for rid in request_ids:  # the record is complete, as the worker writes it
            for seq in range(EVENTS):
                append_tokens(pipe, event(rid, seq), keys=keys)
        sends = [send for send in sends if send != (request_ids[2], 5)]  # lost on the way
        if relay_id is None:
            for rid, seq in sends:
                pipe.publish(keys.token_channel(rid), encode(event(rid, seq)))
            pipe.publish(keys.token_channel(request_ids[3]), b"not an event")
        else:
            channel = keys.reply_channel(relay_id)
            pipe.publish(channel, b"not a group")
            pipe.publish(channel, encode(TokenEventGroup([b"not an event", encode(event("req-elsewhere", 0))])))
            for start in range(0, len(sends), 7):
                group = [encode(event(rid, seq)) for rid, seq in sends[start : start + 7]]
                pipe.publish(channel, encode(TokenEventGroup(group)))
        await pipe.execute()


async def relayed(
    client: redis.asyncio.Redis, *, drain: bool, grouped: bool = False
) -> tuple[dict[str, list[TokenEvent]], int]:
    """What each stream reads through a relay of ``drain``, and how many ``get_message`` calls it made;
    ``grouped``: the events come on the relay's reply channel."""
    keys = Keys(f"met-test-{uuid.uuid4().hex[:12]}")
    relay = TokenRelay(client, keys, drain=drain, idle_fill_s=60.0)  # no stream waits that long here
    calls = 0
    get_message = relay._pubsub.get_message

    async def counted(*args: object, **kwargs: object) -> object:
        nonlocal calls
        calls += 1
        return await get_message(*args, **kwargs)  # type: ignore[arg-type]

    relay._pubsub.get_message = counted  # type: ignore[method-assign]
    request_ids = [f"req-{n}" for n in range(STREAMS)]
    await relay.start()
    try:
        async with asyncio.timeout(10):
            streams: dict[str, EventStream] = {}
            opened = [relay.open(rid) for rid in request_ids]
            for rid, context in zip(request_ids, opened, strict=True):
                streams[rid] = await context.__aenter__()
            await asyncio.sleep(0.2)  # every subscription confirmed (each also reads the empty record)
            await publish_burst(client, keys, request_ids, relay.relay_id if grouped else None)
            read = {rid: [await stream.next() for _ in range(EVENTS)] for rid, stream in streams.items()}
            for context in opened:
                await context.__aexit__(None, None, None)
    finally:
        await relay.close()
    return read, calls


async def test_the_drained_relay_delivers_what_the_one_at_a_time_relay_does(client: redis.asyncio.Redis) -> None:
    drained, drained_reads = await relayed(client, drain=True)
    reference, reference_reads = await relayed(client, drain=False)

    assert drained == reference
    assert all([e.seq for e in events] == list(range(EVENTS)) for events in drained.values())
    assert drained_reads < reference_reads  # the fast path is in use with this redis-py and hiredis


@pytest.mark.parametrize("drain", [True, False], ids=["drained", "one-at-a-time"])
async def test_grouped_events_reach_every_stream_as_events_on_their_own_channels_do(
    client: redis.asyncio.Redis, drain: bool
) -> None:
    grouped, _ = await relayed(client, drain=drain, grouped=True)
    reference, _ = await relayed(client, drain=False)

    assert grouped == reference
    assert all([e.seq for e in events] == list(range(EVENTS)) for events in grouped.values())


async def test_buffered_replies_are_taken_in_order_and_only_once(client: redis.asyncio.Redis) -> None:
    pubsub = client.pubsub()
    await pubsub.subscribe("drain-test")
    assert await pubsub.get_message(timeout=2) is not None  # the subscribe confirmation
    assert can_drain(pubsub.connection)
    for n in range(5):
        await client.publish("drain-test", b"m%d" % n)
    await asyncio.sleep(0.1)
    first = await pubsub.get_message(timeout=2)
    rest = buffered_replies(pubsub.connection)
    assert first is not None and first["data"] == b"m0"
    assert [list(reply) for reply in rest] == [[b"message", b"drain-test", b"m%d" % n] for n in range(1, 5)]
    assert buffered_replies(pubsub.connection) == []
    await pubsub.aclose()
