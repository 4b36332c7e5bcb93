"""Load a KimiLinear model from an HF folder: ``config.json`` + safetensors (single file or sharded).

Everything is checked before any weight is read: every tensor we need exists, has the expected shape,
and nothing in the checkpoint is left over. Any problem raises :class:`CheckpointError` naming the
tensor and the file; a model is returned whole or not at all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from metrale.worker.model.config import ModelConfig
from metrale.worker.model.kimi_linear import KimiLinearModel
from metrale.worker.model.weight_map import Recipe, build_weight_map, canonical_name

INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the tensor and file at fault."""


@dataclass(frozen=True)
class _Source:
    name: str  # the name as stored in the file
    file: Path
    shape: tuple[int, ...]


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise CheckpointError(f"dtype {name!r} is not supported (use one of {sorted(_DTYPES)})") from None


def load_model(
    directory: str | Path, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> KimiLinearModel:
    """Build a :class:`KimiLinearModel` from ``directory``; ``dtype`` defaults to the config's."""
    directory = Path(directory)
    config = ModelConfig.from_pretrained(directory)
    dtype = dtype or parse_dtype(config.dtype)
    sources = _index_tensors(directory)
    plan = _resolve(build_weight_map(config), sources)
    _check_leftovers(sources, plan)
    tensors = _read_tensors([src for _, used in plan.values() for src in used])
    weights = {name: recipe.combine([tensors[s.name] for s in used]) for name, (recipe, used) in plan.items()}
    with torch.device("meta"):
        model = KimiLinearModel(config)
    model.to_empty(device=device)
    state = {name: tensor.to(dtype) for name, tensor in weights.items()}
    model.load_state_dict(state, strict=True)
    return model.to(dtype).eval()


def stored_shapes(directory: str | Path) -> dict[str, tuple[int, ...]]:
    """Canonical name → shape of every tensor in the checkpoint, read from the headers only."""
    return {name: src.shape for name, src in _index_tensors(Path(directory)).items()}


def _index_tensors(directory: Path) -> dict[str, _Source]:
    """Canonical tensor name → where it is stored."""
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
    for file in files:
        for source in _file_tensors(file):
            canon = canonical_name(source.name)
            if canon in sources:
                raise CheckpointError(
                    f"tensor '{source.name}' is stored twice: {sources[canon].file.name} and {file.name}"
                )
            sources[canon] = source
    return sources


def _file_tensors(file: Path) -> list[_Source]:
    """The tensors a safetensors file holds, read from its header only."""
    if not file.exists():
        raise CheckpointError(f"{file}: shard named in {INDEX_FILE} does not exist")
    try:
        with safe_open(str(file), framework="pt") as f:
            return [_Source(name, file, tuple(f.get_slice(name).get_shape())) for name in f.keys()]  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: not a valid safetensors file ({exc})") from None


def _resolve(
    weight_map: dict[str, list[Recipe]], sources: dict[str, _Source]
) -> dict[str, tuple[Recipe, list[_Source]]]:
    plan: dict[str, tuple[Recipe, list[_Source]]] = {}
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


def _check_leftovers(sources: dict[str, _Source], plan: dict[str, tuple[Recipe, list[_Source]]]) -> None:
    used = {src.name for _, srcs in plan.values() for src in srcs}
    extra = sorted((s for s in sources.values() if s.name not in used), key=lambda s: s.name)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(f"unexpected tensor '{extra[0].name}' in {extra[0].file.name}{more}")


def _read_tensors(needed: list[_Source]) -> dict[str, torch.Tensor]:
    """Stored name → tensor, opening each file once."""
    by_file: dict[Path, list[str]] = {}
    for src in needed:
        by_file.setdefault(src.file, []).append(src.name)
    tensors: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        try:
            with safe_open(str(file), framework="pt") as f:
                tensors.update((name, f.get_tensor(name)) for name in names)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise CheckpointError(f"{file}: cannot read its tensors ({exc})") from None
    return tensors
