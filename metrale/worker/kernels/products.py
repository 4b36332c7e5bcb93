"""The model's matrix products, in the weight dtype — except bf16 on a CPU without bf16 instructions.

On such a CPU (no AVX512-BF16, no AMX: most AVX2 servers) torch multiplies bf16 matrices in a generic
loop, 3–6× slower than its fp32 product of the same shape; only a single row (a matrix-vector product)
is as fast. So there, a bf16 product of more than one row widens its operands to fp32 (exactly: a bf16
value is the top half of an fp32 one), multiplies in fp32 and rounds the result to bf16 once — what a
native bf16 product computes, summed in another order. The weights stay bf16 in memory.

On the CPU a row's result does not depend on how many other rows it is multiplied with
(**batch invariance**), so a sequence's logits are the same bits alone and in any batch; two products
see to it, by the kind of rows:

- **Decode rows** (decode and verify rows: one stream's step alone, or a batch's) go through the C
  product (``native.product``), whose every output element is summed in one order fixed by ``K`` alone,
  for any row count, one row included. It reads the weight once for all its rows, as sequential streams
  far apart: faster than torch's matrix-vector product for one or a few rows, about as fast as MKL for 64
  (``bench/lone_rows.py``).
- **Batch rows** (prefill chunks) go through torch's product (MKL's sgemm, or oneDNN's bf16), padded with
  zero rows to a multiple of :data:`ROW_BLOCK` (at most 3 more; a lone batch row too, such as a prefill's
  last row at the LM head, which would otherwise take the matrix-vector product's order): MKL's AVX2
  kernels sum a row of a product of ``M`` rows in one order when ``M`` is such a multiple and in others
  when it is not. Its AVX-512 kernels, on a Xeon, pick kernels and a thread split by the product's size
  (a row's bits differ between 1, 2–15 and 16+ rows there), which the padding cannot mend:
  ``metrale/__init__.py`` turns on MKL's strict reproducibility (``MKL_CBWR=AUTO,STRICT``), under which
  an fp32 row is summed in one order whatever the rows and threads beside it.

Which rows are which is set per forward (:func:`forward_rows`: the executor's forwards put their decode
rows first) and per call where a layer multiplies rows of its own (:func:`rows_of_kind`: an MoE's expert
runs, MLA's absorbed projections). Outside any forward a lone row is a decode row and more are batch rows.
Without the C library (no compiler) every product is torch's, and a lone row keeps the matrix-vector
product, which may differ from that row batched in its last bits.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from metrale.worker.kernels.native import product as native_product

BF16_MATMUL_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
"""CPU flags (``/proc/cpuinfo``) under which torch multiplies bf16 natively."""


@cache
def cpu_multiplies_bf16() -> bool:
    """Whether this CPU has bf16 matrix instructions (read once from ``/proc/cpuinfo``; True where it
    cannot be read, leaving torch's own choice in place)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), None)
    return flags is None or not BF16_MATMUL_FLAGS.isdisjoint(flags)


WIDEN_BF16 = not cpu_multiplies_bf16()
"""Whether bf16 products of more than one row run in fp32 here (a constant, so a compiled graph holds it)."""


ROW_BLOCK = 4
"""A CPU product of batch rows runs on a multiple of this many rows (zero rows padded): MKL's sgemm (AVX2
kernels, 1 to 16 threads, tested on an EPYC) gives a row the same bits in every product whose row count is
such a multiple (not its AVX-512 kernels: see the module's docstring)."""


@dataclass(frozen=True)
class RowKinds:
    """The kinds of a product's rows: in a forward of ``rows`` rows the first ``decode`` are decode rows,
    and so are the first ``logit_decode`` of the ``logit_rows`` rows the LM head reads."""

    rows: int
    decode: int
    logit_rows: int
    logit_decode: int

    def leading_decode(self, count: int) -> int:
        """How many of a product's ``count`` leading rows are decode rows (the rest: batch rows)."""
        if count == self.rows:
            return self.decode
        if count == self.logit_rows:
            return self.logit_decode
        if self.decode == self.rows:  # a decode forward: every product's rows are decode rows
            return count
        return 0  # a prefill forward's, or in a mixed one rows no caller classified: batch rows


_ROW_KINDS: ContextVar[RowKinds | None] = ContextVar("row_kinds", default=None)
_ONE_KIND: ContextVar[bool | None] = ContextVar("one_kind", default=None)
"""Set by :func:`rows_of_kind`: every product's rows are decode rows (True) or batch rows (False)."""


@contextmanager
def forward_rows(rows: int, decode: int, logit_rows: torch.Tensor) -> Iterator[None]:
    """Within: a forward of ``rows`` rows whose first ``decode`` are decode rows, and whose LM head reads
    ``logit_rows`` (int64 ``[R]``; its decode rows are decode rows to the head where they come first)."""
    logit_decode = len(logit_rows) if decode == rows else 0
    if 0 < decode < rows and logit_rows.device.type == "cpu":  # (only the CPU's products read kinds)
        is_decode = logit_rows < decode
        count = int(is_decode.sum())
        # Read in another order (every row's logits, in the callers' order), they are batch rows.
        logit_decode = count if bool(is_decode[:count].all()) else 0
    token = _ROW_KINDS.set(RowKinds(rows, decode, len(logit_rows), logit_decode))
    try:
        yield
    finally:
        _ROW_KINDS.reset(token)


@contextmanager
def rows_of_kind(decode: bool) -> Iterator[None]:
    """Within: every product's rows are decode rows (``decode``) or batch rows."""
    token = _ONE_KIND.set(decode)
    try:
        yield
    finally:
        _ONE_KIND.reset(token)


def decode_rows(count: int, batched: bool = False) -> int:
    """How many of a product's ``count`` leading rows are decode rows, here (see the module's docstring).
    ``batched``: outside a forward, even one row is a part of a batch's rows."""
    one_kind = _ONE_KIND.get()
    if one_kind is not None:
        return count if one_kind else 0
    kinds = _ROW_KINDS.get()
    if kinds is None:
        return count if count == 1 and not batched else 0
    return kinds.leading_decode(count)


def _fixed_order(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the one-order C product can run (an eager CPU product of an fp32 or bf16 weight)."""
    return (
        x.device.type == "cpu"
        and weight.dtype in native_product.WEIGHT_DTYPES
        and not torch.compiler.is_compiling()
        and native_product.available()
    )


def one_order_rows(x: torch.Tensor, weight: torch.Tensor) -> int:
    """How many of ``x``'s leading rows a product with ``weight`` takes through the one-order C product
    (its decode rows, where the C library runs; else 0): a C kernel that fuses a block of products over
    those rows (``native.swiglu``) gives them the bits it would."""
    return decode_rows(_rows(x)) if _fixed_order(x, weight) else 0


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.dim() else 1


def _widened(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return WIDEN_BF16 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and _rows(x) > 1


def _padded_rows(rows: int, device: torch.device, batched: bool = False) -> int:
    """How many zero rows a CPU product of ``rows`` rows gets: none for one row alone (the matrix-vector
    product) unless it is ``batched`` (one of a batch's rows: padded as they are, for their bits), or
    while a graph is compiled (a compiled step sums in its own order anyway)."""
    if (rows == 1 and not batched) or device.type != "cpu" or torch.compiler.is_compiling():
        return 0
    return -rows % ROW_BLOCK


def linear(x: torch.Tensor, weight: torch.Tensor, *, batched: bool = False) -> torch.Tensor:
    """``F.linear(x, weight)``: ``x [..., K]``, ``weight [N, K]`` -> ``[..., N]`` in ``x.dtype``; on the CPU a
    row's result is the same whatever the other rows (see the module's docstring). ``batched``: the rows
    are a part of a batch's rows (an expert's run): outside a forward, or as batch rows, even one is padded."""
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    fixed = _fixed_order(flat, weight)
    decode = decode_rows(flat.shape[0], batched) if fixed else 0
    if decode == 0:  # batch rows, even a lone one (a prefill's last row at the LM head), where decode rows are C's
        out = _batch_linear(flat, weight, batched or fixed)
    else:
        leading = flat if decode == flat.shape[0] else flat[:decode]
        rows = leading if leading.dtype is torch.float32 and leading.stride(-1) == 1 else _fp32_rows(leading)
        out = native_product.rows_product(rows, weight if weight.stride(-1) == 1 else weight.contiguous())
        out = out if x.dtype is torch.float32 else out.to(x.dtype)
        if decode < flat.shape[0]:
            out = torch.cat([out, _batch_linear(flat[decode:], weight, batched=True)])
    return out if x.dim() == 2 else out.view(*x.shape[:-1], weight.shape[0])


def _fp32_rows(rows: torch.Tensor) -> torch.Tensor:
    rows = rows.float()
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _batch_linear(flat: torch.Tensor, weight: torch.Tensor, batched: bool) -> torch.Tensor:
    padding = _padded_rows(flat.shape[0], flat.device, batched)
    if padding:
        flat = F.pad(flat, (0, 0, 0, padding))
    out = F.linear(flat.float(), weight.float()).to(flat.dtype) if _widened(flat, weight) else F.linear(flat, weight)
    return out[: out.shape[0] - padding] if padding else out


def bmm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(x, weight)``: ``x [E, M, K]``, ``weight [E, K, N]`` -> ``[E, M, N]`` in ``x.dtype``;
    batch-invariant over ``M`` on the CPU like :func:`linear` (``M`` counts the rows' kinds)."""
    fixed = _fixed_order(x, weight)
    decode = decode_rows(x.shape[1]) if fixed else 0
    if decode == 0:
        return _batch_bmm(x, weight, batched=fixed)
    leading = x[:, :decode]
    if weight.stride(1) == 1:  # a transposed [E, N, K] weight, as F.linear's: the dot form
        out = native_product.product(leading, weight.transpose(1, 2)).to(x.dtype)
    else:
        out = native_product.product_kn(leading, weight).to(x.dtype)
    return out if decode == x.shape[1] else torch.cat([out, _batch_bmm(x[:, decode:], weight, batched=True)], dim=1)


def _batch_bmm(x: torch.Tensor, weight: torch.Tensor, batched: bool = False) -> torch.Tensor:
    padding = _padded_rows(x.shape[1], x.device, batched)
    padded = F.pad(x, (0, 0, 0, padding)) if padding else x
    out = torch.bmm(padded.float(), weight.float()).to(x.dtype) if _widened(x, weight) else torch.bmm(padded, weight)
    return out[:, : x.shape[1]] if padding else out


def heads_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Each head's rows times its own matrix, like :func:`bmm` over the rows' kinds: ``x [N, H, K]``,
    ``weight [H, K, C]`` -> ``[N, H, C]`` in ``x.dtype`` (``torch.einsum("nhk,hkc->nhc", x, weight)``)."""
    return bmm(x.transpose(0, 1), weight).transpose(0, 1)


def einsum(equation: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``torch.einsum(equation, x, y)`` of two operands, in ``x.dtype``; widened like :func:`linear` when
    both are bf16 on such a CPU (small bf16 batched products there, like MLA's per-head ones, run
    ~25x slower than widened)."""
    if _widened(x, y) and x.dtype == torch.bfloat16:
        return torch.einsum(equation, x.float(), y.float()).to(x.dtype)
    return torch.einsum(equation, x, y)


def row_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``torch.sigmoid(x)`` of fp32 ``x``, an element's bits the same wherever it sits (on the CPU, with the C
    library; torch's CPU sigmoid computes its vector body and its scalar tail differently, so a row's result
    would change with the rows before it)."""
    if (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and native_product.available()
    ):
        return native_product.sigmoid(x)
    return x.sigmoid()
