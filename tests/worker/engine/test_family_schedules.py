"""Random schedules on the real tiny model of every family: arrivals, chunked prefill under small token
budgets, too few blocks (preemption by swap or by restart), and each request's seeded tokens equal to its
run alone; every slot, block and swap byte back, the state ledger empty (no position fed twice)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from metrale.worker.engine.engine import Engine
from metrale.worker.engine.request import Request
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.model.executor import ModelExecutor
from metrale.worker.scheduler.config import SchedulerConfig
from tests.worker.engine.test_engine_real_model import BLOCK, _loaded, _run_arrivals

SLOTS = 4


@dataclass(frozen=True)
class Schedule:
    """Requests (prompt length, new tokens, arrival step) and the engine's limits."""

    requests: tuple[tuple[int, int, int], ...]
    max_batch_tokens: int
    num_blocks: int
    swap_space_bytes: int


schedules = st.builds(
    Schedule,
    requests=st.lists(st.tuples(st.integers(1, 50), st.integers(1, 12), st.integers(0, 6)), min_size=2, max_size=6).map(
        tuple
    ),
    max_batch_tokens=st.sampled_from([7, 16, 33]),
    num_blocks=st.sampled_from([5, 8, 40]),  # 5 blocks: two long sequences at most, preemption is forced
    swap_space_bytes=st.sampled_from([0, 10**8]),
)


def _engine(model_dir: Path, schedule: Schedule | None) -> Engine:
    blocks = schedule.num_blocks if schedule else 40
    config = SchedulerConfig(
        max_batch_tokens=schedule.max_batch_tokens if schedule else 64,
        max_seqs=SLOTS,
        num_slots=SLOTS,
        num_blocks=blocks,
        block_size=BLOCK,
        swap_space_bytes=schedule.swap_space_bytes if schedule else 0,
        max_model_len=blocks * BLOCK,
    )
    executor = ModelExecutor(_loaded(model_dir), num_slots=SLOTS, num_blocks=blocks, block_size=BLOCK)
    return Engine(executor, config, seed=0)


def _requests(schedule: Schedule) -> list[Request]:
    rng = random.Random(len(schedule.requests))
    return [
        Request(
            f"q{i}",
            tuple(rng.randrange(512) for _ in range(length)),
            SamplingParams(max_tokens=new, temperature=0.9, seed=100 + i, ignore_eos=True),
        )
        for i, (length, new, _) in enumerate(schedule.requests)
    ]


CROWDED = ((28, 12, 0), (29, 12, 0), (10, 12, 1))
"""Two prompts of two blocks each that need three each as they decode: five blocks are too few, one is
preempted."""


def test_random_schedules_match_each_request_run_alone(family_model_dir: Path) -> None:
    alone: dict[tuple[tuple[int, ...], SamplingParams], list[int]] = {}
    preempted = {"swap-out": 0, "restart": 0}

    # Both kinds of preemption, whatever the search finds on its own.
    @example(Schedule(CROWDED, max_batch_tokens=16, num_blocks=5, swap_space_bytes=0))
    @example(Schedule(CROWDED, max_batch_tokens=16, num_blocks=5, swap_space_bytes=10**8))
    @settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(schedules)
    def check(schedule: Schedule) -> None:
        requests = _requests(schedule)
        engine = _engine(family_model_dir, schedule)
        got = _run_arrivals(engine, requests, [arrival for *_, arrival in schedule.requests])
        stats = engine.stats()
        assert (stats.free_slots, stats.free_blocks, stats.swap_bytes_used) == (SLOTS, schedule.num_blocks, 0)
        assert engine._runner.ledger.is_empty  # type: ignore[attr-defined]
        preempted["swap-out"] += stats.swap_outs
        preempted["restart"] += stats.restarts
        for request in requests:
            key = (request.prompt_ids, request.params)
            if key not in alone:
                alone[key] = _run_arrivals(_engine(family_model_dir, None), [request], [0])[
                    request.request_id
                ].token_ids
            assert got[request.request_id].token_ids == alone[key], (request.request_id, schedule)

    check()
    assert preempted["swap-out"] > 0 and preempted["restart"] > 0, preempted
