"""The C KDA recurrence (``kda_recurrence.c``): a pooled decode step and a varlen pooled prefill.

Both run each token through the same per-head update, so a token's output and state are bitwise the same
whether it was decoded or prefilled, alone or in any batch. Contracts: ``kernels.kda.decode.kda_decode``
and ``kernels.kda.chunked.kda_chunked_prefill``; the plain twin is ``kernels.kda.naive.kda_recurrent``.
"""

from __future__ import annotations

import torch

from metrale.worker.kernels.native.layouts import state_pool_fits
from metrale.worker.kernels.native.library import native_library


def supports(state_pool: torch.Tensor, slots: torch.Tensor) -> bool:
    """Whether the C kernels can run this call (CPU, fp32 contiguous pool, built library)."""
    return state_pool_fits(state_pool) and slots.device.type == "cpu" and native_library() is not None


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
    batch, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    q32, k32, v32, g32, beta32 = _fp32(q, k, v, g, beta)
    slots64 = slots.to(torch.int64).contiguous()
    out = torch.empty(batch, heads, value_dim, dtype=torch.float32)
    library.met_kda_decode(
        state_pool.data_ptr(),
        slots64.data_ptr(),
        q32.data_ptr(),
        k32.data_ptr(),
        v32.data_ptr(),
        g32.data_ptr(),
        beta32.data_ptr(),
        out.data_ptr(),
        batch,
        heads,
        key_dim,
        value_dim,
        scale,
        torch.get_num_threads(),
    )
    return out.to(q.dtype)


def kda_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Run a flat batch of sequence chunks through the recurrence, states read from and written to the pool.

    Args:
        q, k: ``[N, H, K]``; v: ``[N, H, V]``; g: ``[N, H, K]``; beta: ``[N, H]``. Sequence ``s`` owns
            rows ``cu_seqlens[s]:cu_seqlens[s+1]``.
        cu_seqlens: int64 ``[S+1]``, every length >= 1.
        state_pool: fp32 contiguous ``[P, H, K, V]`` on the CPU; ``state_pool[slots[s]]`` is the state
            entering sequence ``s`` and is overwritten with the state after it. Other rows are untouched.
        slots: int64 ``[S]``, distinct.
        has_initial_state: bool ``[S]``; False starts from zero, ignoring the pool row (may be garbage).
        scale: query multiplier.

    Returns:
        ``o [N, H, V]`` in ``q.dtype``.
    """
    library = native_library()
    assert library is not None, "call supports() first"
    rows, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    q32, k32, v32, g32, beta32 = _fp32(q, k, v, g, beta)
    slots64, bounds = slots.to(torch.int64).contiguous(), cu_seqlens.to(torch.int64).contiguous()
    initial = has_initial_state.to(torch.uint8).contiguous()
    out = torch.empty(rows, heads, value_dim, dtype=torch.float32)
    library.met_kda_prefill(
        state_pool.data_ptr(),
        slots64.data_ptr(),
        initial.data_ptr(),
        bounds.data_ptr(),
        q32.data_ptr(),
        k32.data_ptr(),
        v32.data_ptr(),
        g32.data_ptr(),
        beta32.data_ptr(),
        out.data_ptr(),
        slots64.numel(),
        heads,
        key_dim,
        value_dim,
        scale,
        torch.get_num_threads(),
    )
    return out.to(q.dtype)


def _fp32(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.float().contiguous() for t in tensors]
