"""Preallocated per-sequence state: KDA slots and the block-paged MLA latent cache."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from metrale.worker.model.config import ModelConfig
from metrale.worker.model.interface import SequenceState
from metrale.worker.model.precision import STATE_DTYPE


@dataclass(frozen=True)
class StateSizes:
    """Bytes of one sequence's state: constant KDA part plus MLA latents growing per token."""

    slot_bytes: int
    token_bytes: int

    def total(self, length: int) -> int:
        return self.slot_bytes + length * self.token_bytes


def state_sizes(config: ModelConfig, latent_dtype: torch.dtype) -> StateSizes:
    """State bytes per sequence for ``config``: KDA recurrent and conv states in fp32 (always), MLA
    latents in ``latent_dtype`` (the weight dtype)."""
    state, latent = STATE_DTYPE.itemsize, latent_dtype.itemsize
    kda = len(config.kda_layers)
    recurrent = config.linear_num_heads * config.linear_head_dim**2 * state
    conv = 3 * config.linear_dim * (config.linear_conv_kernel_dim - 1) * state
    return StateSizes(kda * (recurrent + conv), len(config.mla_layers) * config.latent_dim * latent)


class StatePool:
    """Every sequence's state, in pools the model indexes by slot id and block id.

    Per KDA layer: ``recurrent[i]`` ``[num_slots, H, K, V]`` and ``conv[i]`` ``[num_slots, 3·H·K, W-1]``
    (the last W-1 inputs of the short conv), both fp32 whatever the weights. Per MLA layer: ``kv[i]``
    ``[num_blocks, block_size, C + R]`` in ``latent_dtype``, the normalized KV latent and the shared key
    part of each cached token. Indexed by the layer's absolute number (``layer_idx``) through the dicts.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        num_blocks: int,
        block_size: int,
        latent_dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_slots < 1 or num_blocks < 1 or block_size < 1:
            raise ValueError("num_slots, num_blocks and block_size must be positive")
        self.config = config
        self.latent_dtype = latent_dtype
        self.sizes = state_sizes(config, latent_dtype)
        self.num_slots, self.num_blocks, self.block_size = num_slots, num_blocks, block_size
        h, k, w = config.linear_num_heads, config.linear_head_dim, config.linear_conv_kernel_dim
        self.recurrent = {
            i: torch.zeros(num_slots, h, k, k, dtype=STATE_DTYPE, device=device) for i in config.kda_layers
        }
        self.conv = {
            i: torch.zeros(num_slots, 3 * config.linear_dim, w - 1, dtype=STATE_DTYPE, device=device)
            for i in config.kda_layers
        }
        self.kv = {
            i: torch.zeros(num_blocks, block_size, config.latent_dim, dtype=latent_dtype, device=device)
            for i in config.mla_layers
        }

    def nbytes(self, length: int) -> int:
        """Bytes :meth:`export` produces for a sequence of ``length`` tokens."""
        return self.sizes.total(length)

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
        state: dict[str, torch.Tensor] = {}
        for i in self.recurrent:
            state[f"kda.{i}.recurrent"] = self.recurrent[i][slot].to("cpu", copy=True)
            state[f"kda.{i}.conv"] = self.conv[i][slot].to("cpu", copy=True)
        index = self._token_index(block_ids, length)
        for i, cache in self.kv.items():
            flat = cache.view(-1, cache.shape[-1])
            state[f"mla.{i}.kv"] = flat[index.to(cache.device)].to("cpu", copy=True)
        return state

    def import_(self, state: SequenceState, slot: int, block_ids: Sequence[int]) -> None:
        """Write ``state`` (from :meth:`export`) into ``slot`` and ``block_ids``."""
        expected = {f"kda.{i}.{part}" for i in self.recurrent for part in ("recurrent", "conv")}
        expected |= {f"mla.{i}.kv" for i in self.kv}
        if set(state) != expected:
            raise ValueError(f"state keys {sorted(state)} do not match this model's {sorted(expected)}")
        for i in self.recurrent:
            self.recurrent[i][slot].copy_(state[f"kda.{i}.recurrent"])
            self.conv[i][slot].copy_(state[f"kda.{i}.conv"])
        for i, cache in self.kv.items():
            latents = state[f"mla.{i}.kv"]
            index = self._token_index(block_ids, latents.shape[0]).to(cache.device)
            cache.view(-1, cache.shape[-1])[index] = latents.to(cache.device, cache.dtype)
