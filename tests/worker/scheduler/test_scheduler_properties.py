"""Random schedules through the scheduler alone, on integer states: every plan respects the limits,
every state consumes each position once and in order, every request finishes, nothing leaks."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, target

from metrale.worker.scheduler.config import SchedulerConfig
from metrale.worker.scheduler.plan import StepPlan
from metrale.worker.scheduler.scheduler import Scheduler
from metrale.worker.scheduler.sequence import SequenceId, StopParams
from tests.worker.scheduler.simulator import GARBAGE, StateSimulator, isolated_tokens, state_nbytes
from tests.worker.scheduler.strategies import RequestSpec, Scenario, scenarios

MAX_STEPS = 400


def stop_params(spec: RequestSpec) -> StopParams:
    return StopParams(spec.max_tokens, frozenset(spec.stop_token_ids), spec.include_stop_token)


def check_plan(plan: StepPlan, config: SchedulerConfig) -> None:
    assert plan.num_tokens <= config.max_batch_tokens
    assert len(plan.chunks) <= config.max_seqs
    kinds = [chunk.is_decode for chunk in plan.chunks]
    assert kinds == sorted(kinds, reverse=True), "decode rows come first"
    slots = [chunk.slot for chunk in plan.chunks]
    assert len(slots) == len(set(slots)), "a slot fed twice in one step"
    blocks = [block for chunk in plan.chunks for block in chunk.block_ids]
    assert len(blocks) == len(set(blocks)), "two rows share a KV block"
    for chunk in plan.chunks:
        assert len(chunk.block_ids) == config.blocks_for(chunk.end)
        if config.checkpoint_grid is not None and not chunk.is_decode:
            grid = config.checkpoint_grid
            assert chunk.start // grid == (chunk.end - 1) // grid, "a prefill chunk crosses the grid"


def run_scenario(scenario: Scenario) -> tuple[dict[SequenceId, list[int]], Scheduler, set[str]]:
    """Drive the scheduler to completion; return each choice's emitted tokens and the aborted ids."""
    config = scenario.config
    scheduler, simulator = Scheduler(config, state_nbytes), StateSimulator()
    emitted: dict[SequenceId, list[int]] = {}
    aborted: set[str] = set()
    for step in range(MAX_STEPS):
        for spec in scenario.requests:
            if spec.arrival_step == step:
                scheduler.add(spec.request_id, spec.prompt, stop_params(spec), spec.priority, spec.n)
            if spec.abort_step == step and not scheduler.is_finished(spec.request_id):
                scheduler.abort(spec.request_id)
                aborted.add(spec.request_id)
        arrivals_left = any(spec.arrival_step > step for spec in scenario.requests)
        if not arrivals_left and not scheduler.has_unfinished():
            return emitted, scheduler, aborted
        plan = scheduler.schedule()
        check_plan(plan, config)
        for update in scheduler.postprocess(plan, simulator.run(plan)):
            if update.token_id is not None:
                emitted.setdefault(update.seq_id, []).append(update.token_id)
    raise AssertionError(f"unfinished after {MAX_STEPS} steps: {scheduler.stats()}")


def test_random_schedules_keep_states_exact_and_finish() -> None:
    seen: Counter[str] = Counter()

    @given(scenarios())
    def check(scenario: Scenario) -> None:
        emitted, scheduler, aborted = run_scenario(scenario)
        config = scenario.config
        for spec in scenario.requests:
            for choice in range(spec.n):
                got = emitted.get(SequenceId(spec.request_id, choice), [])
                expected = isolated_tokens(spec.prompt, choice, stop_params(spec), config.max_model_len)
                assert GARBAGE not in got
                if spec.request_id in aborted:
                    assert got == expected[: len(got)]
                else:
                    assert got == expected
        stats = scheduler.stats()
        assert (stats.free_slots, stats.free_blocks) == (config.num_slots, config.num_blocks)
        assert stats.swap_bytes_used == 0
        target(float(stats.swap_outs + stats.restarts), label="preemptions")
        seen["swap-out"] += stats.swap_outs > 0
        seen["restart"] += stats.restarts > 0

    check()
    assert seen["swap-out"] > 0 and seen["restart"] > 0, seen
