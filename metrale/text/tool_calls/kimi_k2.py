"""Kimi's tool-call section (``--tool-call-parser kimi_k2``, as vLLM names it).

The model writes its calls after any text, with the tokenizer's special tokens::

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>
    ...
    <|tool_calls_section_end|>

(no newlines in the real text). A call's id is its header ``functions.NAME:IDX`` as written, its name
the part between ``functions.`` and ``:``. Arguments stream as they are written. Text outside the
section is content; text between calls is dropped. A section the text ends in is never content: a
call cut off in its arguments keeps what was written of them, one cut off in its header is dropped.
The text must be decoded with special tokens kept.
"""

from __future__ import annotations

import re
from enum import Enum

from metrale.text.tool_calls.parser import ParsedDelta, ToolCallDelta, first_marker, held_back

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"

_HEADER = re.compile(r"(?:functions\.)?(?P<name>.*?)(?::\d+)?", re.DOTALL)


def call_header(name: str, index: int) -> str:
    """The header (and id) of call ``index`` of a chat to function ``name``: ``functions.NAME:IDX``."""
    return f"functions.{name}:{index}"


def name_of(header: str) -> str:
    """The function a header names: ``functions.get_weather:0`` -> ``get_weather``."""
    match = _HEADER.fullmatch(header.strip())
    return match.group("name") if match else ""


class _State(Enum):
    CONTENT = "content"
    SECTION = "section"
    HEADER = "header"
    ARGUMENTS = "arguments"


class KimiToolCallParser:
    """Parses Kimi's section; see the module docstring. Calls without a name are dropped."""

    def __init__(self) -> None:
        self._state = _State.CONTENT
        self._buffer = ""
        self._calls = 0
        self._in_call = False

    def push(self, text: str) -> ParsedDelta:
        self._buffer += text
        out = ParsedDelta()
        while self._step(out):
            pass
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta(cut_off=self._state in (_State.HEADER, _State.ARGUMENTS))
        if self._state is _State.CONTENT:
            out.content = self._buffer
        elif self._state is _State.ARGUMENTS and self._in_call:
            out.calls.append(ToolCallDelta(self._calls - 1, self._buffer))
        self._buffer = ""
        return out

    def _step(self, out: ParsedDelta) -> bool:
        """Consume what the buffer decides in the current state; True if the state changed."""
        if self._state is _State.CONTENT:
            return self._content(out)
        if self._state is _State.SECTION:
            return self._section()
        if self._state is _State.HEADER:
            return self._header(out)
        return self._arguments(out)

    def _content(self, out: ParsedDelta) -> bool:
        offset = self._buffer.find(SECTION_BEGIN)
        if offset < 0:
            keep = held_back(self._buffer, [SECTION_BEGIN])
            out.content += self._buffer[: len(self._buffer) - keep]
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        out.content += self._buffer[:offset]
        self._move(_State.SECTION, offset + len(SECTION_BEGIN))
        return True

    def _section(self) -> bool:
        found = first_marker(self._buffer, [CALL_BEGIN, SECTION_END])
        if found is None:
            keep = held_back(self._buffer, [CALL_BEGIN, SECTION_END])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        offset, marker = found
        self._move(_State.HEADER if marker == CALL_BEGIN else _State.CONTENT, offset + len(marker))
        return True

    def _header(self, out: ParsedDelta) -> bool:
        found = first_marker(self._buffer, [ARGUMENT_BEGIN, CALL_END, SECTION_END])
        if found is None:
            return False
        offset, marker = found
        if marker != ARGUMENT_BEGIN:  # a header without arguments: not a call
            self._move(_State.SECTION if marker == CALL_END else _State.CONTENT, offset + len(marker))
            return True
        header = self._buffer[:offset].strip()
        name = name_of(header)
        self._in_call = bool(name)
        if name:
            out.calls.append(ToolCallDelta(self._calls, "", id=header, name=name))
            self._calls += 1
        self._move(_State.ARGUMENTS, offset + len(marker))
        return True

    def _arguments(self, out: ParsedDelta) -> bool:
        found = first_marker(self._buffer, [CALL_END, SECTION_END])
        end = found[0] if found is not None else len(self._buffer) - held_back(self._buffer, [CALL_END, SECTION_END])
        if self._in_call and end > 0:
            out.calls.append(ToolCallDelta(self._calls - 1, self._buffer[:end]))
        if found is None:
            self._buffer = self._buffer[end:]
            return False
        offset, marker = found
        self._move(_State.SECTION if marker == CALL_END else _State.CONTENT, offset + len(marker))
        return True

    def _move(self, state: _State, consumed: int) -> None:
        self._state = state
        self._buffer = self._buffer[consumed:]
