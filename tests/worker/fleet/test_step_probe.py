"""The start-up probe of a full batch's step, and the heartbeat that carries it."""

from __future__ import annotations

from pathlib import Path

from metrale.worker.engine.factory import EngineLimits, build_engine
from metrale.worker.fleet.liveness import Liveness, WorkerShape
from metrale.worker.fleet.step_probe import full_step_s
from metrale.worker.scheduler.scheduler import SchedulerStats


def test_the_probe_times_full_decode_steps_and_leaves_the_engine_empty(tiny_model_dir: Path) -> None:
    engine = build_engine(tiny_model_dir, EngineLimits(max_seqs=4, num_blocks=32)).engine
    seconds = full_step_s(engine, decode_steps=3)
    assert 0.0 < seconds < 5.0
    assert not engine.has_unfinished()
    assert engine.stats().free_slots == 4


def stats() -> SchedulerStats:
    return SchedulerStats(0, 0, 0, free_slots=4, free_blocks=8, swap_bytes_used=0, swap_outs=0, restarts=0)


def test_the_heartbeat_says_the_probe_until_full_steps_were_taken() -> None:
    liveness = Liveness("w1", "m", 3, shape=WorkerShape("cpu", total_slots=4, full_step_s=0.05))
    assert liveness.heartbeat(stats()).full_step_s == 0.05
    liveness.note_step(3, 3, 1.0)  # not a full batch: says nothing of one
    assert liveness.heartbeat(stats()).full_step_s == 0.05
    liveness.note_step(4, 4, 0.2)
    liveness.note_step(4, 4, 0.4)
    assert abs(liveness.heartbeat(stats()).full_step_s - 0.3) < 1e-9
