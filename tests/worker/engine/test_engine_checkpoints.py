"""Snapshots from the engine resume other requests exactly: same tokens as a prefill from position 0."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from metrale.worker.engine.engine import Engine
from metrale.worker.engine.request import Completion, Request, ResumePoint
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.engine.snapshots import Snapshot
from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.interface import ForwardChunk
from metrale.worker.model.loader import load_model
from metrale.worker.scheduler.config import SchedulerConfig

BLOCK = 16


@pytest.fixture(scope="module")
def executor(family_model_dir: Path) -> ModelExecutor:
    """The tiny model of each family in turn: every test here runs over every family."""
    return ModelExecutor(load_model(family_model_dir), num_slots=8, num_blocks=128, block_size=BLOCK)


def _engine(executor: ModelExecutor, grid: int | None = None) -> Engine:
    config = SchedulerConfig(
        max_batch_tokens=256,
        max_seqs=8,
        num_slots=8,
        num_blocks=128,
        block_size=BLOCK,
        max_model_len=128 * BLOCK,
        checkpoint_grid=grid,
    )
    return Engine(executor, config, seed=0)


def _run(engine: Engine, request: Request) -> tuple[list[int], list[Snapshot]]:
    engine.add_request(request)
    completion = Completion()
    snapshots: list[Snapshot] = []
    while engine.has_unfinished():
        for output in engine.step():
            completion.extend(output)
        snapshots += engine.take_snapshots()
    return completion.token_ids, snapshots


PARAMS = {
    "greedy": SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=12, temperature=0.8, top_k=50, seed=99, ignore_eos=True),
}


@pytest.mark.parametrize("mode", sorted(PARAMS))
def test_next_turn_resumed_from_final_snapshot_equals_full_prefill(executor: ModelExecutor, mode: str) -> None:
    rng = random.Random(1)
    params = PARAMS[mode]
    first_prompt = tuple(rng.randrange(512) for _ in range(40))
    output, snapshots = _run(_engine(executor), Request("turn1", first_prompt, params, snapshots=True))
    [final] = [s for s in snapshots if s.final]
    assert final.consumed == (*first_prompt, *output[:-1])  # the last sampled token is not consumed
    second_prompt = (*first_prompt, *output, *(rng.randrange(512) for _ in range(25)))

    cold, _ = _run(_engine(executor), Request("cold", second_prompt, params))
    resume = ResumePoint(len(final.consumed), final.state)
    warm, _ = _run(_engine(executor), Request("warm", second_prompt, params, resume=resume))
    assert warm == cold


def test_grid_and_marks_snapshot_exact_prefix_states(executor: ModelExecutor) -> None:
    rng = random.Random(2)
    prompt = tuple(rng.randrange(512) for _ in range(100))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    _, snapshots = _run(
        _engine(executor, grid=32), Request("p", prompt, params, snapshots=True, checkpoint_marks=(45,))
    )
    prefix_lengths = sorted(len(s.consumed) for s in snapshots if not s.final)
    assert prefix_lengths == [32, 45, 64, 96]
    for snapshot in snapshots:
        if snapshot.final:
            continue
        n = len(snapshot.consumed)
        assert snapshot.consumed == prompt[:n]
        tail = (*prompt, 7, 8, 9)
        cold, _ = _run(_engine(executor), Request("cold", tail, params))
        warm, _ = _run(_engine(executor), Request("warm", tail, params, resume=ResumePoint(n, snapshot.state)))
        assert warm == cold, n


class CountingExecutor(ModelExecutor):
    """Counts the rows every forward feeds."""

    fed: list[int]

    def forward(self, chunks: Sequence[ForwardChunk]) -> torch.Tensor:
        self.fed.extend(len(c.token_ids) for c in chunks)
        return super().forward(chunks)


def test_resume_feeds_only_the_tokens_after_the_checkpoint(executor: ModelExecutor) -> None:
    rng = random.Random(3)
    prompt = tuple(rng.randrange(512) for _ in range(64))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    _, snapshots = _run(_engine(executor, grid=48), Request("a", prompt, params, snapshots=True))
    [at48] = [s for s in snapshots if len(s.consumed) == 48 and not s.final]
    counting = CountingExecutor(executor.model, num_slots=8, num_blocks=128, block_size=BLOCK)
    counting.fed = []
    engine = _engine(counting)
    _run(engine, Request("b", prompt, params, resume=ResumePoint(48, at48.state)))
    assert sum(counting.fed) == (64 - 48) + 2  # the rest of the prompt, then two decode rows
    assert engine._runner.ledger.is_empty  # type: ignore[attr-defined]


def test_a_mark_at_the_prompt_end_snapshots_the_whole_prompt_once(executor: ModelExecutor) -> None:
    """A session's prompt end is marked: its state is taken (not as a decode checkpoint) and resumes a
    longer prompt exactly."""
    rng = random.Random(3)
    prompt = tuple(rng.randrange(512) for _ in range(40))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    _, snapshots = _run(_engine(executor), Request("p", prompt, params, snapshots=True, checkpoint_marks=(40,)))
    at_end = [s for s in snapshots if not s.final and len(s.consumed) == 40]
    assert len(at_end) == 1 and not at_end[0].decode and at_end[0].consumed == prompt
    tail = (*prompt, 5, 6, 7)
    cold, _ = _run(_engine(executor), Request("cold", tail, params))
    warm, _ = _run(_engine(executor), Request("warm", tail, params, resume=ResumePoint(40, at_end[0].state)))
    assert warm == cold
