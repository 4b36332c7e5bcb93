from __future__ import annotations

import pytest
import torch

from metrale.worker.kernels.pool_rows import PoolRows

POOL = 8

LAYOUTS = [
    pytest.param([2, 3, 4], True, id="ascending-run"),
    pytest.param([4, 2, 3], True, id="shuffled-range"),
    pytest.param([6, 1, 3], False, id="scattered"),
]


def _pool() -> torch.Tensor:
    return torch.arange(POOL * 2, dtype=torch.float32).view(POOL, 2)


@pytest.mark.parametrize(("slots", "is_view"), LAYOUTS)
def test_rows_hold_the_batch_states_and_view_the_pool_for_a_slot_range(slots: list[int], is_view: bool) -> None:
    pool = _pool()
    taken = PoolRows.take(pool, torch.tensor(slots))

    assert torch.equal(taken.rows, taken.to_rows(pool[slots]))
    shares_memory = taken.rows.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()
    assert shares_memory == is_view


@pytest.mark.parametrize(("slots", "is_view"), LAYOUTS)
def test_to_batch_undoes_to_rows(slots: list[int], is_view: bool) -> None:
    taken = PoolRows.take(_pool(), torch.tensor(slots))
    per_item = torch.randn(len(slots), 3, generator=torch.Generator().manual_seed(0))

    assert torch.equal(taken.to_batch(taken.to_rows(per_item)), per_item)


@pytest.mark.parametrize(("slots", "is_view"), LAYOUTS)
def test_commit_writes_each_items_new_state_to_its_slot_only(slots: list[int], is_view: bool) -> None:
    pool = _pool()
    taken = PoolRows.take(pool, torch.tensor(slots))
    new_states = -torch.arange(1, len(slots) + 1, dtype=torch.float32).unsqueeze(1).expand(-1, 2)

    taken.rows.copy_(taken.to_rows(new_states))
    taken.commit()

    assert torch.equal(pool[slots], new_states)
    untouched = [i for i in range(POOL) if i not in slots]
    assert torch.equal(pool[untouched], _pool()[untouched])
