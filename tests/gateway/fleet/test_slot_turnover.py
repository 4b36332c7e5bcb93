from __future__ import annotations

import pytest

from metrale.gateway.fleet.slot_turnover import PROBE_HEADROOM, FleetCapacity, SlotTurnover
from metrale.shared.messages import WorkerHeartbeat, WorkerState


def beat(
    worker: str,
    sent_at: float,
    finished: int,
    slot_ms: int,
    *,
    slots: int = 8,
    state: WorkerState = WorkerState.TAKING,
) -> WorkerHeartbeat:
    counters = [("request_slot_ms", slot_ms), ("requests_finished", finished), ("swap_outs", 0)]
    return WorkerHeartbeat(
        worker, "m", 0, 0, 0, 0, 0.0, slots, 64, 0.0, sent_at, state=state, total_slots=slots, counters=counters
    )


def test_unknown_until_a_request_finished() -> None:
    assert SlotTurnover().capacity([beat("w1", 1.0, 0, 0)]) == FleetCapacity(8, None)


def test_one_heartbeat_gives_the_lifetime_mean() -> None:
    assert SlotTurnover().capacity([beat("w1", 1.0, 4, 10_000)]) == FleetCapacity(8, 2.5)


def test_later_heartbeats_give_the_mean_over_their_growth() -> None:
    turnover = SlotTurnover(window_s=30)
    turnover.capacity([beat("w1", 1.0, 100, 100_000)])  # 1 s each, long ago
    capacity = turnover.capacity([beat("w1", 4.0, 110, 140_000)])  # the last ten took 4 s each
    assert capacity == FleetCapacity(8, 4.0)
    assert capacity.drain_per_s == 2.0


def test_the_window_forgets_old_heartbeats() -> None:
    turnover = SlotTurnover(window_s=10)
    turnover.capacity([beat("w1", 0.0, 0, 0)])
    turnover.capacity([beat("w1", 5.0, 10, 10_000)])  # 1 s each
    turnover.capacity([beat("w1", 11.0, 20, 40_000)])  # 3 s each
    # At 16 s the window starts from the 5 s beat's counters: (30 + 20) s over 20 requests.
    assert turnover.capacity([beat("w1", 16.0, 30, 60_000)]).hold_s == 2.5
    assert turnover.capacity([beat("w1", 30.0, 40, 100_000)]).hold_s == 4.0  # from the 16 s beat on


def test_a_quiet_window_falls_back_to_the_lifetime_mean() -> None:
    turnover = SlotTurnover()
    turnover.capacity([beat("w1", 1.0, 5, 10_000)])
    assert turnover.capacity([beat("w1", 4.0, 5, 10_000)]).hold_s == 2.0


def test_workers_are_pooled_and_draining_ones_offer_no_slots() -> None:
    beats = [
        beat("w1", 1.0, 3, 3_000, slots=4),
        beat("w2", 1.0, 1, 5_000, slots=16),
        beat("w3", 1.0, 0, 0, slots=32, state=WorkerState.DRAINING),
    ]
    assert SlotTurnover().capacity(beats) == FleetCapacity(20, 2.0)


def test_a_restarted_worker_starts_over() -> None:
    turnover = SlotTurnover()
    turnover.capacity([beat("w1", 1.0, 50, 500_000)])
    assert turnover.capacity([beat("w1", 3.0, 2, 1_000)]).hold_s == 0.5


def test_workers_gone_are_forgotten() -> None:
    turnover = SlotTurnover()
    turnover.capacity([beat("w1", 1.0, 10, 10_000), beat("w2", 1.0, 10, 30_000)])
    assert turnover.capacity([beat("w2", 2.0, 10, 30_000)]) == FleetCapacity(8, 3.0)


def test_a_worker_without_slot_totals_offers_running_plus_free() -> None:
    old = WorkerHeartbeat("w1", "m", 3, 0, 0, 0, 0.0, 5, 64, 0.0, 1.0)  # a version 1 heartbeat
    assert SlotTurnover().capacity([old]).slots == 8


@pytest.mark.parametrize("hold_s", [None, 0.0])
def test_drain_rate_is_none_or_finite(hold_s: float | None) -> None:
    drain = FleetCapacity(4, hold_s).drain_per_s
    assert drain is None if hold_s is None else drain is not None and drain > 0


def cold_beat(
    worker: str, full_step_s: float, *, slots: int = 8, finished: int = 0, tokens: int = 0
) -> WorkerHeartbeat:
    counters = [("request_slot_ms", finished * 1000), ("request_tokens", tokens), ("requests_finished", finished)]
    return WorkerHeartbeat(
        worker,
        "m",
        0,
        0,
        0,
        0,
        0.0,
        slots,
        64,
        0.0,
        1.0,
        total_slots=slots,
        counters=counters,
        probe_step_s=full_step_s / 2,
        full_step_s=full_step_s,
    )


def test_a_fresh_fleet_drains_at_its_full_step_for_what_requests_ask() -> None:
    # Two workers of 8 slots, 0.1 s and 0.2 s per full step: 80 + 40 tokens a second at full batch.
    capacity = SlotTurnover().capacity([cold_beat("w1", 0.1), cold_beat("w2", 0.2)])
    assert capacity.hold_s is None and capacity.full_tokens_per_s == pytest.approx(120.0)
    assert capacity.drain_per_s is None  # nothing says what a request takes yet
    assert capacity.asking(60.0).drain_per_s == pytest.approx(2.0)  # 60 tokens each: 2 leave a second


def test_measured_tokens_per_request_win_over_what_was_asked() -> None:
    capacity = SlotTurnover().capacity([cold_beat("w1", 0.1, finished=4, tokens=80)])  # 20 tokens each
    assert capacity.tokens_per_request == 20.0
    # Held 1 s each: 8 a second by the holds, 80 / 20 = 4 by the full step: the slower counts.
    assert capacity.asking(1_000.0).drain_per_s == pytest.approx(4.0)


def test_holds_measured_at_a_small_batch_do_not_outrun_the_full_step() -> None:
    fast_holds = cold_beat("w1", 0.1, finished=4, tokens=4 * 64)  # 64 tokens in 1 s each: at batch 1
    assert SlotTurnover().capacity([fast_holds]).drain_per_s == pytest.approx(80 / 64)


def test_a_worker_without_a_full_step_drains_as_measured() -> None:
    assert SlotTurnover().capacity([cold_beat("w1", 0.0, finished=4, tokens=80)]).asking(50.0).drain_per_s == 8.0


def test_the_running_requests_ages_become_when_they_were_taken() -> None:
    aged = WorkerHeartbeat(
        "w1", "m", 2, 0, 0, 2, 0.0, 2, 64, 0.0, 50.0, total_slots=4, probe_step_s=0.1, slot_ages_ms=[500, 2_000]
    )
    assert SlotTurnover().capacity([aged]).taken_at == (49.5, 48.0)
    assert SlotTurnover().capacity([aged, beat("w2", 50.0, 1, 1_000)]).taken_at is None  # w2 does not say


def test_before_a_worker_ran_full_its_probe_is_planned_longer() -> None:
    probed = WorkerHeartbeat("w1", "m", 0, 0, 0, 0, 0.0, 8, 64, 0.0, 1.0, total_slots=8, probe_step_s=0.1)
    assert SlotTurnover().capacity([probed]).full_tokens_per_s == pytest.approx(80 / PROBE_HEADROOM)
