"""Element-wise ops computed at the same lanes whatever the rows around a row (issue #30)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metrale.worker.kernels.pointwise import row_invariant
from metrale.worker.kernels.products import forward_rows


@pytest.mark.parametrize(
    "op", [torch.sigmoid, F.softplus, F.silu, torch.cos, torch.sin], ids=["sigmoid", "softplus", "silu", "cos", "sin"]
)
@pytest.mark.parametrize("width", [8, 5, 64, 70])
def test_a_row_s_result_is_the_same_bits_alone_and_among_any_rows(op: object, width: int) -> None:
    x = torch.randn(40, width, generator=torch.Generator().manual_seed(width)) * 4
    together = row_invariant(op, x)  # type: ignore[arg-type]
    torch.testing.assert_close(together, op(x.double()).float(), rtol=2e-6, atol=1e-7)  # type: ignore[operator]
    for count in (1, 2, 3, 7, 13):
        for start in (0, 5, 40 - count):
            rows = row_invariant(op, x[start : start + count])  # type: ignore[arg-type]
            assert torch.equal(rows, together[start : start + count]), (count, start)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [11008, 17408, 40000])
def test_a_decode_row_s_result_is_the_same_bits_alone_and_among_wide_rows_at_any_thread_count(
    dtype: torch.dtype, width: int
) -> None:
    """Rows wide enough that torch splits the tensor over threads (issue #33: a verify chunk's k + 1 rows
    of an MLP's activation against each row decoded alone): as decode rows of a forward, each row's bits
    are its bits alone, with 1, 2, 3 and 16 threads (raw ``F.silu`` differed here with 3 and 16)."""
    x = (torch.randn(11, width, generator=torch.Generator().manual_seed(width)) * 4).to(dtype)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3, 16):
            torch.set_num_threads(count)
            for rows in (2, 5, 11):
                with forward_rows(rows, rows, torch.arange(rows)):
                    together = row_invariant(F.silu, x[:rows])
                for row in range(rows):
                    assert torch.equal(together[row], row_invariant(F.silu, x[row : row + 1])[0]), (count, rows, row)
    finally:
        torch.set_num_threads(threads)
