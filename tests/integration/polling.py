"""Waiting for something the fleet does asynchronously, with a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pytest

Found = TypeVar("Found")

WAIT_S = 10.0
"""Long enough for any single step of the fleet on two busy cores."""


def wait_for(probe: Callable[[], Found | None], what: str, timeout_s: float = WAIT_S) -> Found:
    """Poll ``probe`` until it returns something other than None; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (found := probe()) is None:
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting {timeout_s:.0f} s for {what}")
        time.sleep(0.01)
    return found
