"""Triton KDA decode and chunked prefill against their torch references, under Triton's interpreter."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from metrale.worker.kernels.kda import chunked, decode
from metrale.worker.kernels.triton import kda_chunked, kda_decode

pytestmark = pytest.mark.triton

POOL = 6
POISON = 1e30
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}

PrefillKernel = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Shape:
    heads: int
    key_dim: int
    value_dim: int

    @property
    def scale(self) -> float:
        return self.key_dim**-0.5


# Small, and neither K nor V a power of two in the second: every tile is padded and masked.
SHAPES = [
    pytest.param(Shape(heads=2, key_dim=16, value_dim=8), id="h2-k16-v8"),
    pytest.param(Shape(heads=1, key_dim=24, value_dim=72), id="h1-k24-v72-multitile"),
]


def _inputs(shape: Shape, rows: int, seed: int) -> tuple[torch.Tensor, ...]:
    """``q, k [N, H, K]``, ``v [N, H, V]``, ``g [N, H, K]`` (log-decays <= 0), ``beta [N, H]``."""
    generator = torch.Generator().manual_seed(seed)

    def normal(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, generator=generator)

    keyed = (rows, shape.heads, shape.key_dim)
    g = F.logsigmoid(2.0 * normal(*keyed) + 2.0)
    beta = torch.sigmoid(normal(rows, shape.heads))
    return normal(*keyed), normal(*keyed), normal(rows, shape.heads, shape.value_dim), g, beta


def _poisoned_pool(shape: Shape) -> torch.Tensor:
    return torch.full((POOL, shape.heads, shape.key_dim, shape.value_dim), POISON)


def _carried_states(pool: torch.Tensor, slots: list[int], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    pool[slots] = 0.5 * torch.randn(len(slots), *pool.shape[1:], generator=generator)


def _cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def _untouched(pool: torch.Tensor, slots: list[int]) -> torch.Tensor:
    return pool[[slot for slot in range(POOL) if slot not in slots]]


def _prefill(
    prefill: PrefillKernel,
    inputs: tuple[torch.Tensor, ...],
    lengths: list[int],
    pool: torch.Tensor,
    slots: list[int],
    carried: list[bool],
    chunk: int,
) -> torch.Tensor:
    scale = inputs[0].shape[-1] ** -0.5
    cu_seqlens, slot_ids, has_initial_state = _cu_seqlens(lengths), torch.tensor(slots), torch.tensor(carried)
    return prefill(*inputs, cu_seqlens, pool, slot_ids, has_initial_state, scale, chunk_size=chunk)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    ("lengths", "carried", "chunk"),
    [
        pytest.param([1], [False], 16, id="one-token-fresh-chunk16"),
        pytest.param([16], [True], 16, id="exact-chunk-carried-chunk16"),
        pytest.param([5, 40, 1, 33], [True, False, True, False], 16, id="varlen-mixed-chunk16"),
        pytest.param([33, 7], [False, True], 32, id="varlen-mixed-chunk32"),
    ],
)
def test_triton_chunked_prefill_matches_torch(
    shape: Shape, lengths: list[int], carried: list[bool], chunk: int
) -> None:
    slots = [4, 0, 3, 1][: len(lengths)]
    inputs = _inputs(shape, sum(lengths), seed=sum(lengths))
    pool = _poisoned_pool(shape)
    _carried_states(pool, [slot for slot, c in zip(slots, carried, strict=True) if c], seed=1)
    expected_pool = pool.clone()

    o = _prefill(kda_chunked.kda_chunked_prefill, inputs, lengths, pool, slots, carried, chunk)
    expected_o = _prefill(chunked.kda_chunked_prefill, inputs, lengths, expected_pool, slots, carried, chunk)

    torch.testing.assert_close(o, expected_o, **TOLERANCE)
    torch.testing.assert_close(pool, expected_pool, **TOLERANCE)
    assert torch.equal(_untouched(pool, slots), _untouched(_poisoned_pool(shape), slots))


@pytest.mark.parametrize("shape", SHAPES)
def test_triton_decode_steps_after_prefill_match_torch_and_touch_only_their_slots(shape: Shape) -> None:
    prompt_lengths, slots = [3, 9, 1], [5, 2, 0]
    prompt = _inputs(shape, sum(prompt_lengths), seed=2)
    pool = _poisoned_pool(shape)
    _prefill(chunked.kda_chunked_prefill, prompt, prompt_lengths, pool, slots, [False] * 3, chunk=4)
    expected_pool = pool.clone()

    for step in range(3):
        token = _inputs(shape, len(slots), seed=100 + step)
        o = kda_decode.kda_decode(*token, pool, torch.tensor(slots), shape.scale)
        expected_o = decode.kda_decode(*token, expected_pool, torch.tensor(slots), shape.scale)
        torch.testing.assert_close(o, expected_o, **TOLERANCE)
        torch.testing.assert_close(pool, expected_pool, **TOLERANCE)

    assert torch.equal(_untouched(pool, slots), _untouched(_poisoned_pool(shape), slots))


def test_triton_fresh_prefill_never_reads_its_poisoned_slot() -> None:
    shape = Shape(heads=2, key_dim=16, value_dim=8)
    inputs = _inputs(shape, 20, seed=3)
    poisoned, zeroed = _poisoned_pool(shape), torch.zeros(POOL, shape.heads, shape.key_dim, shape.value_dim)

    o_poisoned = _prefill(kda_chunked.kda_chunked_prefill, inputs, [20], poisoned, [1], [False], chunk=16)
    o_zeroed = _prefill(kda_chunked.kda_chunked_prefill, inputs, [20], zeroed, [1], [True], chunk=16)

    assert torch.isfinite(o_poisoned).all()
    assert torch.equal(o_poisoned, o_zeroed)
    assert torch.equal(poisoned[1], zeroed[1])


@pytest.mark.parametrize("chunk", [8, 24], ids=lambda c: f"chunk{c}")
def test_triton_chunked_prefill_rejects_chunks_tl_dot_cannot_tile(chunk: int) -> None:
    shape = Shape(heads=1, key_dim=16, value_dim=16)
    inputs = _inputs(shape, 4, seed=4)
    with pytest.raises(ValueError, match="power of two"):
        _prefill(kda_chunked.kda_chunked_prefill, inputs, [4], _poisoned_pool(shape), [0], [False], chunk)
