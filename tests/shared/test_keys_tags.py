"""Control and tenant keys on a Redis Cluster key space (issue #34): what one transaction touches
shares one hash slot; a plain key space keeps its names."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from metrale.shared.keys import Keys
from metrale.shared.messages import Priority

CLUSTER_SHARDS = 12
"""A cluster key space's request shards (as ``Keys.for_redis`` gives a cluster URL)."""


def slot(key: str) -> int:
    return int(key_slot(key.encode()))


def control_keys(keys: Keys) -> list[str]:
    return [
        keys.worker("gpu-1"),
        keys.worker_index(),
        keys.model("moonshotai/Kimi-Linear-48B-A3B-Instruct"),
        keys.control_channel("gpu-1"),
        keys.checkpoint_counters(),
        keys.failover_counters(),
        keys.gateway_counters(),
        keys.active_batches(),
        keys.file_expiry(),
    ]


def tenant_keys(keys: Keys, tenant: str) -> list[str]:
    return [
        keys.session(tenant, "s1"),
        keys.session_transcript(tenant, "s1"),
        keys.response(tenant, "resp_1"),
        keys.response_events(tenant, "resp_1"),
        keys.response_index(tenant),
        keys.batch(tenant, "batch_1"),
        keys.batch_results(tenant, "batch_1"),
        keys.batch_index(tenant),
        keys.file(tenant, "file-1"),
        keys.file_index(tenant),
        keys.file_sizes(tenant),
        keys.tenant_in_flight(tenant),
        keys.tenant_tokens(tenant, 29_500_000),
    ]


def test_control_keys_share_one_slot_on_a_cluster() -> None:
    keys = Keys("met", shards=CLUSTER_SHARDS)
    assert len({slot(key) for key in control_keys(keys)}) == 1
    assert keys.worker("gpu-1") == "met:worker:{ctl}:gpu-1"
    assert keys.worker_pattern() == "met:worker:{ctl}:*"


@pytest.mark.parametrize("tenant", ["acme", "default", "s3.69", "a/b@c"])
def test_a_tenants_keys_share_one_slot_on_a_cluster(tenant: str) -> None:
    keys = Keys("met", shards=CLUSTER_SHARDS)
    assert len({slot(key) for key in tenant_keys(keys, tenant)}) == 1
    assert keys.response(tenant, "resp_1") == f"met:resp:{{{tenant}}}:resp_1"


def test_tenants_spread_over_slots_and_checkpoints_stay_untagged() -> None:
    keys = Keys("met", shards=CLUSTER_SHARDS)
    assert len({slot(keys.batch_index(f"tenant-{n}")) for n in range(50)}) > 40
    assert keys.checkpoint("fp", "acme", "abc") == "met:ckpt:fp:acme:abc"


def test_dead_letters_live_in_their_request_shard() -> None:
    keys = Keys("met", shards=CLUSTER_SHARDS)
    assert len(keys.dead_letters()) == CLUSTER_SHARDS
    for shard in range(CLUSTER_SHARDS):
        assert slot(keys.dead_letter(shard)) == slot(keys.request_stream(Priority.INTERACTIVE, shard))


def test_one_redis_keeps_every_name() -> None:
    keys = Keys("met")
    assert control_keys(keys) == [
        "met:worker:gpu-1",
        "met:workers",
        "met:model:moonshotai/Kimi-Linear-48B-A3B-Instruct",
        "met:control:gpu-1",
        "met:metrics:checkpoints",
        "met:metrics:failover",
        "met:metrics:gateway",
        "met:active-batches",
        "met:files-expiring",
    ]
    assert tenant_keys(keys, "acme")[:3] == [
        "met:session:acme:s1",
        "met:session:acme:s1:transcript",
        "met:resp:acme:resp_1",
    ]
    assert keys.tenant_tokens("acme", 7) == "met:tenant:acme:tokens:7"
    assert keys.dead_letters() == ("met:dead",)


def test_a_tenant_that_could_break_a_key_is_refused() -> None:
    with pytest.raises(ValueError, match="tenant"):
        Keys("met", shards=CLUSTER_SHARDS).batch_index("a}b")
