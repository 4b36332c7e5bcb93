"""A KDA layer's decode rows in one C call (``kda_layer.c``), and the gates' element-wise C function the
layer's op-by-op path shares with it (so a decode row gets the same bits through either path).

Contract: ``layers.kda.KimiDeltaAttention.forward`` on a forward of decode rows only, fp32 — bit for bit
(the same C products, conv, recurrence, norm and gate functions, in the same order; tested).
"""

from __future__ import annotations

import torch

from metrale.worker.kernels.native.layouts import state_pool_fits
from metrale.worker.kernels.native.library import native_library


def available() -> bool:
    """Whether the C library is built."""
    return native_library() is not None


def softplus_decay(f: torch.Tensor, dt_bias: torch.Tensor, neg_a: torch.Tensor) -> torch.Tensor:
    """KDA's log decay ``neg_a[h] * softplus(f + dt_bias)`` (torch's softplus, threshold 20): ``f [M, H·K]``
    fp32 with unit-stride rows, ``dt_bias [H·K]``, ``neg_a [H]`` (``-exp(A_log)``) -> ``[M, H, K]`` fp32."""
    library = native_library()
    assert library is not None, "the C library is not built"
    heads = neg_a.shape[0]
    bias, scale = dt_bias.float().contiguous(), neg_a.float().contiguous()
    out = torch.empty(f.shape[0], heads, f.shape[1] // heads, dtype=torch.float32)
    library.met_softplus_decay(
        f.data_ptr(), f.stride(0), bias.data_ptr(), scale.data_ptr(), out.data_ptr(), f.shape[0], heads, out.shape[2]
    )
    return out


def supports(x: torch.Tensor, weights: list[torch.Tensor], conv_states: torch.Tensor, states: torch.Tensor) -> bool:
    """Whether the fused decode layer runs this call: CPU, fp32 rows, weights and pools (contiguous), built
    library."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and all(w.dtype == torch.float32 and w.device.type == "cpu" for w in weights)
        and conv_states.dtype == torch.float32
        and conv_states.is_contiguous()
        and state_pool_fits(states)
        and native_library() is not None
    )


def decode_layer(
    x: torch.Tensor,
    *,
    in_proj: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_states: torch.Tensor,
    f_b: torch.Tensor,
    dt_bias: torch.Tensor,
    neg_a: torch.Tensor,
    g_b: torch.Tensor,
    o_norm: torch.Tensor,
    eps: float,
    o_proj: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One decode row per sequence through a KDA layer: ``x [B, D]`` fp32 -> ``[B, D]`` fp32; the sequences'
    conv states (``conv_states [P, 3·L, W-1]``) and recurrent states (``states [P, H, K, K]``) at ``slots
    [B]`` advanced in place. Weights as ``KimiDeltaAttention``'s: ``in_proj [3·L + 2·K + H, D]``,
    ``conv_weight [3·L, W]``, ``f_b``, ``g_b [L, K]``, ``dt_bias [L]``, ``neg_a [H]`` (``-exp(A_log)``),
    ``o_norm [K]``, ``o_proj [D, L]``."""
    library = native_library()
    assert library is not None, "call supports() first"
    heads, head_dim = neg_a.shape[0], o_norm.shape[0]
    # Held in names: a temporary's memory would be freed before the call reads it.
    held = [t.contiguous() for t in (x, in_proj, conv_weight, f_b, dt_bias, neg_a, g_b, o_norm, o_proj)]
    rows, in_w, conv_w, f_w, bias, neg, g_w, norm_w, o_w = held
    slots64 = slots.to(torch.int64).contiguous()
    out = torch.empty(rows.shape, dtype=torch.float32)
    status = library.met_kda_decode_layer(
        rows.data_ptr(),
        rows.shape[0],
        rows.shape[1],
        in_w.data_ptr(),
        conv_w.data_ptr(),
        conv_w.shape[1],
        conv_states.data_ptr(),
        f_w.data_ptr(),
        bias.data_ptr(),
        neg.data_ptr(),
        g_w.data_ptr(),
        norm_w.data_ptr(),
        eps,
        o_w.data_ptr(),
        states.data_ptr(),
        slots64.data_ptr(),
        heads,
        head_dim,
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("the C KDA layer could not allocate its scratch rows")
    return out
