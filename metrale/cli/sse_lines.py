"""The lines of a server-sent event stream, split where the SSE format ends a line: CRLF, LF or CR.

httpx's ``iter_lines`` splits as ``str.splitlines`` does, also at U+0085, U+2028, U+2029 and a few
control characters, so a token that decodes to one of them would cut its event's JSON in two. The
gateway escapes them (``gateway/streams/streaming.py``); these readers do not depend on it.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator

_LINE_END = re.compile("\r\n|\r|\n")


class SseLineSplitter:
    """Text in, whole lines out; a line's end may arrive in a later piece of text (a CR, say, whose LF
    comes next), so the last, unended part is kept until it is ended."""

    def __init__(self) -> None:
        self._pending = ""

    def feed(self, text: str) -> list[str]:
        """The lines ``text`` ends (without their line ends)."""
        pieces = _LINE_END.split(self._pending + text)
        self._pending = pieces.pop()
        if self._pending == "" and text.endswith("\r") and pieces:
            self._pending = pieces.pop() + "\r"  # its LF may come next: one line end, not two
        return pieces

    def finish(self) -> list[str]:
        """At the stream's end: the line a last CR ended (text after the last line end is no line)."""
        pending, self._pending = self._pending, ""
        return [pending[:-1]] if pending.endswith("\r") else []


def iter_sse_lines(texts: Iterable[str]) -> Iterator[str]:
    """The lines of a stream read as text pieces (httpx's ``Response.iter_text()``)."""
    splitter = SseLineSplitter()
    for text in texts:
        yield from splitter.feed(text)
    yield from splitter.finish()


async def aiter_sse_lines(texts: AsyncIterable[str]) -> AsyncIterator[str]:
    """The lines of a stream read as text pieces (httpx's ``Response.aiter_text()``)."""
    splitter = SseLineSplitter()
    async for text in texts:
        for line in splitter.feed(text):
            yield line
    for line in splitter.finish():
        yield line
