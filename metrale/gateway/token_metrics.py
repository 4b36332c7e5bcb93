"""The gateway's per-token metrics, counted without locks.

Every token event a gateway streams adds to ``metrale_generation_tokens_total`` and (after a request's
first) to ``metrale_inter_token_latency_seconds``. prometheus_client's ``Counter`` and ``Histogram``
take a lock for every ``inc`` (a histogram's ``observe`` takes two and walks its buckets in Python): 1.5
µs a token, a fifth of the Python work of streaming one. These two count into plain numbers instead and
hand Prometheus a snapshot when collected (a custom ``Collector``, the library's public interface for
that). Their samples are the ones prometheus_client's own ``Counter`` and ``Histogram`` expose, their
reference twins in the tests.

Invariant: they are updated from one thread, the gateway's event loop (a collect may run on another and
then sees every update that finished before it).
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Iterator, Sequence

from prometheus_client import metrics as prometheus_metrics
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString


class UnlockedCounter(Collector):
    """A counter without labels: ``prometheus_client.Counter``'s ``inc`` and samples, no lock."""

    def __init__(self, name: str, documentation: str) -> None:
        self._name = name.removesuffix("_total")
        self._documentation = documentation
        self._created = time.time()
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        """Add ``amount`` (not negative)."""
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        self.value += amount

    def collect(self) -> Iterator[Metric]:
        created = self._created if _exposes_created() else None
        yield CounterMetricFamily(self._name, self._documentation, value=self.value, created=created)


class UnlockedHistogram(Collector):
    """A histogram without labels: ``prometheus_client.Histogram``'s ``observe`` and samples, no lock.

    ``buckets`` are the upper bounds, sorted, none below zero; ``+Inf`` is added when missing. An
    observation counts in the first bucket whose bound is at least it (NaN in none, as there)."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        bounds = [float(bound) for bound in buckets]
        if not bounds or bounds != sorted(bounds) or bounds[0] < 0:
            raise ValueError(f"histogram buckets must be sorted, not empty and not below zero, not {buckets}")
        if bounds[-1] != math.inf:
            bounds.append(math.inf)
        self._name = name
        self._documentation = documentation
        self._bounds = tuple(bounds)
        self._labels = tuple(floatToGoString(bound) for bound in bounds)
        self._counts = [0] * len(bounds)
        self._sum = 0.0
        self._created = time.time()

    def observe(self, amount: float) -> None:
        """Count ``amount``."""
        self._sum += amount
        if amount == amount:  # not NaN
            self._counts[bisect.bisect_left(self._bounds, amount)] += 1

    def collect(self) -> Iterator[Metric]:
        counts, total = list(self._counts), self._sum
        cumulative, running = [], 0.0
        for label, count in zip(self._labels, counts, strict=True):
            running += count
            cumulative.append((label, running))
        family = HistogramMetricFamily(self._name, self._documentation, buckets=cumulative, sum_value=total)
        if _exposes_created():
            family.samples.append(Sample(f"{self._name}_created", {}, self._created, None, None))
        yield family


def _exposes_created() -> bool:
    """Whether prometheus_client writes ``_created`` samples (``PROMETHEUS_DISABLE_CREATED_SERIES``)."""
    return bool(getattr(prometheus_metrics, "_use_created", True))
