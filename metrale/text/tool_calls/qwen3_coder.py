"""Qwen3-Coder's XML tool calls (``--tool-call-parser qwen3_coder``, as vLLM names it); Qwen3.5 speaks it.

Each call is a block::

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

several blocks one after another (a newline between them), text before the first. A value is raw text
(one newline after ``<parameter=ARG>`` and one before ``</parameter>`` belong to the markup); it is
converted by the type the function's ``parameters`` schema gives the argument, as vLLM's parser does:
``integer`` / ``number`` / ``boolean`` parsed, ``object`` / ``array`` read as JSON, anything else (and an
argument the schema does not declare) kept as text; ``null`` (any case) is JSON null. A call's header
(its id from ``CallIds`` and its name) is emitted once ``<function=NAME>`` is complete, its arguments
as compact JSON, one argument at a time as each closes, the closing brace at ``</function>``. A value
also ends at the next ``<parameter=`` or at ``</function>`` (vLLM's leniency). Whitespace between calls
and after the last one is not content. A block the text ends in (cut off) is never content: a call with
the arguments written so far once its function's name is whole, else dropped (``ParsedDelta.cut_off``
says so either way).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any

from metrale.text.tool_calls.parser import CallIds, ParsedDelta, ToolCallDelta, first_marker, held_back

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"
VALUE_ENDS = (PARAMETER_CLOSE, PARAMETER_OPEN, FUNCTION_CLOSE)
"""What ends an argument's value; a value the grammar writes holds none of them."""


def call_text(name: str, arguments: Mapping[str, Any]) -> str:
    """A call as Qwen's chat templates render an earlier one (values: strings raw, objects and
    arrays as JSON, the rest as JSON scalars)."""
    lines = [CALL_OPEN, f"{FUNCTION_OPEN}{name}>"]
    for argument, value in arguments.items():
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        lines += [f"{PARAMETER_OPEN}{argument}>", text, PARAMETER_CLOSE]
    return "\n".join([*lines, FUNCTION_CLOSE, CALL_CLOSE])


def convert_value(text: str, schema: Any) -> Any:
    """An argument's value text as the JSON value its ``schema`` types it (vLLM's conversion); the
    text itself when the schema says string, names no type, or the text does not parse."""
    if text.lower() == "null":
        return None
    kinds = schema.get("type") if isinstance(schema, Mapping) else None
    for kind in kinds if isinstance(kinds, list) else [kinds]:
        converted = _converted(text, kind)
        if converted is not _UNCONVERTED:
            return converted
    return text


_UNCONVERTED = object()


def _converted(text: str, kind: Any) -> Any:
    try:
        if kind == "integer":
            return int(text)
        if kind == "number":
            number = float(text)
            return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number
        if kind == "boolean":
            return {"true": True, "false": False}.get(text.strip().lower(), _UNCONVERTED)
        if kind in ("object", "array"):
            value = json.loads(text)
            return value if isinstance(value, dict if kind == "object" else list) else _UNCONVERTED
    except ValueError:
        return _UNCONVERTED
    return _UNCONVERTED


class _State(Enum):
    CONTENT = "content"
    CALL = "call"  # after <tool_call>, before <function=
    HEADER = "header"  # the function's name, up to >
    BODY = "body"  # between arguments
    ARGUMENT = "argument"  # an argument's name, up to >
    VALUE = "value"
    AFTER = "after"  # after </function>, before </tool_call>


class Qwen3CoderToolCallParser:
    """Parses Qwen3-Coder call blocks; see the module docstring. ``functions`` maps a function's name
    to its ``parameters`` schema (the types values are converted by)."""

    def __init__(self, call_ids: CallIds, functions: Mapping[str, Any] | None = None) -> None:
        self._call_ids = call_ids
        self._schemas = dict(functions or {})
        self._state = _State.CONTENT
        self._buffer = ""
        self._calls = 0
        self._arguments = 0  # arguments emitted for the open call
        self._function = ""
        self._argument = ""
        self._blank = ""  # whitespace after a call, shown only if more content follows

    def push(self, text: str) -> ParsedDelta:
        self._buffer += text
        out = ParsedDelta()
        while self._step(out):
            pass
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._state is _State.CONTENT:
            self._show(self._buffer, out, final=True)
        elif self._state is _State.VALUE:
            self._emit_value(self._buffer, out)
            self._close_call(out)
        elif self._state in (_State.BODY, _State.ARGUMENT):
            self._close_call(out)
        out.cut_off = self._state not in (_State.CONTENT, _State.AFTER)
        self._buffer = ""
        self._state = _State.CONTENT
        return out

    def _step(self, out: ParsedDelta) -> bool:
        """Consume what the buffer decides in the current state; True if the state changed."""
        state = self._state
        if state is _State.CONTENT:
            return self._content(out)
        if state is _State.CALL:
            return self._expect([FUNCTION_OPEN, CALL_CLOSE], {FUNCTION_OPEN: _State.HEADER, CALL_CLOSE: _State.CONTENT})
        if state is _State.HEADER or state is _State.ARGUMENT:
            return self._name(out)
        if state is _State.BODY:
            return self._body(out)
        if state is _State.VALUE:
            return self._value(out)
        return self._expect([CALL_CLOSE, CALL_OPEN], {CALL_CLOSE: _State.CONTENT, CALL_OPEN: _State.CALL})

    def _content(self, out: ParsedDelta) -> bool:
        offset = self._buffer.find(CALL_OPEN)
        if offset < 0:
            keep = held_back(self._buffer, [CALL_OPEN])
            self._show(self._buffer[: len(self._buffer) - keep], out)
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        self._show(self._buffer[:offset], out)
        self._move(_State.CALL, offset + len(CALL_OPEN))
        return True

    def _expect(self, markers: Sequence[str], next_state: Mapping[str, _State]) -> bool:
        """Skip to the first of ``markers`` and go to its state (text before it is dropped)."""
        found = first_marker(self._buffer, markers)
        if found is None:
            self._buffer = self._buffer[len(self._buffer) - held_back(self._buffer, markers) :]
            return False
        offset, marker = found
        self._move(next_state[marker], offset + len(marker))
        return True

    def _name(self, out: ParsedDelta) -> bool:
        offset = self._buffer.find(">")
        if offset < 0:
            return False
        name = self._buffer[:offset].strip()
        if self._state is _State.HEADER and not name:  # not a call: skip its block
            self._move(_State.AFTER, offset + 1)
        elif self._state is _State.HEADER:
            self._function, self._arguments = name, 0
            out.calls.append(ToolCallDelta(self._calls, "", id=self._call_ids(self._calls), name=name))
            self._calls += 1
            self._move(_State.BODY, offset + 1)
        else:
            self._argument = name
            self._move(_State.VALUE, offset + 1)
        return True

    def _body(self, out: ParsedDelta) -> bool:
        markers = [PARAMETER_OPEN, FUNCTION_CLOSE, CALL_CLOSE]
        found = first_marker(self._buffer, markers)
        if found is None:
            self._buffer = self._buffer[len(self._buffer) - held_back(self._buffer, markers) :]
            return False
        offset, marker = found
        if marker == PARAMETER_OPEN:
            self._move(_State.ARGUMENT, offset + len(marker))
            return True
        self._close_call(out)
        self._move(_State.AFTER if marker == FUNCTION_CLOSE else _State.CONTENT, offset + len(marker))
        return True

    def _value(self, out: ParsedDelta) -> bool:
        found = first_marker(self._buffer, VALUE_ENDS)
        if found is None:
            return False
        offset, marker = found
        self._emit_value(self._buffer[:offset], out)
        consumed = offset + len(marker) if marker == PARAMETER_CLOSE else offset
        self._move(_State.BODY, consumed)
        return True

    def _emit_value(self, raw: str, out: ParsedDelta) -> None:
        text = raw.removeprefix("\n").removesuffix("\n")
        schema = self._schemas.get(self._function)
        properties = schema.get("properties") if isinstance(schema, Mapping) else None
        argument_schema = properties.get(self._argument) if isinstance(properties, Mapping) else None
        value = convert_value(text, argument_schema)
        pair = json.dumps(self._argument, ensure_ascii=False) + ":" + _compact(value)
        out.calls.append(ToolCallDelta(self._calls - 1, ("," if self._arguments else "{") + pair))
        self._arguments += 1

    def _close_call(self, out: ParsedDelta) -> None:
        out.calls.append(ToolCallDelta(self._calls - 1, "}" if self._arguments else "{}"))
        self._blank = ""

    def _show(self, text: str, out: ParsedDelta, *, final: bool = False) -> None:
        """Content, except whitespace after a call until something else follows it."""
        if self._calls and not (self._blank + text).strip():
            self._blank = "" if final else self._blank + text
            return
        out.content += self._blank + text
        self._blank = ""

    def _move(self, state: _State, consumed: int) -> None:
        self._state = state
        self._buffer = self._buffer[consumed:]


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
