"""A response's output items, built as the model's parsed text arrives, with the stream's events.

The parsed text (reasoning, then ``ParsedDelta``: plain text and tool-call pieces) becomes items in
the order the model wrote them: its reasoning (``<think>…</think>``) a ``reasoning`` item with one
``reasoning_text`` part (``summary`` empty: the text is the model's own), a run of text a ``message``
item with one ``output_text`` part, each call a ``function_call`` item. At most one item is open at a
time (the last); the next one's start closes it. The events are the Responses API's, in its order:
``output_item.added`` (and ``content_part.added`` for a message or reasoning), the item's deltas
(``reasoning_text.delta``, ``output_text.delta`` or ``function_call_arguments.delta``), then its
``.done`` events and ``output_item.done``. A whole answer is built by the same code from the same
text, so it is what the stream adds up to.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from typing import Any

from metrale.gateway.responses.objects import output_message, reasoning_item, reasoning_part, text_part
from metrale.text.tool_calls.parser import ParsedDelta, ToolCallDelta


@dataclass(frozen=True, slots=True)
class OutputEvent:
    """One stream event before it is numbered: its ``type`` and its other fields."""

    kind: str
    fields: dict[str, Any]


class ResponseOutput:
    """The output items of one response; ``push`` parsed text, then ``finish``. Item ids are made
    from ``response_id`` and the item's place, so the same text read again gives the same items (a
    background response's job run again continues the events it had stored)."""

    def __init__(self, response_id: str) -> None:
        self._response_id = response_id
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._calls: dict[int, dict[str, Any]] = {}

    def push(self, parsed: ParsedDelta, reasoning: str = "") -> list[OutputEvent]:
        """The events of the next piece of parsed text: ``reasoning`` (written before ``parsed``), then
        ``parsed``'s text and calls."""
        events: list[OutputEvent] = []
        if reasoning:
            events += self._reasoning(reasoning)
        if parsed.content:
            events += self._text(parsed.content)
        for piece in parsed.calls:
            events += self._call_piece(piece)
        return events

    def finish(self, status: str) -> list[OutputEvent]:
        """Close the open item with ``status`` (``completed``, or ``incomplete`` when the output was cut
        off); an output with no message or call (nothing, or reasoning only) gets an empty message."""
        events: list[OutputEvent] = []
        if all(item["type"] == "reasoning" for item in self.items):
            events += self._open_message()
        events += self._close(status)
        return events

    def assistant_message(self) -> dict[str, Any]:
        """The output as one chat-template assistant message (text, then ``tool_calls``)."""
        text = "".join(item["content"][0]["text"] for item in self.items if item["type"] == "message")
        message: dict[str, Any] = {"role": "assistant", "content": text}
        reasoning = "".join(item["content"][0]["text"] for item in self.items if item["type"] == "reasoning")
        if reasoning:
            message["reasoning_content"] = reasoning  # what thinking templates render (or drop) it from
        calls = [item for item in self.items if item["type"] == "function_call"]
        if calls:
            message["tool_calls"] = [
                {"id": c["call_id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in calls
            ]
        return message

    def _text(self, text: str) -> list[OutputEvent]:
        events = [] if self._open is not None and self._open["type"] == "message" else self._open_message()
        message = self._open
        assert message is not None
        message["content"][0]["text"] += text
        where = {"item_id": message["id"], "output_index": len(self.items) - 1, "content_index": 0}
        return [*events, OutputEvent("response.output_text.delta", {**where, "delta": text, "logprobs": []})]

    def _reasoning(self, text: str) -> list[OutputEvent]:
        events = [] if self._open is not None and self._open["type"] == "reasoning" else self._open_reasoning()
        item = self._open
        assert item is not None
        item["content"][0]["text"] += text
        where = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
        return [*events, OutputEvent("response.reasoning_text.delta", {**where, "delta": text})]

    def _call_piece(self, piece: ToolCallDelta) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        call = self._calls.get(piece.index)
        if call is None:
            events += self._close("completed")
            call = self._calls[piece.index] = {
                "id": self._item_id("fc"),
                "type": "function_call",
                "call_id": piece.id or self._item_id("call"),
                "name": piece.name or "",
                "arguments": "",
                "status": "in_progress",
            }
            self._open = call
            self.items.append(call)
            events.append(
                OutputEvent(
                    "response.output_item.added", {"output_index": len(self.items) - 1, "item": copy.deepcopy(call)}
                )
            )
        if piece.arguments:
            call["arguments"] += piece.arguments
            where = {"item_id": call["id"], "output_index": self.items.index(call)}
            events.append(OutputEvent("response.function_call_arguments.delta", {**where, "delta": piece.arguments}))
        return events

    def _item_id(self, prefix: str) -> str:
        """``{prefix}_`` + 32 hex digits, the same for the same response and output index."""
        digest = hashlib.sha256(f"{self._response_id}/{len(self.items)}".encode()).hexdigest()
        return f"{prefix}_{digest[:32]}"

    def _open_message(self) -> list[OutputEvent]:
        return self._open_with_part(output_message(self._item_id("msg"), "", "in_progress"), text_part(""))

    def _open_reasoning(self) -> list[OutputEvent]:
        return self._open_with_part(reasoning_item(self._item_id("rs"), "", "in_progress"), reasoning_part(""))

    def _open_with_part(self, item: dict[str, Any], part: dict[str, Any]) -> list[OutputEvent]:
        """Open ``item`` (added with no content) and its one content part ``part``."""
        events = self._close("completed")
        self._open = item
        self.items.append(item)
        index = len(self.items) - 1
        events.append(OutputEvent("response.output_item.added", {"output_index": index, "item": copy.deepcopy(item)}))
        item["content"] = [part]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        events.append(OutputEvent("response.content_part.added", {**where, "part": copy.deepcopy(part)}))
        return events

    def _close(self, status: str) -> list[OutputEvent]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        index = self.items.index(item)
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            done = (
                OutputEvent(
                    "response.output_text.done", {**where, "content_index": 0, "text": part["text"], "logprobs": []}
                )
                if item["type"] == "message"
                else OutputEvent("response.reasoning_text.done", {**where, "content_index": 0, "text": part["text"]})
            )
            part_done = {**where, "content_index": 0, "part": copy.deepcopy(part)}
            events = [done, OutputEvent("response.content_part.done", part_done)]
        else:
            events = [OutputEvent("response.function_call_arguments.done", {**where, "arguments": item["arguments"]})]
        events.append(OutputEvent("response.output_item.done", {"output_index": index, "item": copy.deepcopy(item)}))
        return events
