"""The runner executes plans in order and lets the ledger veto a bad one before the model sees it."""

from __future__ import annotations

import pytest

from metrale.worker.engine.runner import ModelRunner
from metrale.worker.engine.sampler import Sampler
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.engine.state_ledger import StateInvariantError, StateLedger
from metrale.worker.scheduler.plan import ChunkPlan, Fork, SampleSpec, StepPlan, SwapIn, SwapOut
from metrale.worker.scheduler.sequence import SequenceId
from tests.worker.fakes import GARBAGE, RecordingModel

A, B = SequenceId("a", 0), SequenceId("b", 0)
PROMPT = (3, 4, 5, 6)


def make_runner() -> tuple[ModelRunner, RecordingModel]:
    model = RecordingModel(num_slots=3, num_blocks=8, block_size=2)
    model.register("a", PROMPT)
    runner = ModelRunner(model, Sampler(), StateLedger())
    runner.register("a", SamplingParams(temperature=0.0), seed=0)
    runner.register("b", SamplingParams(temperature=0.0), seed=0)
    return runner, model


def prefill(seq_id: SequenceId, slot: int, blocks: tuple[int, ...]) -> StepPlan:
    chunk = ChunkPlan(seq_id, slot, blocks, 0, PROMPT, is_decode=False)
    return StepPlan(chunks=[chunk], samples=[SampleSpec(seq_id, 0, 4, PROMPT, [])])


def decode(seq_id: SequenceId, slot: int, blocks: tuple[int, ...], start: int, token: int) -> StepPlan:
    chunk = ChunkPlan(seq_id, slot, blocks, start, (token,), is_decode=True)
    return StepPlan(chunks=[chunk], samples=[SampleSpec(seq_id, 0, start + 1, PROMPT, [token])])


def test_a_swapped_state_continues_exactly_in_another_slot() -> None:
    runner, model = make_runner()
    [first] = runner.run(prefill(A, slot=0, blocks=(0, 1)))
    runner.run(StepPlan(swap_outs=[SwapOut(A, 0, (0, 1), 4)]))
    runner.run(prefill(B, slot=0, blocks=(0, 1)))  # someone else overwrites slot 0 and its blocks
    swap_in = SwapIn(A, 2, (4, 5), 4)
    plan = decode(A, slot=2, blocks=(4, 5, 6), start=4, token=first.token_id)
    [second] = runner.run(StepPlan(chunks=plan.chunks, samples=plan.samples, swap_ins=[swap_in]))
    assert second.token_id != GARBAGE
    assert model.forwards[-1][0].owner == "a"
    assert runner.num_parked == 0


@pytest.mark.parametrize(
    "bad_plan",
    [
        decode(A, slot=0, blocks=(0, 1, 2), start=5, token=1),
        decode(B, slot=0, blocks=(0, 1, 2), start=4, token=1),
        StepPlan(swap_outs=[SwapOut(A, 0, (0, 1), 3)]),
        StepPlan(swap_ins=[SwapIn(A, 1, (2, 3), 4)]),
        StepPlan(forks=[Fork(A, 0, (0, 1), 3, SequenceId("a", 1), 1, (2, 3))]),
    ],
    ids=["skips-a-position", "feeds-another-state", "swaps-out-short", "swaps-in-nothing", "forks-wrong-length"],
)
def test_the_ledger_vetoes_a_corrupting_plan_before_the_model_runs(bad_plan: StepPlan) -> None:
    runner, model = make_runner()
    runner.run(prefill(A, slot=0, blocks=(0, 1)))
    forwards_before = len(model.forwards)
    with pytest.raises(StateInvariantError):
        runner.run(bad_plan)
    assert len(model.forwards) == forwards_before


def test_fork_children_sample_their_own_choice_from_the_parent_row() -> None:
    runner, _ = make_runner()
    runner.register("a", SamplingParams(temperature=1.0, n=3), seed=5)
    children = [SequenceId("a", choice) for choice in (1, 2)]
    plan = prefill(A, slot=0, blocks=(0, 1))
    plan.forks.extend([Fork(A, 0, (0, 1), 4, children[0], 1, (2, 3)), Fork(A, 0, (0, 1), 4, children[1], None, ())])
    plan.samples.extend(SampleSpec(child, 0, 4, PROMPT, []) for child in children)
    sampled = runner.run(plan)
    assert len(sampled) == 3 and runner.num_parked == 1
    assert runner.ledger.parked_position(children[1]) == 4
    runner.release("a")
    assert runner.num_parked == 0 and runner.ledger.parked_position(children[1]) is None
