"""A worker's speculation counters: the fields it adds to the fleet-wide hash, and those its heartbeat
carries (none until it has verified a draft)."""

from __future__ import annotations

import fakeredis

from metrale.worker.engine.speculation import SpeculationTally
from metrale.worker.fleet.failover_counters import HashCounterSink
from metrale.worker.fleet.speculation_counters import heartbeat_fields, speculation_fields


def _tally(*chunks: tuple[int, int]) -> SpeculationTally:
    tally = SpeculationTally()
    for drafted, accepted in chunks:
        tally.record(drafted, accepted)
    return tally


def test_the_hash_fields_count_drafts_tokens_and_each_accepted_position() -> None:
    stats = _tally((4, 2), (3, 0), (4, 4)).stats()
    assert speculation_fields(stats) == {
        "num_drafts": 3,
        "num_draft_tokens": 11,
        "num_accepted_tokens": 6,
        "pos:0": 2,
        "pos:1": 2,
        "pos:2": 1,
        "pos:3": 1,
    }


def test_the_heartbeat_says_nothing_until_a_draft_was_verified() -> None:
    assert heartbeat_fields(SpeculationTally().stats()) == {}
    stats = _tally((4, 3)).stats()
    assert heartbeat_fields(stats) == {"spec_drafts": 1, "spec_draft_tokens": 4, "spec_accepted_tokens": 3}


def test_workers_add_their_growth_to_one_fleet_wide_hash() -> None:
    client = fakeredis.FakeRedis(decode_responses=True)
    first, second = (
        HashCounterSink(client, "met:metrics:speculation"),
        HashCounterSink(client, "met:metrics:speculation"),
    )
    tally = _tally((4, 2))
    first.push(speculation_fields(tally.stats()))
    second.push(speculation_fields(_tally((2, 2)).stats()))
    tally.record(4, 1)
    first.push(speculation_fields(tally.stats()))
    fields = {key: int(value) for key, value in client.hgetall("met:metrics:speculation").items()}
    assert fields == {
        "num_drafts": 3,
        "num_draft_tokens": 10,
        "num_accepted_tokens": 5,
        "pos:0": 3,
        "pos:1": 2,
    }  # a field that never grew is never written
