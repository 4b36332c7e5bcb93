"""What every tool-call parser shares: the pieces it emits, and the text buffer it scans.

A parser reads an assistant's generated text in arbitrary pieces (``push``) and returns, for each
piece, the plain text it is now sure of (``content``) and ``ToolCallDelta`` s: a call's ``id`` and
``name`` first, once its header is complete, then pieces of its ``arguments`` text. ``finish`` ends
the text and returns what was held back: a call the text ends in (cut off by ``max_tokens`` or a stop
string) comes back as a call with the arguments written so far, never as its markup in ``content``,
and its ``ParsedDelta`` says ``cut_off``. Invariant: however the text is split into pieces, the
deltas joined give the same content and the same calls (``fold_deltas``), so a streamed answer
reassembles to the non-streamed one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of call ``index`` (0, 1, ... in the order the model made them). The first delta of a
    call carries its ``id`` and ``name``; ``arguments`` is the next piece of its arguments text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class ParsedDelta:
    """What one ``push`` or ``finish`` adds: plain text, then call pieces; ``cut_off`` when ``finish``
    found a call still open (its arguments may be incomplete JSON)."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)
    cut_off: bool = False

    def extend(self, other: ParsedDelta) -> None:
        self.content += other.content
        self.calls += other.calls
        self.cut_off |= other.cut_off

    @property
    def empty(self) -> bool:
        return not self.content and not self.calls


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A whole call: its id, the function's name and its arguments as JSON text."""

    id: str
    name: str
    arguments: str


class ToolCallParser(Protocol):
    """Turns generated text into content and tool calls, piece by piece."""

    def push(self, text: str) -> ParsedDelta:
        """Read the next piece of text; return what is now certain."""
        ...

    def finish(self) -> ParsedDelta:
        """The text has ended: return whatever was held back."""
        ...


CallIds = Callable[[int], str]
"""The id of call ``index`` of a choice, for formats whose text carries no id."""


def held_back(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers``: the part
    that must wait for more text before it is known not to start a marker."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


def first_marker(text: str, markers: Sequence[str]) -> tuple[int, str] | None:
    """The earliest occurrence in ``text`` of any of ``markers``: its offset and which marker."""
    found = [(text.find(marker), marker) for marker in markers if marker in text]
    return min(found) if found else None


class CallLimit:
    """Drops the calls past the first ``max_calls`` (``parallel_tool_calls: false`` allows one)."""

    def __init__(self, parser: ToolCallParser, max_calls: int | None) -> None:
        self._parser = parser
        self._max_calls = max_calls

    def push(self, text: str) -> ParsedDelta:
        return self._limit(self._parser.push(text))

    def finish(self) -> ParsedDelta:
        return self._limit(self._parser.finish())

    def _limit(self, delta: ParsedDelta) -> ParsedDelta:
        if self._max_calls is not None:
            delta.calls = [call for call in delta.calls if call.index < self._max_calls]
        return delta


def fold_deltas(deltas: Iterable[ParsedDelta]) -> tuple[str, list[ToolCall]]:
    """The content and the whole calls that ``deltas`` add up to, as a streaming client joins them."""
    content = ""
    ids: dict[int, str] = {}
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for delta in deltas:
        content += delta.content
        for call in delta.calls:
            if call.id is not None:
                ids[call.index] = call.id
            if call.name is not None:
                names[call.index] = call.name
            arguments[call.index] = arguments.get(call.index, "") + call.arguments
    calls = [ToolCall(ids[index], names[index], arguments.get(index, "")) for index in sorted(names)]
    return content, calls


def read_whole(parser: ToolCallParser, text: str) -> ParsedDelta:
    """``text`` read in one piece, then ended: everything the parser emits for it."""
    parsed = parser.push(text)
    parsed.extend(parser.finish())
    return parsed


def parse_whole(parser: ToolCallParser, text: str) -> tuple[str, list[ToolCall]]:
    """``text`` read in one piece: its content and its calls."""
    return fold_deltas([read_whole(parser, text)])
