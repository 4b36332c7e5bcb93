"""``tools/slot_audit.py`` on ``MONITOR`` lines as a real ``redis-server`` writes them: a transaction over
two slots is reported by its shape, one within a hash tag's slot is not; a multi-key command over two
slots and the pub/sub channels are reported; the keys come from the server's ``COMMAND GETKEYS``."""

from __future__ import annotations

import redis

from tools.slot_audit import audit, parse_line, server_keys, shape

LINES = [
    '1796612133.345359 [0 127.0.0.1:52584] "MULTI"',
    '1796612133.345360 [0 127.0.0.1:60000] "PUBLISH" "met:out:r9999" "\\x83\\xa1\\"q"',
    '1796612133.345361 [0 127.0.0.1:52584] "HSET" "met:run:r1234" "status" "running"',
    '1796612133.345362 [0 127.0.0.1:52584] "RPUSH" "met:run:r1234:events" "\\x81\\xa3"',
    '1796612133.345363 [0 127.0.0.1:52584] "EXEC"',
    '1796612133.345364 [0 127.0.0.1:52585] "MULTI"',
    '1796612133.345365 [0 127.0.0.1:52585] "HSET" "met:run:{r1234}" "status" "running"',
    '1796612133.345366 [0 127.0.0.1:52585] "RPUSH" "met:run:{r1234}:events" "x"',
    '1796612133.345367 [0 127.0.0.1:52585] "EXEC"',
    '1796612133.345368 [0 127.0.0.1:52586] "BLPOP" "rq:queue:a" "rq:queue:b" "5"',
    '1796612133.345369 [0 127.0.0.1:52586] "SUBSCRIBE" "met:out:r5678" "met:cancel"',
    "garbage",
]


def test_shapes_hide_ids_and_keep_names() -> None:
    assert shape("met:run:r1234:events") == "met:run:*:events"
    assert shape("met:run:{0f3a9c2b11}") == "met:run:{*}"
    assert shape("met:req:interactive") == "met:req:interactive"


def test_a_line_is_its_client_and_arguments() -> None:
    assert parse_line(LINES[2]) == ("127.0.0.1:52584", ["HSET", "met:run:r1234", "status", "running"])
    assert parse_line("garbage") is None


def test_what_a_cluster_refuses_or_broadcasts_is_reported(real_redis_url: str) -> None:
    with redis.Redis.from_url(real_redis_url, decode_responses=True) as client:
        found = audit(LINES, server_keys(client))
    assert found.transactions == 2 and found.commands == 11
    assert dict(found.cross_slot_transactions) == {"[HSET RPUSH] met:run:* met:run:*:events": 1}
    assert dict(found.cross_slot_commands) == {"BLPOP rq:queue:a rq:queue:b": 1}
    assert dict(found.pubsub) == {"PUBLISH met:out:*": 1, "SUBSCRIBE met:out:*": 1, "SUBSCRIBE met:cancel": 1}
    assert "transactions over several slots (a cluster refuses them): 1 shapes" in found.report()
