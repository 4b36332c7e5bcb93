"""What a gateway's ``/metrics`` says of speculative decoding, read around a ``met bench`` run.

The counters are fleet-wide (``metrale_spec_decode_*``, vLLM's names): the difference between a read
before the run and one after is what the run drafted, provided nothing else ran meanwhile. Workers add
their counts to Redis with each heartbeat, so a read lags the work by up to one heartbeat period (a
third of ``MET_HEARTBEAT_TTL_S``, 10 s by default): the read after the run waits ``COUNTER_LAG_S`` when
it has anything to wait for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

COUNTER_LAG_S = 4.0
"""How long after a run the counters may still grow: a heartbeat period (10 s / 3) and some slack."""

_PREFIX = "metrale_spec_decode_"


@dataclass(frozen=True, slots=True)
class SpeculationCounts:
    """The fleet's speculative decoding counters at one moment (or their growth over a run)."""

    drafts: float
    draft_tokens: float
    accepted_tokens: float
    accepted_per_position: tuple[float, ...]

    def since(self, before: SpeculationCounts) -> SpeculationCounts:
        """What grew from ``before`` to these counts."""
        positions = max(len(self.accepted_per_position), len(before.accepted_per_position))
        now, then = _padded(self.accepted_per_position, positions), _padded(before.accepted_per_position, positions)
        return SpeculationCounts(
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted_tokens - before.accepted_tokens,
            tuple(a - b for a, b in zip(now, then, strict=True)),
        )

    def report(self) -> dict[str, Any] | None:
        """As ``vllm bench serve`` reports it: the acceptance rate (accepted / draft tokens), the mean
        acceptance length (1 + accepted per draft: the tokens one verify step emits), the counts, and the
        acceptance of each draft position (accepted there / drafts). None when nothing was drafted."""
        if self.drafts <= 0 or self.draft_tokens <= 0:
            return None
        return {
            "acceptance_rate": self.accepted_tokens / self.draft_tokens,
            "acceptance_length": 1 + self.accepted_tokens / self.drafts,
            "drafts": int(self.drafts),
            "draft_tokens": int(self.draft_tokens),
            "accepted_tokens": int(self.accepted_tokens),
            "per_position_acceptance_rate": [count / self.drafts for count in self.accepted_per_position],
        }


def _padded(values: tuple[float, ...], length: int) -> tuple[float, ...]:
    return values + (0.0,) * (length - len(values))


def parse_speculation_counts(exposition: str) -> SpeculationCounts | None:
    """The ``metrale_spec_decode_*`` counters of a Prometheus text exposition; None when it has none
    (a server without them: another engine, or a Metrale from before them)."""
    totals: dict[str, float] = {}
    positions: dict[int, float] = {}
    for family in text_string_to_metric_families(exposition):
        if not family.name.startswith(_PREFIX):
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            if "position" in sample.labels:
                positions[int(sample.labels["position"])] = sample.value
            else:
                totals[family.name.removeprefix(_PREFIX)] = sample.value
    if "num_draft_tokens" not in totals:
        return None
    per_position = tuple(positions.get(i, 0.0) for i in range(max(positions, default=-1) + 1))
    return SpeculationCounts(
        totals.get("num_drafts", 0.0), totals["num_draft_tokens"], totals.get("num_accepted_tokens", 0.0), per_position
    )


def read_speculation_counts(url: str, headers: dict[str, str]) -> SpeculationCounts | None:
    """The counters ``GET {url}/metrics`` shows now; None when it shows none or does not answer."""
    try:
        response = httpx.get(f"{url}/metrics", headers=headers, timeout=10)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return parse_speculation_counts(response.text)


def speculation_during_run(
    url: str, headers: dict[str, str], before: SpeculationCounts, run_s: float
) -> dict[str, Any] | None:
    """The report of what the fleet drafted since ``before`` (read ``run_s`` seconds ago, just before the
    run), once the counters have caught up; None when it drafted nothing or stopped answering."""
    after = read_speculation_counts(url, headers)
    if after is None:
        return None
    drafted = after.draft_tokens > before.draft_tokens
    if drafted or run_s < COUNTER_LAG_S:  # else a draft during the run would have been counted by now
        time.sleep(COUNTER_LAG_S if drafted else COUNTER_LAG_S - run_s)
        after = read_speculation_counts(url, headers) or after
    return after.since(before).report()
