"""The C products with one summation order per output element (``product.c``), whatever the row count.

Contract: ``out[g, m, n]`` is ``sum_k x[g, m, k] * w[g, n, k]`` (``product``) or ``... * w[g, k, n]``
(``product_kn``), summed in fp32 in an order fixed by ``K`` alone: a row's result depends on that row and
the weight only — not on how many rows share the call, their place in it, or the thread count. The plain
twins: ``torch.einsum`` in float64 (``tests/worker/kernels/test_native_product.py``), to fp32 rounding;
row-count invariance is tested bit for bit. Weights are fp32 or bf16, read in place (a bf16 one widened
exactly as it is read); rows of any float dtype are widened to fp32 first.
"""

from __future__ import annotations

import torch

from metrale.worker.kernels.native.library import native_library

WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    """Whether the C library is built (the callers check the tensors' device and dtypes themselves)."""
    return native_library() is not None


def rows_product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``product`` of one group, its checks left to the caller (a decode step makes ~10 of these a layer):
    ``rows [M, K]`` fp32 with unit stride along ``K``, ``weight [N, K]`` fp32 or bf16 likewise ->
    ``[M, N]`` fp32."""
    count, depth = rows.shape
    out = torch.empty(count, weight.shape[0], dtype=torch.float32)
    library = native_library()
    assert library is not None, "call available() first"
    library.met_product(
        rows.data_ptr(),
        0,
        rows.stride(0),
        weight.data_ptr(),
        0,
        weight.stride(0),
        weight.dtype is torch.bfloat16,
        out.data_ptr(),
        1,
        count,
        weight.shape[0],
        depth,
        torch.get_num_threads(),
    )
    return out


def product(x: torch.Tensor, weight: torch.Tensor, *, portable: bool = False) -> torch.Tensor:
    """``x [G, M, K]`` times ``weight [G, N, K]`` transposed -> ``[G, M, N]`` fp32 (``F.linear`` per
    group). ``portable``: the C code without vector instructions (the same bits; for its test)."""
    rows, weight = _rows(x), _unit_stride(weight)
    groups, count, depth = rows.shape
    if weight.shape[0] != groups or weight.shape[2] != depth:
        raise ValueError(
            f"rows {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply as [G, M, K] x [G, N, K]"
        )
    out = torch.empty(groups, count, weight.shape[1], dtype=torch.float32)
    library = native_library()
    assert library is not None, "call available() first"
    function = library.met_product_portable if portable else library.met_product
    _call(function, rows, weight, out)
    return out


def product_kn(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [G, M, K]`` times ``weight [G, K, N]`` -> ``[G, M, N]`` fp32 (``torch.bmm``)."""
    rows, weight = _rows(x), _unit_stride(weight)
    groups, count, depth = rows.shape
    if weight.shape[0] != groups or weight.shape[1] != depth:
        raise ValueError(
            f"rows {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply as [G, M, K] x [G, K, N]"
        )
    out = torch.empty(groups, count, weight.shape[2], dtype=torch.float32)
    library = native_library()
    assert library is not None, "call available() first"
    _call(library.met_product_kn, rows, weight, out)
    return out


def _call(function: object, rows: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    groups, count, depth = rows.shape
    if out.numel() == 0:
        return
    function(  # type: ignore[operator]
        rows.data_ptr(),
        rows.stride(0),
        rows.stride(1),
        weight.data_ptr(),
        weight.stride(0),
        weight.stride(1),
        int(weight.dtype == torch.bfloat16),
        out.data_ptr(),
        groups,
        count,
        out.shape[2],
        depth,
        torch.get_num_threads(),
    )


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x [G, M, K]`` as fp32 with unit stride along ``K`` (a view where it already is)."""
    rows = x.float()
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _unit_stride(weight: torch.Tensor) -> torch.Tensor:
    return weight if weight.stride(-1) == 1 else weight.contiguous()


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``torch.sigmoid(x)`` of fp32 ``x`` (any shape) -> fp32, each element's bits independent of its place
    (``sigmoid.c``; torch's vector body and scalar tail differ). Within a few ulp of the exact value."""
    library = native_library()
    assert library is not None, "call available() first"
    values = x.contiguous()
    out = torch.empty_like(values)
    library.met_sigmoid(values.data_ptr(), out.data_ptr(), values.numel())
    return out
