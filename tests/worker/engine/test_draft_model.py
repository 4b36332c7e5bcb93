"""The ``draft_model`` method's drafter: its drafts are the draft model's greedy continuation of each
choice's context, whatever the target accepted before (its state goes back to the accepted prefix),
however many choices share its pools (a choice whose slot was taken back starts over), and the model
is refused when its tokenizer is not the target's. The engine-level proof that outputs do not change
is in ``test_speculation_real_model.py``."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from metrale.text.tokenizer import Tokenizer
from metrale.worker.engine.draft_length import CPU_STEP_COST, DraftLengths
from metrale.worker.engine.draft_model import (
    DraftModelDrafter,
    DraftTokenizerError,
    load_drafter,
    relative_step_cost,
)
from metrale.worker.engine.engine import Engine
from metrale.worker.engine.factory import EngineLimits, build_engine
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.engine.speculation import SpeculativeConfig
from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.families.family import FamilyModel
from metrale.worker.model.interface import ForwardChunk
from metrale.worker.model.loader import load_model
from metrale.worker.scheduler.config import SchedulerConfig
from metrale.worker.scheduler.sequence import SequenceId

BLOCK = 16
K = 4
NEAR_TIE = 1e-4
"""Top-2 logit margins below this are near ties (fp32 logits of size ~1 differ in the last place: ~1e-7)."""


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> FamilyModel:
    return load_model(tiny_model_dir, dtype="float32")


def _reference_draft(model: FamilyModel, context: list[int], count: int) -> list[tuple[int, float]]:
    """The plain twin: a fresh state fed the whole context in one chunk, then ``count - 1`` greedy decode
    steps; each draft token with its top-2 logit margin (a near tie may fall either way between the twin's
    one chunk and the drafter's feeds, whose bits differ in the last place)."""
    executor = ModelExecutor(model, num_slots=1, num_blocks=8, block_size=BLOCK)
    blocks = list(range(8))
    drafts: list[tuple[int, float]] = []

    def greedy(logits: torch.Tensor) -> tuple[int, float]:
        top = logits.topk(2)
        return int(top.indices[0]), float(top.values[0] - top.values[1])

    drafts.append(greedy(executor.forward([ForwardChunk(0, blocks, 0, context)])[-1]))
    for position in range(len(context), len(context) + count - 1):
        drafts.append(greedy(executor.forward([ForwardChunk(0, blocks, position, [drafts[-1][0]])])[-1]))
    return drafts


def _compared(drafts: tuple[int, ...], reference: list[tuple[int, float]]) -> int:
    """How many leading draft tokens equal the twin's before its first near tie; -1 at a token that differs."""
    for compared, (token, (expected, margin)) in enumerate(zip(drafts, reference, strict=True)):
        if margin < NEAR_TIE:
            return compared  # the rest follows a token either side of the tie may have taken
        if token != expected:
            return -1
    return len(drafts)


def test_drafts_are_the_greedy_continuation_after_any_accepted_prefix(model: FamilyModel) -> None:
    """Three choices drafted in turn on pools for two (the least recently drafted is taken back and
    starts over), each step accepting a random number of the draft tokens and then a token of its own,
    as the target does; one request is forgotten midway and comes back. Every draft equals the plain
    twin's on the same context."""
    rng = random.Random(3)
    drafter = DraftModelDrafter(
        ModelExecutor(model, num_slots=3, num_blocks=10, block_size=BLOCK), K, model.config.vocab_size, 100
    )
    contexts = {SequenceId(f"r{i}", 0): [rng.randrange(3, 500) for _ in range(5 + 7 * i)] for i in range(3)}
    order = list(contexts)
    checked = 0
    for step in range(18):
        seq_id = order[step % 3 if step % 4 else 0]
        context = contexts[seq_id]
        at_most = rng.randint(1, K + 1)
        drafts = drafter.propose(seq_id, context[:3], context[3:], at_most)
        compared = _compared(tuple(drafts), _reference_draft(model, context, min(K, at_most)))
        assert compared >= 0, (step, seq_id, drafts)
        checked += compared
        accepted = rng.randint(0, len(drafts))
        context += [*drafts[:accepted], rng.randrange(3, 500)]
        if step == 9:
            drafter.forget("r1")
    assert checked >= 40, f"only {checked} draft tokens compared: near ties everywhere?"
    assert drafter.propose(SequenceId("long", 0), [5] * 98, [], 4) == (), "past max_len nothing is drafted"


def test_the_pools_are_given_back(model: FamilyModel) -> None:
    executor = ModelExecutor(model, num_slots=3, num_blocks=6, block_size=BLOCK)
    drafter = DraftModelDrafter(executor, K, model.config.vocab_size, 1000)
    assert len(drafter.propose(SequenceId("a", 0), [7] * 40, [], K)) == K  # three blocks
    assert len(drafter.propose(SequenceId("a", 1), [8] * 40, [], K)) == K  # three more: the pool is full
    assert len(drafter.propose(SequenceId("b", 0), [9] * 40, [], K)) == K  # takes back "a" choice 0's
    assert drafter.propose(SequenceId("c", 0), [9] * 100, [], K) == (), "more than the whole pool"
    drafter.forget("a")
    drafter.forget("b")
    assert drafter._sequences == {} and sorted(drafter._free_blocks) == list(range(6))
    assert sorted(drafter._free_slots) == [0, 1]


def test_a_draft_model_with_another_tokenizer_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    tokenizer_file = other / "tokenizer.json"
    data = json.loads(tokenizer_file.read_text())
    vocab = data["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    tokenizer_file.write_text(json.dumps(data))
    target = Tokenizer.from_dir(tiny_model_dir)
    with pytest.raises(DraftTokenizerError, match="another tokenizer than the target's: 2 tokens differ"):
        load_drafter(
            other,
            num_speculative_tokens=K,
            target_tokenizer=target,
            target_vocab_size=target.vocab_size,
            max_seqs=2,
            num_blocks=8,
            block_size=BLOCK,
            max_model_len=128,
        )


def test_an_engine_drafting_with_its_own_model_accepts_its_greedy_drafts(model: FamilyModel) -> None:
    """The drafter in an engine whose drafts cost nothing (``DraftLengths()``, prompt lookup's costs): drafting
    with the target itself, greedy requests accept nearly every draft token and give plain decoding's tokens."""
    prompts = [tuple(range(10 + i, 40 + 3 * i)) for i in range(3)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = {}
    for speculating in (False, True):
        executor = ModelExecutor(model, num_slots=4, num_blocks=32, block_size=BLOCK)
        config = SchedulerConfig(
            max_batch_tokens=256, max_seqs=4, num_slots=4, num_blocks=32, block_size=BLOCK, max_model_len=128
        )
        drafter = DraftModelDrafter(
            ModelExecutor(model, num_slots=5, num_blocks=36, block_size=BLOCK), K, model.config.vocab_size, 128
        )
        engine = Engine(executor, config, seed=0, drafter=drafter if speculating else None)
        outputs[speculating] = [[c.token_ids for c in r.completions] for r in engine.generate(prompts, params)]
        stats = engine.speculation_stats()
    assert outputs[True] == outputs[False]
    assert stats.draft_tokens > 0 and stats.acceptance_rate > 0.9, stats


def test_a_draft_token_s_cost_is_the_draft_model_s_step_against_the_target_s(model: FamilyModel) -> None:
    """``relative_step_cost`` times one decode step of each model: the same model against itself costs about
    one step (a generous bound: the machine is shared)."""
    draft, target = (ModelExecutor(model, num_slots=2, num_blocks=4, block_size=BLOCK) for _ in range(2))
    assert 0.33 < relative_step_cost(draft, target) < 3.0


def test_drafts_that_cost_a_target_step_are_never_verified() -> None:
    """With a draft token's cost added to a verify row's, a draft model as dear as the target drafts
    nothing even when every token would be accepted, and a cheap one drafts its longest."""
    lone = [(SequenceId("r", 0), K)]
    dear = DraftLengths(replace(CPU_STEP_COST, verify_row=CPU_STEP_COST.verify_row + 1.0))
    cheap = DraftLengths(replace(CPU_STEP_COST, verify_row=CPU_STEP_COST.verify_row + 0.1))
    assert dear.lengths(lone) == [0] and cheap.lengths(lone) == [K]


def test_build_engine_with_a_draft_model_changes_no_token(tiny_model_dir: Path) -> None:
    """``build_engine`` with ``{"model": DIR}`` (the tiny model drafting for itself: as dear as the target, so
    its drafts are weighed at that cost): the same tokens as without speculation."""
    limits = EngineLimits(max_seqs=4, num_blocks=64)
    speculation = SpeculativeConfig.from_mapping({"model": str(tiny_model_dir), "num_speculative_tokens": K})
    prompts = [tuple(range(10 + i, 40 + 3 * i)) for i in range(3)]
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True, logprobs=1)
    outputs = []
    for config in (None, speculation):
        loaded = build_engine(tiny_model_dir, limits, seed=0, speculation=config)
        outputs.append(
            [[(c.token_ids, c.logprobs) for c in r.completions] for r in loaded.engine.generate(prompts, params)]
        )
    assert outputs[0] == outputs[1]
