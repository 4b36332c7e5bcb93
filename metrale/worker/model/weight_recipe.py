"""How one of our parameters is made from checkpoint tensors: a *recipe*, shared by every family's weight map.

A parameter has one or more recipes (checkpoint layouts differ). A recipe names its source tensors with
their expected shapes and where each one goes in the parameter: ``place`` maps the parameter's buffer to
one view per source, so the loader copies every source straight into its final place (no concatenated
copy). The views of a recipe cover the buffer exactly once, each holding its source's number of elements
(the source is reshaped to it: ``A_log`` ``[1, 1, H, 1]`` → ``[H]``, a conv weight ``[C, 1, W]`` → ``[C, W]``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

Place = Callable[[torch.Tensor], list[torch.Tensor]]
"""A parameter's buffer → the view each source is copied into, in the order of the sources."""

WeightMap = dict[str, list["Recipe"]]
"""Our parameter name → its recipes, in order of preference."""


@dataclass(frozen=True)
class Recipe:
    sources: tuple[tuple[str, tuple[int, ...]], ...]  # (canonical tensor name, expected shape)
    place: Place


def whole(buffer: torch.Tensor) -> list[torch.Tensor]:
    """One source fills the whole parameter."""
    return [buffer]


def rows(sizes: Sequence[int]) -> Place:
    """Sources stacked along dim 0 (``sizes[i]`` rows each): the concatenation, without concatenating."""
    return lambda buffer: list(buffer.split(list(sizes), dim=0))


def recipe(sources: Sequence[tuple[str, tuple[int, ...]]], place: Place | None = None) -> Recipe:
    """A recipe from ``(name, shape)`` sources; by default one source fills the parameter, several are
    stacked along dim 0 in the order given."""
    return Recipe(tuple(sources), place or (rows([s[0] for _, s in sources]) if len(sources) > 1 else whole))


@dataclass(frozen=True)
class StoredPart:
    """A tensor a weight map names that a checkpoint stores inside a fused one: its canonical ``name``,
    its ``shape``, and ``take``, which makes it (a new tensor) from the fused tensor."""

    name: str
    shape: tuple[int, ...]
    take: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class FusedTensor:
    """A stored tensor of ``shape`` that the loader presents as its ``parts`` (and never as itself)."""

    shape: tuple[int, ...]
    parts: tuple[StoredPart, ...]


FusedTensors = Callable[[str], FusedTensor | None]
"""A stored tensor's canonical name → how it splits into the tensors a weight map names, or None when it
is loaded as stored. A family whose checkpoints fuse what its weight map keeps apart provides one (built
from its config: ``Family.fused_tensors``)."""
