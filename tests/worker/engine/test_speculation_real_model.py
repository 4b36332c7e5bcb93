"""Speculative decoding on every family's tiny model (Kimi Linear, Qwen3.5, Qwen3.5 MoE, Qwen3-Next), in
fp32 and bf16: random schedules (arrivals, chunked prefill under small token budgets, too few blocks:
swap-outs and restarts) with speculation on give every choice the tokens and the logprobs, bit for bit,
that plain decoding gives in the same schedule — greedy and seeded, ``n = 2``, stop tokens — with drafts
that are the plain run's own continuation with a share of wrong tokens, and with the n-gram method on
prompts that repeat. (A verify row computes as the decode row it stands for: test_verify_forward.py.)
Every slot, block and swap byte comes back and the state ledger ends empty (no position fed twice, no
unsettled slot)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from metrale.worker.engine.draft_length import FullDraftLengths
from metrale.worker.engine.draft_model import DraftModelDrafter
from metrale.worker.engine.engine import Engine
from metrale.worker.engine.request import Completion, Request
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.engine.speculation import Drafter, SpeculativeConfig
from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.families.family import FamilyModel
from metrale.worker.model.loader import load_model
from metrale.worker.scheduler.config import SchedulerConfig
from metrale.worker.scheduler.sequence import SequenceId
from tests.worker.engine.test_engine_real_model import BLOCK
from tests.worker.engine.test_speculation import OracleDrafter

SLOTS = 4
STOP = 7


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request: pytest.FixtureRequest, family_model_dir: Path) -> FamilyModel:
    return load_model(family_model_dir, dtype=request.param)


def _engine(model: FamilyModel, budget: int, blocks: int, swap_bytes: int, drafter: Drafter | None) -> Engine:
    config = SchedulerConfig(
        max_batch_tokens=budget,
        max_seqs=SLOTS,
        num_slots=SLOTS,
        num_blocks=blocks,
        block_size=BLOCK,
        swap_space_bytes=swap_bytes,
        max_model_len=blocks * BLOCK,
    )
    executor = ModelExecutor(model, num_slots=SLOTS, num_blocks=blocks, block_size=BLOCK)
    # Every decoding choice verifies its whole draft (no adaptive back-off): the most verify steps to check.
    lengths = FullDraftLengths() if drafter is not None else None
    return Engine(executor, config, seed=0, drafter=drafter, draft_lengths=lengths)


def _requests(count: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        phrase = [rng.randrange(3, 512) for _ in range(rng.randint(2, 6))]
        prompt = tuple((phrase * 12)[: rng.randint(20, 40)])  # repeats: the n-gram method finds matches
        params = SamplingParams(
            max_tokens=rng.randint(5, 10),
            temperature=0.0 if i % 2 else 0.9,
            seed=100 + i,
            n=2 if i % 3 == 0 else 1,
            stop_token_ids=(STOP,) if i % 4 == 1 else (),
            ignore_eos=True,
            logprobs=2,
            repetition_penalty=1.2 if i % 5 == 2 else 1.0,
        )
        requests.append(Request(f"q{i}", prompt, params))
    return requests


def _choices(engine: Engine, requests: list[Request], arrivals: Sequence[int]) -> dict[SequenceId, Completion]:
    """Every choice's completion (``_run_arrivals`` merges a request's choices)."""
    got: dict[SequenceId, Completion] = {}
    pending = sorted(zip(arrivals, range(len(requests)), strict=True))
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            engine.add_request(requests[pending.pop(0)[1]])
        for output in engine.step() if engine.has_unfinished() else []:
            got.setdefault(SequenceId(output.request_id, output.choice), Completion()).extend(output)
        step += 1
        assert step < 5_000
    return got


def _assert_same(plain: dict[SequenceId, Completion], speculative: dict[SequenceId, Completion]) -> None:
    assert plain.keys() == speculative.keys()
    for seq_id, expected in plain.items():
        got = speculative[seq_id]
        assert got.token_ids == expected.token_ids, seq_id
        assert got.finish_reason == expected.finish_reason, seq_id
        assert got.logprobs == expected.logprobs, seq_id  # bitwise: a verify row is the decode row it replaces
        assert got.top_logprobs == expected.top_logprobs, seq_id


def _check_engine_clean(engine: Engine, blocks: int) -> None:
    stats = engine.stats()
    assert (stats.free_slots, stats.free_blocks, stats.swap_bytes_used) == (SLOTS, blocks, 0)
    assert engine._runner.ledger.is_empty


schedules = st.tuples(
    st.integers(3, 6),  # requests
    st.sampled_from([9, 16, 40]),  # token budget
    st.sampled_from([5, 40]),  # blocks: 5 forces preemption
    st.sampled_from([0, 10**8]),  # swap space
    st.sampled_from([0.0, 0.4, 1.0]),  # share of wrong draft tokens
)


def test_random_schedules_with_speculation_equal_plain_decoding(model: FamilyModel) -> None:
    preempted = {"count": 0}

    # Preemption (five blocks are too few for four sequences), with and without swap space.
    @example((4, 16, 5, 0, 0.4))
    @example((4, 16, 5, 10**8, 0.0))
    @settings(phases=[Phase.explicit], deadline=None)  # the examples alone: CI time
    @given(schedules)
    def check(schedule: tuple[int, int, int, int, float]) -> None:
        count, budget, blocks, swap_bytes, wrong_share = schedule
        requests = _requests(count, seed=count * budget + blocks)
        arrivals = [i // 2 for i in range(count)]
        plain_engine = _engine(model, budget, blocks, swap_bytes, None)
        plain = _choices(plain_engine, requests, arrivals)
        continuations = {seq_id: completion.token_ids for seq_id, completion in plain.items()}
        engine = _engine(model, budget, blocks, swap_bytes, OracleDrafter(continuations, wrong_share, k=4))
        _assert_same(plain, _choices(engine, requests, arrivals))
        _check_engine_clean(engine, blocks)
        stats = engine.stats()
        preempted["count"] += stats.swap_outs + stats.restarts

    check()
    assert preempted["count"] > 0


def test_ngram_speculation_equals_plain_decoding_and_verifies_drafts(model: FamilyModel) -> None:
    """Prompts ``P + C + P`` where ``C`` is the plain continuation of ``P``: the n-gram method drafts from
    any earlier occurrence of the output's last tokens (in the prompt or in 24 tokens of output). On these
    random tiny models the target rejects most of those drafts (the oracle drafts above are the ones it
    accepts); every output and logprob is still plain decoding's."""
    base = [Request(r.request_id, r.prompt_ids, replace(r.params, max_tokens=24)) for r in _requests(3, seed=11)]
    first = _choices(_engine(model, 64, 40, 0, None), base, [0] * len(base))
    requests = [
        Request(r.request_id, (*r.prompt_ids, *first[SequenceId(r.request_id, 0)].token_ids, *r.prompt_ids), r.params)
        for r in base
    ]
    plain = _choices(_engine(model, 64, 40, 0, None), requests, [0, 0, 1])
    engine = _engine(model, 64, 40, 0, SpeculativeConfig("ngram", 4, 4, 1).drafter())
    _assert_same(plain, _choices(engine, requests, [0, 0, 1]))
    _check_engine_clean(engine, 40)
    assert engine.speculation_stats().drafts > 0, "the n-gram method proposed no draft"


@pytest.mark.parametrize("draft", ["itself", "another"])
def test_draft_model_speculation_equals_plain_decoding(model: FamilyModel, draft: str, family_model_dir: Path) -> None:
    """The ``draft_model`` method under preemption by swap (five blocks for four sequences), drafted by the
    target model itself in its own pools (a greedy choice's drafts are what the target draws, but for near
    ties between the draft's chunked and decode-row bits) or by another model (the target's with its
    weights perturbed: most drafts rejected, so the draft state goes back to an accepted prefix every
    step). The tokens are plain decoding's; the logprobs too, to the last place of a prefill's.

    Why not every logprob bit for bit: speculation changes which prompts are prefilled in which step, and
    on an AVX2 CPU a prompt's last logits prefilled beside another prompt differ from those prefilled
    alone in the last place (1.4e-6 measured on the Kimi tiny model); a decode or verify row never does
    (``test_verify_forward.py``). Swap keeps a preempted sequence's exact state; a restart (recompute by
    prefill) would move its later logprobs by as much, so the schedule preempts by swap."""
    draft_model = model if draft == "itself" else _perturbed(model, family_model_dir)
    # Two prompts of two blocks each that need a third as they decode: five blocks are too few, so one is
    # swapped out. Every prompt is prefilled in one chunk (a budget of 256), so its bits do not depend on the step it
    # lands in, which speculation changes.
    requests = [
        Request(r.request_id, r.prompt_ids[:length], replace(r.params, max_tokens=12))
        for r, length in zip(_requests(4, seed=5), (28, 29, 10, 20), strict=True)
    ]
    arrivals = [0, 0, 1, 1]
    plain_engine = _engine(model, 256, 5, 10**8, None)
    plain = _choices(plain_engine, requests, arrivals)
    pools = ModelExecutor(draft_model, num_slots=3, num_blocks=12, block_size=BLOCK)
    drafter = DraftModelDrafter(pools, num_speculative_tokens=4, vocab_size=model.config.vocab_size, max_len=512)
    engine = _engine(model, 256, 5, 10**8, drafter)
    _assert_same(plain, _choices(engine, requests, arrivals))
    _check_engine_clean(engine, 5)
    assert plain_engine.stats().swap_outs > 0 and engine.stats().swap_outs > 0
    stats = engine.speculation_stats()
    greedy = sum(len(c.token_ids) for s, c in plain.items() if requests[int(s.request_id[1:])].params.temperature == 0)
    assert stats.drafts > 0
    if draft == "itself":  # the greedy choices' drafts at least are accepted (but near ties)
        assert stats.accepted_tokens >= greedy // 2, (stats, greedy)
    assert not drafter._sequences, "every request's draft slot was given back"


def _perturbed(model: FamilyModel, directory: Path) -> FamilyModel:
    """Another copy of ``model`` (from ``directory``) with noise of half each weight's spread added."""
    other = load_model(directory, dtype=model.weight_dtype)
    generator = torch.Generator().manual_seed(3)
    for _, parameter in other.named_parameters():
        noise = torch.randn(parameter.shape, generator=generator) * parameter.float().std().nan_to_num() * 0.5
        parameter.data.add_(noise.to(parameter.dtype))
    return other
