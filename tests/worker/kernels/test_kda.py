from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from transformers.models.kimi_linear.modeling_kimi_linear import (
    chunk_kimi_delta_attention,
    recurrent_kimi_delta_attention,
)

from metrale.worker.kernels.kda.chunked import kda_chunked, kda_chunked_prefill
from metrale.worker.kernels.kda.decode import kda_decode
from metrale.worker.kernels.kda.naive import kda_recurrent, l2_normalize

HEADS, KEY_DIM, VALUE_DIM, POOL = 2, 16, 8, 6
SCALE = KEY_DIM**-0.5
POISON = 1e30
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


@dataclass
class KdaInputs:
    """One flat batch of KDA inputs: q, k, g ``[N, H, K]``, v ``[N, H, V]``, beta ``[N, H]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor

    @classmethod
    def random(cls, rows: int, seed: int) -> KdaInputs:
        generator = torch.Generator().manual_seed(seed)

        def normal(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=generator)

        # Log-decays spread from near 0 (long memory) to strongly negative, as the forget gate gives.
        g = F.logsigmoid(2.0 * normal(rows, HEADS, KEY_DIM) + 2.0)
        beta = torch.sigmoid(normal(rows, HEADS))
        return cls(
            normal(rows, HEADS, KEY_DIM),
            normal(rows, HEADS, KEY_DIM),
            normal(rows, HEADS, VALUE_DIM),
            g,
            beta,
        )

    @classmethod
    def concat(cls, parts: list[KdaInputs]) -> KdaInputs:
        return cls(*(torch.cat(column) for column in zip(*(part.as_tuple() for part in parts), strict=True)))

    def rows(self, rows: slice | torch.Tensor) -> KdaInputs:
        return KdaInputs(self.q[rows], self.k[rows], self.v[rows], self.g[rows], self.beta[rows])

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k, self.v, self.g, self.beta


def _random_states(count: int, seed: int) -> torch.Tensor:
    return 0.5 * torch.randn(count, HEADS, KEY_DIM, VALUE_DIM, generator=torch.Generator().manual_seed(seed))


def _cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def _poisoned_pool() -> torch.Tensor:
    return torch.full((POOL, HEADS, KEY_DIM, VALUE_DIM), POISON)


def _prefill(
    inputs: KdaInputs,
    lengths: list[int],
    pool: torch.Tensor,
    slots: list[int],
    carried: list[bool],
    chunk: int = 64,
) -> torch.Tensor:
    return kda_chunked_prefill(
        *inputs.as_tuple(),
        _cu_seqlens(lengths),
        pool,
        torch.tensor(slots),
        torch.tensor(carried),
        scale=SCALE,
        chunk_size=chunk,
    )


def test_first_token_from_zero_state_is_scaled_key_query_match_times_value() -> None:
    inputs = KdaInputs.random(1, seed=0)
    beta = torch.ones(1, HEADS)

    o, state = kda_recurrent(inputs.q, inputs.k, inputs.v, inputs.g, beta, None, SCALE)

    q_hat, k_hat = l2_normalize(inputs.q[0]), l2_normalize(inputs.k[0])
    expected = SCALE * (q_hat * k_hat).sum(-1, keepdim=True) * inputs.v[0]
    torch.testing.assert_close(o[0], expected)
    torch.testing.assert_close(state, k_hat.unsqueeze(-1) * inputs.v[0].unsqueeze(-2))


@pytest.mark.parametrize("carried", [False, True], ids=["fresh", "carried"])
@pytest.mark.parametrize("chunk", [16, 64], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("length", [1, 7, 63, 64, 65, 130], ids=lambda n: f"len{n}")
def test_chunked_prefill_matches_recurrent(length: int, chunk: int, carried: bool) -> None:
    inputs = KdaInputs.random(length, seed=length)
    initial = _random_states(1, seed=1)[0]
    pool = _poisoned_pool()
    pool[2] = initial

    o = _prefill(inputs, [length], pool, slots=[2], carried=[carried], chunk=chunk)

    expected_o, expected_state = kda_recurrent(*inputs.as_tuple(), initial if carried else None, SCALE)
    torch.testing.assert_close(o, expected_o, **TOLERANCE)
    torch.testing.assert_close(pool[2], expected_state, **TOLERANCE)


def test_varlen_batch_matches_each_sequence_alone_and_touches_only_its_slots() -> None:
    lengths, slots, carried = [5, 64, 1, 33], [4, 0, 3, 1], [True, False, True, False]
    inputs = KdaInputs.random(sum(lengths), seed=2)
    initial = _random_states(POOL, seed=3)
    pool = _poisoned_pool()
    pool[[4, 3]] = initial[[4, 3]]

    o = _prefill(inputs, lengths, pool, slots, carried, chunk=16)

    assert torch.isfinite(o).all()
    assert torch.equal(pool[[2, 5]], _poisoned_pool()[[2, 5]])
    bounds = _cu_seqlens(lengths).tolist()
    for s, slot in enumerate(slots):
        rows = slice(bounds[s], bounds[s + 1])
        expected_o, expected_state = kda_recurrent(
            *inputs.rows(rows).as_tuple(), initial[slot] if carried[s] else None, SCALE
        )
        torch.testing.assert_close(o[rows], expected_o, **TOLERANCE)
        torch.testing.assert_close(pool[slot], expected_state, **TOLERANCE)


def test_fresh_sequence_over_poisoned_slot_equals_zero_state() -> None:
    inputs = KdaInputs.random(20, seed=4)
    poisoned, zeroed = _poisoned_pool(), torch.zeros(POOL, HEADS, KEY_DIM, VALUE_DIM)

    o_poisoned = _prefill(inputs, [20], poisoned, slots=[1], carried=[False], chunk=16)
    o_zeroed = _prefill(inputs, [20], zeroed, slots=[1], carried=[True], chunk=16)

    assert torch.equal(o_poisoned, o_zeroed)
    assert torch.equal(poisoned[1], zeroed[1])


def test_decode_steps_match_recurrent_and_touch_only_their_slots() -> None:
    prompt_lengths, decode_steps, slots = [3, 9, 1], 4, [5, 2, 0]
    prompts = KdaInputs.random(sum(prompt_lengths), seed=5)
    steps = [KdaInputs.random(len(slots), seed=100 + i) for i in range(decode_steps)]
    pool = _poisoned_pool()

    _prefill(prompts, prompt_lengths, pool, slots, carried=[False] * len(slots), chunk=4)
    decoded = [kda_decode(*step.as_tuple(), pool, torch.tensor(slots), SCALE) for step in steps]

    assert torch.equal(pool[[1, 3, 4]], _poisoned_pool()[[1, 3, 4]])
    bounds = _cu_seqlens(prompt_lengths).tolist()
    for b, slot in enumerate(slots):
        prompt = prompts.rows(slice(bounds[b], bounds[b + 1]))
        sequence = KdaInputs.concat([prompt, *(step.rows(slice(b, b + 1)) for step in steps)])
        expected_o, expected_state = kda_recurrent(*sequence.as_tuple(), None, SCALE)
        actual_o = torch.stack([o[b] for o in decoded])
        torch.testing.assert_close(actual_o, expected_o[-decode_steps:], **TOLERANCE)
        torch.testing.assert_close(pool[slot], expected_state, **TOLERANCE)


@pytest.mark.parametrize("carried", [False, True], ids=["fresh", "carried"])
def test_recurrent_matches_transformers(carried: bool) -> None:
    inputs = KdaInputs.random(37, seed=6)
    initial = _random_states(1, seed=7) if carried else None

    expected_o, expected_state = recurrent_kimi_delta_attention(
        *(x.unsqueeze(0) for x in inputs.as_tuple()),
        initial_state=initial,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    o, state = kda_recurrent(*inputs.as_tuple(), None if initial is None else initial[0], SCALE)

    torch.testing.assert_close(o, expected_o[0], **TOLERANCE)
    torch.testing.assert_close(state, expected_state[0], **TOLERANCE)


@pytest.mark.parametrize("length", [7, 65], ids=lambda n: f"len{n}")
def test_chunked_prefill_matches_transformers_chunked(length: int) -> None:
    inputs = KdaInputs.random(length, seed=8)
    initial = _random_states(1, seed=9)
    pool = _poisoned_pool()
    pool[3] = initial[0]

    expected_o, expected_state = chunk_kimi_delta_attention(
        *(x.unsqueeze(0) for x in inputs.as_tuple()),
        chunk_size=16,
        initial_state=initial,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    o = _prefill(inputs, [length], pool, slots=[3], carried=[True], chunk=16)

    torch.testing.assert_close(o, expected_o[0], **TOLERANCE)
    torch.testing.assert_close(pool[3], expected_state[0], **TOLERANCE)


def test_low_precision_inputs_give_low_precision_outputs_and_fp32_state() -> None:
    inputs = KdaInputs(*(x.bfloat16() for x in KdaInputs.random(9, seed=10).as_tuple()))
    pool = torch.zeros(POOL, HEADS, KEY_DIM, VALUE_DIM)

    o = _prefill(inputs, [9], pool, slots=[0], carried=[False], chunk=4)
    o_step = kda_decode(*inputs.rows(slice(0, 1)).as_tuple(), pool, torch.tensor([0]), SCALE)
    o_naive, state = kda_recurrent(*inputs.as_tuple(), None, SCALE)

    assert (o.dtype, o_step.dtype, o_naive.dtype) == (torch.bfloat16,) * 3
    assert (pool.dtype, state.dtype) == (torch.float32, torch.float32)


@pytest.mark.parametrize("chunk", [4, 16, 64], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("length", [1, 17, 64, 100], ids=lambda n: f"len{n}")
def test_per_sequence_reference_matches_recurrent(length: int, chunk: int) -> None:
    inputs = KdaInputs.random(length, seed=20 + length)
    initial = _random_states(1, seed=21)[0]

    o, state = kda_chunked(*inputs.as_tuple(), initial, SCALE, chunk_size=chunk)

    expected_o, expected_state = kda_recurrent(*inputs.as_tuple(), initial, SCALE)
    torch.testing.assert_close(o, expected_o, **TOLERANCE)
    torch.testing.assert_close(state, expected_state, **TOLERANCE)


@pytest.mark.parametrize("chunk", [4, 8, 16], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("seed", [0, 1, 2], ids=lambda s: f"seed{s}")
def test_batched_prefill_matches_per_sequence_reference(seed: int, chunk: int) -> None:
    """Many sequences of different chunk counts: the batched steps shrink as sequences finish."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (5,), generator=generator).tolist()
    slots = torch.randperm(POOL, generator=generator)[:5].tolist()
    carried = (torch.rand(5, generator=generator) < 0.5).tolist()
    inputs = KdaInputs.random(sum(lengths), seed=30 + seed)
    initial = _random_states(POOL, seed=31 + seed)
    pool = _poisoned_pool()
    pool[slots] = initial[slots]

    o = _prefill(inputs, lengths, pool, slots, carried, chunk)

    bounds = _cu_seqlens(lengths).tolist()
    for s, slot in enumerate(slots):
        rows = slice(bounds[s], bounds[s + 1])
        expected_o, expected_state = kda_chunked(
            *inputs.rows(rows).as_tuple(), initial[slot] if carried[s] else None, SCALE, chunk_size=chunk
        )
        torch.testing.assert_close(o[rows], expected_o, **TOLERANCE)
        torch.testing.assert_close(pool[slot], expected_state, **TOLERANCE)
    untouched = [i for i in range(POOL) if i not in slots]
    assert torch.equal(pool[untouched], _poisoned_pool()[untouched])


@pytest.mark.parametrize(
    "slots",
    [[1, 2, 3, 4], [3, 1, 4, 2], [5, 0, 3, 1]],
    ids=["ascending-run", "shuffled-range", "scattered"],
)
def test_decode_matches_recurrent_whatever_the_slot_order(slots: list[int]) -> None:
    step = KdaInputs.random(len(slots), seed=40)
    initial = _random_states(POOL, seed=41)
    pool = initial.clone()

    o = kda_decode(*step.as_tuple(), pool, torch.tensor(slots), SCALE)

    for b, slot in enumerate(slots):
        expected_o, expected_state = kda_recurrent(*step.rows(slice(b, b + 1)).as_tuple(), initial[slot], SCALE)
        torch.testing.assert_close(o[b], expected_o[0], **TOLERANCE)
        torch.testing.assert_close(pool[slot], expected_state, **TOLERANCE)
    untouched = [i for i in range(POOL) if i not in slots]
    assert torch.equal(pool[untouched], initial[untouched])
