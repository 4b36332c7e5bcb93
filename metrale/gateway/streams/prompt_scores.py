"""The log-probabilities of a prompt's own tokens, gathered from its request's events as they arrive
(the worker scores them in the prefill and sends them before any token: ``TokenEvent.prompt_logprobs``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from metrale.shared.messages import TokenEvent

TopLogprobs = list[tuple[int, float]]


@dataclass(slots=True)
class PromptScores:
    """``logprobs[i]`` is the logprob of prompt token ``i + 1`` (token 0 has none); ``top_logprobs[i]``
    its best alternatives, best first (empty lists when none were asked for). Complete once the
    request's first token (or its end) has arrived."""

    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)

    def add(self, event: TokenEvent) -> None:
        """Append what ``event`` carries (its positions follow those already added)."""
        scored = event.prompt_logprobs or []
        self.logprobs += scored
        top = event.prompt_top_logprobs
        self.top_logprobs += top if top is not None else [[] for _ in scored]
