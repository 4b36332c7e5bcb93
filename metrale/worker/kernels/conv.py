"""Depthwise causal short convolution with SiLU, the token mixer in front of every KDA layer.

A sequence's conv state is its last ``W - 1`` inputs, oldest first: ``conv_states[slot]`` is
``[D, W - 1]`` with column ``W - 2`` the most recent token. A fresh sequence behaves as if it were
preceded by ``W - 1`` zero inputs. Arithmetic runs in ``weight.dtype``; outputs come back in
``x.dtype`` and the pool keeps its own dtype.
"""

from __future__ import annotations

import torch

from metrale.worker.kernels.pool_rows import PoolRows


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
    context = conv_states[slots].to(weight.dtype).masked_fill_(~has_initial_state.view(-1, 1, 1), 0.0)
    extended, row_at, block_end = _after_context(x.to(weight.dtype), context.transpose(1, 2), cu_seqlens)
    y = _silu(_depthwise_causal(extended, weight)[row_at - state_len])
    last_inputs = block_end.unsqueeze(1) - state_len + torch.arange(state_len, device=x.device)  # [S, W-1]
    conv_states[slots] = extended[last_inputs].transpose(1, 2).to(conv_states.dtype)
    return y.to(x.dtype)


def _after_context(
    x: torch.Tensor, context: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each sequence's rows of ``x [N, D]`` right after its ``C`` rows of ``context [S, C, D]``.

    Returns: ``extended [N + S*C, D]`` = ``[context_0, x_0, context_1, x_1, ...]``, ``row_at [N]`` (where
    each row of ``x`` went) and ``block_end [S]`` (one past each sequence's last row).
    """
    num_sequences, context_len = context.shape[0], context.shape[1]
    sequence = torch.arange(num_sequences, device=x.device)
    row_at = torch.arange(x.shape[0], device=x.device) + context_len * (
        torch.repeat_interleave(sequence, cu_seqlens.diff()) + 1
    )
    context_at = cu_seqlens[:-1] + context_len * sequence
    extended = x.new_empty((x.shape[0] + num_sequences * context_len, x.shape[1]))
    extended[row_at] = x
    extended[(context_at.unsqueeze(1) + torch.arange(context_len, device=x.device)).flatten()] = context.flatten(0, 1)
    return extended, row_at, cu_seqlens[1:] + context_len * (sequence + 1)


def _depthwise_causal(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``[R, D]`` rows, ``[D, W]`` taps -> ``[R - W + 1, D]``: output ``i`` mixes rows ``i .. i + W - 1``."""
    count = rows.shape[0] - weight.shape[1] + 1
    return _mix_taps([rows[tap : tap + count] for tap in range(weight.shape[1])], weight)


def _silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU as ``x / (1 + exp(-x))``, which rounds an element the same wherever it sits in the tensor.
    ``F.silu`` does not on every CPU (on AVX2 its vectorized body and its scalar tail differ in the last
    bit), and that would make a token's output depend on its place in the batch."""
    return x / (1 + torch.exp(-x))


def _mix_taps(taps: list[torch.Tensor], weight: torch.Tensor) -> torch.Tensor:
    """``sum_w taps[w] * weight[:, w]`` for ``W`` contiguous ``[R, D]`` inputs, oldest first.

    Prefill and decode both mix through here, on the same memory layout, so a token's output is
    rounded the same whichever path computes it.
    """
    columns = weight.T.contiguous()  # [W, D]
    mixed, product = taps[0] * columns[0], torch.empty_like(taps[0])
    for tap in range(1, len(taps)):
        mixed += torch.mul(taps[tap], columns[tap], out=product)
    return mixed


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
    history = PoolRows.take(conv_states, slots)  # rows [B, D, W-1]
    x_rows = history.to_rows(x)
    previous = history.rows.permute(2, 0, 1).to(weight.dtype).contiguous()  # [W-1, B, D]
    mixed = _mix_taps([*previous, x_rows.to(weight.dtype)], weight)
    history.rows[..., :-1] = previous[1:].permute(1, 2, 0)  # shift out the oldest input
    history.rows[..., -1] = x_rows
    history.commit()
    return history.to_batch(_silu(mixed)).to(x.dtype)
