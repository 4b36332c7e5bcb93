"""How fast the fleet's state slots turn over, from what workers say in their heartbeats.

A worker holds one state slot per request it runs, from taking it to finishing it. Its heartbeat
carries ``total_slots`` and two counters (``worker/fleet/throughput.py`` ``SlotTimes``): requests its
engine finished and the milliseconds they held their slots, summed since it started. The mean
holding time is taken over the growth of those counters during the last ``window_s`` of heartbeats
(the worker's whole life until two heartbeats have been seen), pooled over the fleet. When every
slot is busy, a slot frees every ``hold_s / slots`` seconds on average: that is the drain rate the
admission estimate uses (``wait_estimate.py``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from metrale.shared.messages import WorkerHeartbeat, WorkerState

FINISHED_COUNTER = "requests_finished"
SLOT_MS_COUNTER = "request_slot_ms"


@dataclass(frozen=True, slots=True)
class FleetCapacity:
    """The state slots of the workers taking requests, and the recent mean time a request held one
    (``None`` until some worker has finished a request)."""

    slots: int
    hold_s: float | None

    @property
    def drain_per_s(self) -> float | None:
        """Requests leaving a slot per second while every slot is busy (None: not measured yet)."""
        if self.hold_s is None or self.slots == 0:
            return None
        return self.slots / max(self.hold_s, 1e-3)


@dataclass(frozen=True, slots=True)
class _Sample:
    sent_at: float
    finished: int
    slot_ms: int


class SlotTurnover:
    """Remembers each worker's counters over the last ``window_s`` of its heartbeats."""

    def __init__(self, window_s: float = 30.0) -> None:
        self._window_s = window_s
        self._samples: dict[str, deque[_Sample]] = {}

    def capacity(self, beats: Iterable[WorkerHeartbeat]) -> FleetCapacity:
        """The fleet's capacity from the live workers' latest heartbeats (``beats``)."""
        slots, finished, slot_ms = 0, 0, 0
        live: set[str] = set()
        for beat in beats:
            live.add(beat.worker_id)
            window = self._note(beat)
            if beat.state is WorkerState.TAKING:
                slots += beat.total_slots or beat.running + beat.free_slots
            done, held = _growth(window)
            finished, slot_ms = finished + done, slot_ms + held
        for gone in self._samples.keys() - live:
            del self._samples[gone]
        return FleetCapacity(slots, slot_ms / 1000 / finished if finished else None)

    def _note(self, beat: WorkerHeartbeat) -> deque[_Sample]:
        counters = dict(beat.counters)
        sample = _Sample(beat.sent_at, counters.get(FINISHED_COUNTER, 0), counters.get(SLOT_MS_COUNTER, 0))
        window = self._samples.setdefault(beat.worker_id, deque())
        if window and sample.finished < window[-1].finished:  # the worker restarted: its counters did
            window.clear()
        if not window or sample.sent_at > window[-1].sent_at:
            window.append(sample)
        while len(window) > 2 and window[1].sent_at <= sample.sent_at - self._window_s:
            window.popleft()
        return window


def _growth(window: deque[_Sample]) -> tuple[int, int]:
    """Requests finished and slot milliseconds over ``window``; the worker's whole life when nothing
    finished within it (a quiet window says nothing about how long a request takes)."""
    first, last = window[0], window[-1]
    if last.finished > first.finished:
        return last.finished - first.finished, last.slot_ms - first.slot_ms
    return last.finished, last.slot_ms
