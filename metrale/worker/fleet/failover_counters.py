"""What failover did on one worker, counted in-process and added to the fleet-wide hash in Redis."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import redis


@dataclass(slots=True)
class FailoverCounters:
    """Requests this worker continued from another's record, or gave away.

    ``resume_prefill_tokens`` counts the tokens continued requests fed before their first new token
    (prompt and emitted tokens past the checkpoint they resumed from); ``resume_checkpoint_tokens``
    the tokens those checkpoints spared. ``unresumable_requests`` ended with an error because they
    could not be continued exactly; ``dead_lettered_requests`` kept losing their workers;
    ``taken_over_requests`` were dropped here because others took them over while this worker's
    heartbeat had lapsed.
    """

    resumed_requests: int = 0
    resume_prefill_tokens: int = 0
    resume_checkpoint_tokens: int = 0
    handed_back_requests: int = 0
    unresumable_requests: int = 0
    dead_lettered_requests: int = 0
    taken_over_requests: int = 0

    def fields(self) -> dict[str, int]:
        """Field name -> value, as written to the shared hash."""
        return asdict(self)


class HashCounterSink:
    """Adds what some counters grew by since the last push to one Redis hash (``HINCRBY``)."""

    def __init__(self, client: redis.Redis, key: str) -> None:
        self.client, self.key = client, key
        self._pushed: Counter[str] = Counter()

    def push(self, fields: Mapping[str, int]) -> None:
        """Raises ``redis.RedisError`` when Redis is unreachable (the increments are kept for later)."""
        delta = {name: n - self._pushed[name] for name, n in fields.items() if n != self._pushed[name]}
        if not delta:
            return
        with self.client.pipeline(transaction=True) as pipe:
            for name, n in delta.items():
                pipe.hincrby(self.key, name, n)
            pipe.execute()
        self._pushed = Counter(fields)
