"""Fleet-wide checkpoint counters in Redis: every worker adds its increments, gateways export them."""

from __future__ import annotations

from collections import Counter

import redis

from metrale.shared.keys import Keys
from metrale.worker.checkpoints.manager import CheckpointCounters


def counter_fields(counters: CheckpointCounters) -> Counter[str]:
    """Flat field → value form of ``counters`` (misses as ``miss:{reason}``)."""
    fields: Counter[str] = Counter(
        lookups=counters.lookups,
        hits=counters.hits,
        tokens_reused=counters.tokens_reused,
        bytes_stored=counters.bytes_stored,
        bytes_loaded=counters.bytes_loaded,
        saves=counters.saves,
        retokenized=counters.retokenized,
    )
    fields.update({f"miss:{reason}": n for reason, n in counters.misses.items()})
    return fields


class RedisCounterSink:
    """Adds what a worker's counters grew by since the last push to the shared hash."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client, self.key = client, keys.checkpoint_counters()
        self._pushed: Counter[str] = Counter()

    def push(self, counters: CheckpointCounters) -> None:
        """Raises ``redis.RedisError`` when Redis is unreachable (the increments are kept for later)."""
        current = counter_fields(counters)
        delta = {field: n - self._pushed[field] for field, n in current.items() if n != self._pushed[field]}
        if not delta:
            return
        with self.client.pipeline(transaction=True) as pipe:
            for field, n in delta.items():
                pipe.hincrby(self.key, field, n)
            pipe.execute()
        self._pushed = current
