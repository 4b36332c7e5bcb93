"""The C kernels as CPU torch ops (``graph_ops.cpp``), for the compiled decode step.

``kernels.graph_ops`` declares the stateful ops a compiled step calls, with Python bodies that reach the C
kernels through ``kernels.ops`` and ctypes. Called from the graph's C++ wrapper, each such call goes back
into the interpreter: ~40 µs a call against ~7 µs for a one-row conv kernel, 14 calls a step on the bench
model. ``graph_ops.cpp`` defines the same ops (namespace ``metrale_native``, same schemas, same padding
rows) in C++ over the same C kernels, so a call costs one dispatcher call; and one op more, MLA's decode
attention in latent space (``mla_decode_latent``: ``native.mla``'s split kernel, which reads each row's own
context, where the graph's torch form scores the whole block table). ``kernels.ops`` emits them while
``torch.compile`` traces, where the native backend runs, ``load()`` has loaded them (a compiled step
calls it before tracing) and ``supports_*`` holds (properties fixed by the graph's shapes and dtypes),
else the Python ops.

The library is built once per source, torch build and machine (C++ with torch's headers, ~10 s), into
the same cache as the C kernels; where it cannot be built, ``load()`` returns False (logged once) and the
graphs call the Python ops.
"""

from __future__ import annotations

import logging
import platform
import shutil
import subprocess
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from metrale.worker.kernels.native.layouts import paged_cache_fits, state_pool_fits
from metrale.worker.kernels.native.library import cached_build, library_path

log = logging.getLogger(__name__)

SOURCE = "graph_ops.cpp"
FLAGS = ("-O2", "-std=c++20", "-shared", "-fPIC", "-w")


loaded = False
"""Whether ``load()`` has loaded ``torch.ops.metrale_native`` (read while a graph is traced)."""


@cache
def load() -> bool:
    """Build (once per machine) and load ``torch.ops.metrale_native``; whether it loaded."""
    global loaded
    kernels = library_path()
    compiler = shutil.which("c++") or shutil.which("g++")
    if kernels is None or compiler is None:
        log.info("no C++ compiler or C kernels: compiled steps call the stateful kernels through Python")
        return False
    try:
        torch.ops.load_library(str(_built(compiler, kernels)))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
        log.warning("building the C++ graph ops failed, compiled steps call the kernels through Python: %s", error)
        return False
    _register_fakes()
    loaded = True
    return True


def supports_kda(state_pool: torch.Tensor) -> bool:
    """Whether ``metrale_native::kda_decode`` runs a call on this pool (CPU, fp32, contiguous)."""
    return state_pool_fits(state_pool)


def supports_conv(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor) -> bool:
    """Whether ``metrale_native::causal_conv1d_update`` runs a call on these (CPU, fp32, unit-stride rows):
    ``native.conv.supports`` less its check that the library built, which reads files and so cannot run
    while Dynamo traces (``loaded`` already says it built)."""
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == conv_states.dtype == torch.float32
        and x.stride(-1) == 1
        and conv_states.is_contiguous()
        and weight.shape[1] >= 2
    )


def supports_store(kv_cache: torch.Tensor) -> bool:
    """Whether ``metrale_native::store_latents`` writes into this cache (CPU, contiguous)."""
    return kv_cache.device.type == "cpu" and kv_cache.is_contiguous()


def supports_mla(kv_cache: torch.Tensor, block_tables: torch.Tensor) -> bool:
    """Whether ``metrale_native::mla_decode_latent`` attends over this cache (CPU, fp32 or bf16,
    contiguous; int64 block tables with unit-stride rows): ``native.mla.supports`` less its check that
    the library built (``loaded`` already says it did)."""
    return paged_cache_fits(kv_cache, block_tables)


def _built(compiler: str, kernels: Path) -> Path:
    here = Path(__file__).parent
    torch_dir = Path(torch.__file__).parent
    includes = [f"-I{path}" for path in (torch_dir / "include", torch_dir / "include/torch/csrc/api/include")]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    libraries = [f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_dir / 'lib'}"]
    libraries += [str(kernels), f"-Wl,-rpath,{kernels.parent}"]
    flags = [*FLAGS, abi, *includes]
    inputs = [(here / SOURCE).read_bytes(), kernels.name.encode()]
    inputs.append(" ".join((compiler, *flags, torch.__version__, platform.machine())).encode())
    return cached_build(
        "metrale-graph-ops", inputs, lambda out: [compiler, *flags, str(here / SOURCE), "-o", str(out), *libraries]
    )


def _register_fakes() -> None:
    """The output shapes ``torch.compile`` traces with (the ops' schemas come from the library)."""

    def kda_decode(
        q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, pool: Tensor, slots: Tensor, scale: float
    ) -> Tensor:
        return q.new_empty(q.shape[0], q.shape[1], v.shape[-1])

    def conv_update(x: Tensor, weight: Tensor, conv_states: Tensor, slots: Tensor) -> Tensor:
        return x.new_empty(x.shape)

    def store_latents(kv_cache: Tensor, latents: Tensor, slot_mapping: Tensor) -> None:
        return None

    def mla_decode_latent(
        q_latent: Tensor, q_rope: Tensor, kv_cache: Tensor, block_tables: Tensor, context_lens: Tensor, scale: float
    ) -> Tensor:
        return q_latent.new_empty(q_latent.shape)

    for name, fake in (
        ("kda_decode", kda_decode),
        ("causal_conv1d_update", conv_update),
        ("store_latents", store_latents),
        ("mla_decode_latent", mla_decode_latent),
    ):
        torch.library.register_fake(f"metrale_native::{name}", fake)
