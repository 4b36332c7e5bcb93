"""The built-in models: the trained toy model shipped in the package, and seeded random-weight ones.

``builtin_model_dir()`` is what ``met serve`` / ``met worker`` / ``met generate`` run without
``--model``: a tiny KimiLinear model trained on the Python standard library (``metrale/builtin_model/``,
see its ``MODEL_CARD.md``), shipped with the package so nothing is generated or downloaded at start.

``random_model_dir(cache_dir)`` writes the seeded random-weight tiny model (``tiny.write_tiny_model``)
into a cache once and reuses it; tests and benchmarks use it where weights must be random (logits
spread wide enough that greedy decoding has no near-ties). It is written into a staging folder and
renamed into place, so a failed or interrupted write never leaves a half-written model behind, and
staging folders left by crashed processes are removed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from metrale.worker.model.tiny import write_tiny_model

BUILTIN_MODEL_NAME = "metrale-tiny"
"""The served name of the built-in model."""

RANDOM_MODEL_NAME = "metrale-tiny-random"
"""The folder (and so the served name) of the random-weight tiny model under a cache."""

_PACKAGED_MODEL = Path(__file__).resolve().parents[2] / "builtin_model"
_RANDOM_REVISION = "v2"  # bump when write_tiny_model's output changes
_STAGING_MARK = ".tmp-"


def builtin_model_dir() -> Path:
    """The trained built-in model's folder inside the installed package."""
    if not (_PACKAGED_MODEL / "model.safetensors").is_file():
        raise FileNotFoundError(f"the built-in model is missing from the installation: {_PACKAGED_MODEL}")
    return _PACKAGED_MODEL


def random_model_dir(cache_dir: Path) -> Path:
    """The random-weight tiny model under ``cache_dir``, written there first if it is not yet."""
    models = cache_dir.expanduser() / "models"
    target = models / _RANDOM_REVISION / RANDOM_MODEL_NAME
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(target.parent)
    staging = target.with_name(f"{target.name}{_STAGING_MARK}{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        write_tiny_model(staging)
        staging.rename(target)
    except OSError:
        if not (target / "model.safetensors").exists():  # not just another process finishing first
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def remove_stale_staging(folder: Path) -> list[Path]:
    """Remove the staging folders in ``folder`` whose writing process is gone; return them."""
    removed = []
    for path in folder.glob(f"*{_STAGING_MARK}*"):
        pid = path.name.rpartition(_STAGING_MARK)[2]
        if pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True
