"""Fixtures of the C kernels' tests."""

from __future__ import annotations

import pytest

from metrale.shared.settings import KernelBackend
from metrale.worker.kernels import ops


@pytest.fixture
def native_backend() -> None:
    """The C kernels' backend for the test (a worker an earlier test built may have left another one set
    process-wide: ``build_engine`` sets ``MET_KERNELS``' backend); ``kernel_backend_restored`` (autouse)
    puts back the one before."""
    ops.set_kernel_backend(KernelBackend.NATIVE)
