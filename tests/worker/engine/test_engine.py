"""The engine end to end on the recording fake: random schedules, offline generate, cancellation,
limits, seeds, and the ledger stopping a plan that would corrupt a state."""

from __future__ import annotations

import functools
from collections import Counter, defaultdict
from typing import Any

import pytest
from hypothesis import example, given, target

from metrale.worker.engine.engine import Engine
from metrale.worker.engine.request import Request, RequestOutput, ResumePoint
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.engine.state_ledger import StateLedger
from metrale.worker.scheduler.config import SchedulerConfig
from metrale.worker.scheduler.scheduler import PromptTooLongError
from metrale.worker.scheduler.sequence import FinishReason, Priority, SequenceId
from tests.worker.fakes import GARBAGE, RecordingModel, isolated_run
from tests.worker.scheduler.strategies import RequestSpec, Scenario, scenarios

EOS = 30
MAX_STEPS = 400

Outputs = dict[SequenceId, list[RequestOutput]]


def make_engine(
    config: SchedulerConfig, ledger: StateLedger | None = None, seed: int = 0
) -> tuple[Engine, RecordingModel]:
    model = RecordingModel(config.num_slots, config.num_blocks, config.block_size)
    return Engine(model, config, eos_token_ids=[EOS], seed=seed, ledger=ledger), model


def params_of(spec: RequestSpec) -> SamplingParams:
    knobs: dict[str, Any] = {"temperature": 0.0 if spec.greedy else 1.0, **dict(spec.sampling)}
    return SamplingParams(
        max_tokens=spec.max_tokens,
        stop_token_ids=spec.stop_token_ids,
        ignore_eos=spec.ignore_eos,
        seed=spec.seed,
        n=spec.n,
        logprobs=1,
        grammar=spec.grammar,
        **knobs,
    )


def expected_run(spec: RequestSpec, choice: int, max_model_len: int) -> tuple[list[int], FinishReason]:
    """One choice of ``spec`` run alone from its prompt (``isolated_run``): its tokens, and why it ended."""
    tokens, reason = _isolated(spec, choice, max_model_len)
    return list(tokens), reason


@functools.cache
def _isolated(spec: RequestSpec, choice: int, max_model_len: int) -> tuple[tuple[int, ...], FinishReason]:
    stops = frozenset(spec.stop_token_ids) | (frozenset() if spec.ignore_eos else {EOS})
    params = params_of(spec)
    tokens, reason = isolated_run(spec.prompt, params, spec.seed, choice, stops, max_model_len, spec.include_stop_token)
    return tuple(tokens), reason


def arrival_of(spec: RequestSpec, max_model_len: int) -> tuple[tuple[int, ...], ResumePoint | None]:
    """The tokens ``spec`` arrives with as generated elsewhere (the start of its isolated run), and the
    checkpoint it resumes from (the exact state after that many of its prompt and those tokens)."""
    tokens, _ = expected_run(spec, 0, max_model_len)
    generated = tuple(tokens[: max(0, min(spec.continued, len(tokens) - 1))])
    known = (*spec.prompt, *generated)
    if spec.checkpoint_at is None or len(known) < 2:
        return generated, None
    length = min(spec.checkpoint_at, len(known) - 1)
    return generated, ResumePoint(length, RecordingModel.checkpoint(known[:length]))


def emitted_run(spec: RequestSpec, choice: int, max_model_len: int) -> tuple[list[int], FinishReason]:
    """What one choice of ``spec`` emits here: its isolated run less the tokens it arrives with."""
    tokens, reason = expected_run(spec, choice, max_model_len)
    return tokens[len(arrival_of(spec, max_model_len)[0]) :], reason


def drive(engine: Engine, model: RecordingModel, scenario: Scenario) -> tuple[Outputs, set[str]]:
    """Add, cancel and step as the scenario says until nothing is left; return outputs per choice."""
    outputs: Outputs = defaultdict(list)
    aborted: set[str] = set()
    for step in range(MAX_STEPS):
        for spec in scenario.requests:
            if spec.arrival_step == step:
                model.register(spec.request_id, spec.prompt)
                generated, resume = arrival_of(spec, scenario.config.max_model_len)
                request = Request(
                    spec.request_id, spec.prompt, params_of(spec), spec.priority, 0.0, spec.include_stop_token,
                    resume=resume, generated=generated,
                )  # fmt: skip
                engine.add_request(request)
            if spec.abort_step == step and engine.abort(spec.request_id):
                aborted.add(spec.request_id)
        if not engine.has_unfinished() and all(spec.arrival_step <= step for spec in scenario.requests):
            return outputs, aborted
        for output in engine.step():
            outputs[SequenceId(output.request_id, output.choice)].append(output)
    raise AssertionError(f"unfinished after {MAX_STEPS} steps: {engine.stats()}")


def check_choice(got: list[RequestOutput], expected: list[int], reason: FinishReason, aborted: bool) -> None:
    tokens = [token for output in got for token in output.token_ids]
    assert GARBAGE not in tokens
    assert all(len(o.logprobs) == len(o.token_ids) == len(o.top_logprobs) for o in got)
    finished = [output for output in got if output.finished]
    if aborted:
        assert tokens == expected[: len(tokens)]
        assert len(finished) <= 1
    else:
        assert tokens == expected
        assert finished == [got[-1]] and got[-1].finish_reason is reason


def _crowded(swap_space_bytes: int) -> Scenario:
    """Three requests that outgrow the blocks together: one is preempted (swapped out, or restarted
    without swap space)."""
    config = SchedulerConfig(
        max_batch_tokens=8, max_seqs=3, num_slots=3, num_blocks=8, block_size=1, max_model_len=8,
        swap_space_bytes=swap_space_bytes,
    )  # fmt: skip
    requests = tuple(
        RequestSpec(f"r{i}", (i, 5, 6), 5, 1, Priority.INTERACTIVE, (), False, True, True, i, 0, None) for i in range(3)
    )
    return Scenario(config, requests)


def test_random_schedules_match_isolated_runs() -> None:
    seen: Counter[str] = Counter()

    # Both kinds of preemption, whatever the search finds on its own.
    @example(_crowded(swap_space_bytes=0))
    @example(_crowded(swap_space_bytes=100_000))
    @given(scenarios())
    def check(scenario: Scenario) -> None:
        ledger = StateLedger()
        engine, model = make_engine(scenario.config, ledger)
        outputs, aborted = drive(engine, model, scenario)
        for spec in scenario.requests:
            for choice in range(spec.n):
                expected, reason = emitted_run(spec, choice, scenario.config.max_model_len)
                got = outputs.get(SequenceId(spec.request_id, choice), [])
                check_choice(got, expected, reason, spec.request_id in aborted)
        assert all(record.owner is not None for forward in model.forwards for record in forward)
        assert model.misplaced_feeds == []
        stats = engine.stats()
        assert (stats.free_slots, stats.free_blocks) == (scenario.config.num_slots, scenario.config.num_blocks)
        assert stats.swap_bytes_used == 0 and ledger.is_empty
        target(float(stats.swap_outs + stats.restarts), label="preemptions")
        seen["swap-out"] += stats.swap_outs > 0
        seen["restart"] += stats.restarts > 0

    check()
    assert seen["swap-out"] > 0 and seen["restart"] > 0, seen


SMALL = SchedulerConfig(max_batch_tokens=8, max_seqs=4, num_slots=4, num_blocks=16, block_size=4, max_model_len=16)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]]
"""Four prompts whose first tokens differ, so the fake can tell their states apart."""


def isolated(prompt: list[int], params: SamplingParams, seed: int, choice: int = 0) -> list[int]:
    stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else {EOS})
    return isolated_run(prompt, params, seed, choice, stops, SMALL.max_model_len)[0]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=6, temperature=0.0),
        SamplingParams(max_tokens=6, seed=7, n=2),
        SamplingParams(max_tokens=6, seed=3, presence_penalty=1.0, top_k=5, logprobs=2),
    ],
    ids=["greedy", "seeded-n2", "penalties-and-logprobs"],
)
def test_generate_returns_each_prompt_in_order_as_if_alone(params: SamplingParams) -> None:
    engine, _ = make_engine(SMALL)
    finished: list[str] = []
    results = engine.generate(PROMPTS, params, progress=lambda result: finished.append(result.request_id))
    assert [result.prompt_ids for result in results] == [tuple(prompt) for prompt in PROMPTS]
    assert sorted(finished) == sorted(result.request_id for result in results)
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert len(result.completions) == params.n
        for choice, completion in enumerate(result.completions):
            assert completion.token_ids == isolated(prompt, params, params.seed or 0, choice)
            assert completion.finish_reason is not None
            assert all(len(top) == (params.logprobs or 0) for top in completion.top_logprobs)


def test_generate_takes_one_params_per_prompt() -> None:
    engine, _ = make_engine(SMALL)
    params = [SamplingParams(max_tokens=k, temperature=0.0) for k in (1, 2, 3, 4)]
    results = engine.generate(PROMPTS, params)
    assert [len(result.completions[0].token_ids) for result in results] == [
        len(isolated(prompt, p, 0)) for prompt, p in zip(PROMPTS, params, strict=True)
    ]
    with pytest.raises(ValueError, match="3 sampling params for 4 prompts"):
        engine.generate(PROMPTS, params[:3])


def test_generate_withdraws_every_prompt_when_one_is_too_long() -> None:
    engine, _ = make_engine(SMALL)
    with pytest.raises(PromptTooLongError):
        engine.generate([[1, 2], list(range(17))], SamplingParams())
    assert not engine.has_unfinished()
    assert engine.stats().waiting == 0


def test_seedless_requests_are_stable_across_preemption() -> None:
    tight = SchedulerConfig(
        max_batch_tokens=4, max_seqs=4, num_slots=2, num_blocks=5, block_size=4, max_model_len=16, swap_space_bytes=200
    )
    ample = SchedulerConfig(max_batch_tokens=64, max_seqs=4, num_slots=4, num_blocks=64, block_size=4, max_model_len=16)
    params = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    runs = []
    for config in (tight, ample):
        engine, _ = make_engine(config, seed=11)
        runs.append([result.completions[0].token_ids for result in engine.generate(PROMPTS, params)])
        stats = engine.stats()
        preempted = stats.swap_outs + stats.restarts
        assert (preempted > 0) is (config is tight)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("steps_before_abort", [0, 1, 3], ids=["queued", "prefilled", "decoding"])
def test_abort_frees_slots_blocks_and_swap_at_any_moment(steps_before_abort: int) -> None:
    ledger = StateLedger()
    engine, _ = make_engine(SMALL, ledger)
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(Request(f"r{index}", tuple(prompt), SamplingParams(max_tokens=8, ignore_eos=True, n=2)))
    for _ in range(steps_before_abort):
        engine.step()
    assert all(engine.abort(f"r{index}") for index in range(len(PROMPTS)))
    assert not engine.abort("r0")
    assert not engine.has_unfinished() and engine.step() == []
    stats = engine.stats()
    assert (stats.free_slots, stats.free_blocks, stats.swap_bytes_used) == (4, 16, 0)
    assert ledger.is_empty


def test_prompt_longer_than_max_model_len_is_refused_at_add() -> None:
    engine, _ = make_engine(SMALL)
    with pytest.raises(PromptTooLongError, match="17 tokens; the limit is 16"):
        engine.add_request(Request("long", tuple(range(17))))
    assert not engine.has_unfinished()


@pytest.mark.parametrize("ignore_eos", [False, True], ids=["eos-stops", "eos-ignored"])
def test_eos_stops_unless_ignored(ignore_eos: bool) -> None:
    greedy_past_eos = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = next(p for p in ([k, 1] for k in range(30)) if EOS in isolated(p, greedy_past_eos, 0))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=ignore_eos)
    engine, _ = make_engine(SMALL)
    [result] = engine.generate([prompt], params)
    tokens = result.completions[0].token_ids
    assert tokens == isolated(prompt, params, 0)
    assert (tokens[-1] == EOS and result.completions[0].finish_reason is FinishReason.STOP) is not ignore_eos


def test_stats_count_queues_and_free_resources() -> None:
    engine, _ = make_engine(SMALL)
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(Request(f"r{index}", tuple(prompt), SamplingParams(max_tokens=4)))
    assert (engine.stats().waiting, engine.stats().running) == (4, 0)
    engine.step()
    stats = engine.stats()
    assert stats.running + stats.waiting == 4 and stats.running >= 1
    assert stats.free_slots == 4 - stats.running


def test_model_and_config_must_agree() -> None:
    model = RecordingModel(num_slots=2, num_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="slots"):
        Engine(model, SMALL)
    with pytest.raises(ValueError, match="block size"):
        Engine(RecordingModel(num_slots=4, num_blocks=16, block_size=2), SMALL)
