"""Request shards of ``Keys`` (a Redis Cluster's key space, issue #34): one shard keeps today's names; with
several, every key of one request, its stream and its running index share one hash slot, the shards' slots
are distinct and spread, and a shard out of range is refused."""

from __future__ import annotations

import pytest
from redis.cluster import key_slot

from metrale.shared.keys import CLUSTER_SHARDS, Keys, request_shards
from metrale.shared.messages import Priority
from metrale.shared.slots import spread_tags

SHARDED = Keys(shards=12)


def _slot(key: str) -> int:
    return int(key_slot(key.encode()))


def test_one_shard_keeps_the_names_of_one_redis() -> None:
    keys = Keys()
    assert keys.shards == 1 and keys.shard_of("r-1") == 0
    assert keys.request_streams(Priority.INTERACTIVE) == ("met:req:interactive",)
    assert (keys.run_record("r-1"), keys.run_events("r-1"), keys.token_channel("r-1")) == (
        "met:run:r-1",
        "met:run:r-1:events",
        "met:out:r-1",
    )
    assert (keys.running_index(), keys.running_info()) == ("met:running", "met:running:info")


@pytest.mark.parametrize("request_id", ["r-1", "chatcmpl-0a1b2c3d", "batch_req_77_3", "resp_x.y"])
def test_a_request_s_keys_its_stream_and_running_index_share_a_slot(request_id: str) -> None:
    shard = SHARDED.shard_of(request_id)
    tag = spread_tags(12)[shard]
    keys = [
        SHARDED.run_record(request_id),
        SHARDED.run_events(request_id),
        SHARDED.token_channel(request_id),
        SHARDED.request_stream(Priority.INTERACTIVE, shard),
        SHARDED.request_stream(Priority.BATCH, shard),
        SHARDED.running_index(shard),
        SHARDED.running_info(shard),
    ]
    assert {_slot(key) for key in keys} == {_slot(f"{{{tag}}}")}
    assert SHARDED.run_record(request_id) == f"met:run:{{{tag}}}:{request_id}"
    assert SHARDED.request_stream(Priority.BATCH, shard) == f"met:req:{{{tag}}}:batch"


def test_the_streams_of_a_priority_cover_every_shard_on_distinct_slots() -> None:
    streams = SHARDED.request_streams(Priority.INTERACTIVE)
    assert len(streams) == 12 and len({_slot(stream) for stream in streams}) == 12
    assert sorted(_slot(stream) for stream in streams) == [_slot(stream) for stream in streams]  # in slot order
    ids = [f"req-{index}" for index in range(1200)]
    assert {SHARDED.shard_of(request_id) for request_id in ids} == set(range(12))


def test_shards_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="shards must be"):
        Keys(shards=0)
    with pytest.raises(ValueError, match="not one of"):
        SHARDED.request_stream(Priority.INTERACTIVE, 12)
    with pytest.raises(ValueError, match="not one of"):
        Keys().running_index(1)
    with pytest.raises(ValueError, match="invalid request id"):
        SHARDED.run_record("a:b")


def test_a_fleet_on_a_cluster_shards_its_requests_and_one_on_a_redis_does_not() -> None:
    assert Keys.for_redis("redis+cluster://127.0.0.1:7000,127.0.0.1:7001").shards == CLUSTER_SHARDS
    assert Keys.for_redis("rediss+cluster://127.0.0.1:7000", "t").namespace == "t"
    for plain in ("redis://127.0.0.1:6379/2", "redis+sentinel://127.0.0.1:26379/mymaster", None):
        assert Keys.for_redis(plain) == Keys()
    assert request_shards("unix:///tmp/redis.sock") == 1
