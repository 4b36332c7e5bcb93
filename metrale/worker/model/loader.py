"""Load a model of any served family from an HF folder: ``config.json`` + safetensors (single file or
sharded). The family (``families/registry.py``) decides the config, the decoder and the weight map.

Everything is checked before any weight is read: every tensor we need exists, has the expected shape,
and nothing in the checkpoint is left over. Any problem raises :class:`CheckpointError` naming the
tensor and the file; a model is returned whole or not at all.

No second copy of the weights is ever held: the model is built on the meta device, then each parameter
is allocated once in its final dtype and device, and each of its source tensors is read (one at a time)
straight into its place in it, cast on the way (``weight_map.Recipe.place``). The files holding a
parameter's sources are opened for that parameter only, so their memory maps — whose touched pages count
as resident memory while mapped — never span more than one parameter's sources. Peak memory is the
weights plus the largest parameter's sources.

A family whose checkpoints fuse tensors its weight map keeps apart (Qwen3-Next's ``in_proj_qkvz``,
interleaved per head) names them (``Family.fused_tensors``): each part is then a source of its own, read
by reading the fused tensor and taking the part (a permuting copy), so the extra memory is one fused
tensor and one part at a time.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from metrale.worker.model.families.family import Family, FamilyModel
from metrale.worker.model.families.registry import read_config
from metrale.worker.model.precision import DtypeChoice, parameter_dtype, weight_dtype
from metrale.worker.model.weight_recipe import FusedTensors, Recipe

INDEX_FILE = "model.safetensors.index.json"

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the tensor and file at fault."""


@dataclass(frozen=True)
class _Source:
    name: str  # the name as stored in the file
    file: Path
    shape: tuple[int, ...]
    take: Callable[[torch.Tensor], torch.Tensor] | None = None  # a part of the stored tensor (else all of it)


_Plan = dict[str, tuple[Recipe, list[_Source]]]


def load_model(directory: str | Path, *, dtype: DtypeChoice = None, device: str | torch.device = "cpu") -> FamilyModel:
    """Build the decoder of the family ``directory``'s config names, with weights in ``dtype`` (None or
    ``"auto"``: the config's; see ``precision`` for the parameters and states that stay fp32)."""
    directory = Path(directory)
    family, config = read_config(directory)
    weights = weight_dtype(dtype, config)
    sources = _index_tensors(directory, family, _fused_tensors(family, config))
    plan = _resolve(family.weight_map(config), sources)
    _check_leftovers(sources, plan)
    with torch.device("meta"):
        model = family.build_model(config)
    state = {}
    for name, meta in model.named_parameters():
        buffer = torch.empty(meta.shape, dtype=parameter_dtype(name, weights), device=device)
        recipe, used = plan[name]
        _read_into(buffer, recipe, used)
        state[name] = buffer
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def stored_shapes(directory: str | Path) -> dict[str, tuple[int, ...]]:
    """Canonical name → shape of every tensor the checkpoint's family loads, read from the headers only."""
    family, config = read_config(directory)
    sources = _index_tensors(Path(directory), family, _fused_tensors(family, config))
    return {name: src.shape for name, src in sources.items()}


def has_weights(directory: str | Path) -> bool:
    """Whether ``directory`` holds weights at all (an index or safetensors files), not only a config."""
    directory = Path(directory)
    return (directory / INDEX_FILE).exists() or any(directory.glob("*.safetensors"))


def _fused_tensors(family: Family, config: Any) -> FusedTensors | None:
    return family.fused_tensors(config) if family.fused_tensors is not None else None


def _index_tensors(directory: Path, family: Family, fused: FusedTensors | None = None) -> dict[str, _Source]:
    """Canonical tensor name → where it is stored, for every tensor ``family`` loads (the skipped ones
    are logged, one line per kind; a fused one gives one entry per part)."""
    index_path = directory / INDEX_FILE
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_path}: not a valid safetensors index ({exc})") from None
        files = sorted({directory / f for f in weight_map.values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{directory}: no model.safetensors (or sharded index) found")
    sources: dict[str, _Source] = {}
    skipped: Counter[str] = Counter()
    for file in files:
        for source in _file_tensors(file):
            canon = family.canonical_name(source.name)
            if canon is None:
                skipped[next(p for p in family.skipped if source.name.startswith(p))] += 1
                continue
            for name, part in _parts(canon, source, fused):
                if name in sources:
                    raise CheckpointError(
                        f"tensor '{source.name}' is stored twice: {sources[name].file.name} and {file.name}"
                    )
                sources[name] = part
    for prefix, count in skipped.items():
        log.info("%s: skipping %s (%d tensors under %s*)", directory.name, family.skipped[prefix], count, prefix)
    return sources


def _parts(canon: str, source: _Source, fused: FusedTensors | None) -> list[tuple[str, _Source]]:
    """The (canonical name, source) entries one stored tensor gives: itself, or each part of a fused one."""
    split = fused(canon) if fused is not None else None
    if split is None:
        return [(canon, source)]
    if source.shape != split.shape:
        raise CheckpointError(
            f"tensor '{source.name}' in {source.file.name} has shape {list(source.shape)}, expected {list(split.shape)}"
        )
    return [(part.name, _Source(source.name, source.file, part.shape, part.take)) for part in split.parts]


def _file_tensors(file: Path) -> list[_Source]:
    """The tensors a safetensors file holds, read from its header only."""
    if not file.exists():
        raise CheckpointError(f"{file}: shard named in {INDEX_FILE} does not exist")
    try:
        with safe_open(str(file), framework="pt") as f:
            return [_Source(name, file, tuple(f.get_slice(name).get_shape())) for name in f.keys()]  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: not a valid safetensors file ({exc})") from None


def _resolve(weight_map: dict[str, list[Recipe]], sources: dict[str, _Source]) -> _Plan:
    plan: _Plan = {}
    for param, recipes in weight_map.items():
        recipe = next((r for r in recipes if all(n in sources for n, _ in r.sources)), None)
        if recipe is None:
            missing = next(n for n, _ in recipes[0].sources if n not in sources)
            where = sorted({s.file.name for s in sources.values()})
            raise CheckpointError(f"missing tensor '{missing}' (needed for {param}; looked in {', '.join(where)})")
        used = [sources[n] for n, _ in recipe.sources]
        for (_, shape), src in zip(recipe.sources, used, strict=True):
            if src.shape != shape:
                raise CheckpointError(
                    f"tensor '{src.name}' in {src.file.name} has shape {list(src.shape)}, expected {list(shape)}"
                )
        plan[param] = (recipe, used)
    return plan


def _check_leftovers(sources: dict[str, _Source], plan: _Plan) -> None:
    used = {src.name for _, srcs in plan.values() for src in srcs}
    extra = sorted((s for s in sources.values() if s.name not in used), key=lambda s: s.name)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(f"unexpected tensor '{extra[0].name}' in {extra[0].file.name}{more}")


def _read_into(buffer: torch.Tensor, recipe: Recipe, used: list[_Source]) -> None:
    """Copy each source of one parameter into its view of ``buffer``, cast to the buffer's dtype.

    One source tensor at a time is read into memory; the files are closed (unmapped) on return.
    """
    views = recipe.place(buffer)
    with ExitStack() as files:
        opened: dict[Path, Any] = {}
        for view, src in zip(views, used, strict=True):
            try:
                if src.file not in opened:
                    opened[src.file] = files.enter_context(safe_open(str(src.file), framework="pt"))
                stored = opened[src.file].get_tensor(src.name)
                view.copy_((stored if src.take is None else src.take(stored)).reshape(view.shape))
            except (SafetensorError, OSError, RuntimeError) as exc:
                raise CheckpointError(f"{src.file}: cannot read tensor '{src.name}' ({exc})") from None
