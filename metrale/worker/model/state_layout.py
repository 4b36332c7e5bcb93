"""The shape of one sequence's state, as a family describes it: the two kinds of per-sequence state.

Every family Metrale serves mixes two kinds of layer, and so holds two kinds of state per sequence:

- a **recurrent** layer (Kimi's KDA, Qwen's Gated DeltaNet) keeps a constant-size state in a *slot*:
  a recurrence state ``[H, K, V]`` and the last ``W - 1`` inputs of its short conv ``[C, W - 1]``,
  both fp32 whatever the weights;
- an **attention** layer (Kimi's MLA, Qwen's gated GQA) caches something per token, in *blocks* of
  the paged cache, in the weight dtype: ``token_shape`` values per token (MLA: the latent
  ``[C + R]``; GQA: keys and values ``[2, Hkv, D]``).

The kinds' names (``kda``/``mla``, ``gdn``/``gqa``) prefix the keys of an exported state, so a state
says which family wrote it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StateLayout:
    """What a :class:`~metrale.worker.model.state.StatePool` allocates for one family's model."""

    family: str
    recurrent_kind: str
    recurrent_layers: tuple[int, ...]
    recurrent_shape: tuple[int, int, int]  # [H, K, V]
    conv_channels: int
    conv_kernel: int  # W; the conv state keeps W - 1 inputs
    attention_kind: str
    attention_layers: tuple[int, ...]
    token_shape: tuple[int, ...]  # values cached per token per attention layer

    @property
    def token_values(self) -> int:
        """Values one token adds to one attention layer's cache."""
        return math.prod(self.token_shape)

    def slot_bytes(self, state_itemsize: int) -> int:
        """Bytes of one sequence's recurrent part (every recurrent layer's state and conv state)."""
        recurrent = math.prod(self.recurrent_shape)
        conv = self.conv_channels * (self.conv_kernel - 1)
        return len(self.recurrent_layers) * (recurrent + conv) * state_itemsize

    def token_bytes(self, cache_itemsize: int) -> int:
        """Bytes one token adds to a sequence's attention caches (every attention layer)."""
        return len(self.attention_layers) * self.token_values * cache_itemsize
