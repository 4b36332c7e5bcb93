"""A gateway's dead letter lands in the shard of the request it concerns (one stream on one Redis)."""

from __future__ import annotations

import uuid
from typing import cast

import pytest

from metrale.shared.dead_letters import MAX_RAW_BYTES, add_dead_letter
from metrale.shared.keys import Keys
from metrale.shared.redis_connect import connect_async

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_dead_letter_goes_to_its_requests_shard(any_redis_url: str) -> None:
    client = connect_async(any_redis_url)
    keys = Keys.for_redis(any_redis_url, f"met-test-{uuid.uuid4().hex[:12]}")
    try:
        ids = [f"chatcmpl-{n}" for n in range(8)]
        for request_id in ids:
            await add_dead_letter(client, keys, reason="undecodable", source="relay", raw=b"x", request_id=request_id)
        await add_dead_letter(client, keys, reason="undecodable", source="relay", raw=b"\x00" * (2 * MAX_RAW_BYTES))
        counts = [await client.xlen(stream) for stream in keys.dead_letters()]
        expected = [0] * keys.shards
        for request_id in ids:
            expected[keys.shard_of(request_id)] += 1
        expected[0] += 1
        assert counts == expected
        newest = cast(list[tuple[bytes, dict[bytes, bytes]]], await client.xrevrange(keys.dead_letter(0), count=1))
        ((_, fields),) = newest
        assert len(fields[b"raw"]) == MAX_RAW_BYTES and fields[b"source"] == b"relay"
    finally:
        await client.aclose()
