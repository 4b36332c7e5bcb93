"""The relay: one pub/sub connection, and a client stream that never skips or repeats a token."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import fakeredis
import pytest
import redis.asyncio

from metrale.gateway.streams.event_stream import EventStream
from metrale.gateway.streams.relay import TokenRelay
from metrale.shared.codec import encode
from metrale.shared.keys import Keys
from metrale.shared.messages import FinishReason, TokenEvent
from metrale.shared.record import append_tokens
from tests.gateway.fake_worker import FakeWorkerScript
from tests.gateway.harness import MODEL, REPLY_TEXT, gateway_harness, reply_with_eos, sse_payloads

pytestmark = pytest.mark.anyio

RID = "chatcmpl-relay"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}


def event(seq: int, *, last: bool = False) -> TokenEvent:
    reason = FinishReason.STOP if last else None
    return TokenEvent(RID, 0, seq, [100 + seq], "w-1", finished=last, finish_reason=reason)


@pytest.fixture
async def relay_on_fakeredis() -> AsyncIterator[tuple[TokenRelay, redis.asyncio.Redis, Keys]]:
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
    keys = Keys(f"met-test-{uuid.uuid4().hex[:12]}")
    relay = TokenRelay(client, keys)
    await relay.start()
    yield relay, client, keys
    await relay.close()
    await client.aclose()


async def record_only(client: redis.asyncio.Redis, keys: Keys, *events: TokenEvent) -> None:
    """Write ``events`` to the durable record without publishing them (as if the messages were lost)."""
    async with client.pipeline(transaction=True) as pipe:
        for item in events:
            append_tokens(pipe, item, keys=keys)
        await pipe.execute()


async def publish(client: redis.asyncio.Redis, keys: Keys, item: TokenEvent) -> None:
    async with client.pipeline(transaction=True) as pipe:
        pipe.publish(keys.token_channel(RID), encode(item))
        append_tokens(pipe, item, keys=keys)
        await pipe.execute()


async def read_seqs(stream: EventStream, count: int) -> list[int]:
    async with asyncio.timeout(3):
        return [(await stream.next()).seq for _ in range(count)]


async def test_a_gap_is_filled_from_the_record(
    relay_on_fakeredis: tuple[TokenRelay, redis.asyncio.Redis, Keys],
) -> None:
    relay, client, keys = relay_on_fakeredis
    async with relay.open(RID) as stream:
        await publish(client, keys, event(0))
        await record_only(client, keys, event(1), event(2))
        await publish(client, keys, event(3, last=True))
        assert await read_seqs(stream, 4) == [0, 1, 2, 3]


async def test_events_written_before_the_subscription_took_effect_are_read_from_the_record(
    relay_on_fakeredis: tuple[TokenRelay, redis.asyncio.Redis, Keys],
) -> None:
    relay, client, keys = relay_on_fakeredis
    await record_only(client, keys, event(0), event(1, last=True))
    async with relay.open(RID) as stream:  # what a resubscription after a reconnect also triggers
        assert await read_seqs(stream, 2) == [0, 1]


async def test_a_lost_last_event_is_found_when_the_stream_goes_quiet(
    relay_on_fakeredis: tuple[TokenRelay, redis.asyncio.Redis, Keys],
) -> None:
    relay, client, keys = relay_on_fakeredis
    relay.idle_fill_s = 0.05
    async with relay.open(RID) as stream:
        await asyncio.sleep(0.05)  # past the subscribe confirmation's own read
        await publish(client, keys, event(0))
        await record_only(client, keys, event(1, last=True))
        assert await read_seqs(stream, 2) == [0, 1]


async def test_closing_a_stream_unsubscribes_its_channel(
    relay_on_fakeredis: tuple[TokenRelay, redis.asyncio.Redis, Keys],
) -> None:
    relay, client, keys = relay_on_fakeredis
    async with relay.open(RID):
        assert await client.pubsub_numsub(keys.token_channel(RID)) == [(keys.token_channel(RID).encode(), 1)]

    async def channel_count() -> int:
        ((_, count),) = await client.pubsub_numsub(keys.token_channel(RID))
        return int(count)

    async with asyncio.timeout(2):
        while await channel_count() != 0:
            await asyncio.sleep(0.01)


async def test_channels_closed_together_leave_in_one_unsubscribe_and_a_reopened_one_stays(
    relay_on_fakeredis: tuple[TokenRelay, redis.asyncio.Redis, Keys], monkeypatch: pytest.MonkeyPatch
) -> None:
    relay, client, keys = relay_on_fakeredis
    sent: list[tuple[str, ...]] = []
    unsubscribe = relay._pubsub.unsubscribe

    async def recorded(*channels: str) -> object:
        sent.append(channels)
        return await unsubscribe(*channels)

    monkeypatch.setattr(relay._pubsub, "unsubscribe", recorded)
    ids = ["req-a", "req-b", "req-c"]
    for request_id in ids:
        async with relay.open(request_id):
            pass
    async with relay.open("req-b"):  # closed a moment ago, opened again before the unsubscribe went out
        await asyncio.sleep(0.2)
        counts = dict(await client.pubsub_numsub(*(keys.token_channel(r) for r in ids)))
        assert counts == {keys.token_channel("req-a").encode(): 0, keys.token_channel("req-b").encode(): 1,
                          keys.token_channel("req-c").encode(): 0}  # fmt: skip
    assert sorted(sent[0]) == [keys.token_channel("req-a"), keys.token_channel("req-c")]


@pytest.mark.parametrize(
    "script",
    [
        pytest.param(FakeWorkerScript(reply_with_eos, unpublished_seqs=frozenset({2, 3, 7})), id="lost-messages"),
        pytest.param(FakeWorkerScript(reply_with_eos, republished_seqs=frozenset({0, 4, 5})), id="duplicates"),
    ],
)
async def test_the_client_sees_each_token_once_whatever_pub_sub_does(script: FakeWorkerScript) -> None:
    async with gateway_harness(script) as h:
        response = await h.http.post("/v1/chat/completions", json=CHAT)
    text = "".join(chunk["choices"][0]["delta"]["content"] for chunk in sse_payloads(response.text))
    assert text == REPLY_TEXT


async def test_concurrent_streams_each_get_their_own_tokens() -> None:
    async with gateway_harness(FakeWorkerScript(reply_with_eos, step_s=0.01)) as h:
        responses = await asyncio.gather(*(h.http.post("/v1/chat/completions", json=CHAT) for _ in range(4)))
    for response in responses:
        chunks = sse_payloads(response.text)
        assert "".join(chunk["choices"][0]["delta"]["content"] for chunk in chunks) == REPLY_TEXT
    assert len({chunk["id"] for response in responses for chunk in sse_payloads(response.text)}) == 4


async def test_a_request_submitted_through_the_relay_subscribes_no_channel_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with gateway_harness(FakeWorkerScript(reply_with_eos, step_s=0.01)) as h:
        relay = h.app.state.gateway.relay
        subscribed: list[str] = []
        subscribe = relay._pubsub.subscribe

        async def recorded(*channels: str, **handlers: object) -> object:
            subscribed.extend(channels)
            return await subscribe(*channels, **handlers)

        monkeypatch.setattr(relay._pubsub, "subscribe", recorded)
        response = await h.http.post("/v1/chat/completions", json=CHAT)
    text = "".join(chunk["choices"][0]["delta"]["content"] for chunk in sse_payloads(response.text))
    assert text == REPLY_TEXT  # every event came on the relay's channel, subscribed at its start
    assert subscribed == []
