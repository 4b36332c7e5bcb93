"""A request ready to go to the fleet, as the stream side of the gateway receives it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from metrale.gateway.fleet.registry import ServedModel
from metrale.gateway.streams.choice import ChoiceDecoder
from metrale.gateway.streams.prompt_scores import PromptScores
from metrale.shared.messages import GenerateRequest


@dataclass(frozen=True, slots=True)
class Submission:
    """A request ready to go: its wire message, the model it runs on, and the stop strings the
    gateway matches on the text."""

    request: GenerateRequest
    model: ServedModel
    stop_strings: tuple[str, ...]
    on_complete: Callable[[ChoiceDecoder], Awaitable[None]] | None = None
    """Called with choice 0 when the worker finished it (before the client sees its end)."""
    keeps_special_tokens: bool = False
    """Whether the text keeps special tokens (their text is what a tool-call parser reads)."""
    prompt_scores: PromptScores | None = None
    """Where the prompt logprobs the request asked for (``prompt_logprobs``) are gathered as they arrive."""
