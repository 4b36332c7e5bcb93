"""Fields of OpenAI's request schemas that Metrale cannot honour: declared, so a client learns why.

Each field is declared with OpenAI's type (so the OpenAPI document shows it) and refused with a 400
naming it when it asks for something Metrale does not do; a value that asks for nothing (``null``,
``store: false``, ``modalities: ["text"]``, ``best_of`` equal to ``n``, an empty ``suffix``) is
accepted, as it is honoured. A field no schema declares is refused as unrecognized (``body.py``).
The full list and each decision is in docs/ARCHITECTURE.md ("Request fields").
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from metrale.shared.errors import BadRequest

SUPPORTED_SERVICE_TIERS = ("auto", "default")
"""The one tier Metrale serves, under both names OpenAI accepts for it."""


class UnsupportedChatFields(BaseModel):
    """Chat fields refused unless they ask for nothing."""

    model_config = ConfigDict(extra="forbid", strict=True)

    audio: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    reasoning_effort: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        """Raise ``BadRequest`` naming the first field that asks for what Metrale does not do."""
        _refuse_set(self, "audio", "audio output is not supported: this model writes text only")
        _refuse_set(self, "functions", "functions is deprecated and not supported; use tools")
        _refuse_set(self, "function_call", "function_call is deprecated and not supported; use tool_choice")
        _refuse_set(self, "metadata", "metadata tags stored completions; Metrale does not store completions")
        modalities = self.modalities
        _refuse(modalities is None or modalities == ["text"], "only the text modality is supported", "modalities")
        _refuse_set(self, "prediction", "predicted outputs are not supported")
        _refuse_set(
            self, "prompt_cache_key", "prompt_cache_key is not supported; Metrale reuses prompts by session (session)"
        )
        _refuse_set(self, "reasoning_effort", "reasoning_effort is not supported: this model does not reason apart")
        tier = self.service_tier
        _refuse(
            tier is None or tier in SUPPORTED_SERVICE_TIERS,
            f"service_tier must be one of {list(SUPPORTED_SERVICE_TIERS)}, got {tier!r}",
            "service_tier",
        )
        _refuse(not self.store, "store is not supported: Metrale does not store completions", "store")
        _refuse_set(self, "verbosity", "verbosity is not supported")
        _refuse_set(self, "web_search_options", "web search is not supported")


class UnsupportedCompletionFields(BaseModel):
    """Completion fields refused unless they ask for nothing."""

    model_config = ConfigDict(extra="forbid", strict=True)

    best_of: int | None = None
    suffix: str | None = None

    def refuse_unsupported(self, n: int) -> None:
        """Raise ``BadRequest`` for ``best_of`` other than ``n`` (Metrale does not rank extra choices
        server-side) or a non-empty ``suffix`` (no insertion mode)."""
        best_of = self.best_of
        _refuse(
            best_of is None or best_of == n,
            f"best_of is not supported (only best_of == n, {n}); ask for n choices and rank them with logprobs",
            "best_of",
        )
        _refuse(not self.suffix, "suffix is not supported: this model has no insertion mode", "suffix")


class StreamOptionFields(BaseModel):
    """``stream_options`` fields beyond ``include_usage``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    include_obfuscation: bool | None = None
    """OpenAI pads stream chunks to hide their sizes; Metrale does not, so ``true`` is refused."""

    def refuse_unsupported(self) -> None:
        """Raise ``BadRequest`` for ``include_obfuscation: true``."""
        _refuse(
            not self.include_obfuscation,
            "stream_options.include_obfuscation is not supported: stream chunks are not padded",
            "stream_options",
        )


def _refuse_set(fields: BaseModel, name: str, message: str) -> None:
    _refuse(getattr(fields, name) is None, message, name)


def _refuse(condition: bool, message: str, param: str) -> None:
    if not condition:
        raise BadRequest(message, param=param)
