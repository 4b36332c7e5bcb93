"""Fixtures of the worker-fleet tests."""

from __future__ import annotations

import uuid

import pytest

from metrale.shared.keys import Keys


@pytest.fixture
def keys() -> Keys:
    """Key names under a namespace of this test alone (the test Redis is shared)."""
    return Keys(f"met-test-{uuid.uuid4().hex}")
