"""Triton causal conv1d (update and varlen prefill) against the torch references, under the interpreter."""

from __future__ import annotations

import pytest
import torch

from metrale.worker.kernels import conv
from metrale.worker.kernels.triton import conv as triton_conv

pytestmark = pytest.mark.triton

POOL = 8
POISON = 1e30
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
WIDTHS = [pytest.param(4, id="width4"), pytest.param(2, id="width2")]


def _tensor(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def _poisoned_states(dim: int, width: int, carried_slots: list[int], seed: int) -> torch.Tensor:
    states = torch.full((POOL, dim, width - 1), POISON)
    states[carried_slots] = _tensor(len(carried_slots), dim, width - 1, seed=seed)
    return states


def _untouched(states: torch.Tensor, slots: list[int]) -> torch.Tensor:
    return states[[slot for slot in range(POOL) if slot not in slots]]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize(
    ("lengths", "carried", "dim"),
    [
        pytest.param([1], [False], 6, id="one-token-fresh"),
        pytest.param([4, 1, 7, 2], [True, False, True, True], 6, id="varlen-mixed"),
        pytest.param([20, 3], [True, False], 300, id="varlen-multitile-channels"),
    ],
)
def test_triton_conv_prefill_matches_torch(lengths: list[int], carried: list[bool], dim: int, width: int) -> None:
    slots = [6, 0, 2, 5][: len(lengths)]
    x, weight = _tensor(sum(lengths), dim, seed=0), _tensor(dim, width, seed=1)
    states = _poisoned_states(dim, width, [s for s, c in zip(slots, carried, strict=True) if c], seed=2)
    expected_states = states.clone()
    batch = (_cu_seqlens(lengths), torch.tensor(slots), torch.tensor(carried))

    y = triton_conv.causal_conv1d_prefill(x, weight, batch[0], states, batch[1], batch[2])
    expected_y = conv.causal_conv1d_prefill(x, weight, batch[0], expected_states, batch[1], batch[2])

    torch.testing.assert_close(y, expected_y, **TOLERANCE)
    torch.testing.assert_close(states, expected_states, rtol=0, atol=0)
    assert torch.equal(_untouched(states, slots), _untouched(torch.full_like(states, POISON), slots))


@pytest.mark.parametrize("width", WIDTHS)
def test_triton_conv_update_steps_match_torch_and_touch_only_their_slots(width: int) -> None:
    slots, dim = [7, 1, 4], 6
    weight = _tensor(dim, width, seed=3)
    states = _poisoned_states(dim, width, slots, seed=4)
    expected_states = states.clone()

    for step in range(3):
        x = _tensor(len(slots), dim, seed=100 + step)
        y = triton_conv.causal_conv1d_update(x, weight, states, torch.tensor(slots))
        expected_y = conv.causal_conv1d_update(x, weight, expected_states, torch.tensor(slots))
        torch.testing.assert_close(y, expected_y, **TOLERANCE)
        torch.testing.assert_close(states, expected_states, rtol=0, atol=0)

    assert torch.equal(_untouched(states, slots), _untouched(torch.full_like(states, POISON), slots))


def test_triton_conv_fresh_prefill_never_reads_its_poisoned_slot() -> None:
    dim, width, slot = 6, 4, torch.tensor([3])
    x, weight = _tensor(2, dim, seed=5), _tensor(dim, width, seed=6)
    poisoned, zeroed = torch.full((POOL, dim, width - 1), POISON), torch.zeros(POOL, dim, width - 1)

    y_poisoned = triton_conv.causal_conv1d_prefill(x, weight, _cu_seqlens([2]), poisoned, slot, torch.tensor([False]))
    y_zeroed = triton_conv.causal_conv1d_prefill(x, weight, _cu_seqlens([2]), zeroed, slot, torch.tensor([True]))

    assert torch.isfinite(y_poisoned).all()
    assert torch.equal(y_poisoned, y_zeroed)
    assert torch.equal(poisoned[3], zeroed[3])
