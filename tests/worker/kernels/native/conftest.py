"""Fixtures of the C kernels' tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from metrale.shared.settings import KernelBackend
from metrale.worker.kernels import ops


@pytest.fixture
def native_backend() -> Iterator[None]:
    """The C kernels' backend for the test (a worker an earlier test built may have left another one set
    process-wide: ``build_engine`` sets ``MET_KERNELS``' backend), restored after."""
    previous = ops.kernel_backend()
    ops.set_kernel_backend(KernelBackend.NATIVE)
    yield
    ops.set_kernel_backend(previous)
