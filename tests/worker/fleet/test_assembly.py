"""Putting a worker together: a state checkpoint names the weight dtype it was computed in."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from metrale.worker.engine.factory import EngineLimits, build_engine
from metrale.worker.fleet.assembly import checkpoint_manager
from tests.worker.worker_helpers import worker_settings


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_checkpoints_are_keyed_by_the_weight_dtype(tiny_model_dir: Path, dtype: str) -> None:
    """A bf16 worker's states differ from an fp32 one's: neither may resume from the other's."""
    loaded = build_engine(tiny_model_dir, EngineLimits(max_seqs=2, num_blocks=8), dtype=dtype)
    client = redis.Redis()  # never connected: building the manager talks to no one
    manager = checkpoint_manager(loaded, client, worker_settings(), fingerprint="f")
    assert manager.dtype == dtype
