"""Depthwise causal short convolution with SiLU over pooled conv states: decode update and varlen prefill.

The twins of ``metrale.worker.kernels.conv`` (same contracts). A conv state is a sequence's last
``W - 1`` inputs, oldest first (``conv_states[slot]`` is ``[D, W - 1]``). Sums run in fp32; outputs
come back in ``x.dtype`` and the pool keeps its own dtype.

Prefill takes two launches: the first computes every output (reading the entering states), the
second writes the states after each sequence; stream order keeps the reads before the writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.worker.kernels.triton.runtime import block_size, ensure_contiguous, ensure_launchable, sequence_of_rows

MAX_BLOCK_D = 256
BLOCK_TOKENS = 16


@triton.jit
def _silu(x):
    return x * tl.sigmoid(x)


@triton.jit
def _load_window(state_rows, x, channel_ok, first: tl.constexpr, W: tl.constexpr, BLOCK_W: tl.constexpr):
    """Columns ``first .. first + BLOCK_W - 1`` of ``[state (W - 1 columns) ++ x]``, zero past column W - 1.

    ``state_rows`` are ``[BLOCK_D]`` pointers to each channel's state; ``x`` is ``[BLOCK_D]`` fp32.
    """
    source = tl.arange(0, BLOCK_W) + first
    held = tl.load(
        state_rows[:, None] + source[None, :],
        mask=channel_ok[:, None] & (source[None, :] < W - 1),
        other=0.0,
    ).to(tl.float32)
    return tl.where(source[None, :] == W - 1, x[:, None], held)


@triton.jit
def _conv_update_kernel(
    x_ptr,  # [B, D]
    weight_ptr,  # [D, W]
    states_ptr,  # [P, D, W - 1], contiguous
    slots_ptr,  # int64 [B]
    y_ptr,  # [B, D]
    D: tl.constexpr,
    W: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    seq, channel_tile = tl.program_id(0), tl.program_id(1)
    channels = channel_tile * BLOCK_D + tl.arange(0, BLOCK_D)
    channel_ok = channels < D
    taps = tl.arange(0, BLOCK_W)
    slot = tl.load(slots_ptr + seq)
    state_rows = states_ptr + (slot * D + channels) * (W - 1)

    x = tl.load(x_ptr + seq * D + channels, mask=channel_ok, other=0.0).to(tl.float32)
    weight_ok = channel_ok[:, None] & (taps[None, :] < W)
    weight = tl.load(weight_ptr + channels[:, None] * W + taps[None, :], mask=weight_ok, other=0.0)
    window = _load_window(state_rows, x, channel_ok, 0, W, BLOCK_W)
    y = _silu(tl.sum(window * weight.to(tl.float32), 1))
    tl.store(y_ptr + seq * D + channels, y.to(y_ptr.dtype.element_ty), mask=channel_ok)

    shifted = _load_window(state_rows, x, channel_ok, 1, W, BLOCK_W)
    tl.debug_barrier()  # every thread's reads of this state precede any thread's writes
    state_ok = channel_ok[:, None] & (taps[None, :] < W - 1)
    tl.store(state_rows[:, None] + taps[None, :], shifted.to(states_ptr.dtype.element_ty), mask=state_ok)


@triton.jit
def _conv_prefill_kernel(
    x_ptr,  # [N, D]
    weight_ptr,  # [D, W]
    states_ptr,  # [P, D, W - 1], contiguous; only read here
    row_seq_ptr,  # int64 [N], the sequence of each row
    cu_seqlens_ptr,  # int64 [S + 1]
    slots_ptr,  # int64 [S]
    carried_ptr,  # int32 [S], 1 where the sequence continues its pooled state
    y_ptr,  # [N, D]
    N,
    D: tl.constexpr,
    W: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # rows * D may pass 2**31
    channels = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok, channel_ok = rows < N, channels < D
    seq = tl.load(row_seq_ptr + rows, mask=row_ok, other=0)
    bos = tl.load(cu_seqlens_ptr + seq, mask=row_ok, other=0)
    slot = tl.load(slots_ptr + seq, mask=row_ok, other=0)
    carried = tl.load(carried_ptr + seq, mask=row_ok, other=0) != 0

    mixed = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for tap in tl.static_range(W):
        source = rows - (W - 1) + tap  # input row this tap reads; before `bos` it lies in the state
        in_chunk = (source >= bos) & row_ok
        from_state = (source < bos) & carried & row_ok
        x = tl.load(x_ptr + source[:, None] * D + channels[None, :], mask=in_chunk[:, None] & channel_ok[None, :])
        # For source < bos, W - 1 + (source - bos) is in [0, W - 2]: a column of the entering state.
        state_column = (slot[:, None] * D + channels[None, :]) * (W - 1) + (W - 1 + source - bos)[:, None]
        held = tl.load(states_ptr + state_column, mask=from_state[:, None] & channel_ok[None, :])
        inputs = tl.where(in_chunk[:, None], x.to(tl.float32), held.to(tl.float32))
        inputs = tl.where((in_chunk | from_state)[:, None], inputs, 0.0)
        weight = tl.load(weight_ptr + channels * W + tap, mask=channel_ok, other=0.0).to(tl.float32)
        mixed += inputs * weight[None, :]
    y = _silu(mixed)
    tl.store(
        y_ptr + rows[:, None] * D + channels[None, :],
        y.to(y_ptr.dtype.element_ty),
        mask=row_ok[:, None] & channel_ok[None, :],
    )


@triton.jit
def _conv_final_state_kernel(
    x_ptr,  # [N, D]
    states_ptr,  # [P, D, W - 1], contiguous
    cu_seqlens_ptr,  # int64 [S + 1]
    slots_ptr,  # int64 [S]
    carried_ptr,  # int32 [S]
    D: tl.constexpr,
    W: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    seq = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    channel_ok = channels < D
    bos, eos = tl.load(cu_seqlens_ptr + seq), tl.load(cu_seqlens_ptr + seq + 1)
    slot, carried = tl.load(slots_ptr + seq), tl.load(carried_ptr + seq)
    state_rows = states_ptr + (slot * D + channels) * (W - 1)

    # Column c of the new state is column (length + c) of [entering state (W - 1 columns) ++ x rows].
    columns = tl.arange(0, BLOCK_W)
    source = eos - bos + columns
    from_x = source >= W - 1
    x_rows = bos + source - (W - 1)
    x = tl.load(x_ptr + x_rows[None, :] * D + channels[:, None], mask=channel_ok[:, None] & from_x[None, :])
    # A fresh sequence reads no state (its bound, (W - 1) * carried, is 0).
    from_state = source < (W - 1) * carried
    held = tl.load(state_rows[:, None] + source[None, :], mask=channel_ok[:, None] & from_state[None, :])
    kept = tl.where(from_x[None, :], x.to(tl.float32), tl.where(from_state[None, :], held.to(tl.float32), 0.0))
    tl.debug_barrier()  # every thread's reads of this state precede any thread's writes
    state_ok = channel_ok[:, None] & (columns[None, :] < W - 1)
    tl.store(state_rows[:, None] + columns[None, :], kept.to(states_ptr.dtype.element_ty), mask=state_ok)


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Advance B sequences by one token each; the contract of ``kernels.conv.causal_conv1d_update``.

    Args:
        x: ``[B, D]``, one new input per sequence.
        weight: ``[D, W]`` per-channel taps, ``weight[:, W-1]`` multiplies the new input.
        conv_states: contiguous ``[P, D, W-1]``, read at ``slots`` and shifted there in place; other
            rows are neither read nor written.
        slots: int64 ``[B]``, distinct.

    Returns:
        ``[B, D]`` = SiLU(causal depthwise conv) at the new token, in ``x.dtype``.
    """
    ensure_launchable(_conv_update_kernel, x)
    ensure_contiguous(conv_states, "conv_states")
    batch, dim = x.shape
    width = weight.shape[1]
    y = torch.empty(batch, dim, dtype=x.dtype, device=x.device)
    if batch == 0:
        return y
    block_d = block_size(dim, maximum=MAX_BLOCK_D)
    _conv_update_kernel[(batch, triton.cdiv(dim, block_d))](
        x.contiguous(),
        weight.contiguous(),
        conv_states,
        slots,
        y,
        D=dim,
        W=width,
        BLOCK_D=block_d,
        BLOCK_W=block_size(width),
    )
    return y


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_states: torch.Tensor,
    slots: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """Convolve a flat batch of sequence chunks; the contract of ``kernels.conv.causal_conv1d_prefill``.

    Args:
        x: ``[N, D]`` inputs; sequence ``s`` owns rows ``cu_seqlens[s]:cu_seqlens[s+1]``.
        weight: ``[D, W]`` per-channel taps.
        cu_seqlens: int64 ``[S+1]``, every sequence length >= 1.
        conv_states: contiguous ``[P, D, W-1]``; ``conv_states[slots[s]]`` is overwritten in place with
            the last ``W-1`` inputs of sequence ``s``. Other rows are neither read nor written.
        slots: int64 ``[S]``, distinct.
        has_initial_state: bool ``[S]``; False means a zero left context, the pool row is not read.

    Returns:
        ``[N, D]`` = SiLU(causal depthwise conv), in ``x.dtype``.
    """
    ensure_launchable(_conv_prefill_kernel, x)
    ensure_contiguous(conv_states, "conv_states")
    rows, dim = x.shape
    width = weight.shape[1]
    y = torch.empty(rows, dim, dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    x, carried = x.contiguous(), has_initial_state.to(torch.int32)
    block_d = block_size(dim, maximum=MAX_BLOCK_D)
    channel_tiles = triton.cdiv(dim, block_d)
    _conv_prefill_kernel[(triton.cdiv(rows, BLOCK_TOKENS), channel_tiles)](
        x,
        weight.contiguous(),
        conv_states,
        sequence_of_rows(cu_seqlens, rows),
        cu_seqlens,
        slots,
        carried,
        y,
        rows,
        D=dim,
        W=width,
        BLOCK_T=BLOCK_TOKENS,
        BLOCK_D=block_d,
    )
    _conv_final_state_kernel[(slots.shape[0], channel_tiles)](
        x,
        conv_states,
        cu_seqlens,
        slots,
        carried,
        D=dim,
        W=width,
        BLOCK_D=block_d,
        BLOCK_W=block_size(width - 1),
    )
    return y
