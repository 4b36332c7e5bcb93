"""``slots.py``: shard tags spread evenly over the hash slots, away from range edges; a request's shard is
a pure function of its id that spreads ids evenly. (On a real cluster: ``tests/failover/test_cluster_clients.py``.)"""

from __future__ import annotations

from collections import Counter

import pytest
from redis.cluster import key_slot

from metrale.shared.slots import MAX_SHARDS, SLOTS, shard_of, slot_of, spread_tags


@pytest.mark.parametrize("count", [1, 2, 3, 12, 16, 64])
def test_each_tag_sits_in_the_middle_of_its_own_slot_range(count: int) -> None:
    tags = spread_tags(count)
    assert len(tags) == len(set(tags)) == count
    width = SLOTS / count
    for shard, tag in enumerate(tags):
        assert shard * width + width / 4 <= slot_of(tag) < shard * width + 3 * width / 4
        assert key_slot(f"met:req:{{{tag}}}:interactive".encode()) == slot_of(tag)  # what a cluster computes
    assert spread_tags(count) == tags  # the same in every process


def test_tags_are_plain_key_characters() -> None:
    assert all(tag.replace(".", "").isalnum() for tag in spread_tags(64))


@pytest.mark.parametrize("count", [0, -1, MAX_SHARDS + 1])
def test_a_shard_count_out_of_range_is_refused(count: int) -> None:
    with pytest.raises(ValueError, match="shards must be"):
        spread_tags(count)


def test_request_ids_spread_evenly_over_the_shards() -> None:
    counts = Counter(shard_of(f"chatcmpl-{index:08x}", 8) for index in range(8000))
    assert set(counts) == set(range(8)) and max(counts.values()) < 1.15 * 1000
    assert shard_of("r-1", 1) == 0 and shard_of("r-1", 8) == shard_of("r-1", 8)
