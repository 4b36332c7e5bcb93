"""The common ``<tool_call>{json}</tool_call>`` format (``--tool-call-parser hermes``, as vLLM names it).

Each call is a JSON object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and
``</tool_call>`` (Hermes, Qwen and the built-in model's template write it so). A call is emitted whole
once its closing tag arrives (or the text ends): its id from ``CallIds``, its name, and its arguments
as compact JSON text. A block that is not such an object stays content, tags included. Whitespace
between calls and after the last one is not content.
"""

from __future__ import annotations

import json
from typing import Any

from metrale.text.tool_calls.parser import CallIds, ParsedDelta, ToolCallDelta, held_back

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"


def call_text(name: str, arguments: Any) -> str:
    """A call as this format writes it (what the built-in template renders for an earlier call)."""
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CALL_CLOSE}"


class HermesToolCallParser:
    """Parses ``<tool_call>`` blocks; see the module docstring."""

    def __init__(self, call_ids: CallIds) -> None:
        self._call_ids = call_ids
        self._buffer = ""
        self._in_call = False
        self._calls = 0
        self._blank = ""  # whitespace after a call, shown only if more content follows

    def push(self, text: str) -> ParsedDelta:
        self._buffer += text
        out = ParsedDelta()
        while self._step(out):
            pass
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._in_call:
            self._close(self._buffer, out, closed=False)
        else:
            self._show(self._buffer, out, final=True)
        self._buffer = ""
        return out

    def _step(self, out: ParsedDelta) -> bool:
        marker = CALL_CLOSE if self._in_call else CALL_OPEN
        offset = self._buffer.find(marker)
        if offset < 0:
            if not self._in_call:
                keep = held_back(self._buffer, [CALL_OPEN])
                self._show(self._buffer[: len(self._buffer) - keep], out)
                self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        if self._in_call:
            self._close(self._buffer[:offset], out, closed=True)
        else:
            self._show(self._buffer[:offset], out)
        self._in_call = not self._in_call
        self._buffer = self._buffer[offset + len(marker) :]
        return True

    def _show(self, text: str, out: ParsedDelta, *, final: bool = False) -> None:
        """Content, except whitespace after a call until something else follows it."""
        if self._calls and not (self._blank + text).strip():
            self._blank = "" if final else self._blank + text
            return
        out.content += self._blank + text
        self._blank = ""

    def _close(self, body: str, out: ParsedDelta, *, closed: bool) -> None:
        call = _as_call(body)
        if call is None:
            self._show(CALL_OPEN + body + (CALL_CLOSE if closed else ""), out)
            return
        name, arguments = call
        out.calls.append(ToolCallDelta(self._calls, arguments, id=self._call_ids(self._calls), name=name))
        self._calls += 1
        self._blank = ""


def _as_call(body: str) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of a block's text, or None if it is not a call object."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        return value["name"], arguments
    return value["name"], json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
