"""The OpenAI response bodies the gateway returns: completions, stream chunks, model lists."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, SerializerFunctionWrapHandler, model_serializer

from metrale.shared.messages import Usage


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class UsageInfo(BaseModel):
    """``usage``: ``cached_tokens`` are prompt tokens restored from a recurrent-state checkpoint."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, usage: Usage) -> UsageInfo:
        return cls(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            total_tokens=usage.prompt_tokens + usage.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
        )


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """Chat format: one entry per generated token."""

    content: list[TokenLogprob]


class CompletionLogprobs(BaseModel):
    """Legacy completions format: parallel lists, ``text_offset`` counted in characters of the text.
    With ``echo`` the prompt's tokens come first; the first has no logprob (``null`` in both lists)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's ``Logprob``: one token of a ``prompt_logprobs`` entry; ``rank`` is its place in the
    distribution (1: most likely), null for a prompt token outside the alternatives asked for."""

    logprob: float
    rank: int | None
    decoded_token: str


PromptLogprobsList = list[dict[str, PromptLogprob] | None]
"""vLLM's ``prompt_logprobs``: per prompt token, its token id (as a string key) and its alternatives'
ids mapped to their ``PromptLogprob``; the first entry is null."""


class FunctionCall(BaseModel):
    name: str
    arguments: str
    """The arguments as JSON text, as the model wrote them."""


class ToolCallBody(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    """The answer; ``tool_calls`` is left out unless the model called tools (then ``content`` is the text
    before the calls, None if there was none)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    """The model's reasoning (``<think>…</think>``), for a model read by a reasoning parser (vLLM's field)."""
    tool_calls: list[ToolCallBody] | None = None

    @model_serializer(mode="wrap")
    def _without_absent_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        optional = ("tool_calls", "reasoning_content")
        return {name: value for name, value in handler(self).items() if name not in optional or value is not None}


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    """``prompt_logprobs`` (vLLM puts it on the response, not a choice) is left out unless asked for."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobsList | None = None

    @model_serializer(mode="wrap")
    def _without_absent_prompt_logprobs(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {name: value for name, value in handler(self).items() if name != "prompt_logprobs" or value is not None}


class FunctionCallDelta(BaseModel):
    """A piece of a streamed call: the name comes once, with the call's first piece."""

    name: str | None = None
    arguments: str = ""

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {name: value for name, value in handler(self).items() if value is not None}


class ToolCallChunk(BaseModel):
    """A streamed call piece; ``id`` and ``type`` come with the call's first piece only."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {name: value for name, value in handler(self).items() if value is not None}


class ChatDelta(BaseModel):
    """A chunk's ``delta``; fields that are not set are left out (``{"content": "..."}``)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallChunk] | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {name: value for name, value in handler(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(BaseModel):
    """One SSE chunk; the optional last one (``include_usage``) has no choices and carries the usage."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChoice(BaseModel):
    """``prompt_logprobs`` (vLLM) is left out unless the request asked for it."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobsList | None = None

    @model_serializer(mode="wrap")
    def _without_absent_prompt_logprobs(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {name: value for name, value in handler(self).items() if name != "prompt_logprobs" or value is not None}


class Completion(BaseModel):
    """A text completion, and also each chunk of a streamed one (OpenAI uses one object for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "metrale"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
