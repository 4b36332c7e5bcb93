from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metrale.worker.kernels.conv import causal_conv1d_prefill, causal_conv1d_update

DIM, WIDTH, POOL = 6, 4, 8
POISON = 1e30


def _tensor(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def _reference_fresh(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SiLU of a zero-padded causal depthwise conv over one whole sequence ``x [L, D]``."""
    padded = F.conv1d(x.T.unsqueeze(0), weight.unsqueeze(1), padding=WIDTH - 1, groups=DIM)
    return F.silu(padded[0, :, : x.shape[0]]).T


def _prefill_one(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slot: int, carried: bool) -> torch.Tensor:
    return causal_conv1d_prefill(
        x, weight, _cu_seqlens([x.shape[0]]), states, torch.tensor([slot]), torch.tensor([carried])
    )


@pytest.mark.parametrize("length", [1, 2, 3, 9], ids=lambda n: f"len{n}")
def test_fresh_prefill_matches_zero_padded_conv1d(length: int) -> None:
    x, weight = _tensor(length, DIM, seed=0), _tensor(DIM, WIDTH, seed=1)
    states = torch.full((POOL, DIM, WIDTH - 1), POISON)

    y = _prefill_one(x, weight, states, slot=3, carried=False)

    torch.testing.assert_close(y, _reference_fresh(x, weight))
    expected_state = F.pad(x.T, (WIDTH - 1, 0))[:, -(WIDTH - 1) :]
    torch.testing.assert_close(states[3], expected_state, rtol=0, atol=0)


@pytest.mark.parametrize("seed", [0, 1, 2], ids=lambda s: f"seed{s}")
def test_split_into_prefills_and_updates_matches_one_shot(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    length = 17
    x, weight = _tensor(length, DIM, seed=seed + 10), _tensor(DIM, WIDTH, seed=seed + 20)
    cuts = sorted(torch.randperm(length - 1, generator=generator)[:5].add(1).tolist())
    pieces = torch.tensor_split(torch.arange(length), cuts)
    states = torch.full((POOL, DIM, WIDTH - 1), POISON)
    slot = 5

    outputs = []
    for index, rows in enumerate(pieces):
        if len(rows) == 1 and index > 0:
            outputs.append(causal_conv1d_update(x[rows], weight, states, torch.tensor([slot])))
        else:
            outputs.append(_prefill_one(x[rows], weight, states, slot, carried=index > 0))

    one_shot_states = torch.zeros(POOL, DIM, WIDTH - 1)
    one_shot = _prefill_one(x, weight, one_shot_states, slot, carried=False)
    torch.testing.assert_close(torch.cat(outputs), one_shot)
    torch.testing.assert_close(states[slot], one_shot_states[slot])
    torch.testing.assert_close(one_shot, _reference_fresh(x, weight))


def test_varlen_batch_with_carried_state_matches_each_sequence_alone() -> None:
    lengths, slots, carried = [4, 1, 7], [6, 0, 2], [True, False, True]
    x, weight = _tensor(sum(lengths), DIM, seed=3), _tensor(DIM, WIDTH, seed=4)
    initial = _tensor(POOL, DIM, WIDTH - 1, seed=5)
    batched_states = initial.clone()

    y = causal_conv1d_prefill(
        x, weight, _cu_seqlens(lengths), batched_states, torch.tensor(slots), torch.tensor(carried)
    )

    alone_states = initial.clone()
    rows = torch.tensor_split(x, _cu_seqlens(lengths)[1:-1].tolist())
    alone = [_prefill_one(r, weight, alone_states, s, c) for r, s, c in zip(rows, slots, carried, strict=True)]
    torch.testing.assert_close(y, torch.cat(alone), rtol=0, atol=0)
    torch.testing.assert_close(batched_states, alone_states, rtol=0, atol=0)


def test_batched_update_matches_each_sequence_alone() -> None:
    slots = torch.tensor([7, 1, 4])
    weight = _tensor(DIM, WIDTH, seed=6)
    initial = _tensor(POOL, DIM, WIDTH - 1, seed=7)
    batched_states, alone_states = initial.clone(), initial.clone()

    for step in range(3):
        x = _tensor(len(slots), DIM, seed=100 + step)
        y = causal_conv1d_update(x, weight, batched_states, slots)
        for b, slot in enumerate(slots.tolist()):
            alone = _prefill_one(x[b : b + 1], weight, alone_states, slot, carried=True)
            torch.testing.assert_close(y[b : b + 1], alone)
    torch.testing.assert_close(batched_states, alone_states)


def test_pool_slots_not_named_are_untouched_and_fresh_slot_poison_is_ignored() -> None:
    lengths, slots = [3, 5], torch.tensor([1, 4])
    x, weight = _tensor(sum(lengths), DIM, seed=8), _tensor(DIM, WIDTH, seed=9)
    states = torch.full((POOL, DIM, WIDTH - 1), POISON)
    states[4] = _tensor(DIM, WIDTH - 1, seed=10)
    carried_state = states[4].clone()

    y = causal_conv1d_prefill(x, weight, _cu_seqlens(lengths), states, slots, torch.tensor([False, True]))
    y_next = causal_conv1d_update(_tensor(2, DIM, seed=11), weight, states, slots)

    assert torch.isfinite(y).all() and torch.isfinite(y_next).all()
    untouched = [i for i in range(POOL) if i not in slots.tolist()]
    assert torch.equal(states[untouched], torch.full((len(untouched), DIM, WIDTH - 1), POISON))
    torch.testing.assert_close(y[:3], _reference_fresh(x[:3], weight))
    carried_reference = F.silu(
        F.conv1d(torch.cat([carried_state, x[3:].T], dim=1).unsqueeze(0), weight.unsqueeze(1), groups=DIM)
    )[0].T
    torch.testing.assert_close(y[3:], carried_reference)


def test_output_dtype_follows_input_and_pool_keeps_its_dtype() -> None:
    x, weight = _tensor(5, DIM, seed=12).bfloat16(), _tensor(DIM, WIDTH, seed=13)
    states = torch.zeros(POOL, DIM, WIDTH - 1, dtype=torch.float16)

    y = _prefill_one(x, weight, states, slot=0, carried=False)
    y_next = causal_conv1d_update(x[:1], weight, states, torch.tensor([0]))

    assert (y.dtype, y_next.dtype, states.dtype) == (torch.bfloat16, torch.bfloat16, torch.float16)


@pytest.mark.parametrize(
    "slots", [[2, 3, 4], [4, 2, 3], [7, 0, 5]], ids=["ascending-run", "shuffled-range", "scattered"]
)
def test_update_matches_each_sequence_alone_whatever_the_slot_order(slots: list[int]) -> None:
    x, weight = _tensor(len(slots), DIM, seed=14), _tensor(DIM, WIDTH, seed=15)
    initial = _tensor(POOL, DIM, WIDTH - 1, seed=16)
    batched_states, alone_states = initial.clone(), initial.clone()

    y = causal_conv1d_update(x, weight, batched_states, torch.tensor(slots))

    for b, slot in enumerate(slots):
        alone = _prefill_one(x[b : b + 1], weight, alone_states, slot, carried=True)
        torch.testing.assert_close(y[b : b + 1], alone, rtol=0, atol=0)
    torch.testing.assert_close(batched_states, alone_states, rtol=0, atol=0)


@pytest.mark.parametrize("dim", [6, 64], ids=lambda d: f"dim{d}")
def test_decode_step_rounds_exactly_like_the_same_token_in_a_prefill(dim: int) -> None:
    x, weight = _tensor(9, dim, seed=17), _tensor(dim, WIDTH, seed=18)
    one_shot_states, stepped_states = torch.zeros(2, dim, WIDTH - 1), torch.zeros(2, dim, WIDTH - 1)
    fresh = torch.tensor([False])

    one_shot = causal_conv1d_prefill(x, weight, _cu_seqlens([9]), one_shot_states, torch.tensor([1]), fresh)
    causal_conv1d_prefill(x[:8], weight, _cu_seqlens([8]), stepped_states, torch.tensor([1]), fresh)
    last = causal_conv1d_update(x[8:], weight, stepped_states, torch.tensor([1]))

    assert torch.equal(last, one_shot[8:])
    assert torch.equal(stepped_states, one_shot_states)
