"""Shared fixtures and hypothesis profiles for the whole suite."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True)
settings.register_profile("long", max_examples=5000, deadline=None)
settings.load_profile("ci")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny model, written once per test session."""
    from metrale.worker.model.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))
