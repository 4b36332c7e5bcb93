"""A chat answer's tool calls as OpenAI writes them: whole in ``message.tool_calls``, or as the
``delta.tool_calls`` pieces of a stream (one entry per call and chunk: ``id``, ``type`` and the
function's ``name`` with the call's first piece, then ``arguments`` pieces), and the finish reason
``"tool_calls"`` of a choice the model ended after calling tools. A call cut off (``max_tokens``, a
stop string) is still a call, with the arguments written so far: never markup in ``content``."""

from __future__ import annotations

from collections.abc import Sequence

from metrale.gateway.response_bodies import (
    AssistantMessage,
    ChatDelta,
    FunctionCall,
    FunctionCallDelta,
    ToolCallBody,
    ToolCallChunk,
)
from metrale.shared.messages import FinishReason
from metrale.text.tool_calls.parser import ParsedDelta, ToolCall, ToolCallDelta

TOOL_CALLS = "tool_calls"
"""The finish reason of a choice that stopped after calling tools."""


def finish_reason(reason: FinishReason | None, called: bool, cut_off: bool = False) -> str | None:
    """``"tool_calls"`` for a choice that ended by itself (a stop) having called tools, its last call
    whole; else ``reason`` (``"length"`` for a call cut off by ``max_tokens``, as OpenAI gives it, and
    ``"stop"`` for one a stop string cut off: a client must not run an incomplete call)."""
    if reason is FinishReason.STOP and called and not cut_off:
        return TOOL_CALLS
    return None if reason is None else reason.value


def assistant_message(content: str, calls: Sequence[ToolCall], reasoning: str | None = None) -> AssistantMessage:
    """The message of a parsed answer: without calls as before; with calls, ``content`` None if empty.
    ``reasoning`` (a model read by a reasoning parser) is ``reasoning_content``, and then an empty
    answer's ``content`` is None too."""
    empty_content = None if calls or reasoning is not None else content
    if not calls:
        return AssistantMessage(content=content or empty_content, reasoning_content=reasoning or None)
    bodies = [ToolCallBody(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]
    return AssistantMessage(content=content or None, reasoning_content=reasoning or None, tool_calls=bodies)


def chat_delta(parsed: ParsedDelta, reasoning: str = "") -> ChatDelta:
    """A stream chunk's ``delta`` for what a parser emitted: ``content`` unless only calls or
    reasoning came; ``reasoning_content`` when reasoning came."""
    chunks = tool_call_chunks(parsed.calls)
    content = parsed.content if parsed.content or not (chunks or reasoning) else None
    return ChatDelta(content=content, reasoning_content=reasoning or None, tool_calls=chunks or None)


def tool_call_chunks(calls: Sequence[ToolCallDelta]) -> list[ToolCallChunk]:
    """The pieces of one chunk, one entry per call (its pieces joined), in call order."""
    merged: dict[int, ToolCallChunk] = {}
    for call in calls:
        entry = merged.get(call.index)
        if entry is None:
            entry = merged[call.index] = ToolCallChunk(index=call.index, function=FunctionCallDelta())
        if call.id is not None:
            entry.id, entry.type = call.id, "function"
        if call.name is not None:
            entry.function.name = call.name
        entry.function.arguments += call.arguments
    return [merged[index] for index in sorted(merged)]
