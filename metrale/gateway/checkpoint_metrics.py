"""The fleet's checkpoint counters (workers add to ``met:metrics:checkpoints``) as Prometheus counters."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

_COUNTERS = {
    "lookups": "Checkpoint lookups (one per request on a worker with checkpoints).",
    "hits": "Lookups that resumed from a checkpoint.",
    "tokens_reused": "Prompt tokens skipped by resuming from checkpoints.",
    "bytes_stored": "Checkpoint bytes written.",
    "bytes_loaded": "Checkpoint bytes read for resumes.",
    "saves": "Checkpoints written.",
}


class CheckpointCounters(Collector):
    """Exports the values last read from Redis (``update`` is called at scrape time)."""

    def __init__(self) -> None:
        self._fields: dict[str, int] = {}

    def update(self, raw: Mapping[bytes | str, bytes | str]) -> None:
        fields = {}
        for key, value in raw.items():
            name = key.decode() if isinstance(key, bytes) else key
            try:
                fields[name] = int(value)
            except ValueError:
                continue
        self._fields = fields

    def collect(self) -> Iterator[CounterMetricFamily]:
        for name, documentation in _COUNTERS.items():
            family = CounterMetricFamily(f"metrale_checkpoint_{name}", documentation)
            family.add_metric([], self._fields.get(name, 0))
            yield family
        misses = CounterMetricFamily(
            "metrale_checkpoint_misses", "Lookups that did not resume, by reason.", labels=["reason"]
        )
        for field, count in sorted(self._fields.items()):
            if field.startswith("miss:"):
                misses.add_metric([field.removeprefix("miss:")], count)
        yield misses
