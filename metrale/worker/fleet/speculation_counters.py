"""What speculative decoding did on one worker, as the fields of the fleet-wide hash and its heartbeat.

The hash (``Keys.speculation_counters``) sums every worker's ``speculation_fields``, added by a
``HashCounterSink`` with each heartbeat; gateways export it under vLLM's names
(``gateway/fleet/counters.py``). The heartbeat carries ``heartbeat_fields``, from which ``met top``
shows the worker's acceptance (``WorkerHeartbeat.acceptance``).
"""

from __future__ import annotations

from metrale.shared.messages import SPEC_ACCEPTED_TOKENS_COUNTER, SPEC_DRAFT_TOKENS_COUNTER
from metrale.worker.engine.speculation import SpeculationStats

POSITION_PREFIX = "pos:"
"""Hash fields ``pos:{i}``: how often draft position ``i`` (0: the first draft token) was accepted."""


def speculation_fields(stats: SpeculationStats) -> dict[str, int]:
    """Field name -> count, as added to the fleet-wide hash: drafts, draft and accepted tokens, and the
    accepted count of each draft position."""
    fields = {
        "num_drafts": stats.drafts,
        "num_draft_tokens": stats.draft_tokens,
        "num_accepted_tokens": stats.accepted_tokens,
    }
    fields |= {f"{POSITION_PREFIX}{i}": count for i, count in enumerate(stats.accepted_per_position)}
    return fields


def heartbeat_fields(stats: SpeculationStats) -> dict[str, int]:
    """The heartbeat's speculation counters: none until the worker has verified a draft (a worker
    without speculation says nothing of it), then its drafts, draft and accepted tokens."""
    if stats.drafts == 0:
        return {}
    return {
        "spec_drafts": stats.drafts,
        SPEC_DRAFT_TOKENS_COUNTER: stats.draft_tokens,
        SPEC_ACCEPTED_TOKENS_COUNTER: stats.accepted_tokens,
    }
