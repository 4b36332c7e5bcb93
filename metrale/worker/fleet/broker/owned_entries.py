"""Letting go of a stream entry only while this worker still owns it.

A worker whose heartbeat lapsed (a long stall) may have had its entries claimed by an heir
(``reclaim.py``) and then still finish them before its next beat tells it so. Had it acknowledged and
deleted such an entry, the heir's pending entry would be gone with it: should the heir die too, no
third worker could reclaim the request. So each ``XACK`` + ``XDEL`` (with the dead-letter ``XADD`` or
the re-queue ``XADD`` that goes with it) runs in one Lua script that first asks ``XPENDING`` who owns
the entry, and does nothing unless it is this worker. Queued on a pipeline, the script joins the
caller's ``MULTI``; its reply is 1 when it let the entry go, 0 when another worker (or nobody) holds it.
"""

from __future__ import annotations

import redis
import redis.cluster

from metrale.shared.keys import WORKER_GROUP

_RELEASE_IF_OWNED = """
local ok, pending = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if not ok or pending[1] == nil or pending[1][2] ~= ARGV[3] then
    return 0
end
if #KEYS == 2 then
    local fields = {}
    for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
    redis.call('XADD', KEYS[2], '*', (table.unpack or unpack)(fields))
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return 1
"""
"""KEYS: the stream, then optionally a stream to add ``ARGV[4:]`` (field, value, ...) to before the
entry goes. ARGV: the group, the entry id, the consumer that must own it."""


def queue_release(
    pipe: redis.client.Pipeline | redis.cluster.ClusterPipeline,
    stream: str,
    entry_id: str,
    consumer: str,
    *,
    then_add: tuple[str, dict[str, str | bytes]] | None = None,
) -> None:
    """Queue on ``pipe``: acknowledge and delete ``entry_id`` of ``stream`` if ``consumer`` owns it,
    first adding ``then_add`` (stream, fields) — a dead letter, or the request queued again."""
    keys: list[str] = [stream]
    args: list[str | bytes] = [WORKER_GROUP, entry_id, consumer]
    if then_add is not None:
        keys.append(then_add[0])
        args += [part for field, value in then_add[1].items() for part in (field, value)]
    # EVAL by name: a Redis Cluster's pipeline routes it by its keys (its ``eval`` method is refused there).
    pipe.execute_command("EVAL", _RELEASE_IF_OWNED, len(keys), *keys, *args)
