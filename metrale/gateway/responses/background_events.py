"""A background response's stream, read from Redis: the events stored after a ``sequence_number``,
then the new ones as its job appends them, until its last.

Any gateway serves it (the job, not the gateway, makes the events), so a client that lost its
connection, or whose gateway restarted, resumes with ``starting_after`` the last number it saw and
gets every later event once, in order.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from metrale.gateway.responses.background_store import TERMINAL_EVENTS, BackgroundStore
from metrale.gateway.streams.streaming import sse_event

WAIT_MS = 1000
"""How long one read waits for a new event before it looks at the response's status."""


async def follow_events(
    store: BackgroundStore, tenant: str, response_id: str, after: int, *, wait_ms: int = WAIT_MS
) -> AsyncIterator[str]:
    """SSE writes of the events after ``after`` (-1: all), ending after the response's last event: a
    terminal one, or the last stored once its status is terminal (a cancel adds no event) or it is gone."""
    last = after
    while True:
        found = await store.read(tenant, response_id, last, block_ms=wait_ms)
        if not found:
            status = await store.status(tenant, response_id)
            if status is not None and not status.is_terminal:
                continue
            # a terminal status is written with the last events (one transaction): what is left is here now
            found = await store.read(tenant, response_id, last, block_ms=None)
            if found:
                yield _writes(found)[0]
            return
        text, last, ended = _writes(found)
        yield text
        if ended:
            return


def _writes(found: list[str]) -> tuple[str, int, bool]:
    """The SSE text of ``found`` events, the last one's number, and whether one ends the stream."""
    writes, last, ended = [], -1, False
    for data in found:
        event = json.loads(data)
        kind = event["type"]
        writes.append(f"event: {kind}\n{sse_event(data)}")
        last, ended = event["sequence_number"], ended or kind in TERMINAL_EVENTS
    return "".join(writes), last, ended
