"""The fleet's failover counters (workers add to ``met:metrics:failover``) as Prometheus counters."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

_COUNTERS = {
    "resumed_requests": "Requests a worker continued from the record of a lost or stopping worker.",
    "resume_prefill_tokens": "Tokens continued requests fed again before their next token (past their checkpoint).",
    "resume_checkpoint_tokens": "Tokens continued requests restored from checkpoints instead of feeding them.",
    "handed_back_requests": "Requests a stopping worker checkpointed and queued again.",
    "unresumable_requests": "Requests that lost their worker and could not continue exactly (ended with an error).",
    "dead_lettered_requests": "Requests given up after losing too many workers (ended with an error).",
}


class FailoverCounters(Collector):
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
            family = CounterMetricFamily(f"metrale_{name}", documentation)
            family.add_metric([], self._fields.get(name, 0))
            yield family
