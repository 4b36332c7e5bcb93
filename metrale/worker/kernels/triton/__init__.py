"""Triton twins of the torch reference kernels in ``metrale.worker.kernels``.

Each module here imports ``triton`` and is imported only when a Triton kernel is about to run (see
``metrale.worker.kernels.ops``), so this package's ``__init__`` must stay free of that import: Triton
is an optional dependency and every torch path works without it.
"""

from __future__ import annotations


class TritonUnavailableError(RuntimeError):
    """Triton kernels were asked for where they cannot run (not installed, or CPU tensors without
    Triton's interpreter)."""
