"""Redis Cluster hash slots: which of ``count`` shards a request belongs to, and the hash tag that puts a
shard's keys on its own part of the 16384 slots (issue #34).

A Redis Cluster keeps a key in the slot ``CRC16(tag) mod 16384``, where ``tag`` is the part of the key
between the first ``{`` and the next ``}`` (the whole key without one). Keys sharing a tag share a slot,
so one transaction may touch them all. ``spread_tags(count)`` gives ``count`` tags whose slots lie one in
the middle of each of ``count`` equal ranges of the slots: however a cluster splits the slots evenly over
its primaries, the shards spread over them evenly (12 shards on 3 primaries: 4 each). Nothing here
talks to Redis; the tags are the same in every process for the same ``count``.
"""

from __future__ import annotations

from functools import lru_cache

from redis.crc import key_slot

SLOTS = 16384
"""Hash slots of a Redis Cluster."""
MAX_SHARDS = 256


@lru_cache(maxsize=16)
def spread_tags(count: int) -> tuple[str, ...]:
    """``count`` hash tags (without braces): the ``k``-th one's slot lies in the middle half of the
    ``k``-th of ``count`` equal slot ranges, so that shards fall evenly on evenly split primaries and
    never on a range's edge, where two primaries' ranges meet."""
    if not 1 <= count <= MAX_SHARDS:
        raise ValueError(f"shards must be 1..{MAX_SHARDS}; got {count}")
    return tuple(_tag_in(shard, count) for shard in range(count))


def slot_of(tag: str) -> int:
    """The hash slot of keys tagged ``{tag}``."""
    return int(key_slot(tag.encode()))


def shard_of(request_id: str, count: int) -> int:
    """Which of ``count`` shards ``request_id`` belongs to: its own slot scaled to ``count`` ranges, so ids
    spread over the shards as evenly as CRC16 spreads them over the slots."""
    return slot_of(request_id) * count // SLOTS


def _tag_in(shard: int, count: int) -> str:
    width = SLOTS / count
    low, high = shard * width + width / 4, shard * width + 3 * width / 4
    candidate = 0
    while True:  # CRC16 is uniform enough that a tag is found after ~2 * count tries
        tag = f"s{shard}.{candidate}"
        if low <= slot_of(tag) < high:
            return tag
        candidate += 1
