"""``ForwardChunk.verify``: a sequence's pending token plus draft tokens in one forward. Every row's
logits are the bits of the decode step that row would have been, and after ``settle_verified(slot, j)``
the state is the bits ``j`` decode steps leave: the next decode continues exactly, for every ``j``, on
every family's tiny model in fp32 and bf16, next to plain decode rows, a prefill and other verify chunks
of other lengths, in any order the caller gives them and at another thread count.

Bitwise, because a verify row takes the decode row's computation: attention's decode kernel (one-row
sequences), the recurrence and short conv stepped a token at a time by the decode kernels, and the
products' one-order C product for decode rows (the LM head's included: it reads the rows decode-first,
whatever the caller's order). The reference is plain decoding, one token a forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.families.family import FamilyModel
from metrale.worker.model.interface import ForwardChunk, SequenceState
from metrale.worker.model.loader import load_model

BLOCK = 16
BLOCKS_PER_SEQUENCE = 8
DRAFT = [7, 9, 11, 13, 15]
OTHER_DRAFT = [21, 22, 23]
ORDERS = {1: (0, 1, 2, 3), 2: (3, 1, 0, 2), 5: (2, 3, 1, 0)}
"""Per kept count, the caller's order of the step's chunks (decode row, verify chunk, shorter verify
chunk, prefill): decode rows first as the scheduler plans them, or a prefill before them."""


def _executor(model: FamilyModel) -> ModelExecutor:
    return ModelExecutor(model, num_slots=4, num_blocks=4 * BLOCKS_PER_SEQUENCE, block_size=BLOCK)


def _blocks(slot: int) -> list[int]:
    return list(range(slot * BLOCKS_PER_SEQUENCE, (slot + 1) * BLOCKS_PER_SEQUENCE))


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(3, 500, (37,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request: pytest.FixtureRequest, family_model_dir: Path) -> FamilyModel:
    return load_model(family_model_dir, dtype=request.param)


def _decoded(
    model: FamilyModel, prompt: list[int], tokens: list[int]
) -> tuple[list[torch.Tensor], list[SequenceState]]:
    """Logits of each decode step of ``tokens`` after ``prompt``, and the state after each step."""
    executor = _executor(model)
    executor.forward([ForwardChunk(0, _blocks(0), 0, prompt)])
    logits, states = [], []
    for i, token in enumerate(tokens):
        logits.append(executor.forward([ForwardChunk(0, _blocks(0), len(prompt) + i, [token])])[0])
        states.append(executor.export_state(0, _blocks(0), len(prompt) + i + 1))
    return logits, states


def test_verify_then_settle_is_bitwise_decoding_the_kept_tokens(model: FamilyModel, prompt: list[int]) -> None:
    expected_logits, expected_states = _decoded(model, prompt, DRAFT)
    for kept, order in ORDERS.items():
        _check_kept(model, prompt, kept, order, expected_logits, expected_states)


def _check_kept(
    model: FamilyModel,
    prompt: list[int],
    kept: int,
    order: tuple[int, ...],
    expected_logits: list[torch.Tensor],
    expected_states: list[SequenceState],
) -> None:
    n = len(prompt)
    executor = _executor(model)
    executor.forward([ForwardChunk(1, _blocks(1), 0, prompt)])
    executor.forward([ForwardChunk(2, _blocks(2), 0, prompt[:20])])
    executor.forward([ForwardChunk(3, _blocks(3), 0, prompt[:30])])
    chunks = [
        ForwardChunk(2, _blocks(2), 20, [5]),  # a plain decode row
        ForwardChunk(1, _blocks(1), n, DRAFT, verify=True),
        ForwardChunk(3, _blocks(3), 30, OTHER_DRAFT, verify=True),  # a shorter verify chunk
        # A fresh prefill, long enough that a tensor of one value a row (Qwen's MoE shared gate) reaches
        # torch's vectorised loops: 1 + 5 + 3 + 74 rows.
        ForwardChunk(0, _blocks(0), 0, prompt * 2),
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if kept == 5 else threads)  # the decode steps ran on the default count
    try:
        logits = executor.forward([chunks[i] for i in order])
    finally:
        torch.set_num_threads(threads)
    assert logits.shape[0] == 1 + len(DRAFT) + len(OTHER_DRAFT) + 1
    first = sum(1 if i != 1 and not chunks[i].verify else len(chunks[i].token_ids) for i in order[: order.index(1)])
    verified = logits[first : first + len(DRAFT)]
    for row, expected in enumerate(expected_logits):
        assert torch.equal(verified[row], expected), (kept, row, (verified[row] - expected).abs().max().item())
    executor.settle_verified(1, kept)
    executor.settle_verified(3, 1)
    state = executor.export_state(1, _blocks(1), n + kept)
    for name, expected in expected_states[kept - 1].items():
        assert torch.equal(state[name], expected), (kept, name)
    if kept < len(DRAFT):  # the next token decodes as it would have after `kept` decode steps
        following = executor.forward([ForwardChunk(1, _blocks(1), n + kept, [DRAFT[kept]])])[0]
        assert torch.equal(following, expected_logits[kept])


def test_a_forward_before_every_verified_slot_is_settled_is_refused(tiny_model_dir: Path, prompt: list[int]) -> None:
    executor = _executor(load_model(tiny_model_dir))
    executor.forward([ForwardChunk(0, _blocks(0), 0, prompt)])
    executor.forward([ForwardChunk(0, _blocks(0), len(prompt), DRAFT, verify=True)])
    with pytest.raises(RuntimeError, match="never settled"):
        executor.forward([ForwardChunk(0, _blocks(0), len(prompt) + 1, [DRAFT[1]])])
    with pytest.raises(ValueError, match="rows kept"):
        executor.settle_verified(0, len(DRAFT) + 1)
    executor.settle_verified(0, 2)
    with pytest.raises(RuntimeError, match="no verify chunk"):
        executor.settle_verified(0, 2)
