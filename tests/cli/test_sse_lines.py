"""Reading SSE lines: split at CRLF, LF or CR only, wherever the text pieces were cut."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from hypothesis import given
from hypothesis import strategies as st

from metrale.cli.sse_lines import SseLineSplitter, aiter_sse_lines, iter_sse_lines

LINE = st.text(alphabet=st.characters(blacklist_characters="\r\n"), max_size=12)
"""A line's text: anything but CR and LF; U+2028, U+0085, form feeds and the like included."""


def _cut(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(cut, len(text)) for cut in cuts})
    return [text[start:end] for start, end in zip([0, *points], [*points, len(text)], strict=True)]


@given(st.lists(LINE, max_size=8), st.sampled_from(["\n", "\r", "\r\n"]), st.lists(st.integers(0, 120)))
def test_the_lines_come_back_whole_however_the_text_was_cut(lines: list[str], line_end: str, cuts: list[int]) -> None:
    stream = "".join(line + line_end for line in lines)
    assert list(iter_sse_lines(_cut(stream, cuts))) == lines


def test_a_cr_at_the_end_of_a_piece_and_the_lf_that_starts_the_next_are_one_line_end() -> None:
    splitter = SseLineSplitter()
    assert splitter.feed("data: 1\r") == []
    assert splitter.feed("\ndata: 2\r") == ["data: 1"]
    assert splitter.feed("\r") == ["data: 2"]  # the empty line's CR may still be followed by its LF
    assert splitter.finish() == [""]


def test_a_line_separator_inside_an_event_does_not_end_it() -> None:
    event = 'data: {"text":"a\u2028b\x85c"}\n\n'

    async def pieces() -> AsyncIterator[str]:
        yield event[:12]
        yield event[12:]

    async def read() -> list[str]:
        return [line async for line in aiter_sse_lines(pieces())]

    assert asyncio.run(read()) == ['data: {"text":"a\u2028b\x85c"}', ""]
