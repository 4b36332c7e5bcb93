"""Peak memory while loading a bf16 checkpoint, over the weights' own bytes.

    python bench/load_memory.py [--model large|medium] [--dtype bfloat16] [--load-dtype auto]

Writes the model once (bf16 safetensors, ``bench/models.py``), then loads it in a fresh interpreter that
reports its peak resident set (``getrusage(RUSAGE_SELF).ru_maxrss``) three times: after importing torch
(the baseline the issue names), after importing the loader (safetensors, Metrale), and after
``load_model``. The ratio is (peak - baseline) / the loaded parameters' bytes; 1.0 means the weights
and nothing else. Loading must never hold a second full copy (goal: ≤ 1.3).

Linux keeps ``ru_maxrss`` across ``exec``: a child starts with its parent's peak. So this script imports
no torch itself and writes the model in a subprocess of its own; the child also reports ``VmHWM``
(``/proc/self/status``, the peak of its own address space only) as a cross-check.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_WRITER = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from bench.models import bench_model
print(bench_model(sys.argv[2], Path(sys.argv[3]), dtype=sys.argv[4]))
"""

_CHILD = """
import json, re, resource, sys
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
hwm = lambda: int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
import torch
after_torch, hwm_torch = peak(), hwm()
from metrale.worker.model.loader import load_model
after_imports, hwm_imports = peak(), hwm()
model = load_model(sys.argv[1], dtype=sys.argv[2])
after_load, hwm_load = peak(), hwm()
weights = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"after_torch": after_torch, "after_imports": after_imports, "after_load": after_load,
                  "hwm_torch": hwm_torch, "hwm_imports": hwm_imports, "hwm_load": hwm_load,
                  "weights": weights, "parameters": sum(p.numel() for p in model.parameters())}))
"""


def measure(directory: Path, load_dtype: str) -> dict[str, int]:
    """Run one load in a fresh interpreter (so its peak is the load's own) and return its numbers."""
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(directory), load_dtype], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="large", choices=["medium", "large"])
    parser.add_argument("--dtype", default="bfloat16", help="dtype the checkpoint is written in")
    parser.add_argument("--load-dtype", default="auto", help="dtype to load it in (auto: the checkpoint's)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.gettempdir()) / "metrale-bench"
    writer = [sys.executable, "-c", _WRITER, str(ROOT), args.model, str(root), args.dtype]
    directory = Path(subprocess.run(writer, capture_output=True, text=True, check=True).stdout.strip())
    stored = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    print(f"model={args.model} stored as {args.dtype}: {stored / 2**20:,.0f} MiB in {directory}")
    for _ in range(args.repeats):
        r = measure(directory, args.load_dtype)
        ratio = (r["after_load"] - r["after_torch"]) / r["weights"]
        ratio_imports = (r["after_load"] - r["after_imports"]) / r["weights"]
        ratio_hwm = (r["hwm_load"] - r["hwm_torch"]) / r["weights"]
        print(
            f"loaded as {args.load_dtype}: {r['parameters']:,} parameters, weights {r['weights'] / 2**20:,.0f} MiB; "
            f"peak RSS after torch {r['after_torch'] / 2**20:,.0f} MiB, after imports "
            f"{r['after_imports'] / 2**20:,.0f} MiB, after load {r['after_load'] / 2**20:,.0f} MiB; "
            f"(peak - torch baseline) / weights = {ratio:.3f}, (peak - import baseline) / weights = {ratio_imports:.3f}"
            f", by VmHWM {ratio_hwm:.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
