"""The C short convolution (``conv.c``): a pooled decode step and a varlen pooled prefill.

Contracts: ``kernels.conv.causal_conv1d_update`` and ``kernels.conv.causal_conv1d_prefill`` (the plain
twins). Inputs may be row-strided views (the split of a fused projection); they are not copied.
"""

from __future__ import annotations

import torch

from metrale.worker.kernels.native.library import native_library


def supports(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor) -> bool:
    """Whether the C kernels can run this call (CPU, fp32 throughout, rows of unit stride, contiguous
    pool, built library)."""
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == conv_states.dtype == torch.float32
        and x.stride(-1) == 1
        and conv_states.is_contiguous()
        and weight.shape[1] >= 2
        and native_library() is not None
    )


def causal_conv1d_update(
    x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """Advance B sequences by one token each; ``conv_states[slots]`` is shifted in place.

    Args:
        x: ``[B, D]`` fp32, one new input per sequence.
        weight: ``[D, W]`` fp32 per-channel taps, ``W >= 2``.
        conv_states: fp32 contiguous ``[P, D, W-1]`` (see ``supports``).
        slots: int64 ``[B]``, distinct.

    Returns:
        ``[B, D]`` = SiLU(causal depthwise conv) at the new token.
    """
    library = native_library()
    assert library is not None, "call supports() first"
    batch, channels = x.shape
    taps, slots64 = weight.contiguous(), slots.to(torch.int64).contiguous()
    out = x.new_empty(batch, channels)
    library.met_conv_update(
        conv_states.data_ptr(),
        slots64.data_ptr(),
        x.data_ptr(),
        x.stride(0),
        taps.data_ptr(),
        out.data_ptr(),
        batch,
        channels,
        weight.shape[1],
        torch.get_num_threads(),
    )
    return out


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_states: torch.Tensor,
    slots: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """Convolve a flat batch of sequence chunks, each continuing from (or starting) its pooled state.

    Args:
        x: ``[N, D]`` fp32; sequence ``s`` owns rows ``cu_seqlens[s]:cu_seqlens[s+1]``.
        weight: ``[D, W]`` fp32 per-channel taps, ``weight[:, W-1]`` multiplies the current token.
        cu_seqlens: int64 ``[S+1]``, every sequence length >= 1.
        conv_states: fp32 contiguous ``[P, D, W-1]``; ``conv_states[slots[s]]`` is overwritten with the
            last ``W-1`` inputs of sequence ``s``. Other slots are not touched.
        slots: int64 ``[S]``, distinct.
        has_initial_state: bool ``[S]``; False means the pooled state is ignored and the left context is zero.

    Returns:
        ``[N, D]`` = SiLU(causal depthwise conv).
    """
    library = native_library()
    assert library is not None, "call supports() first"
    rows, channels = x.shape
    columns = weight.T.contiguous()
    slots64, bounds = slots.to(torch.int64).contiguous(), cu_seqlens.to(torch.int64).contiguous()
    initial = has_initial_state.to(torch.uint8).contiguous()
    out = x.new_empty(rows, channels)
    failed = library.met_conv_prefill(
        conv_states.data_ptr(),
        slots64.data_ptr(),
        initial.data_ptr(),
        bounds.data_ptr(),
        x.data_ptr(),
        x.stride(0),
        columns.data_ptr(),
        out.data_ptr(),
        slots64.numel(),
        channels,
        weight.shape[1],
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError("the C short-conv prefill could not allocate its history buffers")
    return out
