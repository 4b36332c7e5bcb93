"""What a model family gives the rest of the worker: how to read its config, build its decoder and load
its weights. One :class:`Family` per module in ``families/``, listed in ``families/registry.py``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from metrale.worker.model.batch import BatchLayout
from metrale.worker.model.state import StatePool
from metrale.worker.model.state_layout import StateLayout
from metrale.worker.model.weight_recipe import FusedTensors, WeightMap


class FamilyConfig(Protocol):
    """The fields every family's config has (each family's frozen dataclass holds more)."""

    family: ClassVar[str]

    @property
    def vocab_size(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def num_hidden_layers(self) -> int: ...

    @property
    def max_position_embeddings(self) -> int: ...

    @property
    def tie_word_embeddings(self) -> bool: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def pad_token_id(self) -> int | None: ...

    @property
    def dtype(self) -> str: ...

    @property
    def state_layout(self) -> StateLayout: ...

    def to_dict(self) -> dict[str, Any]: ...


class FamilyModel(Protocol):
    """A family's decoder (an ``nn.Module``): weights only, state in the pool it is handed."""

    config: Any
    embed_tokens: nn.Embedding

    @property
    def weight_dtype(self) -> torch.dtype: ...

    def __call__(self, layout: BatchLayout, pool: StatePool, logit_rows: torch.Tensor) -> torch.Tensor: ...

    def eval(self) -> Any: ...

    def named_parameters(self) -> Any: ...

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = ..., assign: bool = ...) -> Any: ...


@dataclass(frozen=True)
class Family:
    """One model family. ``architectures`` and ``model_types`` are the ``config.json`` values that name
    it; ``canonical_name`` maps a stored tensor's name to the one its weight map uses, or to None for a
    tensor that is not loaded (``skipped``: prefix → what those tensors are, logged once each);
    ``fused_tensors`` (from the config), when given, names the stored tensors the loader splits into
    the parts its weight map names."""

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    read_config: Callable[[dict[str, Any]], FamilyConfig]
    build_model: Callable[[Any], FamilyModel]
    weight_map: Callable[[Any], WeightMap]
    canonical_name: Callable[[str], str | None]
    skipped: Mapping[str, str] = field(default_factory=dict)
    fused_tensors: Callable[[Any], FusedTensors] | None = None
