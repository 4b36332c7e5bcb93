"""The rows of a slot-indexed state pool that one batch updates in place."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PoolRows:
    """The states of a batch, ``pool[slots]``, to update in place and then ``commit``.

    When the slots cover one contiguous range of the pool (a full decode batch, in any order), ``rows``
    is a view of that range in slot order, ``rows[i]`` being the state of batch item ``row_items[i]``:
    the small per-item tensors are permuted (``to_rows``, ``to_batch``) instead of the states.
    Otherwise ``rows`` is a gathered copy in batch order, which ``commit`` writes back.
    """

    pool: torch.Tensor  # [P, *]
    slots: torch.Tensor  # [B] int64, distinct
    rows: torch.Tensor  # [B, *]
    gathered: bool  # rows is a copy, not a view of the pool
    row_items: torch.Tensor | None  # [B] batch item of each row; None when rows are in batch order
    item_rows: torch.Tensor | None  # [B] row of each batch item (the inverse of row_items)

    @classmethod
    def take(cls, pool: torch.Tensor, slots: torch.Tensor) -> PoolRows:
        """The rows of ``pool [P, *]`` at ``slots`` (int64 ``[B]``, distinct)."""
        start = _range_start(slots)
        if start is None:
            return cls(pool, slots, pool.index_select(0, slots), True, None, None)
        rows = pool[start : start + slots.numel()]
        item_rows = slots - start
        if bool((item_rows.diff() > 0).all()):
            return cls(pool, slots, rows, False, None, None)
        return cls(pool, slots, rows, False, torch.argsort(item_rows), item_rows)

    def to_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Per-item ``[B, *]`` in batch order -> the order of ``rows``."""
        return x if self.row_items is None else x[self.row_items]

    def to_batch(self, x: torch.Tensor) -> torch.Tensor:
        """Per-row ``[B, *]`` in the order of ``rows`` -> batch order."""
        return x if self.item_rows is None else x[self.item_rows]

    def commit(self) -> None:
        """Make the pool hold ``rows`` (nothing to do for a view)."""
        if self.gathered:
            self.pool.index_copy_(0, self.slots, self.rows)


def _range_start(slots: torch.Tensor) -> int | None:
    """``s`` when ``slots`` holds exactly ``s .. s+B-1`` in some order (on the CPU), else None."""
    if slots.device.type != "cpu" or slots.numel() == 0:
        return None
    first, last = int(slots.min()), int(slots.max())
    return first if last - first + 1 == slots.numel() else None
