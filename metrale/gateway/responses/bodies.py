"""``POST /v1/responses`` request bodies (pydantic at the HTTP edge).

Every field of the Responses API's ``ResponseCreateParams`` is declared, so a client learns why one is
not served: what it asks for is honoured, or refused with a 400 naming it (``refusals.py``). The
sampling extensions of chat completions (``top_k``, ``min_p``, penalties, ``seed``, ``ignore_eos``,
``stop_token_ids``, ``priority``, ``speculative``) are accepted too, and vLLM's ``chat_template_kwargs`` (the chat
template's extra variables, e.g. ``{"enable_thinking": false}``), checked as on chat.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from metrale.gateway.request_bodies import JsonSchemaFormat, ResponseFormat, SamplingFields


class InputContentPart(BaseModel):
    """One part of an input message's content; only text parts are supported."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class InputItem(BaseModel):
    """One input item: a message (``type`` ``message`` or omitted, as the easy input message), a
    ``reasoning`` item (an earlier output replayed: its ``content`` the ``reasoning_text`` parts), a
    ``function_call`` the model made, or a ``function_call_output`` the client answers it with."""

    model_config = ConfigDict(extra="allow")

    type: str = "message"
    role: str | None = None
    content: str | list[InputContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputContentPart] | None = None


class TextFormat(BaseModel):
    """``text.format``: free ``text``, any ``json_object``, or a ``json_schema`` (flat, unlike chat's
    ``response_format.json_schema``)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    type: str
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    def as_response_format(self) -> ResponseFormat:
        """The same constraint as chat's ``response_format``."""
        if self.type != "json_schema":
            return ResponseFormat(type=self.type)  # type: ignore[arg-type]  # checked by the refusals
        spec = JsonSchemaFormat(name=self.name or "", description=self.description, strict=self.strict)
        spec.schema_ = self.schema_
        return ResponseFormat(type="json_schema", json_schema=spec)


class TextConfig(BaseModel):
    """``text``: the output's format, and its verbosity (not supported)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(BaseModel):
    """``reasoning``: how much a reasoning model thinks, and the summary it gives."""

    model_config = ConfigDict(extra="forbid", strict=True)

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponseCreateRequest(SamplingFields):
    """A ``responses.create`` body."""

    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    text: TextConfig | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    truncation: str | None = None
    reasoning: ReasoningConfig | None = None
    safety_identifier: str | None = None
    background: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # fields Metrale cannot honour: declared so a value that asks for something is refused by name
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    service_tier: str | None = None
    context_management: list[dict[str, Any]] | None = None
    access_programs: dict[str, Any] | None = None
    background_options: dict[str, Any] | None = None
    image: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None

    @property
    def token_budget(self) -> int | None:
        return self.max_output_tokens

    @property
    def text_format(self) -> TextFormat | None:
        """``text.format``, if the request gave one."""
        return self.text.format if self.text is not None else None

    def chat_response_format(self) -> ResponseFormat | None:
        """``text.format`` as chat's ``response_format`` (what ``build_submission`` constrains with)."""
        text_format = self.text_format
        return text_format.as_response_format() if text_format is not None else None
