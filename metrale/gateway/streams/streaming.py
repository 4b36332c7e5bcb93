"""Server-sent events as OpenAI streams them: ``data: {json}\n\n`` per chunk, then ``data: [DONE]\n\n``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse

from metrale.shared.errors import MetraleError

SSE_DONE = "data: [DONE]\n\n"
"""The last event of every stream."""

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(chunk_json: str) -> str:
    """One chunk, given as its JSON text, as an SSE event."""
    return f"data: {chunk_json}\n\n"


def sse_error(error: MetraleError) -> str:
    """An error that happens after the stream started, as an event holding the OpenAI error object."""
    return f"data: {json.dumps(error.to_openai(), ensure_ascii=False)}\n\n"


def sse_response(events: AsyncIterator[str], on_close: Callable[[], Awaitable[object]]) -> StreamingResponse:
    """A ``text/event-stream`` response sending ``events`` as they come; ``on_close`` runs once the
    response is over, even if the client left before the first event was sent."""
    return StreamingResponse(
        events, media_type="text/event-stream", headers=_SSE_HEADERS, background=BackgroundTask(on_close)
    )
