"""Build (once per source and machine) and load the shared library of the C kernels next to this file.

The library is compiled with the C compiler on the path (``cc``, else ``gcc``)
for the build machine's own CPU (``-march=native``) with OpenMP, into a cache (``MET_CACHE_DIR``) keyed by the
sources, the flags and the CPU, so a worker pays the compile (about a second) once. When no compiler is
found or the build fails, ``native_library()`` returns None and callers use the torch references.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# One library. -ffp-contract=off keeps products unfused (conv.c, exp.h); -fno-trapping-math lets the
# vectorizer if-convert exp.h's clamp (no result changes: it only drops the promise to raise FP traps).
SOURCES = (
    "kda_recurrence.c",
    "gdn_recurrence.c",
    "conv.c",
    "mla_decode.c",
    "gqa_decode.c",
    "norm.c",
    "exp.c",
    "product.c",
    "sigmoid.c",
    "swiglu.c",
    "router.c",
    "kda_layer.c",
    "decode_layers.c",
)
HEADERS = ("exp.h", "bf16.h")
FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-ffp-contract=off",
    "-fno-trapping-math",
    "-std=c11",
    "-shared",
    "-fPIC",
)

_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    # name: (result, arguments) — tensors go as data pointers, sizes and strides as int64
    "met_kda_decode": (None, [_PTR] * 8 + [_I64] * 4 + [_F32, _INT]),
    "met_kda_prefill": (None, [_PTR] * 10 + [_I64] * 4 + [_F32, _INT]),
    "met_gdn_decode": (None, [_PTR] * 8 + [_I64] * 5 + [_F32, _INT]),
    "met_gdn_prefill": (None, [_PTR] * 10 + [_I64] * 5 + [_F32, _INT]),
    "met_conv_update": (None, [_PTR] * 3 + [_I64] + [_PTR] * 2 + [_I64] * 3 + [_INT]),
    "met_conv_prefill": (_INT, [_PTR] * 5 + [_I64, _PTR, _PTR] + [_I64] * 3 + [_INT]),
    "met_mla_decode_f32": (_INT, [_PTR] * 3 + [_I64] + [_PTR] * 2 + [_I64] * 5 + [_F32, _INT]),
    "met_mla_decode_bf16": (_INT, [_PTR] * 3 + [_I64] + [_PTR] * 2 + [_I64] * 5 + [_F32, _INT]),
    "met_gqa_decode_f32": (_INT, [_PTR] * 3 + [_I64] + [_PTR] * 2 + [_I64] * 5 + [_F32, _INT]),
    "met_gqa_decode_bf16": (_INT, [_PTR] * 3 + [_I64] + [_PTR] * 2 + [_I64] * 5 + [_F32, _INT]),
    "met_rms_norm": (None, [_PTR, _I64, _PTR, _PTR, _I64, _I64, _F32, _INT]),
    "met_gated_rms_norm": (None, [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _F32, _INT]),
    "met_rms_norm_bf16": (None, [_PTR, _I64, _PTR, _PTR, _I64, _I64, _F32, _INT]),
    "met_exp": (None, [_PTR, _PTR, _I64]),
    "met_sigmoid": (None, [_PTR, _PTR, _I64]),
    "met_product": (None, [_PTR, _I64, _I64, _PTR, _I64, _I64, _INT, _PTR] + [_I64] * 4 + [_INT]),
    "met_product_portable": (None, [_PTR, _I64, _I64, _PTR, _I64, _I64, _INT, _PTR] + [_I64] * 4 + [_INT]),
    "met_product_kn": (None, [_PTR, _I64, _I64, _PTR, _I64, _I64, _INT, _PTR] + [_I64] * 4 + [_INT]),
    "met_softplus_decay": (None, [_PTR, _I64, _PTR, _PTR, _PTR] + [_I64] * 3),
    "met_kda_decode_layer": (
        _INT,
        [_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _F32, _PTR, _PTR, _PTR]
        + [_I64] * 2
        + [_F32, _PTR, _INT],
    ),
    "met_decode_layers": (_INT, [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _INT]),
    "met_sigmoid_route": (_INT, [_PTR, _I64, _I64, _PTR, _INT, _PTR] + [_I64] * 4 + [_INT, _F32, _PTR, _PTR, _INT]),
    "met_swiglu": (_INT, [_PTR, _I64, _I64, _PTR, _PTR, _I64, _INT, _INT, _PTR, _INT]),
    "met_routed_experts": (_INT, [_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _INT, _INT, _PTR, _INT]),
}


@cache
def native_library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (logged once) when they cannot be built on this machine."""
    compiler = _compiler()
    if compiler is None:
        log.info("no C compiler on the path: the CPU kernels run as torch code")
        return None
    try:
        library = ctypes.CDLL(str(_built(compiler)))
    except (OSError, subprocess.CalledProcessError) as error:
        log.warning("building the C kernels failed, the CPU kernels run as torch code: %s", error)
        return None
    for name, (result, arguments) in SIGNATURES.items():
        function = getattr(library, name)
        function.restype, function.argtypes = result, arguments
    return library


def _built(compiler: str) -> Path:
    here = Path(__file__).parent
    inputs = [(here / name).read_bytes() for name in SOURCES + HEADERS]
    inputs.append(" ".join((compiler, *FLAGS, platform.machine(), _cpu_model())).encode())
    sources = [str(here / name) for name in SOURCES]
    return cached_build("metrale-kernels", inputs, lambda out: [compiler, *FLAGS, *sources, "-o", str(out), "-lm"])


def cached_build(stem: str, inputs: list[bytes], command: Callable[[Path], list[str]]) -> Path:
    """``<cache>/<stem>-<digest of inputs>.so``, made by running ``command(output path)`` unless it exists.

    Raises:
        subprocess.CalledProcessError: the build failed.
    """
    digest = hashlib.sha256()
    for part in inputs:
        digest.update(part)
    target = _cache_dir() / f"{stem}-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            partial = Path(scratch) / target.name
            subprocess.run(command(partial), check=True, capture_output=True)
            os.replace(partial, target)  # atomic: concurrent builders each install a whole library
    return target


def library_path() -> Path | None:
    """The built library's file (what ``native_library`` loaded), or None where it could not be built."""
    compiler = _compiler()
    return _built(compiler) if compiler is not None and native_library() is not None else None


def _compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def _cache_dir() -> Path:
    """``MET_CACHE_DIR``/kernels when it is writable, else a per-user folder under the temp dir."""
    from metrale.shared.settings import load_settings

    home_cache = load_settings().cache_dir / "kernels"
    try:
        home_cache.mkdir(parents=True, exist_ok=True)
        if os.access(home_cache, os.W_OK):
            return home_cache
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"metrale-kernels-{os.getuid()}"


def _cpu_model() -> str:
    """The CPU's model name and feature flags: ``-march=native`` code is only valid where both match (a
    VM may hide features its CPU model has)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags")
    return " | ".join(next((line for line in lines if line.startswith(field)), field) for field in wanted)
