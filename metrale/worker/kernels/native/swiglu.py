"""The C SwiGLU blocks over decode rows (``swiglu.c``): a dense MLP, and a mixture's routed experts.

Contracts: ``layers.mlp.DenseMLP.forward`` and ``RoutedExperts._routed_experts`` (the plain twins), to
rounding — SiLU takes ``exp.h``'s exp, the products are ``native.product``'s one-order products. A row's
result does not depend on the other rows or on the thread count (each expert multiplies all its rows at
once, in the product's fixed order). A bf16 model's intermediates are rounded to bf16 where the twins'
bf16 tensors are.
"""

from __future__ import annotations

import torch

from metrale.worker.kernels.native.library import native_library
from metrale.worker.kernels.native.product import WEIGHT_DTYPES


def supports(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether the C blocks run this call: CPU, fp32 or bf16 rows and weights of one dtype, built library."""
    return (
        x.device.type == "cpu"
        and x.dtype in WEIGHT_DTYPES
        and all(w.device.type == "cpu" and w.dtype == weights[0].dtype for w in weights)
        and weights[0].dtype in WEIGHT_DTYPES
        and native_library() is not None
    )


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate) * up)`` with ``[gate | up] = gate_up(x)``: ``x [..., D]``, ``gate_up [2·I, D]``,
    ``down [D, I]`` -> ``[..., D]`` in ``x.dtype``."""
    rows = _fp32_rows(x)
    gate_up, down = gate_up.contiguous(), down.contiguous()  # named: a temporary would be freed before the call
    out = torch.empty(rows.shape, dtype=torch.float32)
    library = native_library()
    assert library is not None, "call supports() first"
    status = library.met_swiglu(
        rows.data_ptr(),
        rows.shape[0],
        rows.shape[1],
        gate_up.data_ptr(),
        down.data_ptr(),
        down.shape[1],
        gate_up.dtype is torch.bfloat16,
        x.dtype is torch.bfloat16,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    _check(status)
    return out.view(x.shape).to(x.dtype)


def routed_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts_gate_up: torch.Tensor, experts_down: torch.Tensor
) -> torch.Tensor:
    """``sum_j weights[:, j] * expert_{ids[:, j]}(x)``, summed in fp32 in expert order: ``x [M, D]``, ``ids``
    int64 and ``weights`` fp32 ``[M, top_k]``, ``experts_gate_up [E, 2·I, D]``, ``experts_down [E, D, I]``
    -> ``[M, D]`` in ``x.dtype``.

    Raises:
        IndexError: an expert id outside ``[0, E)``.
    """
    rows = _fp32_rows(x)
    ids, weights = ids.to(torch.int64).contiguous(), weights.float().contiguous()
    experts_gate_up, experts_down = experts_gate_up.contiguous(), experts_down.contiguous()
    out = torch.empty(rows.shape, dtype=torch.float32)
    library = native_library()
    assert library is not None, "call supports() first"
    status = library.met_routed_experts(
        rows.data_ptr(),
        rows.shape[0],
        rows.shape[1],
        ids.data_ptr(),
        weights.data_ptr(),
        ids.shape[1],
        experts_gate_up.data_ptr(),
        experts_down.data_ptr(),
        experts_gate_up.shape[0],
        experts_down.shape[2],
        experts_gate_up.dtype is torch.bfloat16,
        x.dtype is torch.bfloat16,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    _check(status)
    return out.to(x.dtype)


def _fp32_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` as fp32 ``[M, D]``, contiguous."""
    return x.detach().float().reshape(-1, x.shape[-1]).contiguous()


def _check(status: int) -> None:
    if status == -1:
        raise IndexError("an expert id is outside the model's experts")
    if status != 0:
        raise MemoryError("the C SwiGLU kernel could not allocate its scratch rows")
