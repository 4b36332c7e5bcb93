"""The gateway's token relay across a sentinel failover (real primary, replica, three sentinels): once
the replica is promoted, events written to the request's record but never published reach the stream,
from the record read that the relay's resubscription triggers — in order, each once; whether the events
come on the request's own channel or grouped on the relay's reply channel."""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Callable

import pytest
import redis

from metrale.gateway.streams.relay import TokenRelay
from metrale.shared.codec import encode
from metrale.shared.keys import Keys
from metrale.shared.messages import TokenEvent, TokenEventGroup
from metrale.shared.record import append_tokens
from metrale.shared.redis_connect import async_client, sync_client
from tests.failover.sentinels import SentinelGroup

pytestmark = pytest.mark.slow

EVENTS_BEFORE = 5
EVENTS_AFTER = 5
WAIT_S = 60.0


def event(request_id: str, seq: int) -> TokenEvent:
    return TokenEvent(request_id, 0, seq, [100 + seq], "worker-1")


@pytest.mark.parametrize("grouped", [False, True], ids=["own-channel", "reply-channel"])
def test_events_written_while_the_relay_was_away_come_from_the_record(
    sentinels: SentinelGroup, caplog: pytest.LogCaptureFixture, grouped: bool
) -> None:
    keys = Keys(f"met-relay-{uuid.uuid4().hex[:8]}")
    request_id = "req-failover"
    relay_id = "relay-failover"
    writer = sync_client(sentinels.url)

    def publish(seq: int) -> None:
        payload = encode(event(request_id, seq))
        with writer.pipeline(transaction=True) as pipe:
            append_tokens(pipe, event(request_id, seq), keys=keys)
            if grouped:
                pipe.publish(keys.reply_channel(relay_id), encode(TokenEventGroup([payload])))
            else:
                pipe.publish(keys.token_channel(request_id), payload)
            pipe.execute()

    def record_only(seq: int) -> None:  # as if published while the relay's connection was down
        with writer.pipeline(transaction=True) as pipe:
            append_tokens(pipe, event(request_id, seq), keys=keys)
            pipe.execute()

    async def scenario() -> list[int]:
        relay = TokenRelay(
            async_client(sentinels.url), keys, idle_fill_s=WAIT_S, relay_id=relay_id
        )  # no idle read: only the resubscribe's
        await relay.start()
        seqs = []
        try:
            async with relay.open(request_id) as stream:
                for seq in range(EVENTS_BEFORE):
                    await asyncio.to_thread(publish, seq)
                    seqs.append((await asyncio.wait_for(stream.next(), WAIT_S)).seq)
                old = await asyncio.to_thread(sentinels.kill_primary)
                await asyncio.to_thread(sentinels.wait_for_promotion, old)
                for seq in range(EVENTS_BEFORE, EVENTS_BEFORE + EVENTS_AFTER):
                    await asyncio.to_thread(_until_served, lambda s=seq: record_only(s))
                # Live again. Should the relay have resubscribed before the writes above (a slow writer),
                # this event's seq reveals the gap, and the record fills it just the same.
                await asyncio.to_thread(publish, EVENTS_BEFORE + EVENTS_AFTER)
                for _ in range(EVENTS_AFTER + 1):
                    seqs.append((await asyncio.wait_for(stream.next(), WAIT_S)).seq)
        finally:
            await relay.close()
        return seqs

    with caplog.at_level(logging.INFO, logger="metrale.gateway.streams.relay"):
        seqs = asyncio.run(scenario())
    writer.close()
    assert seqs == list(range(EVENTS_BEFORE + EVENTS_AFTER + 1))
    resubscribed = rf"request {request_id}: \d+ events read from its record after a reconnect"
    gap = rf"request {request_id}: gap before seq {EVENTS_BEFORE + EVENTS_AFTER}, reading its record"
    assert re.search(resubscribed, caplog.text) or re.search(gap, caplog.text), caplog.text


def _until_served(call: Callable[[], object], timeout_s: float = WAIT_S) -> None:
    """Call until a primary serves it (each call's own retries may end before the promotion settles)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            call()
            return
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "no primary answered"
