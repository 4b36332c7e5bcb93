"""A request continued on another engine produces exactly the tokens of an undisturbed run: from its
emitted tokens alone, from a decode checkpoint, or from the state a suspended engine handed over."""

from __future__ import annotations

from pathlib import Path

import pytest

from metrale.worker.engine.engine import Engine
from metrale.worker.engine.request import Completion, Request, ResumePoint
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.engine.snapshots import Snapshot
from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.loader import load_model
from metrale.worker.scheduler.config import SchedulerConfig

BLOCK = 16
INTERVAL = 6
PROMPT = tuple(range(5, 5 + 21))
PARAMS = {
    "greedy": SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
    "seeded-penalized": SamplingParams(
        max_tokens=14, temperature=0.8, top_k=40, seed=77, frequency_penalty=0.8, presence_penalty=0.5, ignore_eos=True
    ),
}


@pytest.fixture(scope="module")
def executor(family_model_dir: Path) -> ModelExecutor:
    """The tiny model of each family in turn: every test here runs over every family."""
    return ModelExecutor(load_model(family_model_dir), num_slots=4, num_blocks=64, block_size=BLOCK)


def _engine(executor: ModelExecutor, interval: int | None = None) -> Engine:
    config = SchedulerConfig(
        max_batch_tokens=128, max_seqs=4, num_slots=4, num_blocks=64, block_size=BLOCK, max_model_len=512
    )
    return Engine(executor, config, seed=0, decode_checkpoint_interval=interval)


def _run(engine: Engine, request: Request) -> tuple[list[int], list[Snapshot]]:
    engine.add_request(request)
    completion = Completion()
    snapshots: list[Snapshot] = []
    while engine.has_unfinished():
        for output in engine.step():
            completion.extend(output)
        snapshots += engine.take_snapshots()
    return completion.token_ids, snapshots


@pytest.fixture(scope="module", params=sorted(PARAMS))
def undisturbed(request: pytest.FixtureRequest, executor: ModelExecutor) -> tuple[SamplingParams, list[int]]:
    params = PARAMS[request.param]
    tokens, _ = _run(_engine(executor), Request("whole", PROMPT, params))
    assert len(tokens) == params.max_tokens
    return params, tokens


@pytest.mark.parametrize("emitted", [1, 13], ids=lambda k: f"emitted-{k}")
def test_continuing_after_emitted_tokens_matches_the_undisturbed_run(
    executor: ModelExecutor, undisturbed: tuple[SamplingParams, list[int]], emitted: int
) -> None:
    params, whole = undisturbed
    request = Request("moved", PROMPT, params, generated=tuple(whole[:emitted]))

    rest, _ = _run(_engine(executor), request)

    assert rest == whole[emitted:]


def test_decode_checkpoints_are_exact_and_every_one_resumes_the_request(
    executor: ModelExecutor, undisturbed: tuple[SamplingParams, list[int]]
) -> None:
    params, whole = undisturbed
    _, snapshots = _run(_engine(executor, INTERVAL), Request("first", PROMPT, params, snapshots=True))
    decode = [s for s in snapshots if s.decode]

    assert [len(s.consumed) - len(PROMPT) for s in decode] == [0, 6, 12]
    for snapshot in decode:
        assert snapshot.consumed == (*PROMPT, *whole[: len(snapshot.consumed) - len(PROMPT)])
        emitted = len(snapshot.consumed) - len(PROMPT) + 1  # the worker died one token after the checkpoint
        resume = ResumePoint(len(snapshot.consumed), snapshot.state)
        request = Request("resumed", PROMPT, params, generated=tuple(whole[:emitted]), resume=resume)
        rest, _ = _run(_engine(executor), request)
        assert rest == whole[emitted:], f"resumed from {len(snapshot.consumed)} tokens"


@pytest.mark.parametrize("steps", [1, 8], ids=lambda n: f"after-{n}-steps")
def test_a_suspended_request_continues_elsewhere_from_its_handed_over_state(
    executor: ModelExecutor, undisturbed: tuple[SamplingParams, list[int]], steps: int
) -> None:
    params, whole = undisturbed
    first = _engine(executor)
    first.add_request(Request("moving", PROMPT, params))
    emitted = [token for _ in range(steps) for output in first.step() for token in output.token_ids]

    snapshot = first.suspend("moving")

    assert snapshot is not None and not first.has_unfinished()
    assert snapshot.consumed == (*PROMPT, *emitted[:-1])  # the newest sampled token is not consumed yet
    resume = ResumePoint(len(snapshot.consumed), snapshot.state)
    rest, _ = _run(_engine(executor), Request("moved", PROMPT, params, generated=tuple(emitted), resume=resume))
    assert emitted + rest == whole


def test_a_request_that_holds_no_state_suspends_without_a_snapshot(executor: ModelExecutor) -> None:
    engine = _engine(executor)
    engine.add_request(Request("queued", PROMPT, PARAMS["greedy"]))

    assert engine.suspend("queued") is None
    assert not engine.has_unfinished()
    assert engine.suspend("unknown") is None


@pytest.mark.parametrize(
    ("n", "generated", "max_tokens"),
    [(2, (7,), 8), (1, (7, 8, 9), 3)],
    ids=["several-choices", "nothing-left-to-generate"],
)
def test_continuations_the_engine_cannot_run_are_refused(
    executor: ModelExecutor, n: int, generated: tuple[int, ...], max_tokens: int
) -> None:
    params = SamplingParams(max_tokens=max_tokens, n=n, seed=1)
    with pytest.raises(ValueError):
        _engine(executor).add_request(Request("bad", PROMPT, params, generated=generated))
