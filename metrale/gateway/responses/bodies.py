"""``POST /v1/responses`` request bodies (pydantic at the HTTP edge).

The sampling extensions of chat completions (``top_k``, ``min_p``, penalties, ``seed``, ``ignore_eos``,
``stop_token_ids``, ``priority``) are accepted too. What the Responses API does not have, or what
Metrale does not support yet (function tools, background mode), is refused with a 400 naming it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from metrale.gateway.metadata import check_metadata
from metrale.gateway.request_bodies import SamplingFields
from metrale.shared.errors import BadRequest


class InputContentPart(BaseModel):
    """One part of an input message's content; only text parts are supported."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class InputItem(BaseModel):
    """One input item: a message (``type`` ``message`` or omitted, as the easy input message)."""

    model_config = ConfigDict(extra="allow")

    type: str = "message"
    role: str | None = None
    content: str | list[InputContentPart] | None = None


class ResponseCreateRequest(SamplingFields):
    """A ``responses.create`` body."""

    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    background: bool | None = None

    def refuse_unsupported(self) -> None:
        """400 for fields this endpoint does not take (chat-only fields, tools, background)."""
        if self.tools:
            raise BadRequest(
                "Function tools are not supported by /v1/responses yet (tool calling in chat completions has "
                "not landed); send the request without 'tools'.",
                param="tools",
            )
        if self.tool_choice not in (None, "none", "auto"):
            raise BadRequest(
                "'tool_choice' needs tools, which /v1/responses does not support yet.", param="tool_choice"
            )
        if self.background:
            raise BadRequest("Background responses are not supported: send 'background': false.", param="background")
        refused = {
            "max_tokens": "use 'max_output_tokens'",
            "stop": "the Responses API has no stop strings",
            "stream_options": "the Responses API always reports usage",
            "session": "continue a conversation with 'previous_response_id'",
        }
        for name, why in refused.items():
            if name in self.model_fields_set:
                raise BadRequest(f"'{name}' is not a /v1/responses parameter: {why}.", param=name)
        if self.n != 1:
            raise BadRequest("A response has one output: 'n' must be 1.", param="n")
        check_metadata(self.metadata)

    @property
    def token_budget(self) -> int | None:
        return self.max_output_tokens
