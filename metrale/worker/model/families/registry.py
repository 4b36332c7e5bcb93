"""The families Metrale serves, and the choice of one from a ``config.json``.

Adding a family: a module in ``families/`` that defines its ``FAMILY``, and one line in ``FAMILIES``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from metrale.worker.model.config import ModelConfigError
from metrale.worker.model.families import kimi_linear, qwen3_5, qwen3_next
from metrale.worker.model.families.family import Family, FamilyConfig

FAMILIES: tuple[Family, ...] = (kimi_linear.FAMILY, qwen3_5.FAMILY, qwen3_5.FAMILY_MOE, qwen3_next.FAMILY)


def served() -> str:
    """The families served, as one line: ``kimi_linear (KimiLinearForCausalLM), …``."""
    return ", ".join(f"{f.name} ({', '.join(f.architectures)})" for f in FAMILIES)


def family_for(data: dict[str, Any]) -> Family:
    """The family a ``config.json``'s ``architectures`` (else its ``model_type``, or its ``text_config``'s)
    names; an unknown one raises ``ModelConfigError`` listing what is served."""
    architectures = data.get("architectures") or []
    for family in FAMILIES:
        if any(a in family.architectures for a in architectures):
            return family
    text = data.get("text_config")
    model_types = [data.get("model_type"), text.get("model_type") if isinstance(text, dict) else None]
    for family in FAMILIES:
        if any(t in family.model_types for t in model_types):
            return family
    listed = f"architectures {architectures}; " if architectures else ""
    raise ModelConfigError(
        f"config.json: model_type {data.get('model_type')!r} is not supported ({listed}Metrale serves {served()})"
    )


def read_config_dict(directory: str | Path) -> dict[str, Any]:
    """A model folder's ``config.json`` as a dict; ``ModelConfigError`` when missing or not a JSON object."""
    path = Path(directory) / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelConfigError(f"{path}: no config.json in the model directory") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path}: expected a JSON object")
    return data


def read_config(directory: str | Path) -> tuple[Family, FamilyConfig]:
    """The family and config of the model in ``directory``."""
    data = read_config_dict(directory)
    family = family_for(data)
    return family, family.read_config(data)
