"""Where the built-in tiny model lives: generated once into the cache directory, then reused."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from metrale.worker.model.tiny import write_tiny_model

BUILTIN_MODEL_NAME = "metrale-tiny"
"""The served name of the built-in model."""
_BUILTIN_REVISION = "v2"  # bump when write_tiny_model's output changes


def builtin_model_dir(cache_dir: Path) -> Path:
    """The built-in model's folder under ``cache_dir``, written there first if it is not yet."""
    target = cache_dir.expanduser() / "models" / f"{BUILTIN_MODEL_NAME}-{_BUILTIN_REVISION}"
    if (target / "model.safetensors").exists():
        return target
    staging = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    write_tiny_model(staging)
    try:
        staging.rename(target)
    except OSError:  # another process finished first; its copy is identical
        shutil.rmtree(staging, ignore_errors=True)
    return target
