"""The C Gated DeltaNet kernels against their torch twins and against transformers' recurrence."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

from metrale.shared.settings import KernelBackend
from metrale.worker.kernels import ops
from metrale.worker.kernels.gdn import chunked, decode
from metrale.worker.kernels.native import gdn as native_gdn
from tests.worker.kernels.gdn_inputs import SHAPES, GdnInputs, GdnShape, Schedule

POOL = 8
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
# Qwen3.5's head sizes (fewer heads): the 64-column register blocks of the recall; and V = 72, one
# block and a tail.
NATIVE_SHAPES = [
    *SHAPES,
    GdnShape(key_heads=2, value_heads=4, key_dim=128, value_dim=128),
    GdnShape(key_heads=1, value_heads=2, key_dim=24, value_dim=72),
]
SHAPE_PARAMS = [pytest.param(shape, id=shape.id) for shape in NATIVE_SHAPES]


@pytest.fixture
def backend() -> Iterator[None]:
    previous = ops.kernel_backend()
    yield
    ops.set_kernel_backend(previous)


def _prefill(shape: GdnShape, inputs: GdnInputs, schedule: Schedule, pool: torch.Tensor) -> torch.Tensor:
    return native_gdn.gdn_prefill(*inputs.as_tuple(), *_pooled(schedule, pool), shape.scale)


def _pooled(schedule: Schedule, pool: torch.Tensor) -> tuple[torch.Tensor, ...]:
    cu_seqlens, slots, carried = schedule.arguments()
    return cu_seqlens, pool, slots, carried


@pytest.mark.parametrize("shape", SHAPE_PARAMS)
@pytest.mark.parametrize("slots", [[1, 2, 3], [3, 1, 2], [6, 0, 4]], ids=["run", "shuffled", "scattered"])
def test_gdn_decode_steps_match_transformers_and_touch_only_their_slots(shape: GdnShape, slots: list[int]) -> None:
    initial = shape.states(POOL, seed=1)
    pool = initial.clone()
    steps = [GdnInputs.random(shape, len(slots), seed=10 + i) for i in range(5)]

    outputs = [native_gdn.gdn_decode(*step.as_tuple(), pool, torch.tensor(slots), shape.scale) for step in steps]

    for b, slot in enumerate(slots):
        sequence = GdnInputs.concat([step.rows(slice(b, b + 1)) for step in steps])
        expected_o, expected_state = torch_recurrent_gated_delta_rule(
            *(x.unsqueeze(0) for x in sequence.as_tuple()),
            initial_state=initial[slot].unsqueeze(0),
            output_final_state=True,
        )
        torch.testing.assert_close(torch.stack([o[b] for o in outputs]), expected_o[0], **TOLERANCE)
        torch.testing.assert_close(pool[slot], expected_state[0], **TOLERANCE)
    untouched = [i for i in range(POOL) if i not in slots]
    assert torch.equal(pool[untouched], initial[untouched])


@pytest.mark.parametrize("shape", SHAPE_PARAMS)
def test_gdn_decode_matches_its_torch_twin(shape: GdnShape) -> None:
    step = GdnInputs.random(shape, 6, seed=2)
    pool = shape.states(POOL, seed=3)
    slots = torch.randperm(POOL, generator=torch.Generator().manual_seed(4))[:6]
    native_pool, torch_pool = pool.clone(), pool.clone()

    native_o = native_gdn.gdn_decode(*step.as_tuple(), native_pool, slots, 0.125)
    torch_o = decode.gdn_decode(*step.as_tuple(), torch_pool, slots, 0.125)

    torch.testing.assert_close(native_o, torch_o, **TOLERANCE)
    torch.testing.assert_close(native_pool, torch_pool, **TOLERANCE)


@pytest.mark.parametrize("shape", SHAPE_PARAMS)
@pytest.mark.parametrize("seed", [0, 1, 2], ids=lambda s: f"seed{s}")
def test_gdn_prefill_matches_the_chunked_torch_twin_and_touches_only_its_slots(shape: GdnShape, seed: int) -> None:
    schedule = Schedule.random(seed, sequences=4, pool_size=POOL, max_length=40)
    inputs = GdnInputs.random(shape, sum(schedule.lengths), seed=20 + seed)
    pool = shape.pool(POOL)
    pool[schedule.slots] = shape.states(len(schedule.slots), seed=21 + seed)
    expected_pool = pool.clone()

    o = _prefill(shape, inputs, schedule, pool)
    expected_o = chunked.gdn_chunked_prefill(*inputs.as_tuple(), *_pooled(schedule, expected_pool), shape.scale)

    torch.testing.assert_close(o, expected_o, **TOLERANCE)
    torch.testing.assert_close(pool, expected_pool, **TOLERANCE)
    untouched = [i for i in range(POOL) if i not in schedule.slots]
    assert torch.equal(pool[untouched], shape.pool(POOL)[untouched])


def test_a_token_decoded_is_bitwise_the_same_as_prefilled_at_any_batch_and_thread_count() -> None:
    shape = SHAPES[1]
    inputs = GdnInputs.random(shape, 12, seed=5)
    prefilled_pool, decoded_pool = shape.pool(POOL), shape.pool(POOL)
    threads = torch.get_num_threads()

    whole = _prefill(shape, inputs, Schedule([12], [3], [False]), prefilled_pool)
    _prefill(shape, inputs.rows(slice(0, 11)), Schedule([11], [3], [False]), decoded_pool)
    others = GdnInputs.random(shape, 2, seed=6)
    batch = GdnInputs.concat([others.rows(slice(0, 1)), inputs.rows(slice(11, 12)), others.rows(slice(1, 2))])
    torch.set_num_threads(1)
    try:
        last = native_gdn.gdn_decode(*batch.as_tuple(), decoded_pool, torch.tensor([0, 3, 5]), shape.scale)
    finally:
        torch.set_num_threads(threads)

    assert torch.equal(last[1], whole[11])
    assert torch.equal(decoded_pool[3], prefilled_pool[3])


def test_gdn_kernels_take_low_precision_inputs_and_give_fp32() -> None:
    shape = SHAPES[1]
    inputs = GdnInputs(*(x.bfloat16() for x in GdnInputs.random(shape, 2, seed=7).as_tuple()))
    pool, reference_pool = shape.pool(2, fill=0.0), shape.pool(2, fill=0.0)

    o = native_gdn.gdn_decode(*inputs.as_tuple(), pool, torch.tensor([0, 1]), 0.25)

    expected = decode.gdn_decode(*inputs.as_tuple(), reference_pool, torch.tensor([0, 1]), 0.25)
    assert o.dtype == torch.float32 and pool.dtype == torch.float32
    torch.testing.assert_close(o, expected, **TOLERANCE)


def test_ops_run_the_gdn_c_kernels_under_auto_and_native_and_the_references_under_torch(
    backend: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    real_decode, real_prefill = native_gdn.gdn_decode, native_gdn.gdn_prefill
    monkeypatch.setattr(native_gdn, "gdn_decode", lambda *a: calls.append("decode") or real_decode(*a))
    monkeypatch.setattr(native_gdn, "gdn_prefill", lambda *a: calls.append("prefill") or real_prefill(*a))
    shape = SHAPES[1]
    step, prompt = GdnInputs.random(shape, 2, seed=8), GdnInputs.random(shape, 5, seed=9)
    schedule = Schedule([2, 3], [0, 1], [False, True])

    for chosen, expected in [
        (KernelBackend.TORCH, []),
        (KernelBackend.NATIVE, ["prefill", "decode"]),
        (KernelBackend.AUTO, ["prefill", "decode"]),
    ]:
        ops.set_kernel_backend(chosen)
        calls.clear()
        pool = shape.pool(2, fill=0.0)
        prefill_o = ops.gdn_prefill(*prompt.as_tuple(), *_pooled(schedule, pool), shape.scale)
        decode_o = ops.gdn_decode(*step.as_tuple(), pool, torch.tensor([0, 1]), shape.scale)
        assert calls == expected, chosen
        assert prefill_o.shape == (5, shape.value_heads, shape.value_dim) and decode_o.shape == (2, 4, 12)
