"""The C RMS norms (``norm.c``): fp32 rows (the plain norm also bf16 rows with a bf16 weight, a bf16 model's
layer norms), one pass for the sum of squares and one for the output.

Contracts: ``kernels.norm.rms_norm`` and ``kernels.norm.gated_rms_norm`` (the plain twins), to rounding
(the C kernels sum a row in their own fixed order; the gate's sigmoid takes ``exp.h``'s exp). A row's
result does not depend on the other rows or on the thread count. Torch's CPU ``rms_norm`` runs as six
ops (~4 passes over the input; a ``[2048, 512]`` prefill's norm ~4× one element-wise op), which these
kernels replace on the eager path.
"""

from __future__ import annotations

import torch

from metrale.worker.kernels.native.library import native_library


def supports(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None = None) -> bool:
    """Whether the C kernels run this call: CPU, fp32 throughout (or, without a gate, bf16 ``x`` and
    ``weight``), unit-stride rows, built library."""
    tensors = (x, weight) if gate is None else (x, weight, gate)
    bf16 = gate is None and x.dtype == weight.dtype == torch.bfloat16
    return (
        x.device.type == "cpu"
        and (bf16 or all(t.dtype == torch.float32 for t in tensors))
        and x.dim() >= 1
        and x.stride(-1) == 1
        and (gate is None or (gate.shape == x.shape and gate.stride(-1) == 1))
        and weight.shape == x.shape[-1:]
        and native_library() is not None
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [..., D]`` RMS-normalised over ``D`` and scaled by ``weight [D]`` -> ``[..., D]`` in ``x.dtype``:
    fp32, or bf16 (``x`` and ``weight``; the normalised value rounded to bf16 before the weight multiplies
    it, as ``kernels.norm.rms_norm``)."""
    rows, row_stride = _rows(x)
    weight = weight.contiguous()  # named: a temporary would be freed before the call reads it
    out = torch.empty(x.shape, dtype=x.dtype)
    library = native_library()
    assert library is not None, "call supports() first"
    kernel = library.met_rms_norm_bf16 if x.dtype == torch.bfloat16 else library.met_rms_norm
    kernel(
        rows.data_ptr(),
        row_stride,
        weight.data_ptr(),
        out.data_ptr(),
        rows.shape[0],
        x.shape[-1],
        eps,
        torch.get_num_threads(),
    )
    return out


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm(x) * sigmoid(gate)``: ``x, gate [..., D]`` fp32, ``weight [D]`` -> ``[..., D]``."""
    rows, row_stride = _rows(x)
    gates, gate_stride = _rows(gate)
    weight = weight.contiguous()  # named: a temporary would be freed before the call reads it
    out = torch.empty(x.shape, dtype=torch.float32)
    library = native_library()
    assert library is not None, "call supports() first"
    library.met_gated_rms_norm(
        rows.data_ptr(),
        row_stride,
        gates.data_ptr(),
        gate_stride,
        weight.data_ptr(),
        out.data_ptr(),
        rows.shape[0],
        x.shape[-1],
        eps,
        torch.get_num_threads(),
    )
    return out


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x [..., D]`` as ``[R, D]`` rows (a view where the leading dimensions allow one) and their stride."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]:  # overlapping or broadcast rows
        rows = rows.contiguous()
    return rows, rows.stride(0) if rows.shape[0] > 0 else x.shape[-1]
