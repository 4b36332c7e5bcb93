"""How long a new request would wait for a state slot, and whether to take it: plain numbers.

``in_system`` counts the requests the new one would wait behind or beside for a slot: those of its
priority class and every class served before it, untaken on the streams or taken by a worker and not
finished (waiting in its scheduler or running). While fewer than the fleet's slots, one is free and
the request starts at once. Otherwise it starts once ``in_system - slots + 1`` requests have left
their slots, which happens ``drain_per_s`` times a second (``slot_turnover.py``), planned with
``HOLD_HEADROOM``: the turnover was measured before the requests now arriving, and a burst's own work
(its HTTP, its Redis writes, its relayed tokens, on the cores the workers use) makes the holds in it
longer than the ones measured.

When the heartbeats say when the running requests were taken (``FleetCapacity.taken_at``), the slots
are not assumed to free at an even pace: each frees one planned hold after its request was taken, a
slot that was free one hold after now (what fills it now leaves then), and each slot frees again
every hold after. The ``ahead``-th of those times is the wait. A burst on an idle fleet fills every
slot at once, and its next requests wait a whole hold, however few they are.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from metrale.gateway.fleet.slot_turnover import FleetCapacity

MAX_RETRY_AFTER_S = 60
"""The longest ``Retry-After`` sent: OpenAI's client honours up to 60 s (and backs off by itself beyond)."""

HOLD_HEADROOM = 1.2
"""How much longer than measured the planned slot holds are. In ten 300-stream bursts on one 2-core
machine (``docs/BENCHMARKS.md``), the holds during the burst ran 0.75-1.11 times those measured just
before it; at 1.11 the admitted requests started up to 11 % past the bound."""


@dataclass(frozen=True, slots=True)
class WaitEstimate:
    """``wait_s``: the estimated seconds before a new request starts; None when no slot is free and
    the fleet has not finished a request yet, so its drain rate is unknown. ``ahead``: the requests
    that must leave a slot first (0: one is free)."""

    wait_s: float | None
    ahead: int


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether to take the request; if not, ``retry_after_s`` (whole seconds, 1 to 60)."""

    admit: bool
    retry_after_s: int = 1


def estimate_wait(in_system: int, capacity: FleetCapacity, now: float | None = None) -> WaitEstimate:
    """The wait of one more request beside ``in_system`` others, on ``capacity``, at ``now`` (unix
    seconds; default: the clock's)."""
    ahead = max(0, in_system - capacity.slots + 1)
    if ahead == 0:
        return WaitEstimate(0.0, 0)
    drain = capacity.drain_per_s
    if not drain:
        return WaitEstimate(None, ahead)
    hold_s = capacity.slots / drain * HOLD_HEADROOM
    if capacity.taken_at is None:
        return WaitEstimate(ahead / capacity.slots * hold_s, ahead)
    now = time.time() if now is None else now
    frees = sorted(max(0.0, hold_s - (now - taken)) for taken in capacity.taken_at[: capacity.slots])
    frees += [hold_s] * (capacity.slots - len(frees))
    waves, nth = divmod(ahead - 1, capacity.slots)
    return WaitEstimate(waves * hold_s + frees[nth], ahead)


def judge(estimate: WaitEstimate, max_wait_s: float, *, waited_s: float = 0.0) -> Verdict:
    """Admit when the request should start within ``max_wait_s`` of its arrival, ``waited_s`` ago
    (a free slot always takes it); otherwise refuse, and ask the client to come back when the queue
    should have drained enough for a new request (``wait_s - max_wait_s``, rounded up). An unknown
    wait (a fleet that has not finished a request yet) is admitted: nothing says it could not start
    in time, and ``MET_MAX_QUEUE`` still bounds the queue."""
    if estimate.wait_s is None or estimate.ahead == 0 or estimate.wait_s + max(0.0, waited_s) <= max_wait_s:
        return Verdict(True)
    return Verdict(False, retry_after(estimate.wait_s - max_wait_s))


def retry_after(seconds: float) -> int:
    """``seconds`` as a ``Retry-After`` value: rounded up, at least 1, at most ``MAX_RETRY_AFTER_S``."""
    return min(MAX_RETRY_AFTER_S, max(1, math.ceil(seconds)))
