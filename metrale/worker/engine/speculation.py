"""Speculative decoding's options and drafts: which tokens a decoding choice verifies after its newest one.

The engine asks a ``Drafter`` for draft tokens per decoding choice and step; the scheduler turns its
decode row into a verify chunk; sampling accepts the draft up to its first token that differs from what
the target draws there (``runner.accept_draft``). Outputs are those of plain decoding whatever the draft
proposes: a draft only decides how many tokens one step may emit. Two methods draft: ``ngram`` (prompt
lookup, here) and ``draft_model`` (a smaller model's greedy continuation, ``draft_model.py``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from metrale.worker.engine.ngram_draft import ngram_draft
from metrale.worker.scheduler.sequence import SequenceId

METHODS = ("ngram", "draft_model")
"""The ``method`` values ``--speculative-config`` takes (``draft_model`` is implied by a ``model``, as in vLLM)."""

_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model")
_INTEGER_KEYS = ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
_NGRAM_KEYS = ("prompt_lookup_max", "prompt_lookup_min")


@dataclass(frozen=True, slots=True)
class SpeculationStats:
    """What speculative decoding did since the engine started (all zeros while it is off).

    ``drafts`` counts verify chunks that carried at least one draft token, ``draft_tokens`` the draft
    tokens they verified, ``accepted_tokens`` those accepted (equal to what the target drew there).
    ``accepted_per_position[i]`` counts how often draft position ``i`` (0: the token right after the
    newest sampled one) was accepted; it has one entry per position drafted so far (a draft is accepted
    up to its first miss, so the entries never grow with ``i``). The mean accepted length per draft is
    ``accepted_tokens / drafts``; the acceptance rate ``accepted_tokens / draft_tokens``.
    """

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens per draft token verified (0.0 before any)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


class SpeculationTally:
    """Counts verify chunks as they are settled; ``stats`` is the running total."""

    def __init__(self) -> None:
        self._drafts = self._draft_tokens = self._accepted_tokens = 0
        self._per_position: list[int] = []

    def record(self, drafted: int, accepted: int) -> None:
        """One verify chunk of ``drafted`` draft tokens whose first ``accepted`` were accepted."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"{accepted} draft tokens accepted of {drafted}")
        if drafted == 0:
            return
        self._drafts += 1
        self._draft_tokens += drafted
        self._accepted_tokens += accepted
        if len(self._per_position) < drafted:
            self._per_position.extend([0] * (drafted - len(self._per_position)))
        for position in range(accepted):
            self._per_position[position] += 1

    def stats(self) -> SpeculationStats:
        return SpeculationStats(self._drafts, self._draft_tokens, self._accepted_tokens, tuple(self._per_position))


class Drafter(Protocol):
    """Proposes draft tokens for one choice: up to ``at_most`` tokens to follow ``prompt_ids`` + ``output_ids``,
    never more than ``num_speculative_tokens``. ``forget`` is told when a request is done (a drafter that
    keeps something per choice drops it then)."""

    @property
    def num_speculative_tokens(self) -> int: ...

    def propose(
        self, seq_id: SequenceId, prompt_ids: Sequence[int], output_ids: Sequence[int], at_most: int
    ) -> Sequence[int]: ...

    def forget(self, request_id: str) -> None: ...


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's ``--speculative-config``: ``num_speculative_tokens`` draft tokens per step at most; the
    ``ngram`` method drafts from matches of ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens, the
    ``draft_model`` method with the model in the folder ``model`` (the target's tokenizer, any family)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not served; the methods are {', '.join(METHODS)}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(
                "the draft_model method needs a model (the draft model's folder)"
                if self.model is None
                else f"speculative-config model is the draft_model method's; {self.method} takes none"
            )
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> SpeculativeConfig:
        """From vLLM's keys; an unknown key, or a value of the wrong type, is a ``ValueError``."""
        unknown = sorted(set(values) - set(_KEYS))
        if unknown:
            raise ValueError(f"unknown speculative-config keys: {', '.join(unknown)} (known: {', '.join(_KEYS)})")
        values = dict(values)
        if "model" in values:
            values.setdefault("method", "draft_model")
        if "method" not in values:
            raise ValueError(f"speculative-config needs a method ({', '.join(METHODS)}) or a model")
        for key in _INTEGER_KEYS:
            value = values.get(key, 1)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"speculative-config {key} must be an integer, got {value!r}")
        for key in ("method", "model"):
            if not isinstance(values.get(key, ""), str):
                raise ValueError(f"speculative-config {key} must be a string, got {values[key]!r}")
        ngram_keys = [key for key in _NGRAM_KEYS if key in values]
        if values["method"] == "draft_model" and ngram_keys:
            raise ValueError(f"speculative-config {', '.join(ngram_keys)}: the ngram method's, not draft_model's")
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """From the JSON object ``--speculative-config`` takes."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"speculative-config is not JSON: {error}") from None
        if not isinstance(values, dict):
            raise ValueError("speculative-config must be a JSON object")
        return cls.from_mapping(values)

    def drafter(self) -> Drafter:
        """The ``ngram`` method's drafter (a draft model's needs the target's limits: ``draft_model.load_drafter``)."""
        if self.model is not None:
            raise ValueError("a draft model's drafter is built by draft_model.load_drafter")
        return NgramDrafter(self.num_speculative_tokens, self.prompt_lookup_max, self.prompt_lookup_min)


@dataclass(frozen=True, slots=True)
class NgramDrafter:
    """Prompt lookup over the choice's prompt and output (``ngram_draft``)."""

    num_speculative_tokens: int
    longest: int
    shortest: int

    def propose(
        self, seq_id: SequenceId, prompt_ids: Sequence[int], output_ids: Sequence[int], at_most: int
    ) -> Sequence[int]:
        count = min(self.num_speculative_tokens, at_most)
        return ngram_draft([*prompt_ids, *output_ids], count, self.longest, self.shortest)

    def forget(self, request_id: str) -> None:
        """Nothing is kept per request."""
