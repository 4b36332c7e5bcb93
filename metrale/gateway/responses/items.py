"""Input items to chat messages, and the items a response stores and lists (``input_items``).

Four kinds of input item are served: text messages, ``reasoning`` and ``function_call`` items (what
the model wrote, replayed by a client that sends the whole conversation, as the Agents SDK does) and
``function_call_output`` items (a call's result). As chat messages, a ``reasoning`` item is the
``reasoning_content`` of the assistant message that follows it (the one its text or calls open) —
what thinking templates read, rendering it in the current turn's tool-calling steps and dropping it
from earlier turns, as they drop a chat's; a run of ``function_call`` items is one assistant
message's ``tool_calls`` (joined to the assistant message just before them, if any), and each output
is a ``tool`` message naming its call by ``tool_call_id`` — what chat templates render as tool calls
and tool results. A reasoning item with ``encrypted_content`` is refused (Metrale never encrypts).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from metrale.gateway.content_parts import TEXT_PARTS, refuse_part
from metrale.gateway.responses.bodies import InputContentPart, InputItem, ResponseCreateRequest
from metrale.shared.errors import BadRequest

_INPUT_ROLES = ("user", "system", "developer", "assistant")


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_items(body: ResponseCreateRequest) -> list[dict[str, Any]]:
    """The request's input as stored items (``ResponseInputMessageItem``, ``ResponseFunctionToolCallItem``,
    ``ResponseFunctionToolCallOutputItem`` shapes), each with an id.

    Raises ``BadRequest`` for items of other types and for content that is not text."""
    if isinstance(body.input, str):
        return [_message_item("user", body.input)]
    items = [_stored_item(item, index) for index, item in enumerate(body.input)]
    if not items:
        raise BadRequest("'input' must hold at least one item.", param="input")
    return items


def chat_messages(items: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stored items as chat-template messages."""
    messages: list[dict[str, Any]] = []
    for item in items:
        last = messages[-1] if messages else None
        if item["type"] == "message":
            text = "".join(part["text"] for part in item["content"])
            if item["role"] == "assistant" and last is not None and _reasoning_only(last):
                last["content"] = text
            else:
                messages.append({"role": item["role"], "content": text})
        elif item["type"] == "reasoning":
            text = "".join(part["text"] for part in item["content"])
            messages.append({"role": "assistant", "content": "", "reasoning_content": text})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function", "function": _function(item)}
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def _reasoning_only(message: dict[str, Any]) -> bool:
    """Whether ``message`` is a replayed reasoning item's assistant message, its answer not met yet."""
    return "reasoning_content" in message and not message["content"] and "tool_calls" not in message


def items_chars(items: Sequence[dict[str, Any]]) -> int:
    """Characters of the items' text (what rendering and encoding them grows with)."""
    size = 0
    for item in items:
        if item["type"] in ("message", "reasoning"):
            size += sum(len(part["text"]) for part in item["content"])
        elif item["type"] == "function_call":
            size += len(item["name"]) + len(item["arguments"])
        else:
            size += len(item["output"])
    return size


def _function(item: dict[str, Any]) -> dict[str, str]:
    return {"name": item["name"], "arguments": item["arguments"]}


def _stored_item(item: InputItem, index: int) -> dict[str, Any]:
    if item.type == "message":
        return _message_item(_role(item, index), _text(item.content, f"input[{index}]", "content"))
    if item.type == "reasoning":
        return _reasoning_item(item, index)
    if item.type == "function_call":
        fields = {name: _string(item, name, index) for name in ("call_id", "name", "arguments")}
        return {"id": _given_id(item, "fc"), "type": "function_call", **fields, "status": "completed"}
    if item.type == "function_call_output":
        output = _text(item.output, f"input[{index}]", "output")
        call_id = _string(item, "call_id", index)
        return {
            "id": _given_id(item, "fco"),
            "type": "function_call_output",
            "call_id": call_id,
            "output": output,
            "status": "completed",
        }
    raise BadRequest(
        f"input[{index}] is a {item.type!r} item: the input items served are message, reasoning, function_call "
        "and function_call_output.",
        param=f"input[{index}].type",
    )


def _reasoning_item(item: InputItem, index: int) -> dict[str, Any]:
    """A replayed ``reasoning`` item as stored: its ``reasoning_text`` parts (a summary is not the
    model's words: kept, not rendered)."""
    where = f"input[{index}]"
    extra = item.model_extra or {}
    if extra.get("encrypted_content") is not None:
        raise BadRequest(
            f"{where} holds 'encrypted_content': Metrale never encrypts reasoning, so it cannot read it back; "
            "replay the item as the server returned it (its 'content').",
            param=f"{where}.encrypted_content",
        )
    parts = item.content if isinstance(item.content, list) else []
    if isinstance(item.content, str) or any(part.type != "reasoning_text" or part.text is None for part in parts):
        raise BadRequest(
            f"{where} is a reasoning item whose 'content' is not a list of reasoning_text parts.",
            param=f"{where}.content",
        )
    summary = extra.get("summary") or []
    if not isinstance(summary, list):
        raise BadRequest(f"{where}.summary must be a list of summary parts.", param=f"{where}.summary")
    content = [{"type": "reasoning_text", "text": part.text} for part in parts]
    return {"id": _given_id(item, "rs"), "type": "reasoning", "summary": summary, "content": content}


def _message_item(role: str, text: str) -> dict[str, Any]:
    part_type = "output_text" if role == "assistant" else "input_text"
    return {
        "id": item_id("msg"),
        "type": "message",
        "role": role,
        "status": "completed",
        "content": [{"type": part_type, "text": text}],
    }


def _given_id(item: InputItem, prefix: str) -> str:
    given = (item.model_extra or {}).get("id")
    return given if isinstance(given, str) and given else item_id(prefix)


def _role(item: InputItem, index: int) -> str:
    if item.role not in _INPUT_ROLES:
        raise BadRequest(f"input[{index}].role must be one of {', '.join(_INPUT_ROLES)}.", param=f"input[{index}].role")
    return item.role


def _string(item: InputItem, name: str, index: int) -> str:
    value = getattr(item, name)
    if not isinstance(value, str):
        raise BadRequest(
            f"input[{index}] is a {item.type} item without a string '{name}'.", param=f"input[{index}].{name}"
        )
    return value


def _text(content: str | list[InputContentPart] | None, where: str, field: str) -> str:
    """A message's content or a call's output: a string, or the text of its text parts."""
    if content is None:
        raise BadRequest(f"{where} has no {field}.", param=f"{where}.{field}")
    if isinstance(content, str):
        return content
    texts = []
    for part_index, part in enumerate(content):
        at = f"{where}.{field}[{part_index}]"
        if part.type not in TEXT_PARTS:
            refuse_part(part.type, at)
        if part.text is None:
            raise BadRequest(f"{at} is a {part.type!r} part without a string 'text'.", param=f"{at}.text")
        texts.append(part.text)
    return "".join(texts)
