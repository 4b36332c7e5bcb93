"""Generated tokens per second and the mean step time over a sliding window, for the worker's heartbeat."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


class ThroughputMeter:
    """Counts tokens as they are produced; ``rate()`` is tokens per second over the last ``window_s``.

    Before a full window has passed, the rate is taken over the time since the meter started.
    """

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self._window_s = window_s
        self._clock = clock
        self._started = clock()
        self._samples: deque[tuple[float, int]] = deque()
        self._in_window = 0

    def add(self, tokens: int) -> None:
        """Note ``tokens`` produced now."""
        if tokens:
            self._samples.append((self._clock(), tokens))
            self._in_window += tokens

    def rate(self) -> float:
        """Tokens per second over the window ending now."""
        now = self._clock()
        while self._samples and self._samples[0][0] <= now - self._window_s:
            self._in_window -= self._samples.popleft()[1]
        span = min(self._window_s, now - self._started)
        return self._in_window / span if span > 0 else 0.0


class StepTimer:
    """The mean duration of the engine steps taken in the last ``window_s`` (0 when none was)."""

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self._window_s = window_s
        self._clock = clock
        self._steps: deque[tuple[float, float]] = deque()
        self._total_s = 0.0

    def add(self, seconds: float) -> None:
        """Note one step that took ``seconds``, ending now."""
        self._steps.append((self._clock(), seconds))
        self._total_s += seconds

    def mean(self) -> float:
        """Mean step seconds over the window ending now."""
        now = self._clock()
        while self._steps and self._steps[0][0] <= now - self._window_s:
            self._total_s -= self._steps.popleft()[1]
        if not self._steps:
            self._total_s = 0.0
            return 0.0
        return max(self._total_s, 0.0) / len(self._steps)


@dataclass(slots=True)
class SlotTimes:
    """Requests the engine finished here, the milliseconds they spent on this worker, from being
    taken to finishing, and the tokens they generated (all choices), summed. Sent as heartbeat
    counters, from which gateways derive how long a request holds a slot and how many steps it
    takes, hence how fast the fleet's slots turn over (``gateway/fleet/slot_turnover.py``)."""

    requests_finished: int = 0
    request_slot_ms: int = 0
    request_tokens: int = 0

    def add(self, seconds: float, tokens: int = 0) -> None:
        """One request finished after holding its slot ``seconds`` and generating ``tokens``."""
        self.requests_finished += 1
        self.request_slot_ms += max(0, round(seconds * 1000))
        self.request_tokens += max(0, tokens)

    def fields(self) -> dict[str, int]:
        """Counter name -> value, for the heartbeat."""
        return {
            "requests_finished": self.requests_finished,
            "request_slot_ms": self.request_slot_ms,
            "request_tokens": self.request_tokens,
        }
