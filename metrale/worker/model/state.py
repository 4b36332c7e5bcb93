"""Preallocated per-sequence state: recurrent slots and the block-paged attention cache.

What is allocated comes from the family's :class:`StateLayout` (KDA + MLA latents for Kimi Linear, Gated
DeltaNet + GQA keys and values for Qwen3.5); the pool itself knows no family.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from metrale.worker.model.interface import SequenceState
from metrale.worker.model.precision import STATE_DTYPE
from metrale.worker.model.state_layout import StateLayout


class HasStateLayout(Protocol):
    """A family's config: it says what one sequence's state holds."""

    @property
    def state_layout(self) -> StateLayout: ...


@dataclass(frozen=True)
class StateSizes:
    """Bytes of one sequence's state: constant recurrent part plus attention caches growing per token."""

    slot_bytes: int
    token_bytes: int

    def total(self, length: int) -> int:
        return self.slot_bytes + length * self.token_bytes


def state_sizes(config: HasStateLayout, cache_dtype: torch.dtype) -> StateSizes:
    """State bytes per sequence for ``config``: recurrent and conv states in fp32 (always), attention
    caches (MLA latents, GQA keys and values) in ``cache_dtype`` (the weight dtype)."""
    layout = config.state_layout
    return StateSizes(layout.slot_bytes(STATE_DTYPE.itemsize), layout.token_bytes(cache_dtype.itemsize))


class StateMismatchError(ValueError):
    """A state that does not fit this model: another family's, or another shape's; the message says which."""


class StatePool:
    """Every sequence's state, in pools the model indexes by slot id and block id.

    Per recurrent layer (KDA, Gated DeltaNet): ``recurrent[i]`` ``[num_slots, H, K, V]`` and ``conv[i]``
    ``[num_slots, C, W-1]`` (the last W-1 inputs of the short conv), both fp32 whatever the weights. Per
    attention layer: ``kv[i]`` ``[num_blocks, block_size, *token_shape]`` in ``latent_dtype`` — MLA: the
    normalized KV latent and the shared key part ``[C + R]``; GQA: keys and values ``[2, Hkv, D]``.
    Indexed by the layer's absolute number (``layer_idx``) through the dicts.
    """

    def __init__(
        self,
        config: HasStateLayout,
        num_slots: int,
        num_blocks: int,
        block_size: int,
        latent_dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_slots < 1 or num_blocks < 1 or block_size < 1:
            raise ValueError("num_slots, num_blocks and block_size must be positive")
        self.config = config
        self.layout = layout = config.state_layout
        self.latent_dtype = latent_dtype
        self.sizes = state_sizes(config, latent_dtype)
        self.num_slots, self.num_blocks, self.block_size = num_slots, num_blocks, block_size
        conv_shape = (num_slots, layout.conv_channels, layout.conv_kernel - 1)
        self.recurrent = {
            i: torch.zeros(num_slots, *layout.recurrent_shape, dtype=STATE_DTYPE, device=device)
            for i in layout.recurrent_layers
        }
        self.conv = {i: torch.zeros(conv_shape, dtype=STATE_DTYPE, device=device) for i in layout.recurrent_layers}
        self.kv = {
            i: torch.zeros(num_blocks, block_size, *layout.token_shape, dtype=latent_dtype, device=device)
            for i in layout.attention_layers
        }

    def nbytes(self, length: int) -> int:
        """Bytes :meth:`export` produces for a sequence of ``length`` tokens."""
        return self.sizes.total(length)

    def copy_slot(self, source: int, target: int) -> None:
        """Copy every recurrent layer's state (recurrent and conv) of slot ``source`` into slot ``target``; the
        attention caches are addressed by block, not slot, so they are shared by whoever holds the blocks."""
        for i in self.recurrent:
            self.recurrent[i][target].copy_(self.recurrent[i][source])
            self.conv[i][target].copy_(self.conv[i][source])

    def _token_index(self, block_ids: Sequence[int], length: int) -> torch.Tensor:
        """Flat cache index ``[length]`` of positions ``0..length-1`` laid out over ``block_ids``."""
        needed = -(-length // self.block_size)
        if len(block_ids) < needed:
            raise ValueError(f"{len(block_ids)} blocks cannot hold {length} tokens of {self.block_size}")
        positions = torch.arange(length)
        blocks = torch.as_tensor(list(block_ids[:needed]), dtype=torch.long)
        return blocks[positions // self.block_size] * self.block_size + positions % self.block_size

    def export(self, slot: int, block_ids: Sequence[int], length: int) -> dict[str, torch.Tensor]:
        """Copy out a sequence's state after ``length`` tokens as CPU tensors (bit-exact)."""
        rec, att = self.layout.recurrent_kind, self.layout.attention_kind
        state: dict[str, torch.Tensor] = {}
        for i in self.recurrent:
            state[f"{rec}.{i}.recurrent"] = self.recurrent[i][slot].to("cpu", copy=True)
            state[f"{rec}.{i}.conv"] = self.conv[i][slot].to("cpu", copy=True)
        index = self._token_index(block_ids, length)
        for i, cache in self.kv.items():
            flat = cache.view(-1, *self.layout.token_shape)
            state[f"{att}.{i}.kv"] = flat[index.to(cache.device)].to("cpu", copy=True)
        return state

    def import_(self, state: SequenceState, slot: int, block_ids: Sequence[int]) -> None:
        """Write ``state`` (from :meth:`export`) into ``slot`` and ``block_ids``.

        Raises:
            StateMismatchError: the state was written by another family's model, or by one of another shape.
        """
        self._check_keys(state)
        rec, att = self.layout.recurrent_kind, self.layout.attention_kind
        for i in self.recurrent:
            self.recurrent[i][slot].copy_(state[f"{rec}.{i}.recurrent"])
            self.conv[i][slot].copy_(state[f"{rec}.{i}.conv"])
        for i, cache in self.kv.items():
            cached = state[f"{att}.{i}.kv"]
            index = self._token_index(block_ids, cached.shape[0]).to(cache.device)
            cache.view(-1, *self.layout.token_shape)[index] = cached.to(cache.device, cache.dtype)

    def _check_keys(self, state: SequenceState) -> None:
        rec, att = self.layout.recurrent_kind, self.layout.attention_kind
        expected = {f"{rec}.{i}.{part}" for i in self.recurrent for part in ("recurrent", "conv")}
        expected |= {f"{att}.{i}.kv" for i in self.kv}
        if set(state) == expected:
            return
        kinds = sorted({key.partition(".")[0] for key in state})
        if kinds and not set(kinds) <= {rec, att}:
            raise StateMismatchError(
                f"the state holds {'/'.join(kinds)} layers, written by another model family; "
                f"this {self.layout.family} model's state is {rec}/{att}"
            )
        raise StateMismatchError(f"state keys {sorted(state)} do not match this model's {sorted(expected)}")
