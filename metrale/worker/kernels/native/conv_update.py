"""The C short-conv decode step (``conv_update.c``); contract of ``kernels.conv.causal_conv1d_update``."""

from __future__ import annotations

import torch

from metrale.worker.kernels.native.library import native_library


def supports(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor) -> bool:
    """Whether the C kernel can run this call (CPU, fp32 throughout, contiguous pool, built library)."""
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == conv_states.dtype == torch.float32
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
    x32, taps = x.contiguous(), weight.contiguous()
    slots64 = slots.to(torch.int64).contiguous()
    out = torch.empty_like(x32)
    library.met_conv_update(
        conv_states.data_ptr(),
        slots64.data_ptr(),
        x32.data_ptr(),
        taps.data_ptr(),
        out.data_ptr(),
        batch,
        channels,
        weight.shape[1],
        torch.get_num_threads(),
    )
    return out
