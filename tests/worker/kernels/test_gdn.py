"""The Gated DeltaNet torch references: the naive recurrence against transformers 5.23, the chunked varlen
prefill and the pooled decode step against the naive recurrence."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from metrale.worker.kernels.gdn.chunked import gdn_chunked_prefill
from metrale.worker.kernels.gdn.decode import gdn_decode
from metrale.worker.kernels.gdn.naive import gdn_recurrent
from tests.worker.kernels.gdn_inputs import SHAPES, GdnInputs, GdnShape, Schedule

POOL = 8
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
SHAPE_PARAMS = [pytest.param(shape, id=shape.id) for shape in SHAPES]


def _prefill(shape: GdnShape, inputs: GdnInputs, schedule: Schedule, pool: torch.Tensor, chunk: int) -> torch.Tensor:
    cu_seqlens, slots, carried = schedule.arguments()
    return gdn_chunked_prefill(*inputs.as_tuple(), cu_seqlens, pool, slots, carried, shape.scale, chunk_size=chunk)


def _batched(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.unsqueeze(0)


@pytest.mark.parametrize("shape", SHAPE_PARAMS)
@pytest.mark.parametrize("carried", [False, True], ids=["fresh", "carried"])
def test_recurrent_matches_transformers_recurrent(shape: GdnShape, carried: bool) -> None:
    inputs = GdnInputs.random(shape, 37, seed=1)
    initial = shape.states(1, seed=2)[0] if carried else None

    expected_o, expected_state = torch_recurrent_gated_delta_rule(
        *(x.unsqueeze(0) for x in inputs.as_tuple()), initial_state=_batched(initial), output_final_state=True
    )
    o, state = gdn_recurrent(*inputs.as_tuple(), initial, shape.scale)

    torch.testing.assert_close(o, expected_o[0], **TOLERANCE)
    torch.testing.assert_close(state, expected_state[0], **TOLERANCE)


@pytest.mark.parametrize("shape", SHAPE_PARAMS)
@pytest.mark.parametrize("length", [7, 64, 65], ids=lambda n: f"len{n}")
def test_chunked_prefill_matches_transformers_chunked(shape: GdnShape, length: int) -> None:
    inputs = GdnInputs.random(shape, length, seed=3)
    initial = shape.states(1, seed=4)
    pool = shape.pool(POOL)
    pool[5] = initial[0]

    expected_o, expected_state = torch_chunk_gated_delta_rule(
        *(x.unsqueeze(0) for x in inputs.as_tuple()), chunk_size=16, initial_state=initial, output_final_state=True
    )
    o = _prefill(shape, inputs, Schedule([length], [5], [True]), pool, chunk=16)

    torch.testing.assert_close(o, expected_o[0], **TOLERANCE)
    torch.testing.assert_close(pool[5], expected_state[0], **TOLERANCE)


@pytest.mark.parametrize("shape", SHAPE_PARAMS)
@pytest.mark.parametrize("carried", [False, True], ids=["fresh", "carried"])
@pytest.mark.parametrize("chunk", [4, 16, 32], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("length", [1, 15, 16, 17, 33], ids=lambda n: f"len{n}")
def test_chunked_prefill_matches_recurrent_across_chunk_boundaries(
    shape: GdnShape, length: int, chunk: int, carried: bool
) -> None:
    inputs = GdnInputs.random(shape, length, seed=length)
    initial = shape.states(1, seed=5)[0]
    pool = shape.pool(POOL)
    pool[2] = initial

    o = _prefill(shape, inputs, Schedule([length], [2], [carried]), pool, chunk)

    expected_o, expected_state = gdn_recurrent(*inputs.as_tuple(), initial if carried else None, shape.scale)
    torch.testing.assert_close(o, expected_o, **TOLERANCE)
    torch.testing.assert_close(pool[2], expected_state, **TOLERANCE)


@pytest.mark.parametrize("shape", SHAPE_PARAMS)
@pytest.mark.parametrize("chunk", [4, 16], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("seed", [0, 1, 2], ids=lambda s: f"seed{s}")
def test_varlen_prefill_matches_each_sequence_alone_and_touches_only_its_slots(
    shape: GdnShape, seed: int, chunk: int
) -> None:
    schedule = Schedule.random(seed, sequences=5, pool_size=POOL, max_length=40)
    inputs = GdnInputs.random(shape, sum(schedule.lengths), seed=30 + seed)
    initial = shape.states(POOL, seed=31 + seed)
    pool = shape.pool(POOL)
    pool[schedule.slots] = initial[schedule.slots]

    o = _prefill(shape, inputs, schedule, pool, chunk)

    bounds = schedule.bounds()
    for s, slot in enumerate(schedule.slots):
        rows = slice(bounds[s], bounds[s + 1])
        start = initial[slot] if schedule.carried[s] else None
        expected_o, expected_state = gdn_recurrent(*inputs.rows(rows).as_tuple(), start, shape.scale)
        torch.testing.assert_close(o[rows], expected_o, **TOLERANCE)
        torch.testing.assert_close(pool[slot], expected_state, **TOLERANCE)
    untouched = [i for i in range(POOL) if i not in schedule.slots]
    assert torch.equal(pool[untouched], shape.pool(POOL)[untouched])


def test_fresh_sequence_over_poisoned_slot_equals_zero_state() -> None:
    shape = SHAPES[1]
    inputs = GdnInputs.random(shape, 20, seed=6)
    poisoned, zeroed = shape.pool(POOL), shape.pool(POOL, fill=0.0)

    o_poisoned = _prefill(shape, inputs, Schedule([20], [1], [False]), poisoned, chunk=16)
    o_zeroed = _prefill(shape, inputs, Schedule([20], [1], [True]), zeroed, chunk=16)

    assert torch.equal(o_poisoned, o_zeroed)
    assert torch.equal(poisoned[1], zeroed[1])


@pytest.mark.parametrize("shape", SHAPE_PARAMS)
@pytest.mark.parametrize("slots", [[5, 2, 0], [3, 1, 2], [1, 2, 3]], ids=["scattered", "shuffled-run", "run"])
def test_decode_steps_match_recurrent_and_touch_only_their_slots(shape: GdnShape, slots: list[int]) -> None:
    prompt = Schedule(lengths=[3, 9, 1], slots=slots, carried=[False] * 3)
    prompts = GdnInputs.random(shape, sum(prompt.lengths), seed=7)
    steps = [GdnInputs.random(shape, len(slots), seed=100 + i) for i in range(4)]
    pool = shape.pool(POOL)

    _prefill(shape, prompts, prompt, pool, chunk=4)
    decoded = [gdn_decode(*step.as_tuple(), pool, torch.tensor(slots), shape.scale) for step in steps]

    untouched = [i for i in range(POOL) if i not in slots]
    assert torch.equal(pool[untouched], shape.pool(POOL)[untouched])
    bounds = prompt.bounds()
    for b, slot in enumerate(slots):
        own_prompt = prompts.rows(slice(bounds[b], bounds[b + 1]))
        sequence = GdnInputs.concat([own_prompt, *(step.rows(slice(b, b + 1)) for step in steps)])
        expected_o, expected_state = gdn_recurrent(*sequence.as_tuple(), None, shape.scale)
        torch.testing.assert_close(torch.stack([o[b] for o in decoded]), expected_o[-len(steps) :], **TOLERANCE)
        torch.testing.assert_close(pool[slot], expected_state, **TOLERANCE)


def test_low_precision_inputs_give_fp32_outputs_and_state() -> None:
    shape = SHAPES[1]
    inputs = GdnInputs(*(x.bfloat16() for x in GdnInputs.random(shape, 9, seed=8).as_tuple()))
    pool = shape.pool(POOL, fill=0.0)

    o = _prefill(shape, inputs, Schedule([9], [0], [False]), pool, chunk=4)
    o_step = gdn_decode(*inputs.rows(slice(0, 1)).as_tuple(), pool, torch.tensor([0]), shape.scale)
    o_naive, state = gdn_recurrent(*inputs.as_tuple(), None, shape.scale)

    assert {o.dtype, o_step.dtype, o_naive.dtype, pool.dtype, state.dtype} == {torch.float32}


def test_a_token_that_forgets_everything_stays_finite_and_restarts_the_state() -> None:
    """A decay of -1000 (exp underflows to 0) inside a chunk: no inf or NaN, and what follows it equals
    a fresh start from that token (to 1e-4: past it the chunk's cumulative log-decays are ~1000, where
    an fp32 ulp is 6e-5, and the pairwise decays of the later tokens carry that error)."""
    shape = SHAPES[0]
    inputs = GdnInputs.random(shape, 24, seed=9)
    inputs.g[10] = -1000.0
    pool = shape.pool(POOL)
    pool[0] = shape.states(1, seed=10)[0]

    o = _prefill(shape, inputs, Schedule([24], [0], [True]), pool, chunk=16)

    assert torch.isfinite(o).all()
    tail = inputs.rows(slice(10, 24))
    forgetful = GdnInputs(tail.q, tail.k, tail.v, torch.cat([torch.zeros_like(tail.g[:1]), tail.g[1:]]), tail.beta)
    expected_o, expected_state = gdn_recurrent(*forgetful.as_tuple(), None, shape.scale)
    torch.testing.assert_close(o[10:], expected_o, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool[0], expected_state, rtol=1e-4, atol=1e-4)


def test_value_heads_that_do_not_share_key_heads_evenly_are_refused() -> None:
    inputs = GdnInputs.random(GdnShape(key_heads=2, value_heads=3, key_dim=8, value_dim=8), 2, seed=11)
    with pytest.raises(ValueError, match="multiple of key heads"):
        gdn_recurrent(*inputs.as_tuple(), None, 1.0)
