"""The Checkpoints and failover panel: the fleet-wide counter hashes the workers add to."""

from __future__ import annotations

from dataclasses import dataclass, field

from metrale.shared.keys import Keys
from metrale.shared.redis_connect import SyncClient
from metrale.top.queries.replies import int_fields

MISS_PREFIX = "miss:"


@dataclass(frozen=True, slots=True)
class CountersView:
    """``met:metrics:checkpoints`` and ``met:metrics:failover``, field by field."""

    checkpoints: dict[str, int] = field(default_factory=dict)
    failover: dict[str, int] = field(default_factory=dict)

    @property
    def lookups(self) -> int:
        return self.checkpoints.get("lookups", 0)

    @property
    def hits(self) -> int:
        return self.checkpoints.get("hits", 0)

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.lookups if self.lookups else None

    @property
    def tokens_reused(self) -> int:
        return self.checkpoints.get("tokens_reused", 0)

    @property
    def misses(self) -> dict[str, int]:
        """Lookups that did not resume, by reason."""
        found = self.checkpoints.items()
        return {name.removeprefix(MISS_PREFIX): n for name, n in sorted(found) if name.startswith(MISS_PREFIX)}


def read_counters(client: SyncClient, keys: Keys) -> CountersView:
    """One round trip."""
    with client.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys.checkpoint_counters())
        pipe.hgetall(keys.failover_counters())
        checkpoints, failover = pipe.execute(raise_on_error=False)
    return CountersView(int_fields(checkpoints), int_fields(failover))
