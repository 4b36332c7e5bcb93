from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metrale.gateway.fleet.slot_turnover import FleetCapacity
from metrale.gateway.fleet.wait_estimate import (
    HOLD_HEADROOM,
    MAX_RETRY_AFTER_S,
    Verdict,
    WaitEstimate,
    estimate_wait,
    judge,
)


@pytest.mark.parametrize(
    ("in_system", "capacity", "expected"),
    [
        pytest.param(0, FleetCapacity(4, None), WaitEstimate(0.0, 0), id="idle-fleet"),
        pytest.param(3, FleetCapacity(4, 2.0), WaitEstimate(0.0, 0), id="a-slot-is-free"),
        pytest.param(4, FleetCapacity(4, 2.0), WaitEstimate(0.5 * HOLD_HEADROOM, 1), id="first-to-wait"),
        pytest.param(70, FleetCapacity(64, 3.2), WaitEstimate(0.35 * HOLD_HEADROOM, 7), id="seven-ahead"),
        pytest.param(4, FleetCapacity(4, None), WaitEstimate(None, 1), id="turnover-not-measured"),
        pytest.param(1, FleetCapacity(0, 1.0), WaitEstimate(None, 2), id="no-slots"),
    ],
)
def test_estimate_wait(in_system: int, capacity: FleetCapacity, expected: WaitEstimate) -> None:
    got = estimate_wait(in_system, capacity)
    assert got.ahead == expected.ahead
    assert got.wait_s == (pytest.approx(expected.wait_s) if expected.wait_s is not None else None)


@pytest.mark.parametrize(
    ("wait_s", "verdict"),
    [
        pytest.param(0.0, Verdict(True), id="starts-at-once"),
        pytest.param(5.0, Verdict(True), id="at-the-bound"),
        pytest.param(5.01, Verdict(False, 1), id="just-over-retries-in-1s"),
        pytest.param(12.2, Verdict(False, 8), id="retry-when-it-would-fit"),
        pytest.param(1000.0, Verdict(False, MAX_RETRY_AFTER_S), id="capped"),
        pytest.param(None, Verdict(True), id="unknown-is-admitted"),
    ],
)
def test_judge_against_a_5s_bound(wait_s: float | None, verdict: Verdict) -> None:
    assert judge(WaitEstimate(wait_s, 1), 5.0) == verdict


def test_time_already_spent_in_the_gateway_counts_against_the_bound() -> None:
    assert judge(WaitEstimate(4.0, 8), 5.0, waited_s=0.5).admit
    assert judge(WaitEstimate(4.0, 8), 5.0, waited_s=1.5) == Verdict(False, 1)
    assert judge(WaitEstimate(0.0, 0), 5.0, waited_s=60.0).admit  # a free slot takes it whenever it came


@given(
    in_system=st.integers(0, 5000),
    more=st.integers(1, 100),
    slots=st.integers(1, 512),
    hold_s=st.floats(0.01, 600),
)
def test_more_requests_never_wait_less(in_system: int, more: int, slots: int, hold_s: float) -> None:
    capacity = FleetCapacity(slots, hold_s)
    before, after = estimate_wait(in_system, capacity), estimate_wait(in_system + more, capacity)
    assert before.wait_s is not None and after.wait_s is not None
    assert after.wait_s >= before.wait_s and after.ahead >= before.ahead


def test_a_refused_request_retrying_after_its_retry_after_fits_if_the_queue_drained_as_estimated() -> None:
    capacity = FleetCapacity(8, 2.0)  # a slot frees every 0.25 s
    in_system = 8 + 60  # 61 ahead: 15.25 s, planned as 18.3 s
    verdict = judge(estimate_wait(in_system, capacity), 5.0)
    assert verdict == Verdict(False, 14)
    drained = round(verdict.retry_after_s * capacity.slots / 2.0)  # requests that left meanwhile
    assert judge(estimate_wait(in_system - drained, capacity), 5.0).admit


def test_a_burst_on_an_idle_fleet_waits_a_whole_hold_for_the_slots_it_fills() -> None:
    # 4 slots, 2 s holds (2.4 s planned), nothing running at the beat: the burst fills all four now,
    # and the next four wait for them to finish together, the four after for a second hold.
    idle = FleetCapacity(4, 2.0, taken_at=())
    hold = 2.0 * HOLD_HEADROOM
    waits = [estimate_wait(in_system, idle, now=100.0).wait_s for in_system in range(4, 12)]
    assert waits == pytest.approx([hold] * 4 + [2 * hold] * 4)


def test_slots_free_one_hold_after_their_requests_were_taken() -> None:
    hold = 2.0 * HOLD_HEADROOM
    busy = FleetCapacity(4, 2.0, taken_at=(99.0, 98.0, 97.8, 100.0))  # ages at 100 s: 1, 2, 2.2, 0
    waits = [estimate_wait(in_system, busy, now=100.0).wait_s for in_system in range(4, 9)]
    assert waits == pytest.approx([0.2, 0.4, hold - 1.0, hold, 0.2 + hold])


def test_without_ages_the_slots_free_at_an_even_pace() -> None:
    assert estimate_wait(8, FleetCapacity(4, 2.0)).wait_s == pytest.approx(5 / 4 * 2.0 * HOLD_HEADROOM)
