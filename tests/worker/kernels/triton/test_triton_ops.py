"""Which implementation ``kernels.ops`` runs under each backend, and the error when Triton cannot run."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from triton.runtime.jit import JITFunction

from metrale.shared.settings import KernelBackend
from metrale.worker.kernels import ops
from metrale.worker.kernels.triton import TritonUnavailableError
from metrale.worker.kernels.triton import norm as triton_norm

pytestmark = pytest.mark.triton

# (op, its torch reference module, its Triton module, its C kernel module or None, positional arguments
# after the first tensor). Each module names its function as the op does, except as IMPLEMENTED_AS says.
# CPU_TWINS: the reference module's fast torch twin that CPU calls take under every backend but torch
# where no C kernel takes them (the first tensor here is one row: the one-row MLA).
CPU_TWINS = {
    "rms_norm": "fused_rms_norm",
    "gated_rms_norm": "fused_gated_rms_norm",
    "paged_mla_attention": "paged_mla_attention_one_row",
}
CPU_TWIN_KERNELS = {"paged_mla_attention": "metrale.worker.kernels.native.mla"}
"""The C kernels a CPU twin hands part of its work (a lone MLA row's attention in latent space)."""
IMPLEMENTED_AS = {
    ("kda_prefill", "torch"): "kda_chunked_prefill",
    ("kda_prefill", "triton"): "kda_chunked_prefill",
    ("gdn_prefill", "torch"): "gdn_chunked_prefill",
    ("gdn_prefill", "triton"): "gdn_chunked_prefill",
}
ROUTES = [
    (
        "kda_decode",
        "metrale.worker.kernels.kda.decode",
        "metrale.worker.kernels.triton.kda_decode",
        "metrale.worker.kernels.native.kda",
        7,
    ),
    (
        "kda_prefill",
        "metrale.worker.kernels.kda.chunked",
        "metrale.worker.kernels.triton.kda_chunked",
        "metrale.worker.kernels.native.kda",
        9,
    ),
    (
        "gdn_decode",
        "metrale.worker.kernels.gdn.decode",
        "metrale.worker.kernels.triton.gdn_decode",
        "metrale.worker.kernels.native.gdn",
        7,
    ),
    (
        "gdn_prefill",
        "metrale.worker.kernels.gdn.chunked",
        "metrale.worker.kernels.triton.gdn_chunked",
        "metrale.worker.kernels.native.gdn",
        9,
    ),
    (
        "causal_conv1d_update",
        "metrale.worker.kernels.conv",
        "metrale.worker.kernels.triton.conv",
        "metrale.worker.kernels.native.conv",
        3,
    ),
    (
        "causal_conv1d_prefill",
        "metrale.worker.kernels.conv",
        "metrale.worker.kernels.triton.conv",
        "metrale.worker.kernels.native.conv",
        5,
    ),
    ("store_latents", "metrale.worker.kernels.mla", "metrale.worker.kernels.triton.mla", None, 2),
    ("paged_mla_attention", "metrale.worker.kernels.mla", "metrale.worker.kernels.triton.mla", None, 8),
    ("store_kv", "metrale.worker.kernels.gqa", "metrale.worker.kernels.triton.gqa", None, 3),
    (
        "rms_norm",
        "metrale.worker.kernels.norm",
        "metrale.worker.kernels.triton.norm",
        "metrale.worker.kernels.native.norm",
        2,
    ),
    (
        "gated_rms_norm",
        "metrale.worker.kernels.norm",
        "metrale.worker.kernels.triton.norm",
        "metrale.worker.kernels.native.norm",
        3,
    ),
]


class Recorder:
    """Stands in for one implementation and notes that it ran."""

    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(self.name)


@pytest.mark.parametrize(
    ("backend", "expected"),
    [
        pytest.param(KernelBackend.TORCH, "torch", id="torch-backend"),
        pytest.param(KernelBackend.NATIVE, "native", id="native-backend"),
        pytest.param(KernelBackend.AUTO, "native", id="auto-backend-cpu-tensors"),
        pytest.param(KernelBackend.TRITON, "triton", id="triton-backend"),
    ],
)
@pytest.mark.parametrize(("op", "reference", "fast", "native", "arity"), ROUTES, ids=[route[0] for route in ROUTES])
def test_triton_ops_route_each_kernel_by_backend(
    monkeypatch: pytest.MonkeyPatch,
    use_backend: Callable[[KernelBackend], None],
    backend: KernelBackend,
    expected: str,
    op: str,
    reference: str,
    fast: str,
    native: str | None,
    arity: int,
) -> None:
    """On CPU tensors ``native`` and ``auto`` run the C kernel where one exists (and says it supports the
    call), the reference's fast torch twin where it has one (``CPU_TWINS``), the torch reference otherwise."""
    calls: list[str] = []
    for module, kind in [(reference, "torch"), (fast, "triton"), (native, "native")]:
        if module is not None:
            name = IMPLEMENTED_AS.get((op, kind), op)
            monkeypatch.setattr(importlib.import_module(module), name, Recorder(kind, calls))
    if native is not None:
        monkeypatch.setattr(importlib.import_module(native), "supports", lambda *args: True)
    if op in CPU_TWINS:
        monkeypatch.setattr(importlib.import_module(reference), CPU_TWINS[op], Recorder("cpu-twin", calls))
    if op in CPU_TWIN_KERNELS:
        monkeypatch.setattr(importlib.import_module(CPU_TWIN_KERNELS[op]), "supports", lambda *args: True)
    use_backend(backend)

    getattr(ops, op)(torch.zeros(1), *[object()] * arity)

    if expected == "native" and op in CPU_TWINS and native is None:
        expected = "cpu-twin"
    assert calls == [expected if native is not None or expected != "native" else "torch"]


def test_triton_kernels_compiled_for_a_gpu_refuse_cpu_tensors_with_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, use_backend: Callable[[KernelBackend], None]
) -> None:
    compiled = JITFunction(triton_norm._rms_norm_kernel.fn)
    monkeypatch.setattr(triton_norm, "_rms_norm_kernel", compiled)
    use_backend(KernelBackend.TRITON)

    with pytest.raises(TritonUnavailableError, match="TRITON_INTERPRET=1"):
        ops.rms_norm(torch.ones(2, 16), torch.ones(16), 1e-6)
