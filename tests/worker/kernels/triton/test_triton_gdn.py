"""Triton Gated DeltaNet decode and chunked prefill against their torch twins, under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from metrale.worker.kernels.gdn import chunked, decode
from metrale.worker.kernels.triton import gdn_chunked, gdn_decode
from tests.worker.kernels.gdn_inputs import SHAPES, GdnInputs, GdnShape, Schedule

pytestmark = pytest.mark.triton

POOL = 6
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
# Past a log-decay of -1000 the chunk's cumulative log-decays are ~1000, where an fp32 ulp is 6e-5: the
# pairwise decays exp(G_t - G_j) of the tokens after it carry that error in every chunked form.
FORGETFUL_TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}
# Neither K nor V a power of two in the last: every tile is padded and masked, V spans several tiles.
TRITON_SHAPES = [*SHAPES, GdnShape(key_heads=1, value_heads=2, key_dim=24, value_dim=72)]
SHAPE_PARAMS = [pytest.param(shape, id=shape.id) for shape in TRITON_SHAPES]


def _pooled(schedule: Schedule, pool: torch.Tensor) -> tuple[torch.Tensor, ...]:
    cu_seqlens, slots, carried = schedule.arguments()
    return cu_seqlens, pool, slots, carried


@pytest.mark.parametrize("shape", SHAPE_PARAMS)
@pytest.mark.parametrize(
    ("schedule", "chunk"),
    [
        pytest.param(Schedule([1], [2], [False]), 16, id="one-token-fresh-chunk16"),
        pytest.param(Schedule([16], [0], [True]), 16, id="exact-chunk-carried-chunk16"),
        pytest.param(Schedule([5, 40, 1, 33], [4, 0, 3, 1], [True, False, True, False]), 16, id="varlen-chunk16"),
        pytest.param(Schedule([33, 7], [5, 2], [False, True]), 32, id="varlen-chunk32"),
    ],
)
def test_triton_chunked_prefill_matches_torch(shape: GdnShape, schedule: Schedule, chunk: int) -> None:
    inputs = GdnInputs.random(shape, sum(schedule.lengths), seed=sum(schedule.lengths))
    pool = shape.pool(POOL)
    carried_slots = [slot for slot, c in zip(schedule.slots, schedule.carried, strict=True) if c]
    pool[carried_slots] = shape.states(len(carried_slots), seed=1)
    expected_pool = pool.clone()

    o = gdn_chunked.gdn_chunked_prefill(*inputs.as_tuple(), *_pooled(schedule, pool), shape.scale, chunk_size=chunk)
    expected_o = chunked.gdn_chunked_prefill(
        *inputs.as_tuple(), *_pooled(schedule, expected_pool), shape.scale, chunk_size=chunk
    )

    torch.testing.assert_close(o, expected_o, **TOLERANCE)
    torch.testing.assert_close(pool, expected_pool, **TOLERANCE)
    untouched = [i for i in range(POOL) if i not in schedule.slots]
    assert torch.equal(pool[untouched], shape.pool(POOL)[untouched])


@pytest.mark.parametrize("shape", SHAPE_PARAMS)
def test_triton_decode_steps_after_prefill_match_torch_and_touch_only_their_slots(shape: GdnShape) -> None:
    prompt = Schedule(lengths=[3, 9, 1], slots=[5, 2, 0], carried=[False] * 3)
    pool = shape.pool(POOL)
    chunked.gdn_chunked_prefill(
        *GdnInputs.random(shape, 13, seed=2).as_tuple(), *_pooled(prompt, pool), shape.scale, chunk_size=4
    )
    expected_pool = pool.clone()
    slots = torch.tensor(prompt.slots)

    for step in range(3):
        token = GdnInputs.random(shape, len(prompt.slots), seed=100 + step).as_tuple()
        o = gdn_decode.gdn_decode(*token, pool, slots, shape.scale)
        expected_o = decode.gdn_decode(*token, expected_pool, slots, shape.scale)
        torch.testing.assert_close(o, expected_o, **TOLERANCE)
        torch.testing.assert_close(pool, expected_pool, **TOLERANCE)

    untouched = [i for i in range(POOL) if i not in prompt.slots]
    assert torch.equal(pool[untouched], shape.pool(POOL)[untouched])


def test_triton_fresh_prefill_never_reads_its_poisoned_slot() -> None:
    shape = SHAPES[1]
    inputs = GdnInputs.random(shape, 20, seed=3)
    poisoned, zeroed = shape.pool(POOL), shape.pool(POOL, fill=0.0)

    fresh, carried_zero = Schedule([20], [1], [False]), Schedule([20], [1], [True])
    o_poisoned = gdn_chunked.gdn_chunked_prefill(*inputs.as_tuple(), *_pooled(fresh, poisoned), 0.3, chunk_size=16)
    o_zeroed = gdn_chunked.gdn_chunked_prefill(*inputs.as_tuple(), *_pooled(carried_zero, zeroed), 0.3, chunk_size=16)

    assert torch.isfinite(o_poisoned).all()
    assert torch.equal(o_poisoned, o_zeroed)
    assert torch.equal(poisoned[1], zeroed[1])


def test_triton_chunked_prefill_of_a_token_that_forgets_everything_stays_finite() -> None:
    shape = SHAPES[0]
    inputs = GdnInputs.random(shape, 20, seed=4)
    inputs.g[6] = -1000.0
    schedule = Schedule([20], [0], [True])
    pool = shape.pool(POOL, fill=0.5)
    expected_pool = pool.clone()

    o = gdn_chunked.gdn_chunked_prefill(*inputs.as_tuple(), *_pooled(schedule, pool), shape.scale, chunk_size=16)
    expected_o = chunked.gdn_chunked_prefill(
        *inputs.as_tuple(), *_pooled(schedule, expected_pool), shape.scale, chunk_size=16
    )

    assert torch.isfinite(o).all()
    torch.testing.assert_close(o, expected_o, **FORGETFUL_TOLERANCE)
    torch.testing.assert_close(pool, expected_pool, **FORGETFUL_TOLERANCE)


@pytest.mark.parametrize("chunk", [8, 24], ids=lambda c: f"chunk{c}")
def test_triton_gdn_prefill_rejects_chunks_tl_dot_cannot_tile(chunk: int) -> None:
    shape = SHAPES[0]
    inputs = GdnInputs.random(shape, 4, seed=5)
    with pytest.raises(ValueError, match="power of two"):
        gdn_chunked.gdn_chunked_prefill(
            *inputs.as_tuple(), *_pooled(Schedule([4], [0], [False]), shape.pool(POOL)), 1.0, chunk_size=chunk
        )
