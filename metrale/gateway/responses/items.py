"""Input items to chat messages, and the items a response stores and lists (``input_items``)."""

from __future__ import annotations

import uuid
from typing import Any

from metrale.gateway.content_parts import TEXT_PARTS, refuse_part
from metrale.gateway.responses.bodies import InputItem, ResponseCreateRequest
from metrale.shared.errors import BadRequest

_INPUT_ROLES = ("user", "system", "developer", "assistant")


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_items(body: ResponseCreateRequest) -> list[dict[str, Any]]:
    """The request's input as stored message items (``ResponseInputMessageItem`` shape), each with an id.

    Raises ``BadRequest`` for items other than text messages (function calls need tool support, which
    has not landed; images are not supported)."""
    if isinstance(body.input, str):
        return [_message_item("user", body.input)]
    items = []
    for index, item in enumerate(body.input):
        items.append(_message_item(_role(item, index), _text(item, index)))
    if not items:
        raise BadRequest("'input' must hold at least one item.", param="input")
    return items


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Stored message items as chat-template messages."""
    return [{"role": item["role"], "content": "".join(part["text"] for part in item["content"])} for item in items]


def _message_item(role: str, text: str) -> dict[str, Any]:
    part_type = "output_text" if role == "assistant" else "input_text"
    return {
        "id": item_id("msg"),
        "type": "message",
        "role": role,
        "status": "completed",
        "content": [{"type": part_type, "text": text}],
    }


def _role(item: InputItem, index: int) -> str:
    if item.type != "message":
        raise BadRequest(
            f"input[{index}] is a {item.type!r} item: only message items are supported (function_call and "
            "function_call_output need tool support, which /v1/responses does not have yet).",
            param=f"input[{index}].type",
        )
    if item.role not in _INPUT_ROLES:
        raise BadRequest(f"input[{index}].role must be one of {', '.join(_INPUT_ROLES)}.", param=f"input[{index}].role")
    return item.role


def _text(item: InputItem, index: int) -> str:
    content = item.content
    if content is None:
        raise BadRequest(f"input[{index}] has no content.", param=f"input[{index}].content")
    if isinstance(content, str):
        return content
    texts = []
    for part_index, part in enumerate(content):
        where = f"input[{index}].content[{part_index}]"
        if part.type not in TEXT_PARTS:
            refuse_part(part.type, where)
        if part.text is None:
            raise BadRequest(f"{where} is a {part.type!r} part without a string 'text'.", param=f"{where}.text")
        texts.append(part.text)
    return "".join(texts)
