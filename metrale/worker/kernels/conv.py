"""Depthwise causal short convolution with SiLU, the token mixer in front of every KDA layer.

A sequence's conv state is its last ``W - 1`` inputs, oldest first: ``conv_states[slot]`` is
``[D, W - 1]`` with column ``W - 2`` the most recent token. A fresh sequence behaves as if it were
preceded by ``W - 1`` zero inputs. Arithmetic runs in ``weight.dtype``; outputs come back in
``x.dtype`` and the pool keeps its own dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _keep_last(window: torch.Tensor, count: int) -> torch.Tensor:
    """The last ``count`` columns of ``window [..., L]`` (``count`` may be 0)."""
    return window[..., window.shape[-1] - count :]


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
        x: ``[N, D]`` inputs; sequence ``s`` owns rows ``cu_seqlens[s]:cu_seqlens[s+1]``.
        weight: ``[D, W]`` per-channel taps, ``weight[:, W-1]`` multiplies the current token.
        cu_seqlens: int64 ``[S+1]``, every sequence length >= 1.
        conv_states: ``[P, D, W-1]`` state pool; ``conv_states[slots[s]]`` is overwritten in place
            with the last ``W-1`` inputs of sequence ``s``. Other slots are not touched.
        slots: int64 ``[S]``, distinct.
        has_initial_state: bool ``[S]``; False means the pooled state is ignored (it may be garbage)
            and the left context is zero.

    Returns:
        ``[N, D]`` = SiLU(causal depthwise conv), in ``x.dtype``.
    """
    state_len = weight.shape[1] - 1
    taps = weight.unsqueeze(1)  # [D, 1, W], the layout of a grouped conv1d
    y = torch.empty_like(x)
    bounds = cu_seqlens.tolist()
    for s, (slot, carried) in enumerate(zip(slots.tolist(), has_initial_state.tolist(), strict=True)):
        start, end = bounds[s], bounds[s + 1]
        context = conv_states[slot].to(weight.dtype)
        if not carried:
            context = torch.zeros_like(context)
        window = torch.cat([context, x[start:end].T.to(weight.dtype)], dim=1)  # [D, W-1 + L]
        mixed = F.conv1d(window.unsqueeze(0), taps, groups=weight.shape[0]).squeeze(0)  # [D, L]
        y[start:end] = F.silu(mixed).T.to(x.dtype)
        conv_states[slot] = _keep_last(window, state_len).to(conv_states.dtype)
    return y


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Advance B sequences by one token each, all at once.

    Args:
        x: ``[B, D]``, one new input per sequence.
        weight: ``[D, W]`` per-channel taps.
        conv_states: ``[P, D, W-1]`` state pool, read at ``slots`` and shifted there in place.
        slots: int64 ``[B]``, distinct.

    Returns:
        ``[B, D]`` = SiLU(causal depthwise conv) at the new token, in ``x.dtype``.
    """
    state_len = weight.shape[1] - 1
    history = conv_states[slots].to(weight.dtype)  # [B, D, W-1]
    window = torch.cat([history, x.to(weight.dtype).unsqueeze(-1)], dim=-1)  # [B, D, W]
    mixed = (window * weight).sum(dim=-1)
    conv_states[slots] = _keep_last(window, state_len).to(conv_states.dtype)
    return F.silu(mixed).to(x.dtype)
