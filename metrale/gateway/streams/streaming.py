"""Server-sent events as OpenAI streams them: ``data: {json}\n\n`` per chunk, then ``data: [DONE]\n\n``.

An event's JSON never holds U+0085, U+2028 or U+2029 raw (``line_safe``): they end a line for many
clients' line readers (httpx's ``iter_lines``, Python's ``str.splitlines``), which would cut a token
that decodes to one of them out of its event. Escaped, the JSON means the same text.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse

from metrale.shared.errors import MetraleError

SSE_DONE = "data: [DONE]\n\n"
"""The last event of every stream."""

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

_LINE_BREAKS_JSON_KEEPS = re.compile("[\u0085\u2028\u2029]")
"""What ``str.splitlines`` breaks a line at and JSON writes raw (the rest are control characters,
which JSON escapes)."""


def line_safe(json_text: str) -> str:
    """``json_text`` with U+0085, U+2028 and U+2029 escaped (they occur only inside its strings).

    Most chunks are ASCII, which holds none of the three: ``str.isascii`` answers that without reading
    the text (CPython keeps it as a flag). ``line_safe_reference`` is the plain twin."""
    if json_text.isascii():
        return json_text
    return line_safe_reference(json_text)


def line_safe_reference(json_text: str) -> str:
    """``line_safe``, every text searched."""
    return _LINE_BREAKS_JSON_KEEPS.sub(_escaped, json_text)


def _escaped(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def sse_event(chunk_json: str) -> str:
    """One chunk, given as its JSON text, as an SSE event."""
    return f"data: {line_safe(chunk_json)}\n\n"


def sse_error(error: MetraleError) -> str:
    """An error that happens after the stream started, as an event holding the OpenAI error object."""
    return sse_event(json.dumps(error.to_openai(), ensure_ascii=False))


def sse_response(events: AsyncIterator[str], on_close: Callable[[], Awaitable[object]]) -> StreamingResponse:
    """A ``text/event-stream`` response sending ``events`` as they come; ``on_close`` runs once the
    response is over, even if the client left before the first event was sent."""
    return StreamingResponse(
        events, media_type="text/event-stream", headers=_SSE_HEADERS, background=BackgroundTask(on_close)
    )
