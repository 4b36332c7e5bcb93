"""Stored responses in Redis: ``met:resp:{tenant}:{id}``, one hash with a TTL per response.

A stored response keeps its response object, its input items, the conversation's messages so far (to
render the next turn's new text) and its exact transcript: the token ids the model consumed and
produced (prompt plus the reply as generated), which a continuation by ``previous_response_id`` is
fed again verbatim. A ``store: false`` response leaves only a marker, so continuing it can be refused
with a clear reason rather than a 404. A tenant's stored ids are also in ``met:resps:{tenant}``, scored by
expiry, which its quota counts.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, cast

from metrale.shared.errors import QuotaExceeded
from metrale.shared.keys import Keys
from metrale.shared.redis_connect import AsyncClient
from metrale.shared.sessions import Transcript


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A response kept for ``retrieve``, ``input_items`` and continuation."""

    body: dict[str, Any]
    input_items: list[dict[str, Any]]
    messages: list[dict[str, Any]]
    transcript: Transcript
    rendered: str = ""
    """The conversation as the chat template renders it, up to the reply's last shown text."""
    stop_text: str = ""
    """The text of the hidden stop token that ended the reply ("" when none did)."""


@dataclass(frozen=True, slots=True)
class BackgroundResponse:
    """A background response with no transcript yet: queued, in progress, failed or cancelled
    (``background_store.py``); its object is as far as it got."""

    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class UnstoredResponse:
    """A response created with ``store: false``: known to exist, not kept."""

    response_id: str


class ResponseStore:
    """Responses of every tenant; another tenant's id reads as missing."""

    def __init__(self, client: AsyncClient, keys: Keys, ttl_s: int, *, max_stored: int = 0) -> None:
        self.client, self.keys, self.ttl_s = client, keys, ttl_s
        self.max_stored = max_stored
        """The most stored responses one tenant keeps (0: no limit; ``MET_TENANT_MAX_STORED_RESPONSES``)."""

    async def check_room(self, tenant: str) -> None:
        """400 if the tenant keeps as many stored responses as it may; asked before a ``store: true``
        response is generated (responses being made at the same time may each pass)."""
        if not self.max_stored:
            return
        index = self.keys.response_index(tenant)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.zremrangebyscore(index, "-inf", time.time())  # expired ones no longer count
            pipe.zcard(index)
            _, kept = await pipe.execute()
        if kept >= self.max_stored:
            raise QuotaExceeded(
                f"The tenant keeps {kept} stored responses, as many as MET_TENANT_MAX_STORED_RESPONSES="
                f"{self.max_stored} allows: delete some, or create this one with 'store': false.",
                param="store",
            )

    async def save(self, tenant: str, response: StoredResponse) -> None:
        await self._write(self.keys.response(tenant, response.body["id"]), stored_fields(response))
        await self.client.zadd(self.keys.response_index(tenant), {response.body["id"]: time.time() + self.ttl_s})

    async def mark_unstored(self, tenant: str, response_id: str) -> None:
        await self._write(self.keys.response(tenant, response_id), {"stored": b"0"})

    async def get(self, tenant: str, response_id: str) -> StoredResponse | BackgroundResponse | UnstoredResponse | None:
        """The response, a background one not completed, its ``store: false`` marker, or None (never
        created, expired, deleted, another tenant's)."""
        stored = await self.client.hgetall(self.keys.response(tenant, response_id))
        raw: dict[bytes, bytes] = {_bytes(name): _bytes(value) for name, value in stored.items()}
        if not raw:
            return None
        if raw.get(b"stored") != b"1":
            return UnstoredResponse(response_id)
        transcript = Transcript.from_fields(cast("dict[bytes | str, bytes | str]", raw))
        if transcript is None:
            return BackgroundResponse(json.loads(raw[b"object"])) if raw.get(b"background") == b"1" else None
        return StoredResponse(
            json.loads(raw[b"object"]),
            json.loads(raw[b"input_items"]),
            json.loads(raw[b"messages"]),
            transcript,
            raw.get(b"rendered", b"").decode(),
            raw.get(b"stop_text", b"").decode(),
        )

    async def delete(self, tenant: str, response_id: str) -> bool:
        """Forget a stored response; False when there was none to forget."""
        key = self.keys.response(tenant, response_id)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hget(key, "stored")
            pipe.delete(key, self.keys.response_events(tenant, response_id))
            pipe.zrem(self.keys.response_index(tenant), response_id)
            stored, _, _ = await pipe.execute()
        return stored == b"1"

    async def _write(self, key: str, fields: dict[str, bytes]) -> None:
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.hset(key, mapping=fields)  # type: ignore[arg-type]
            pipe.expire(key, self.ttl_s)
            await pipe.execute()


def stored_fields(response: StoredResponse) -> dict[str, bytes]:
    """The hash fields of a stored response."""
    return {
        "stored": b"1",
        "object": json.dumps(response.body).encode(),
        "input_items": json.dumps(response.input_items).encode(),
        "messages": json.dumps(response.messages).encode(),
        "rendered": response.rendered.encode(),
        "stop_text": response.stop_text.encode(),
        **response.transcript.to_fields(),
    }


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()
