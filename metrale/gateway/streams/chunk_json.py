"""Stream chunks written straight to JSON text: the per-token hot path of every SSE stream.

Every chunk of a request shares its envelope (``id``, ``object``, ``created``, ``model``,
``system_fingerprint``), so ``ChunkEnvelope`` serializes it once and each delta only encodes its own
choice. The text is byte for byte what pydantic's ``model_dump_json`` writes for the models in
``responses.py``, which remain the schema (the tests compare the two).
"""

from __future__ import annotations

import json

from pydantic import BaseModel

from metrale.shared.messages import FinishReason

_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
"""Compact, non-ASCII kept as is, control characters escaped: the layout pydantic writes."""


def json_text(value: str) -> str:
    """``value`` as a JSON string literal."""
    return _ENCODER.encode(value)


def choice_json(index: int, content: str, logprobs: BaseModel | None, finish_reason: FinishReason | str | None) -> str:
    """One entry of ``choices``: its ``index``, the endpoint's own ``content`` (``"key":value`` text,
    e.g. ``"text":"..."``), then ``logprobs`` and ``finish_reason`` (``null`` while the choice runs; a
    ``FinishReason`` or a reason only the gateway gives, such as ``"tool_calls"``)."""
    logprobs_json = "null" if logprobs is None else logprobs.model_dump_json()
    reason_json = "null" if finish_reason is None else json_text(str(finish_reason))
    return f'{{"index":{index},{content},"logprobs":{logprobs_json},"finish_reason":{reason_json}}}'


class ChunkEnvelope:
    """The fields every chunk of one streamed response repeats, serialized once."""

    def __init__(self, *, id: str, object: str, created: int, model: str, system_fingerprint: str) -> None:
        head = _ENCODER.encode(
            {"id": id, "object": object, "created": created, "model": model, "system_fingerprint": system_fingerprint}
        )
        self._head = head[:-1] + ',"choices":['  # the object left open for the rest of each chunk

    def chunk(self, choice: str) -> str:
        """The chunk holding one ``choice`` (its JSON, see ``choice_json``) and no usage."""
        return f'{self._head}{choice}],"usage":null}}'
