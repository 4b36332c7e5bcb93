"""How fast the fleet's state slots turn over, from what workers say in their heartbeats.

A worker holds one state slot per request it runs, from taking it to finishing it. Its heartbeat
carries ``total_slots``, its full step (how long a step with every slot busy takes: ``full_step_s``,
its loop's recent period at full batch, or before it ran full ``probe_step_s``, timed at its start-up,
planned ``PROBE_HEADROOM`` times as long) and three counters (``worker/fleet/throughput.py``
``SlotTimes``): requests its engine finished, the milliseconds they held their slots and the tokens
they generated, summed since it started. The means per request are taken over the growth of those
counters during the last ``window_s`` of heartbeats (the worker's whole life until two heartbeats
have been seen), pooled over the fleet.

When every slot is busy, requests leave them ``slots / hold_s`` times a second, where ``hold_s`` is
measured; and at most ``full_tokens_per_s / tokens`` times a second, where ``full_tokens_per_s`` is
what the slots generate at full batch (each worker's slots over its full step) and ``tokens`` what a
request generates: measured, or before any request finished, what this gateway's requests asked for
(``requested_tokens.py``). The drain rate the admission estimate uses (``wait_estimate.py``) is the
slower of the two known: the first alone misses when the holds were measured at a smaller batch than
a burst runs, and is unknown on a fresh fleet; the second needs no finished request.

Each heartbeat also says how long ago the worker took each request it runs (``slot_ages_ms``), kept
as the times they were taken (``taken_at``): ``wait_estimate.py`` frees each slot one hold after its
request was taken, and a slot free at the beat one hold after now (a burst fills the free slots at
once, and they free together, not at the average pace).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace

from metrale.shared.messages import WorkerHeartbeat, WorkerState

FINISHED_COUNTER = "requests_finished"
SLOT_MS_COUNTER = "request_slot_ms"
TOKENS_COUNTER = "request_tokens"

PROBE_HEADROOM = 3.0
"""How much longer than the start-up probe a full step is planned, until the worker has run full
(a few full steps later its heartbeat says their real period): the probe times the engine step
alone, and a burst adds its worker's publishing and its gateway's relaying of every token, on the
same CPUs (``met serve``: under the same interpreter lock), which on a small model is most of a
step. On 2 shared vCPUs, fresh ``met serve`` (built-in model, 64 slots), 200 streams of 64 tokens:
the loop's full steps in the burst took 1.3-3.0 times the probe's (``docs/BENCHMARKS.md``)."""


@dataclass(frozen=True, slots=True)
class FleetCapacity:
    """The state slots of the workers taking requests; the recent mean time a request held one and
    the tokens it generated (``None`` until some worker has finished a request); the tokens the slots
    generate per second at full batch (0: no worker measured its full step); what recent requests
    asked for (``None``: unknown), used while the tokens per request are not measured; and when the
    requests running at the last heartbeats were taken (unix seconds; ``None``: some worker does not
    say)."""

    slots: int
    hold_s: float | None
    full_tokens_per_s: float = 0.0
    tokens_per_request: float | None = None
    requested_tokens: float | None = None
    taken_at: tuple[float, ...] | None = None

    @property
    def drain_per_s(self) -> float | None:
        """Requests leaving a slot per second while every slot is busy (None: not known yet)."""
        if self.slots == 0:
            return None
        rates = [self.slots / max(self.hold_s, 1e-3)] if self.hold_s is not None else []
        tokens = self.tokens_per_request or self.requested_tokens
        if self.full_tokens_per_s and tokens:
            rates.append(self.full_tokens_per_s / max(tokens, 1.0))
        return min(rates) if rates else None

    def asking(self, requested_tokens: float | None) -> FleetCapacity:
        """This capacity for requests asking ``requested_tokens`` on average."""
        return replace(self, requested_tokens=requested_tokens)


@dataclass(frozen=True, slots=True)
class _Sample:
    sent_at: float
    finished: int
    slot_ms: int
    tokens: int


class SlotTurnover:
    """Remembers each worker's counters over the last ``window_s`` of its heartbeats."""

    def __init__(self, window_s: float = 30.0) -> None:
        self._window_s = window_s
        self._samples: dict[str, deque[_Sample]] = {}

    def capacity(self, beats: Iterable[WorkerHeartbeat]) -> FleetCapacity:
        """The fleet's capacity from the live workers' latest heartbeats (``beats``)."""
        slots, finished, slot_ms, tokens, full_tokens_per_s = 0, 0, 0, 0, 0.0
        taken_at: list[float] | None = []
        live: set[str] = set()
        for beat in beats:
            live.add(beat.worker_id)
            window = self._note(beat)
            if beat.state is WorkerState.TAKING:
                worker_slots = beat.total_slots or beat.running + beat.free_slots
                slots += worker_slots
                step_s = beat.full_step_s or beat.probe_step_s * PROBE_HEADROOM
                full_tokens_per_s += worker_slots / step_s if step_s > 0 else 0.0
                taken_at = _taken_at(taken_at, beat)
            done, held, generated = _growth(window)
            finished, slot_ms, tokens = finished + done, slot_ms + held, tokens + generated
        for gone in self._samples.keys() - live:
            del self._samples[gone]
        hold_s = slot_ms / 1000 / finished if finished else None
        per_request = tokens / finished if finished and tokens else None
        frozen = tuple(taken_at) if taken_at is not None else None
        return FleetCapacity(slots, hold_s, full_tokens_per_s, per_request, taken_at=frozen)

    def _note(self, beat: WorkerHeartbeat) -> deque[_Sample]:
        counters = dict(beat.counters)
        sample = _Sample(
            beat.sent_at,
            counters.get(FINISHED_COUNTER, 0),
            counters.get(SLOT_MS_COUNTER, 0),
            counters.get(TOKENS_COUNTER, 0),
        )
        window = self._samples.setdefault(beat.worker_id, deque())
        if window and sample.finished < window[-1].finished:  # the worker restarted: its counters did
            window.clear()
        if not window or sample.sent_at > window[-1].sent_at:
            window.append(sample)
        while len(window) > 2 and window[1].sent_at <= sample.sent_at - self._window_s:
            window.popleft()
        return window


def _taken_at(so_far: list[float] | None, beat: WorkerHeartbeat) -> list[float] | None:
    """``so_far`` with when ``beat``'s running requests were taken; None once a worker does not say
    (a worker before heartbeat version 3, which sends no full step either)."""
    if so_far is None or beat.probe_step_s <= 0:
        return None
    return so_far + [beat.sent_at - age_ms / 1000 for age_ms in beat.slot_ages_ms]


def _growth(window: deque[_Sample]) -> tuple[int, int, int]:
    """Requests finished, slot milliseconds and tokens over ``window``; the worker's whole life when
    nothing finished within it (a quiet window says nothing about how long a request takes)."""
    first, last = window[0], window[-1]
    if last.finished > first.finished:
        return last.finished - first.finished, last.slot_ms - first.slot_ms, last.tokens - first.tokens
    return last.finished, last.slot_ms, last.tokens
