"""A sequence's logits do not depend on what else is in its forwards: prefilled and decoded alone or
beside one, two or six others, or decoded alone, its logits are the same bits as beside eleven, on every
family's tiny model in the dtype its folder names (bf16 for the Qwen ones, where a rounding flipped by a
product's row count once changed a token: issue #30)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.families.family import FamilyModel
from metrale.worker.model.interface import ForwardChunk
from metrale.worker.model.loader import load_model

BLOCK = 16
SEQUENCES = 12
PROMPT = 13
"""Prompt tokens per sequence: odd, so the forwards' row counts are all sorts of numbers."""
STEPS = 12
GROUPS = ((3, 9), (0, 7, 11), (1, 2, 4, 5, 6, 8, 10))
"""The sequences split into forwards of 2, 3 and 7 (each group run on its own), against all 12 in one."""
LONE = (0, 6, 11)
"""Sequences decoded alone, one row a step (issue #30), after a prefill beside all the others."""


@pytest.fixture(scope="module")
def loaded(family_model_dir: Path) -> FamilyModel:
    return load_model(family_model_dir)


def _logits(
    model: FamilyModel, members: tuple[int, ...], decode_groups: tuple[tuple[int, ...], ...] | None = None
) -> dict[int, torch.Tensor]:
    """Each member's logits ``[1 + STEPS, vocab]`` (its prefill's, then each decode step's), the members
    prefilled in one forward, then decoded together — or, with ``decode_groups``, those groups' members
    decoded each group on its own. Every sequence is fed fixed tokens, so its inputs are the same
    whatever the batch."""
    blocks_each = -(-(PROMPT + STEPS) // BLOCK)
    executor = ModelExecutor(model, num_slots=SEQUENCES, num_blocks=SEQUENCES * blocks_each, block_size=BLOCK)
    rng = random.Random(30)
    tokens = [[rng.randrange(20, 500) for _ in range(PROMPT + STEPS)] for _ in range(SEQUENCES)]
    blocks = {s: list(range(s * blocks_each, (s + 1) * blocks_each)) for s in range(SEQUENCES)}
    prefill = executor.forward([ForwardChunk(s, blocks[s], 0, tokens[s][:PROMPT]) for s in members])
    logits = {}
    for group in decode_groups or (members,):
        steps = [prefill[[members.index(s) for s in group]]]
        for position in range(PROMPT, PROMPT + STEPS):
            chunks = [ForwardChunk(s, blocks[s], position, [tokens[s][position]]) for s in group]
            steps.append(executor.forward(chunks))
        by_step = torch.stack(steps)  # [1 + STEPS, len(group), vocab]
        logits.update({s: by_step[:, row] for row, s in enumerate(group)})
    return logits


def test_a_sequence_s_logits_are_the_same_bits_in_every_batch(loaded: FamilyModel) -> None:
    together = _logits(loaded, tuple(range(SEQUENCES)))
    differing = {}
    for group in GROUPS:
        for sequence, logits in _logits(loaded, group).items():
            steps = (logits != together[sequence]).any(dim=-1).nonzero().flatten().tolist()
            if steps:
                differing[sequence] = (len(group), steps)
    assert not differing, f"{loaded.weight_dtype}: sequence: (its forwards' size, differing steps) {differing}"


def test_a_sequence_decoded_alone_has_the_logits_of_its_batched_decode(loaded: FamilyModel) -> None:
    """Issue #30: one decode row alone (every product one row) against the same row among twelve — the
    one-order product (``kernels.products``) gives both the same bits."""
    everyone = tuple(range(SEQUENCES))
    together = _logits(loaded, everyone)
    alone = _logits(loaded, everyone, tuple((s,) for s in LONE))
    differing = {s: (alone[s] != together[s]).any(dim=-1).nonzero().flatten().tolist() for s in LONE}
    assert not any(differing.values()), f"{loaded.weight_dtype}: sequence: differing steps {differing}"


def test_a_sequence_prefilled_alone_has_the_logits_of_its_batched_prefill(loaded: FamilyModel) -> None:
    """A prompt prefilled alone — its last row the LM head's only row, a batch row that a matrix-vector
    product would sum in another order than the padded product of several — then decoded alone: the same
    bits as beside eleven (the first token's logprob of a request prefilled alone, whatever arrives beside
    it in another run: speculation moves prefills between steps)."""
    together = _logits(loaded, tuple(range(SEQUENCES)))
    differing = {}
    for sequence in LONE:
        steps = (_logits(loaded, (sequence,))[sequence] != together[sequence]).any(dim=-1).nonzero().flatten()
        if steps.numel():
            differing[sequence] = steps.tolist()
    assert not differing, f"{loaded.weight_dtype}: sequence: differing steps {differing}"
