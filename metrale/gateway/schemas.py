"""The OpenAI request bodies the gateway accepts, as pydantic models (the only place pydantic is used).

Types are checked here (a wrong type or a missing field is a 422); value ranges are checked when the
body is turned into a ``GenerateRequest`` (``sampling.py``; a bad value is a 400). Fields the OpenAI API
defines but Metrale does not use are ignored, as vLLM does. Extensions beyond OpenAI: ``top_k``,
``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``session`` and ``priority``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Number = StrictInt | StrictFloat


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk carrying the usage."""

    include_usage: StrictBool = False


class SamplingFields(BaseModel):
    """Fields common to chat and text completions."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    n: StrictInt = 1
    max_tokens: StrictInt | None = None
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: StrictInt = 0
    min_p: Number = 0.0
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    repetition_penalty: Number = 1.0
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] = Field(default_factory=list)
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    session: StrictStr | None = None
    priority: Literal["interactive", "batch"] = "interactive"

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

    model_config = ConfigDict(extra="allow")

    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` wins over the older ``max_tokens``;
    ``logprobs`` asks for the chosen tokens' logprobs, ``top_logprobs`` for that many alternatives."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def token_budget(self) -> int | None:
        """The most tokens to generate per choice, if the client set a limit."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``. ``prompt`` is a string or a list of token ids (a list of prompts is
    refused with a 400); ``logprobs`` is the number of alternatives to return with each token."""

    prompt: StrictStr | list[StrictInt] | list[StrictStr]
    logprobs: StrictInt | None = None
    echo: StrictBool = False

    @property
    def token_budget(self) -> int:
        """The most tokens to generate per choice; OpenAI's default for completions is 16."""
        return self.max_tokens if self.max_tokens is not None else 16
