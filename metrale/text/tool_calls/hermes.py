"""The common ``<tool_call>{json}</tool_call>`` format (``--tool-call-parser hermes``, as vLLM names it).

Each call is a JSON object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and
``</tool_call>`` (Hermes, Qwen and the built-in model's template write it so). A call is emitted whole
once its closing tag arrives: its id from ``CallIds``, its name, and its arguments as compact JSON
text. A closed block that is not such an object stays content, tags included. Whitespace between
calls and after the last one is not content.

A block the text ends in (cut off by ``max_tokens`` or a stop string) is never content: once its name
is whole it is a call whose arguments are the text written of them (``ParsedDelta.cut_off`` says
so); before that it is dropped, unless it does not start like a call object (then it was text that
mentions the tag, and stays content). Text that ends in the start of ``<tool_call>`` (``<tool_c``)
ends in a call cut off as it opened: that start is dropped too.
"""

from __future__ import annotations

import json
import re
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
        self._after_call = False  # nothing but whitespace since the last call
        self._blank = ""  # that whitespace, shown only if more content follows

    def push(self, text: str) -> ParsedDelta:
        self._buffer += text
        out = ParsedDelta()
        while self._step(out):
            pass
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._in_call:
            self._cut_off(self._buffer, out)
        else:  # what is held back is the start of a tag: a call cut off as it opened
            out.cut_off = bool(self._buffer)
            self._show("", out, final=True)
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
            self._close(self._buffer[:offset], out)
        else:
            self._show(self._buffer[:offset], out)
        self._in_call = not self._in_call
        self._buffer = self._buffer[offset + len(marker) :]
        return True

    def _show(self, text: str, out: ParsedDelta, *, final: bool = False) -> None:
        """Content, except whitespace after a call until something else follows it."""
        if self._after_call and not (self._blank + text).strip():
            self._blank = "" if final else self._blank + text
            return
        out.content += self._blank + text
        self._blank = ""
        self._after_call = False

    def _close(self, body: str, out: ParsedDelta) -> None:
        call = _as_call(body)
        if call is None:
            self._show(CALL_OPEN + body + CALL_CLOSE, out)
            return
        self._emit(*call, out)

    def _cut_off(self, body: str, out: ParsedDelta) -> None:
        """The text ended inside a block: a call with the arguments written so far, if named."""
        body = body[: len(body) - held_back(body, [CALL_CLOSE])]
        call = _as_call(body) or _as_cut_call(body)
        if call is not None:
            self._emit(*call, out)
            out.cut_off = True
        elif body.strip() and not body.lstrip().startswith("{"):
            self._show(CALL_OPEN + body, out, final=True)
        else:
            out.cut_off = True

    def _emit(self, name: str, arguments: str, out: ParsedDelta) -> None:
        out.calls.append(ToolCallDelta(self._calls, arguments, id=self._call_ids(self._calls), name=name))
        self._calls += 1
        self._blank = ""
        self._after_call = True


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


_CUT_CALL = re.compile(
    r'\s*\{\s*"name"\s*:\s*(?P<name>"(?:[^"\\]|\\.)*")'
    r'(?:\s*,\s*(?:"(?:arguments|parameters)"\s*:\s*(?P<arguments>.*)|.*))?',
    re.DOTALL,
)


def _as_cut_call(body: str) -> tuple[str, str] | None:
    """``(name, arguments text so far)`` of a call object cut off after its name, or None."""
    match = _CUT_CALL.fullmatch(body)
    if match is None:
        return None
    try:
        name = json.loads(match["name"])
    except ValueError:
        return None
    return (name, (match["arguments"] or "").rstrip()) if name else None
