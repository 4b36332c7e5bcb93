"""Where the gateway keeps sessions: the last turn's transcript, and the session's checkpoint record
(written by workers).

A session is a cache: a turn's prompt is always the tokenization of its rendered messages. The
transcript only tells the next turn where the previous turn's checkpoints lie (its prompt end, its
reply end), so the gateway can mark them where the new tokenization agrees.
"""

from __future__ import annotations

import logging

from redis.exceptions import RedisError

from metrale.shared.keys import Keys
from metrale.shared.redis_connect import AsyncClient
from metrale.shared.sessions import RETOKENIZED_FIELD, SessionEntry, Transcript

logger = logging.getLogger(__name__)
TRANSCRIPT_TTL_S = 3600


class SessionStore:
    """Transcripts (written here) and checkpoint records (written by workers) of sessions."""

    def __init__(self, client: AsyncClient, keys: Keys, ttl_s: int = TRANSCRIPT_TTL_S) -> None:
        self.client, self.keys, self.ttl_s = client, keys, ttl_s

    async def transcript(self, tenant: str, session_id: str) -> Transcript | None:
        """The session's transcript, or None (none yet, expired, or Redis unreachable: then the prompt is
        tokenized afresh, which only costs the checkpoint)."""
        try:
            raw = await self.client.hgetall(self.keys.session_transcript(tenant, session_id))
        except RedisError as error:
            logger.warning("session %s: transcript unavailable (%s)", session_id, error)
            return None
        return Transcript.from_fields(raw) if raw else None

    async def save_transcript(self, tenant: str, session_id: str, transcript: Transcript) -> None:
        key = self.keys.session_transcript(tenant, session_id)
        try:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.delete(key)
                pipe.hset(key, mapping=transcript.to_fields())  # type: ignore[arg-type]
                pipe.expire(key, self.ttl_s)
                await pipe.execute()
        except RedisError as error:
            logger.warning("session %s: transcript not saved (%s)", session_id, error)

    async def entry(self, tenant: str, session_id: str) -> SessionEntry | None:
        raw = await self.client.hgetall(self.keys.session(tenant, session_id))
        return SessionEntry.from_fields(raw) if raw else None

    async def retokenized(self, tenant: str, session_id: str) -> int:
        """How many lookups found the session's newest checkpoint was not a prefix of their prompt."""
        raw = await self.client.hget(self.keys.session(tenant, session_id), RETOKENIZED_FIELD)
        return int(raw) if raw is not None else 0

    async def delete(self, tenant: str, session_id: str) -> bool:
        """Forget the session: its record, transcript and newest checkpoint."""
        entry = await self.entry(tenant, session_id)
        keys = [self.keys.session(tenant, session_id), self.keys.session_transcript(tenant, session_id)]
        if entry is not None and entry.checkpoint_key:
            keys.append(entry.checkpoint_key)
        return bool(await self.client.delete(*keys))
