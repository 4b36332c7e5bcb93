"""The OpenAI request bodies the gateway accepts, as pydantic models (the only place pydantic is used).

Types are checked here, strictly: a wrong type or a missing field is a 422, and nothing is converted
except an int where a float is due. Value ranges are checked when the body becomes a
``GenerateRequest`` (``sampling.py``; a bad value is a 400). A field no model declares is refused with
a 400 naming it (never accepted and ignored); OpenAI fields Metrale cannot honour are declared in
``unsupported_fields.py`` and refused with a 400 when they ask for something. ``response_format`` is
taken by text completions too, as vLLM does. Extensions beyond OpenAI: ``top_k``, ``min_p``,
``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``session``, ``priority``,
``prompt_logprobs`` and ``speculative``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from metrale.gateway.unsupported_fields import (
    StreamOptionFields,
    UnsupportedChatFields,
    UnsupportedCompletionFields,
)
from metrale.shared.errors import BadRequest


class StreamOptions(StreamOptionFields):
    """``stream_options``: ``include_usage`` adds a last chunk carrying the usage."""

    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: a named JSON schema the output must validate against."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: free ``text``, any ``json_object``, or a ``json_schema``."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(BaseModel):
    """Fields common to chat and text completions. ``logit_bias`` maps token ids (as strings, JSON
    keys) to a bias in [-100, 100] added to their logits; ``user`` (and chat's ``safety_identifier``)
    only name the end user, as in OpenAI, and do not change the output."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    n: int = 1
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    session: str | None = None
    priority: Literal["interactive", "batch"] = "interactive"
    response_format: ResponseFormat | None = None
    speculative: bool = Field(
        default=True,
        description="Metrale extension: false keeps this request off speculative decoding (no draft tokens are "
        "verified for it). Its tokens and logprobs are the same either way; speculation only changes how many "
        "tokens one step emits. On a worker started without --speculative-config, true and false are accepted "
        "and change nothing.",
    )

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list (OpenAI takes one string or a list)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class ChatMessage(BaseModel):
    """One chat turn. ``content`` is text or a list of parts (``{"type": "text", "text": ...}``); other
    keys (``name``, ``tool_calls``, ...) are kept and handed to the chat template."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields, UnsupportedChatFields):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` replaces the older ``max_tokens``: either
    may be given, or both with the same value; ``logprobs`` asks for the chosen tokens' logprobs,
    ``top_logprobs`` for that many alternatives; ``prompt_logprobs`` (vLLM) for the prompt's tokens',
    with that many alternatives each."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    safety_identifier: str | None = None
    prompt_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @property
    def token_budget(self) -> int | None:
        """The most tokens to generate per choice, if the client set a limit; ``BadRequest`` (400) when
        ``max_tokens`` and ``max_completion_tokens`` disagree (neither silently wins)."""
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise BadRequest(
                f"max_tokens ({self.max_tokens}) and max_completion_tokens ({self.max_completion_tokens}) "
                "disagree: send max_completion_tokens alone (max_tokens is its deprecated name).",
                param="max_tokens",
            )
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingFields, UnsupportedCompletionFields):
    """``POST /v1/completions``. ``prompt`` is a string, a list of token ids, or a list of either (one
    choice per prompt and ``n``); ``logprobs`` is the number of alternatives to return with each token;
    ``echo`` puts the prompt before each choice's text (and, with ``logprobs``, its tokens' logprobs
    before the generated ones'), with ``max_tokens`` 0 allowed; ``prompt_logprobs`` (vLLM) returns that
    many alternatives with each prompt token, on each choice."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None

    @property
    def prompts(self) -> list[str | list[int]]:
        """``prompt`` as a list of prompts, each a string or a list of token ids (an empty list: none)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        ids = [item for item in prompt if isinstance(item, int)]
        if prompt and len(ids) == len(prompt):
            return [ids]  # one prompt of token ids
        return [item if isinstance(item, str) else list(item) for item in prompt if not isinstance(item, int)]

    @property
    def token_budget(self) -> int:
        """The most tokens to generate per choice; OpenAI's default for completions is 16."""
        return self.max_tokens if self.max_tokens is not None else 16
