"""Triton kernels on the CPU: Triton's interpreter must be on before any kernel is decorated.

Setting ``TRITON_INTERPRET`` here, at import time, happens while pytest collects this folder and before
any of its test modules import triton or metrale's Triton kernels. Without triton installed (it is an
optional dependency) the folder is not collected.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator

import pytest

from metrale.shared.settings import KernelBackend
from metrale.worker.kernels.ops import kernel_backend, set_kernel_backend

os.environ["TRITON_INTERPRET"] = "1"

collect_ignore_glob = [] if importlib.util.find_spec("triton") else ["test_*.py"]


@pytest.fixture
def use_backend() -> Iterator[Callable[[KernelBackend], None]]:
    """``set_kernel_backend`` for one test; the backend it replaced is restored afterwards."""
    previous = kernel_backend()
    yield set_kernel_backend
    set_kernel_backend(previous)
