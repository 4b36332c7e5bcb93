"""How many draft tokens each decoding choice verifies in a step: as many as pay for themselves.

A draft token costs a verify row whether or not it is accepted, and brings one more token only when it
and every draft token before it are accepted. Each choice keeps an estimate of the chance that its next
draft token is accepted (``AcceptanceEstimate``: decayed counts of accepted and missed draft tokens), so
its ``j``-th draft token is worth ``p ** j`` expected tokens. ``DraftLengths`` gives the step's decoding
choices the draft lengths that maximize the step's expected tokens (prefill rows count as tokens) per
unit of expected cost (``StepCost``: a model of a step's time in its rows, draft tokens and rejections,
measured on this machine). Both back-offs follow from it:

- a choice whose drafts are not accepted gets none (its worth falls under the step's rate), except a
  one-token probe now and then, at intervals that double while probes miss, so it is noticed when its
  drafts start matching again;
- a large batch gets none: its step already makes many tokens per unit of cost, which a verify row
  cannot beat (the step is compute-bound; ``StepCost.compute_bound_rows``).

Outputs do not depend on any of it: a draft only decides how many tokens one step may emit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from metrale.worker.scheduler.sequence import SequenceId


@dataclass(frozen=True, slots=True)
class StepCost:
    """A step's time in units of a lone decode step (one row, no draft): ``1 - decode_row`` fixed, plus
    ``decode_row`` per decode (or prefill) row, and for each verify chunk ``verify_row`` per draft token,
    ``rejected_verify`` when a draft token is rejected (the state of the last accepted row is copied
    back into the slot; when all are accepted it is there already), and ``lone_verify`` when the chunk
    is the step's only row (a lone decode row runs matrix-vector products, a verify chunk matrix ones)."""

    decode_row: float
    verify_row: float
    rejected_verify: float = 0.0
    lone_verify: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 < self.decode_row <= 1.0 or self.verify_row <= 0.0:
            raise ValueError(f"a step cost needs 0 < decode_row <= 1 and verify_row > 0: {self}")
        if self.rejected_verify < 0.0 or self.lone_verify < 0.0:
            raise ValueError(f"a step cost needs rejected_verify, lone_verify >= 0: {self}")

    def base(self, rows: int) -> float:
        """A step of ``rows`` decode or prefill rows, no draft."""
        return 1.0 - self.decode_row + self.decode_row * rows

    def verify(self, rate: float, draft_tokens: int, rows: int) -> float:
        """What a choice verifying ``draft_tokens`` adds to a step of ``rows`` rows, expected when each
        draft token is accepted with chance ``rate`` (all of them with ``rate ** draft_tokens``)."""
        if draft_tokens == 0:
            return 0.0
        lone = self.lone_verify if rows == 1 else 0.0
        return self.verify_row * draft_tokens + self.rejected_verify * (1.0 - rate**draft_tokens) + lone

    def of(self, rows: int, rates: Sequence[float], counts: Sequence[int]) -> float:
        """The expected cost of a step of ``rows`` rows whose decoding choices verify ``counts`` draft
        tokens, each accepted with chance ``rates[i]``."""
        return self.base(rows) + sum(self.verify(r, k, rows) for r, k in zip(rates, counts, strict=True))

    @property
    def compute_bound_rows(self) -> int:
        """The fewest decode rows from which even draft tokens sure to be accepted no longer pay: the step
        then makes more tokens per unit of cost than a verify row does (``1 / verify_row``)."""
        rows = 2
        while rows / self.base(rows) <= 1.0 / self.verify_row:
            rows += 1
            if rows > 1_000_000:
                raise ValueError(f"{self}: a verify row pays at any batch size")
        return rows


CPU_STEP_COST = StepCost(decode_row=0.12, verify_row=0.25, rejected_verify=0.0, lone_verify=0.18)
"""Fitted on this project's 2-core CPU machine, loaded (the Qwen3.5 medium bench model, fp32, one thread,
CPU time per token through the engine; ``python bench/speculation.py --verify-costs``, two runs): one
stream verifying k = 1..4 draft tokens every step costs 1.25-1.52, 1.40-1.95, 1.78-2.11, 2.18-2.20 lone
steps when all are accepted, 1.37-1.56, 1.57-1.98, 1.94-2.15, 2.01-2.34 when none is (the two runs
disagree on which is dearer, so the copy-back of a rejection is within their noise: 0 here); a 64-row
decode step 9.1 (``--row-costs`` times the forward alone: each more decode row 0.04-0.14, each verified
draft token 0.21-0.30 at 4-16 rows). Its ``compute_bound_rows`` is 7: from 7 decode rows on, no draft is
verified (forwards of 4 sure draft tokens per row made 1.1-1.6x the tokens per CPU second at 4 rows,
1.1-1.2x at 8, 0.85x at 16)."""

PROBE_INTERVAL = 8
"""A choice with no drafts probes with one token every this many decode steps; doubled after each probe that
misses, up to ``MAX_PROBE_INTERVAL``, and back to this after one that is accepted."""

MAX_PROBE_INTERVAL = 128

ACCEPTANCE_DECAY = 0.85
"""Weight the acceptance estimate keeps of its past at each verify step (recent drafts count most). At 0.7
a run of misses in drafts 70-80% right sent a choice to probing (simulated on the step costs measured
then: 1.06x plain where always drafting 4 made 1.35x); at 0.85 it made 1.33x, and the same as 0.7 when
none is right."""


@dataclass(slots=True)
class AcceptanceEstimate:
    """A choice's chance that its next draft token is accepted: decayed counts of accepted draft tokens
    over accepted plus missed ones (a verify step misses at most one: its first wrong token ends it).
    It starts at one accepted token of one, so a fresh choice drafts its longest."""

    accepted: float = 1.0
    tried: float = 1.0
    steps_without_draft: int = 0
    probe_interval: int = PROBE_INTERVAL
    probing: bool = False

    @property
    def rate(self) -> float:
        return self.accepted / self.tried

    def record(self, drafted: int, accepted: int) -> None:
        """A verify step of ``drafted`` draft tokens accepted up to ``accepted``."""
        missed = 1 if accepted < drafted else 0
        self.accepted = ACCEPTANCE_DECAY * self.accepted + accepted
        self.tried = ACCEPTANCE_DECAY * self.tried + accepted + missed
        if self.probing:
            self.probe_interval = PROBE_INTERVAL if accepted else min(2 * self.probe_interval, MAX_PROBE_INTERVAL)
        self.probing = False
        self.steps_without_draft = 0


class DraftLengthPolicy(Protocol):
    """Decides per step how many draft tokens each decoding choice verifies (``DraftLengths``: adaptive;
    ``FullDraftLengths``: always its cap), from what earlier verify steps accepted."""

    def lengths(self, caps: Sequence[tuple[SequenceId, int]], other_rows: int = 0) -> list[int]: ...

    def record(self, seq_id: SequenceId, drafted: int, accepted: int) -> None: ...

    def forget(self, request_id: str) -> None: ...


class FullDraftLengths:
    """Every decoding choice verifies as many draft tokens as it may (its cap), whatever it accepts:
    speculation without back-off, for tests that want every step to verify."""

    def lengths(self, caps: Sequence[tuple[SequenceId, int]], other_rows: int = 0) -> list[int]:
        return [cap for _, cap in caps]

    def record(self, seq_id: SequenceId, drafted: int, accepted: int) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass


@dataclass(slots=True)
class DraftLengths:
    """Per decoding choice, its acceptance estimate; per step, how many draft tokens each choice verifies."""

    cost: StepCost = CPU_STEP_COST
    _estimates: dict[SequenceId, AcceptanceEstimate] = field(default_factory=dict)

    def estimate(self, seq_id: SequenceId) -> AcceptanceEstimate:
        return self._estimates.setdefault(seq_id, AcceptanceEstimate())

    def record(self, seq_id: SequenceId, drafted: int, accepted: int) -> None:
        """A verify step of ``seq_id`` (``drafted`` > 0 draft tokens, the first ``accepted`` accepted)."""
        if drafted:
            self.estimate(seq_id).record(drafted, accepted)

    def forget(self, request_id: str) -> None:
        for seq_id in [seq_id for seq_id in self._estimates if seq_id.request_id == request_id]:
            del self._estimates[seq_id]

    def lengths(self, caps: Sequence[tuple[SequenceId, int]], other_rows: int = 0) -> list[int]:
        """The draft tokens each decoding choice of a step verifies, at most its cap (``caps``: the step's
        decoding choices, each with the most it may verify; ``other_rows``: the step's prefill rows).

        The counts maximize the step's expected work per expected cost (``optimal_draft_counts``; a
        prefill row counts as a token's work, so a step with a long prefill chunk is compute-bound too).
        A choice left without any counts a step towards its next probe; once due, it gets one token if a
        sure token would raise the step's ratio."""
        rows = len(caps) + other_rows
        rates = [self.estimate(seq_id).rate for seq_id, _ in caps]
        counts = optimal_draft_counts(rates, [cap for _, cap in caps], rows, self.cost)
        tokens, cost = expected_work(rates, counts, rows), self.cost.of(rows, rates, counts)
        for i, (seq_id, cap) in enumerate(caps):
            estimate = self.estimate(seq_id)
            if counts[i] or cap < 1:
                estimate.steps_without_draft = 0
                continue
            estimate.steps_without_draft += 1
            probe_cost = self.cost.verify(1.0, 1, rows)
            if (
                estimate.steps_without_draft >= estimate.probe_interval
                and (tokens + 1) / (cost + probe_cost) > tokens / cost
            ):
                counts[i], estimate.probing = 1, True
                tokens, cost = tokens + 1.0, cost + probe_cost
        return counts


def optimal_draft_counts(rates: Sequence[float], caps: Sequence[int], rows: int, cost: StepCost) -> list[int]:
    """Draft tokens per decoding choice (at most ``caps[i]``) that maximize a step's expected work per
    expected cost (``expected_work`` over ``StepCost.of``) for a step of ``rows`` rows, where choice
    ``i``'s ``j``-th draft token is accepted with chance ``rates[i] ** j``.

    Dinkelbach's method: for the ratio ``q`` so far, each choice takes the count that maximizes its own
    ``worth - q * cost`` (the choices are independent once ``q`` is fixed; ties: the fewer tokens), which
    raises the ratio unless ``q`` is already the best; repeated until it stops rising (a few rounds)."""
    counts = [0] * len(rates)
    ratio = expected_work(rates, counts, rows) / cost.of(rows, rates, counts)
    while True:
        chosen = [_best_count(rate, cap, rows, ratio, cost) for rate, cap in zip(rates, caps, strict=True)]
        improved = expected_work(rates, chosen, rows) / cost.of(rows, rates, chosen)
        if improved <= ratio * (1.0 + 1e-12):
            return counts
        counts, ratio = chosen, improved


def _best_count(rate: float, cap: int, rows: int, ratio: float, cost: StepCost) -> int:
    """The count in ``0 .. cap`` with the most ``worth - ratio * cost`` (ties: the fewest)."""
    gains = [_worth(rate, k) - ratio * cost.verify(rate, k, rows) for k in range(cap + 1)]
    return max(range(cap + 1), key=lambda k: (gains[k], -k))


def _worth(rate: float, count: int) -> float:
    """Expected tokens ``count`` draft tokens add when each is accepted with chance ``rate``."""
    return sum(rate**j for j in range(1, count + 1))


def expected_work(rates: Sequence[float], counts: Sequence[int], rows: int) -> float:
    """A step's expected work: one per row (a decode row's token, or a prefill row's token of prompt), plus
    each draft token's chance to be accepted."""
    return rows + sum(_worth(rate, count) for rate, count in zip(rates, counts, strict=True))
