"""``kernels.ops`` without Triton: torch paths never need it, and forcing Triton says it is missing."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from metrale.shared.settings import KernelBackend
from metrale.worker.kernels import norm, ops
from metrale.worker.kernels.triton import TritonUnavailableError


@pytest.fixture
def without_triton(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``import triton`` fails and the package looks uninstalled; the backend is restored afterwards."""
    monkeypatch.setitem(sys.modules, "triton", None)
    previous = ops.kernel_backend()
    yield
    ops.set_kernel_backend(previous)


def test_importing_the_model_and_its_kernels_does_not_import_triton() -> None:
    code = (
        "import sys, metrale.worker.model.families.kimi_linear, metrale.worker.kernels.ops;"
        " print('triton' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


@pytest.mark.usefixtures("without_triton")
@pytest.mark.parametrize("backend", [KernelBackend.TORCH, KernelBackend.AUTO], ids=["torch", "auto"])
def test_torch_and_auto_backends_run_the_references_without_triton(backend: KernelBackend) -> None:
    generator = torch.Generator().manual_seed(0)
    x, gate, weight = torch.randn(3, 8, generator=generator), torch.randn(3, 8, generator=generator), torch.ones(8)
    ops.set_kernel_backend(backend)

    assert not ops.uses_triton(x)
    # torch: the references themselves; auto: the C norms on the CPU, equal to them to rounding.
    tolerance = {"rtol": 0.0, "atol": 0.0} if backend is KernelBackend.TORCH else {"rtol": 2e-6, "atol": 2e-6}
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6), norm.rms_norm(x, weight, 1e-6), **tolerance)
    torch.testing.assert_close(
        ops.gated_rms_norm(x, gate, weight, 1e-6), norm.gated_rms_norm(x, gate, weight, 1e-6), **tolerance
    )


@pytest.mark.usefixtures("without_triton")
def test_forcing_triton_without_triton_installed_raises_a_clear_error() -> None:
    ops.set_kernel_backend(KernelBackend.TRITON)
    with pytest.raises(TritonUnavailableError, match="not installed"):
        ops.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6)
