"""What a chat's messages may carry besides text, and which template variables a client may set.

Metrale serves text only, for every family: a release that ships a vision tower (Qwen3.5) is served
without it. A content part of another kind (an image, audio, a file, a video, or a type no API defines) is
refused with a 400 naming the message, the part and its type and saying it is not served, never dropped.
Text parts (``text``, and the Responses API's ``input_text`` / ``output_text``) are served.
``chat_template_kwargs`` reach the template as extra variables (``enable_thinking`` and the like,
as in vLLM), except the ones the server fills itself (``SERVER_VARIABLES``): a 400 names the key.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from metrale.gateway.request_bodies import ChatMessage
from metrale.shared.errors import BadRequest
from metrale.text.chat_templates.render import SERVER_VARIABLES

TEXT_PARTS = frozenset({"text", "input_text", "output_text"})
"""Content part types whose ``text`` is served."""

_NOT_SERVED = {
    "image_url": "images are",
    "input_image": "images are",
    "input_audio": "audio is",
    "file": "files are",
    "input_file": "files are",
    "video_url": "videos are",
}


def refuse_part(part_type: object, where: str) -> None:
    """Raise the 400 for a content part of ``part_type`` (not text) at ``where`` (e.g. ``messages[1].content[0]``)."""
    if isinstance(part_type, str) and part_type in _NOT_SERVED:
        why = (
            f"{_NOT_SERVED[part_type]} not served: Metrale serves a model's text alone "
            "(a release's vision tower, as Qwen3.5's, is not loaded)"
        )
    else:
        why = "no content part type this server knows"
    raise BadRequest(
        f"{where} is a {part_type!r} part: {why}; send the content as 'text' parts.", param=f"{where}.type"
    )


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The chat's messages as the chat template takes them, their text parts all of type ``text``
    (templates look for that type); 400 for the first part that is not a text part with a string
    ``text``."""
    dumped = []
    for index, message in enumerate(messages):
        as_dict = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            as_dict["content"] = [
                _text_part(part, f"messages[{index}].content[{at}]") for at, part in enumerate(message.content)
            ]
        dumped.append(as_dict)
    return dumped


def _text_part(part: Mapping[str, Any], where: str) -> dict[str, Any]:
    part_type = part.get("type")
    if part_type not in TEXT_PARTS:
        refuse_part(part_type, where)
    if not isinstance(part.get("text"), str):
        raise BadRequest(f"{where} is a {part_type!r} part without a string 'text'.", param=f"{where}.text")
    return {**part, "type": "text"}


def check_template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` as the template's extra variables; 400 naming a key the server fills."""
    extra = dict(kwargs or {})
    taken = sorted(SERVER_VARIABLES.intersection(extra))
    if taken:
        raise BadRequest(
            f"chat_template_kwargs may not set {', '.join(repr(name) for name in taken)}: the server passes "
            f"{'it' if len(taken) == 1 else 'them'} to the chat template itself (messages, tools and special "
            "tokens come from the request and the model).",
            param=f"chat_template_kwargs.{taken[0]}",
        )
    return extra
