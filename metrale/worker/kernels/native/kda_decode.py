"""The fused C KDA decode step (``kda_decode.c``); contract of ``kernels.kda.decode.kda_decode``."""

from __future__ import annotations

import torch

from metrale.worker.kernels.native.library import native_library


def supports(state_pool: torch.Tensor, slots: torch.Tensor) -> bool:
    """Whether the C kernel can run this call (CPU, fp32 contiguous pool, built library)."""
    return (
        state_pool.device.type == "cpu"
        and state_pool.dtype == torch.float32
        and state_pool.is_contiguous()
        and slots.device.type == "cpu"
        and native_library() is not None
    )


def kda_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Advance B sequences by one token each; ``state_pool[slots]`` is updated in place.

    Args:
        q, k: ``[B, H, K]`` raw queries and keys (L2-normalised in the kernel, ``q`` times ``scale``).
        v: ``[B, H, V]``.
        g: ``[B, H, K]`` log-decay per key channel.
        beta: ``[B, H]``.
        state_pool: fp32 contiguous ``[P, H, K, V]`` on the CPU (see ``supports``).
        slots: int64 ``[B]``, distinct.
        scale: query multiplier.

    Returns:
        ``o [B, H, V]`` in ``q.dtype``.
    """
    library = native_library()
    assert library is not None, "call supports() first"
    b, h, key_dim = q.shape
    value_dim = v.shape[-1]
    q32, k32, v32, g32, beta32 = (t.float().contiguous() for t in (q, k, v, g, beta))
    slots64 = slots.to(torch.int64).contiguous()
    out = torch.empty(b, h, value_dim, dtype=torch.float32)
    library.met_kda_decode(
        state_pool.data_ptr(),
        slots64.data_ptr(),
        q32.data_ptr(),
        k32.data_ptr(),
        v32.data_ptr(),
        g32.data_ptr(),
        beta32.data_ptr(),
        out.data_ptr(),
        b,
        h,
        key_dim,
        value_dim,
        scale,
        torch.get_num_threads(),
    )
    return out.to(q.dtype)
