"""``redis_connect``'s clients on a real primary, replica and three sentinels: commands and pub/sub
subscriptions follow a ``kill -9`` of the primary to the replica the sentinels promote."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
import redis

from metrale.shared.redis_connect import async_client, sync_client
from tests.failover.sentinels import SentinelGroup

pytestmark = pytest.mark.slow


def test_a_sync_client_and_its_subscription_follow_the_promoted_replica(sentinels: SentinelGroup) -> None:
    client = sync_client(sentinels.url)
    publisher = sync_client(sentinels.url)
    pubsub = client.pubsub()
    pubsub.subscribe("met:test:channel")
    assert pubsub.get_message(timeout=2)["type"] == "subscribe"  # type: ignore[index]
    client.set("met:test:before", "1")
    assert client.wait(1, 2000) == 1  # on the replica before the kill
    old = sentinels.kill_primary()
    _until_served(lambda: client.set("met:test:after", "2"))  # each call retries with backoff, then raises
    assert sentinels.primary_port() != old
    assert client.get("met:test:before") == b"1" and client.get("met:test:after") == b"2"
    heard = _publish_until_heard(publisher, lambda: pubsub.get_message(timeout=0.2))
    assert heard == b"hello"
    pubsub.close()
    client.close()
    publisher.close()


def test_an_asyncio_client_and_its_subscription_follow_the_promoted_replica(sentinels: SentinelGroup) -> None:
    async def scenario() -> bytes:
        client = async_client(sentinels.url)
        pubsub = client.pubsub()
        await pubsub.subscribe("met:test:channel")
        assert (await pubsub.get_message(timeout=2))["type"] == "subscribe"  # type: ignore[index]
        await client.set("met:test:before", "1")
        assert await client.wait(1, 2000) == 1
        old = await asyncio.to_thread(sentinels.kill_primary)
        deadline = time.monotonic() + 30
        while True:
            try:
                await client.set("met:test:after", "2")
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "no primary answered within 30 s"
        assert sentinels.primary_port() != old
        assert await client.get("met:test:before") == b"1"
        heard = None
        deadline = time.monotonic() + 30
        while heard is None and time.monotonic() < deadline:
            await client.publish("met:test:channel", "hello")
            message = await pubsub.get_message(timeout=0.2)
            heard = message["data"] if message is not None and message["type"] == "message" else None
        await pubsub.aclose()
        await client.aclose()
        return heard or b""

    assert asyncio.run(scenario()) == b"hello"


def _until_served(call: Callable[[], object], timeout_s: float = 30.0) -> None:
    """Call until it is served: on a starved machine a failover may outlast one call's retries."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            call()
            return
        except redis.ConnectionError:
            assert time.monotonic() < deadline, f"no primary answered within {timeout_s} s"


def _publish_until_heard(publisher: object, read: object) -> bytes | None:
    """Publish until the subscription (resubscribed on its reconnect) hears it."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        publisher.publish("met:test:channel", "hello")  # type: ignore[attr-defined]
        message = read()  # type: ignore[operator]
        while message is not None:
            if message["type"] == "message":
                return bytes(message["data"])
            message = read()  # type: ignore[operator]
    return None
