"""A Kimi-Linear model's decoder layers over decode rows in one C call (``decode_layers.c``).

Contract: ``families.kimi_linear.DecoderLayer.forward`` over a forward of decode rows only, fp32 — bit for
bit (every piece is the C function the op-by-op path calls on decode rows; tested). The caller describes
each layer once (:class:`DecodeLayer`: pointers to its weights and pools) and calls :func:`decode_layers`
per step.
"""

from __future__ import annotations

import ctypes

import torch

from metrale.worker.kernels.native.library import native_library

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class DecodeLayer(ctypes.Structure):
    """One layer's weights and pools (``decode_layers.c``'s ``DecodeLayer``, field for field): data pointers of
    contiguous fp32 tensors, which the caller keeps alive while the layer is used."""

    _fields_ = [
        ("input_norm", _P),
        ("post_norm", _P),
        ("attention", _I),
        *((name, _P) for name in ("kda_in_proj", "kda_conv_weight", "kda_f_b", "kda_dt_bias", "kda_neg_a")),
        *((name, _P) for name in ("kda_g_b", "kda_o_norm", "kda_o_proj", "conv_pool", "state_pool")),
        ("kda_heads", _I),
        ("kda_head_dim", _I),
        ("conv_width", _I),
        ("kda_scale", _F),
        ("norm_eps", _F),
        *((name, _P) for name in ("mla_in_proj", "mla_kv_norm", "mla_kv_b", "mla_o_proj", "kv_cache")),
        *((name, _I) for name in ("mla_heads", "nope_dim", "rope_dim", "v_dim", "kv_rank", "block_size")),
        ("mla_scale", _F),
        ("mla_pad", _F),
        ("moe", _I),
        ("gate_up", _P),
        ("down", _P),
        ("intermediate", _I),
        *((name, _P) for name in ("router", "router_bias", "experts_gate_up", "experts_down")),
        *((name, _I) for name in ("experts", "groups", "topk_group", "top_k", "renormalize", "expert_intermediate")),
        ("scaling", _F),
        ("moe_pad", _F),
    ]


def available() -> bool:
    """Whether the C library is built."""
    return native_library() is not None


def decode_layers(
    x: torch.Tensor,
    layers: ctypes.Array[DecodeLayer],
    *,
    slots: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scratch_floats: int,
) -> torch.Tensor:
    """``x [B, D]`` fp32, one decode row per sequence, through every layer of ``layers`` -> ``[B, D]`` fp32;
    the layers' pools advanced in place (``slots [B]`` the recurrent state slots, ``slot_mapping [B]`` each
    row's flat latent cache index, ``block_tables [B, *]`` and ``context_lens [B]`` the latent cache's).
    ``scratch_floats``: the most scratch any layer needs (the caller's sizing)."""
    library = native_library()
    assert library is not None, "call available() first"
    out = x.contiguous().clone()
    # Held in names: a temporary's memory would be freed before the call reads it.
    slots64, mapping, tables, lengths = (
        t.to(torch.int64).contiguous() for t in (slots, slot_mapping, block_tables, context_lens)
    )
    status = library.met_decode_layers(
        out.data_ptr(),
        out.shape[0],
        out.shape[1],
        ctypes.addressof(layers),
        len(layers),
        slots64.data_ptr(),
        mapping.data_ptr(),
        tables.data_ptr(),
        tables.stride(0),
        lengths.data_ptr(),
        scratch_floats,
        torch.get_num_threads(),
    )
    if status == -1:
        raise IndexError("an expert id is outside the model's experts")
    if status != 0:
        raise MemoryError("the C decoder layers could not allocate their scratch rows")
    return out
