"""The dead-letter streams ``met:dead`` (one per request shard on a Redis Cluster, ``Keys.dead_letter``):
payloads nobody could read, with why, where from, and the bytes.

Workers write an entry for a request-stream entry that does not decode (``stream``, ``entry_id``,
``reason``, ``raw``: ``redis_transport.py``); gateways write one for a payload on a request's token
channel, or a part of its record, that does not decode (``source``, ``reason``, ``raw``). Gateway
entries trim the stream to about ``DEAD_LETTER_MAXLEN`` entries, so a flood of garbage cannot grow
Redis without bound; a failed write is logged, never raised (the reader goes on). An entry goes to the
shard of the request it concerns, as a worker's does (on one Redis there is one).
"""

from __future__ import annotations

import logging

from redis.exceptions import RedisError

from metrale.shared.keys import Keys
from metrale.shared.redis_connect import AsyncClient

logger = logging.getLogger(__name__)

DEAD_LETTER_MAXLEN = 10_000
"""About how many entries the stream keeps when a gateway adds one (approximate trimming)."""
MAX_RAW_BYTES = 64 * 1024
"""The most bytes of a payload an entry keeps."""


async def add_dead_letter(
    client: AsyncClient, keys: Keys, *, reason: str, source: str, raw: bytes, request_id: str | None = None
) -> None:
    """Append ``raw`` (cut to ``MAX_RAW_BYTES``) to the dead-letter stream with ``reason`` and ``source``:
    the stream of ``request_id``'s shard (None: shard 0's)."""
    fields: dict[str, str | bytes] = {"reason": reason, "source": source, "raw": raw[:MAX_RAW_BYTES]}
    shard = keys.shard_of(request_id) if request_id is not None else 0
    try:
        await client.xadd(keys.dead_letter(shard), fields, maxlen=DEAD_LETTER_MAXLEN, approximate=True)  # type: ignore[arg-type]
    except RedisError as error:
        logger.warning("could not dead-letter a payload from %s (%s): %s", source, reason, error)
