"""Triton kernels on the CPU, through Triton's interpreter.

Whether a ``@triton.jit`` function is interpreted is fixed when it is decorated, Triton's own library
(``tl.zeros``, ``tl.sum``, ...) included, so ``TRITON_INTERPRET=1`` must be set before triton is
imported: ``tests/conftest.py`` sets it first thing on machines without CUDA.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator

import pytest

from metrale.shared.settings import KernelBackend
from metrale.worker.kernels.ops import kernel_backend, set_kernel_backend

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it)")


@pytest.fixture
def use_backend() -> Iterator[Callable[[KernelBackend], None]]:
    """``set_kernel_backend`` for one test; the backend it replaced is restored afterwards."""
    previous = kernel_backend()
    yield set_kernel_backend
    set_kernel_backend(previous)
