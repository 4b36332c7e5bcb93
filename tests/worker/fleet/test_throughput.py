"""Tokens per second over a sliding window, on a hand-driven clock."""

from __future__ import annotations

import pytest

from metrale.worker.fleet.throughput import SlotTimes, ThroughputMeter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_rate_covers_the_time_since_start_until_a_window_has_passed() -> None:
    clock = Clock()
    meter = ThroughputMeter(window_s=10.0, clock=clock)
    assert meter.rate() == 0.0
    clock.now += 2.0
    meter.add(40)
    assert meter.rate() == pytest.approx(20.0)


def test_tokens_older_than_the_window_stop_counting() -> None:
    clock = Clock()
    meter = ThroughputMeter(window_s=10.0, clock=clock)
    clock.now += 1.0
    meter.add(100)
    clock.now += 10.0
    meter.add(50)
    assert meter.rate() == pytest.approx(5.0)
    clock.now += 10.0
    assert meter.rate() == 0.0


def test_slot_times_sum_whole_milliseconds_and_tokens() -> None:
    times = SlotTimes()
    times.add(1.2344, 64)
    times.add(0.0004, 3)
    assert times.fields() == {"requests_finished": 2, "request_slot_ms": 1234, "request_tokens": 67}
