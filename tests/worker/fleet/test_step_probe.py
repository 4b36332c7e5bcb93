"""The start-up probe of a full batch's step, and the heartbeat that carries it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import cast

from metrale.shared.messages import WorkerHeartbeat
from metrale.worker.engine.factory import EngineLimits, build_engine
from metrale.worker.engine.speculation import SpeculationStats, SpeculativeConfig
from metrale.worker.fleet.liveness import EARLY_BEAT_FULL_STEPS, Liveness, WorkerShape
from metrale.worker.fleet.step_probe import full_step_s
from metrale.worker.fleet.transport import WorkerTransport
from metrale.worker.model.builtin import builtin_model_dir
from metrale.worker.scheduler.scheduler import SchedulerStats


def test_the_probe_times_full_decode_steps_and_leaves_the_engine_empty(tiny_model_dir: Path) -> None:
    engine = build_engine(tiny_model_dir, EngineLimits(max_seqs=4, num_blocks=32)).engine
    seconds = full_step_s(engine, decode_steps=3)
    assert 0.0 < seconds < 5.0
    assert not engine.has_unfinished()
    assert engine.stats().free_slots == 4


def test_a_speculating_engine_is_probed_without_drafts() -> None:
    """The probe's prompts repeat (1, 2, 1, 2, ...), and the built-in model's greedy continuation goes on
    repeating them: n-gram drafts would be proposed, and accepted, for every row."""
    speculation = SpeculativeConfig(num_speculative_tokens=4)
    limits = EngineLimits(max_seqs=4, num_blocks=32)
    engine = build_engine(builtin_model_dir(), limits, speculation=speculation).engine
    assert full_step_s(engine, decode_steps=6) > 0.0
    assert engine.speculation_stats() == SpeculationStats()


def stats() -> SchedulerStats:
    return SchedulerStats(0, 0, 0, free_slots=4, free_blocks=8, swap_bytes_used=0, swap_outs=0, restarts=0)


def test_the_heartbeat_says_the_probe_and_the_period_of_consecutive_full_steps() -> None:
    liveness = Liveness("w1", "m", 3, shape=WorkerShape("cpu", total_slots=4, full_step_s=0.05))
    liveness.note_step(4, 4, 0.01)  # the first full step: no period yet
    assert (liveness.heartbeat(stats()).probe_step_s, liveness.heartbeat(stats()).full_step_s) == (0.05, 0.0)
    time.sleep(0.1)
    liveness.note_step(3, 3, 0.01)  # not full: breaks the run
    liveness.note_step(4, 4, 0.01)
    assert liveness.heartbeat(stats()).full_step_s == 0.0
    time.sleep(0.1)
    liveness.note_step(4, 4, 0.01)  # right after a full step: the loop's period, not the step's 0.01 s
    assert 0.1 <= liveness.heartbeat(stats()).full_step_s < 2.0


class Beats:
    """A transport that only keeps the heartbeats sent."""

    def __init__(self) -> None:
        self.sent: list[WorkerHeartbeat] = []

    def heartbeat(self, beat: WorkerHeartbeat) -> None:
        self.sent.append(beat)


def test_a_run_of_full_steps_beats_at_once() -> None:
    liveness, beats = Liveness("w1", "m", 30, shape=WorkerShape("cpu", total_slots=4)), Beats()
    transport = cast(WorkerTransport, beats)
    liveness.beat_if_due(transport, stats())  # the first beat; the next is due in 10 s
    for _ in range(EARLY_BEAT_FULL_STEPS - 1):
        liveness.note_step(4, 4, 0.01)
        liveness.beat_if_due(transport, stats())
    assert len(beats.sent) == 1
    liveness.note_step(4, 4, 0.01)
    liveness.beat_if_due(transport, stats())
    assert len(beats.sent) == 2 and beats.sent[-1].full_step_s > 0
