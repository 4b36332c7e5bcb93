"""Running a layer's state kernels over a flat batch: the decode rows and the prefill chunks apart."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from metrale.worker.kernels.ops import causal_conv1d_prefill, causal_conv1d_update
from metrale.worker.model.batch import BatchLayout

RowsKernel = Callable[[slice], torch.Tensor]
"""Given the slice of rows (which is also the slice of sequences, see :func:`by_row_kind`), its output."""


def by_row_kind(
    layout: BatchLayout, decode: RowsKernel, prefill: RowsKernel, states: torch.Tensor | None = None
) -> torch.Tensor:
    """``decode`` over the decode rows, ``prefill`` over the rest, concatenated in row order.

    Decode sequences come first with one row each, so the slice ``[0, num_decode)`` selects both their
    rows and their sequences (``layout.slots``…), and ``[num_decode, …)`` both the prefill rows and the
    prefill sequences (with ``layout.prefill_cu_seqlens`` as their offsets).

    With ``verify`` rows (``BatchLayout.verify``), ``decode`` runs the plain decode rows, then each
    verify step's rows in turn — a verify chunk's tokens one at a time, each on the state its previous
    token left, exactly as decode steps — and ``states`` (the pool tensor ``decode`` advances in place)
    is saved after each step for the chunks that go on (``VerifyRows.save``).
    """
    d = layout.num_decode
    verify = layout.verify
    if verify is not None:
        if states is None:
            raise ValueError("a forward with verify rows needs the states the kernel advances")
        parts = [decode(slice(0, verify.first_row))] if verify.first_row else []
        for step, rows in enumerate(verify.step_rows()):
            parts.append(decode(rows))
            verify.save(states, step, layout.slots[rows])
        if d < layout.num_rows:
            parts.append(prefill(slice(d, None)))
        return torch.cat(parts) if len(parts) > 1 else parts[0]
    if d == layout.num_rows:
        return decode(slice(0, d))
    if d == 0:
        return prefill(slice(0, None))
    return torch.cat([decode(slice(0, d)), prefill(slice(d, None))])


class DeltaDecode(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        decay: torch.Tensor,
        beta: torch.Tensor,
        states: torch.Tensor,
        slots: torch.Tensor,
        scale: float,
        /,
    ) -> torch.Tensor: ...


class DeltaPrefill(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        decay: torch.Tensor,
        beta: torch.Tensor,
        cu_seqlens: torch.Tensor,
        states: torch.Tensor,
        slots: torch.Tensor,
        has_initial_state: torch.Tensor,
        scale: float,
        /,
    ) -> torch.Tensor: ...


def delta_recurrence(
    decode: DeltaDecode,
    prefill: DeltaPrefill,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    layout: BatchLayout,
    states: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """A gated delta rule's recurrence over a batch (KDA's or Gated DeltaNet's kernels, ``ops``' contracts):
    ``decode`` over the decode and verify rows, ``prefill`` over the prefill chunks (:func:`by_row_kind`).
    ``q, k, v, decay, beta`` hold one row per token (``[N, H, *]``); ``states`` is the pool both advance."""

    def decode_rows(rows: slice) -> torch.Tensor:
        return decode(q[rows], k[rows], v[rows], decay[rows], beta[rows], states, layout.slots[rows], scale)

    def prefill_rows(rows: slice) -> torch.Tensor:
        return prefill(
            q[rows],
            k[rows],
            v[rows],
            decay[rows],
            beta[rows],
            layout.prefill_cu_seqlens,
            states,
            layout.slots[rows],
            layout.has_initial_state[rows],
            scale,
        )

    return by_row_kind(layout, decode_rows, prefill_rows, states)


def short_conv(qkv: torch.Tensor, weight: torch.Tensor, layout: BatchLayout, states: torch.Tensor) -> torch.Tensor:
    """A linear-attention layer's causal short convolution over a batch: ``qkv [N, C]``, ``weight [C, W]``,
    ``states`` the conv state pool both kernels advance; decode/verify and prefill rows as :func:`by_row_kind`."""

    def decode(rows: slice) -> torch.Tensor:
        return causal_conv1d_update(qkv[rows], weight, states, layout.slots[rows])

    def prefill(rows: slice) -> torch.Tensor:
        return causal_conv1d_prefill(
            qkv[rows], weight, layout.prefill_cu_seqlens, states, layout.slots[rows], layout.has_initial_state[rows]
        )

    return by_row_kind(layout, decode, prefill, states)
