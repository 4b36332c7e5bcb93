"""The C kernels against their plain twins and against transformers' KDA recurrence."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from transformers.models.kimi_linear.modeling_kimi_linear import recurrent_kimi_delta_attention

from metrale.shared.settings import KernelBackend
from metrale.worker.kernels import conv, ops
from metrale.worker.kernels.kda import decode
from metrale.worker.kernels.kda.chunked import kda_chunked_prefill
from metrale.worker.kernels.native import conv as native_conv
from metrale.worker.kernels.native import kda as native_kda
from metrale.worker.kernels.native import library

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def _kda_step_inputs(batch: int, heads: int, key_dim: int, value_dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, g ``[B, H, K]``, v ``[B, H, V]``, beta ``[B, H]`` with forget-gate-like log decays."""
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    g = F.logsigmoid(2.0 * normal(batch, heads, key_dim) + 2.0)
    beta = torch.sigmoid(normal(batch, heads))
    return normal(batch, heads, key_dim), normal(batch, heads, key_dim), normal(batch, heads, value_dim), g, beta


@pytest.fixture
def backend() -> Iterator[None]:
    previous = ops.kernel_backend()
    yield
    ops.set_kernel_backend(previous)


def test_the_kernels_build_on_this_machine() -> None:
    assert library.native_library() is not None


@pytest.mark.parametrize("shape", [(4, 128, 128), (2, 16, 8), (3, 5, 33)], ids=["kimi", "small", "odd"])
@pytest.mark.parametrize("slots", [[1, 2, 3], [3, 1, 2], [6, 0, 4]], ids=["run", "shuffled", "scattered"])
def test_kda_decode_steps_match_transformers_and_touch_only_their_slots(
    shape: tuple[int, int, int], slots: list[int]
) -> None:
    heads, key_dim, value_dim = shape
    steps, scale = 5, key_dim**-0.5
    initial = 0.3 * torch.randn(7, heads, key_dim, value_dim, generator=torch.Generator().manual_seed(1))
    pool = initial.clone()
    inputs = [_kda_step_inputs(len(slots), heads, key_dim, value_dim, seed=10 + i) for i in range(steps)]

    outputs = [native_kda.kda_decode(*step, pool, torch.tensor(slots), scale) for step in inputs]

    for b, slot in enumerate(slots):
        sequence = [torch.stack([step[i][b] for step in inputs]).unsqueeze(0) for i in range(5)]  # [1, T, ...]
        expected_o, expected_state = recurrent_kimi_delta_attention(
            *sequence,
            scale=scale,
            initial_state=initial[slot].unsqueeze(0),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        torch.testing.assert_close(torch.stack([o[b] for o in outputs]), expected_o[0], **TOLERANCE)
        torch.testing.assert_close(pool[slot], expected_state[0], **TOLERANCE)
    untouched = [i for i in range(7) if i not in slots]
    assert torch.equal(pool[untouched], initial[untouched])


def test_kda_decode_matches_its_torch_twin() -> None:
    step = _kda_step_inputs(16, 4, 64, 32, seed=3)
    pool = torch.randn(20, 4, 64, 32, generator=torch.Generator().manual_seed(4))
    slots = torch.randperm(20, generator=torch.Generator().manual_seed(5))[:16]
    native_pool, torch_pool = pool.clone(), pool.clone()

    native_o = native_kda.kda_decode(*step, native_pool, slots, 0.125)
    torch_o = decode.kda_decode(*step, torch_pool, slots, 0.125)

    torch.testing.assert_close(native_o, torch_o, **TOLERANCE)
    torch.testing.assert_close(native_pool, torch_pool, **TOLERANCE)


def test_kda_decode_of_a_sequence_is_bitwise_the_same_alone_or_batched_at_any_thread_count() -> None:
    step = _kda_step_inputs(9, 2, 32, 32, seed=6)
    pool = torch.randn(9, 2, 32, 32, generator=torch.Generator().manual_seed(7))
    batched_pool, alone_pool = pool.clone(), pool.clone()
    threads = torch.get_num_threads()

    batched = native_kda.kda_decode(*step, batched_pool, torch.arange(9), 0.2)
    torch.set_num_threads(1)
    try:
        alone = native_kda.kda_decode(*(x[4:5] for x in step), alone_pool, torch.tensor([4]), 0.2)
    finally:
        torch.set_num_threads(threads)

    assert torch.equal(batched[4:5], alone)
    assert torch.equal(batched_pool[4], alone_pool[4])


def test_kda_decode_takes_low_precision_inputs_and_keeps_the_state_fp32() -> None:
    q, k, v, g, beta = (x.to(torch.bfloat16) for x in _kda_step_inputs(2, 2, 16, 16, seed=8))
    pool = torch.zeros(2, 2, 16, 16)

    o = native_kda.kda_decode(q, k, v, g, beta, pool, torch.tensor([0, 1]), 0.25)

    expected = decode.kda_decode(q, k, v, g, beta, torch.zeros(2, 2, 16, 16), torch.tensor([0, 1]), 0.25)
    assert o.dtype == torch.bfloat16 and pool.dtype == torch.float32
    torch.testing.assert_close(o, expected)


@pytest.mark.parametrize("width", [4, 3, 2], ids=lambda w: f"width{w}")
@pytest.mark.parametrize("slots", [[0, 1, 2, 3], [2, 0, 3, 1], [5, 1, 4, 0]], ids=["run", "shuffled", "scattered"])
def test_conv_update_matches_the_torch_reference_over_steps(width: int, slots: list[int]) -> None:
    generator = torch.Generator().manual_seed(width)
    channels = 37
    weight = torch.randn(channels, width, generator=generator)
    initial = torch.randn(6, channels, width - 1, generator=generator)
    native_states, torch_states = initial.clone(), initial.clone()
    slot_tensor = torch.tensor(slots)

    for step in range(5):
        wide = torch.randn(len(slots), 2 * channels, generator=generator)
        x = wide[:, :channels]  # a strided view, as the split of a fused projection gives
        native_y = native_conv.causal_conv1d_update(x, weight, native_states, slot_tensor)
        torch_y = conv.causal_conv1d_update(x, weight, torch_states, slot_tensor)
        torch.testing.assert_close(native_y, torch_y, **TOLERANCE, msg=f"step {step}")
        assert torch.equal(native_states, torch_states)  # the shift copies values, no arithmetic


def test_ops_run_the_c_kernels_under_auto_and_native_and_the_references_under_torch(
    backend: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    real_kda, real_conv = native_kda.kda_decode, native_conv.causal_conv1d_update
    monkeypatch.setattr(native_kda, "kda_decode", lambda *a: calls.append("kda") or real_kda(*a))
    monkeypatch.setattr(native_conv, "causal_conv1d_update", lambda *a: calls.append("conv") or real_conv(*a))
    step = _kda_step_inputs(2, 2, 8, 8, seed=9)
    conv_args = (torch.randn(2, 6), torch.randn(6, 4), torch.zeros(2, 6, 3), torch.tensor([0, 1]))

    for chosen, expected in [
        (KernelBackend.TORCH, []),
        (KernelBackend.NATIVE, ["kda", "conv"]),
        (KernelBackend.AUTO, ["kda", "conv"]),
    ]:
        ops.set_kernel_backend(chosen)
        calls.clear()
        ops.kda_decode(*step, torch.zeros(2, 2, 8, 8), torch.tensor([0, 1]), 0.5)
        ops.causal_conv1d_update(*conv_args)
        assert calls == expected, chosen


def test_without_a_compiler_the_references_run(backend: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(library.shutil, "which", lambda name: None)
    library.native_library.cache_clear()
    try:
        assert library.native_library() is None
        ops.set_kernel_backend(KernelBackend.AUTO)
        step = _kda_step_inputs(2, 2, 8, 8, seed=10)
        pool, reference_pool = torch.zeros(2, 2, 8, 8), torch.zeros(2, 2, 8, 8)
        o = ops.kda_decode(*step, pool, torch.tensor([0, 1]), 0.5)
        assert torch.equal(o, decode.kda_decode(*step, reference_pool, torch.tensor([0, 1]), 0.5))
    finally:
        library.native_library.cache_clear()


def _prefill(
    inputs: tuple[torch.Tensor, ...], lengths: list[int], pool: torch.Tensor, slots: list[int], carried: list[bool]
) -> torch.Tensor:
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return native_kda.kda_prefill(
        *inputs, cu_seqlens, pool, torch.tensor(slots), torch.tensor(carried), scale=inputs[0].shape[-1] ** -0.5
    )


@pytest.mark.parametrize("shape", [(4, 128, 128), (2, 16, 8)], ids=["kimi", "small"])
def test_kda_prefill_matches_transformers_and_touches_only_its_slots(shape: tuple[int, int, int]) -> None:
    heads, key_dim, value_dim = shape
    lengths, slots, carried = [5, 1, 17], [4, 0, 2], [True, False, True]
    inputs = _kda_step_inputs(sum(lengths), heads, key_dim, value_dim, seed=20)
    initial = 0.3 * torch.randn(6, heads, key_dim, value_dim, generator=torch.Generator().manual_seed(21))
    initial[0] = 1e30  # a fresh sequence ignores whatever its slot held
    pool = initial.clone()

    o = _prefill(inputs, lengths, pool, slots, carried)

    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    for s, slot in enumerate(slots):
        rows = slice(bounds[s], bounds[s + 1])
        expected_o, expected_state = recurrent_kimi_delta_attention(
            *(x[rows].unsqueeze(0) for x in inputs),
            scale=key_dim**-0.5,
            initial_state=initial[slot].unsqueeze(0) if carried[s] else None,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        torch.testing.assert_close(o[rows], expected_o[0], **TOLERANCE)
        torch.testing.assert_close(pool[slot], expected_state[0], **TOLERANCE)
    untouched = [1, 3, 5]
    assert torch.equal(pool[untouched], initial[untouched])


def test_a_token_prefilled_in_any_chunks_or_decoded_gives_bitwise_the_same_output_and_state() -> None:
    """Replaying tokens through prefill (a resumed or re-prefilled sequence) reproduces the exact bits of
    having decoded them."""
    tokens, heads, dim = 12, 2, 32
    inputs = _kda_step_inputs(tokens, heads, dim, dim, seed=22)
    initial = torch.randn(1, heads, dim, dim, generator=torch.Generator().manual_seed(23))
    whole_pool, chunked_pool, decoded_pool = initial.clone(), initial.clone(), initial.clone()

    whole = _prefill(inputs, [tokens], whole_pool, [0], [True])
    chunked = torch.cat(
        [
            _prefill(tuple(x[rows] for x in inputs), [rows.stop - rows.start], chunked_pool, [0], [True])
            for rows in (slice(0, 5), slice(5, 6), slice(6, tokens))
        ]
    )
    decoded = torch.cat(
        [
            native_kda.kda_decode(*(x[t : t + 1] for x in inputs), decoded_pool, torch.tensor([0]), dim**-0.5)
            for t in range(tokens)
        ]
    )

    assert torch.equal(whole, chunked) and torch.equal(whole, decoded)
    assert torch.equal(whole_pool, chunked_pool) and torch.equal(whole_pool, decoded_pool)


def test_kda_prefill_matches_the_chunked_torch_form() -> None:
    lengths, slots, carried = [9, 30, 2], [1, 3, 0], [False, True, True]
    inputs = _kda_step_inputs(sum(lengths), 4, 64, 32, seed=24)
    pool = torch.randn(4, 4, 64, 32, generator=torch.Generator().manual_seed(25))
    native_pool, torch_pool = pool.clone(), pool.clone()
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    sequences = (torch.tensor(slots), torch.tensor(carried), 0.125)

    native_o = native_kda.kda_prefill(*inputs, cu_seqlens, native_pool, *sequences)
    torch_o = kda_chunked_prefill(*inputs, cu_seqlens, torch_pool, *sequences)

    torch.testing.assert_close(native_o, torch_o, **TOLERANCE)
    torch.testing.assert_close(native_pool, torch_pool, **TOLERANCE)


@pytest.mark.parametrize("width", [4, 2], ids=lambda w: f"width{w}")
def test_conv_prefill_matches_the_torch_reference_and_touches_only_its_slots(width: int) -> None:
    generator = torch.Generator().manual_seed(30 + width)
    channels, lengths, slots, carried = 19, [1, 2, 9, 3], [3, 0, 5, 1], [True, False, True, False]
    weight = torch.randn(channels, width, generator=generator)
    initial = torch.randn(7, channels, width - 1, generator=generator)
    initial[0] = 1e30  # a fresh sequence ignores whatever its slot held
    native_states, torch_states = initial.clone(), initial.clone()
    wide = torch.randn(sum(lengths), channels + 5, generator=generator)
    x = wide[:, 2 : 2 + channels]  # rows of unit stride, not contiguous
    args = (torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),)
    sequences = (torch.tensor(slots), torch.tensor(carried))

    native_y = native_conv.causal_conv1d_prefill(x, weight, *args, native_states, *sequences)
    torch_y = conv.causal_conv1d_prefill(x, weight, *args, torch_states, *sequences)

    torch.testing.assert_close(native_y, torch_y, **TOLERANCE)
    assert torch.equal(native_states, torch_states)


def test_conv_inputs_prefilled_in_any_chunks_or_decoded_give_bitwise_the_same_outputs_and_state() -> None:
    generator = torch.Generator().manual_seed(40)
    tokens, channels = 9, 24
    weight, x = torch.randn(channels, 4, generator=generator), torch.randn(tokens, channels, generator=generator)
    pools = [torch.randn(1, channels, 3, generator=torch.Generator().manual_seed(41)) for _ in range(3)]
    slot, carried = torch.tensor([0]), torch.tensor([True])

    def prefill(rows: slice, pool: torch.Tensor) -> torch.Tensor:
        bounds = torch.tensor([0, rows.stop - rows.start])
        return native_conv.causal_conv1d_prefill(x[rows], weight, bounds, pool, slot, carried)

    whole = prefill(slice(0, tokens), pools[0])
    chunked = torch.cat([prefill(rows, pools[1]) for rows in (slice(0, 2), slice(2, 3), slice(3, tokens))])
    decoded = torch.cat([native_conv.causal_conv1d_update(x[t : t + 1], weight, pools[2], slot) for t in range(tokens)])

    assert torch.equal(whole, chunked) and torch.equal(whole, decoded)
    assert torch.equal(pools[0], pools[1]) and torch.equal(pools[0], pools[2])


def test_a_failing_build_is_logged_and_the_references_run(
    backend: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(library.shutil, "which", lambda name: "/bin/false")  # a "compiler" that always fails
    library.native_library.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=library.__name__):
            assert library.native_library() is None
        assert "building the C kernels failed" in caplog.text
        ops.set_kernel_backend(KernelBackend.NATIVE)
        x, weight = torch.randn(2, 6), torch.randn(6, 4)
        states, reference_states = torch.zeros(2, 6, 3), torch.zeros(2, 6, 3)
        y = ops.causal_conv1d_update(x, weight, states, torch.tensor([0, 1]))
        assert torch.equal(y, conv.causal_conv1d_update(x, weight, reference_states, torch.tensor([0, 1])))
    finally:
        library.native_library.cache_clear()
