"""The dead-letter stream ``met:dead``: payloads nobody could read, with why, where from, and the bytes.

Workers write an entry for a request-stream entry that does not decode (``stream``, ``entry_id``,
``reason``, ``raw``: ``redis_transport.py``); gateways write one for a payload on a request's token
channel, or a part of its record, that does not decode (``source``, ``reason``, ``raw``). Gateway
entries trim the stream to about ``DEAD_LETTER_MAXLEN`` entries, so a flood of garbage cannot grow
Redis without bound; a failed write is logged, never raised (the reader goes on).
"""

from __future__ import annotations

import logging

import redis.asyncio
from redis.exceptions import RedisError

from metrale.shared.keys import Keys

logger = logging.getLogger(__name__)

DEAD_LETTER_MAXLEN = 10_000
"""About how many entries the stream keeps when a gateway adds one (approximate trimming)."""
MAX_RAW_BYTES = 64 * 1024
"""The most bytes of a payload an entry keeps."""


async def add_dead_letter(client: redis.asyncio.Redis, keys: Keys, *, reason: str, source: str, raw: bytes) -> None:
    """Append ``raw`` (cut to ``MAX_RAW_BYTES``) to the dead-letter stream with ``reason`` and ``source``."""
    fields: dict[str, str | bytes] = {"reason": reason, "source": source, "raw": raw[:MAX_RAW_BYTES]}
    try:
        await client.xadd(keys.dead_letter(), fields, maxlen=DEAD_LETTER_MAXLEN, approximate=True)  # type: ignore[arg-type]
    except RedisError as error:
        logger.warning("could not dead-letter a payload from %s (%s): %s", source, reason, error)
