"""Fleet-wide counters that workers add to a Redis hash (``met:metrics:*``), exported as Prometheus
counters by every gateway: checkpoint lookups and misses, failover resumes, speculative decoding."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector


@dataclass(frozen=True)
class LabelledCounter:
    """Hash fields ``{field_prefix}{label value}`` exported as one counter with a label."""

    field_prefix: str
    name: str
    documentation: str
    label: str


class FleetCounters(Collector):
    """Exports the values last read from Redis (``update`` is called at scrape time)."""

    def __init__(self, prefix: str, counters: Mapping[str, str], labelled: LabelledCounter | None = None) -> None:
        self.prefix, self.counters, self.labelled = prefix, dict(counters), labelled
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
        for name, documentation in self.counters.items():
            family = CounterMetricFamily(f"{self.prefix}{name}", documentation)
            family.add_metric([], self._fields.get(name, 0))
            yield family
        if self.labelled is not None:
            spec = self.labelled
            family = CounterMetricFamily(spec.name, spec.documentation, labels=[spec.label])
            for field, count in sorted(self._fields.items()):
                if field.startswith(spec.field_prefix):
                    family.add_metric([field.removeprefix(spec.field_prefix)], count)
            yield family


def checkpoint_counters() -> FleetCounters:
    """``met:metrics:checkpoints`` as ``metrale_checkpoint_*`` counters."""
    return FleetCounters(
        "metrale_checkpoint_",
        {
            "lookups": "Checkpoint lookups (one per request on a worker with checkpoints).",
            "hits": "Lookups that resumed from a checkpoint.",
            "tokens_reused": "Prompt tokens skipped by resuming from checkpoints.",
            "retokenized": "Session lookups whose newest checkpoint was not a prefix of the prompt (the reply "
            "re-tokenized differently, or the history changed).",
            "bytes_stored": "Checkpoint bytes written.",
            "bytes_loaded": "Checkpoint bytes read for resumes.",
            "saves": "Checkpoints written.",
        },
        LabelledCounter("miss:", "metrale_checkpoint_misses", "Lookups that did not resume, by reason.", "reason"),
    )


def failover_counters() -> FleetCounters:
    """``met:metrics:failover`` as ``metrale_*`` counters."""
    return FleetCounters(
        "metrale_",
        {
            "resumed_requests": "Requests a worker continued from the record of a lost or stopping worker.",
            "resume_prefill_tokens": "Tokens continued requests fed again before their next token "
            "(past their checkpoint).",
            "resume_checkpoint_tokens": "Tokens continued requests restored from checkpoints instead of feeding them.",
            "handed_back_requests": "Requests a stopping worker checkpointed and queued again.",
            "unresumable_requests": "Requests that lost their worker and could not continue exactly "
            "(ended with an error).",
            "dead_lettered_requests": "Requests given up after losing too many workers (ended with an error).",
            "taken_over_requests": "Requests a live worker dropped because others took them over while its "
            "heartbeat had lapsed.",
        },
    )


def speculation_counters() -> FleetCounters:
    """``met:metrics:speculation`` as vLLM's ``spec_decode_*`` counters, prefixed ``metrale_``."""
    return FleetCounters(
        "metrale_spec_decode_",
        {
            "num_drafts": "Verify steps of a choice that carried draft tokens.",
            "num_draft_tokens": "Draft tokens verified.",
            "num_accepted_tokens": "Draft tokens accepted (each equal to the token the model drew there).",
        },
        LabelledCounter(
            "pos:",
            "metrale_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position in the draft (0: the first).",
            "position",
        ),
    )
