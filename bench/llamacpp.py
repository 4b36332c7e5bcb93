"""llama.cpp's CPU tools from a pinned source, built once; our models converted to GGUF; its benchmarks run.

The source is the ``llama-cpp-python`` sdist from PyPI, which vendors a llama.cpp tree (with its git
metadata, so the exact commit is known). Everything lives under ``<MET_CACHE_DIR>/llamacpp/<version>/``:
the sdist, its unpacked tree, ``build/`` (CMake, Release, CPU only, ``GGML_NATIVE=ON``, only the
benchmark targets) and ``gguf/`` (converted models). Each piece is made only when missing.

Converting needs torch, numpy and transformers (all in Metrale's dev extras) and the tree's own
``gguf-py``, which is put on ``PYTHONPATH`` — nothing is installed. Two families convert: Kimi-Linear
(our single-file layout, renamed to the release's on the way) and Qwen3.5 dense/MoE (already in the
release's layout: llama.cpp's ``qwen35`` / ``qwen35moe``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import load_file, save_file

from metrale.shared.settings import load_settings
from metrale.worker.model.config import ModelConfig

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
"""The newest ``llama-cpp-python`` (2026-12) whose vendored llama.cpp converts and runs Kimi-Linear
(``conversion/kimi_linear.py``, ``src/models/kimi-linear.cpp``); it has Qwen3.5 too (``conversion/qwen.py``'s
``Qwen3_5TextModel``, ``src/models/qwen35.cpp``, ``qwen35moe.cpp``)."""
LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
"""The llama.cpp commit that sdist vendors (checked after unpacking)."""
TARGETS = ("llama-bench", "llama-batched-bench", "llama-completion")
CONVERTER = Path(__file__).resolve().with_name("gguf_convert.py")


def cache_root(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """``<MET_CACHE_DIR>/llamacpp/<version>``."""
    return load_settings().cache_dir / "llamacpp" / version


@dataclass(frozen=True)
class LlamaCpp:
    """A built llama.cpp tree: its source, its tools and the commit they came from."""

    source: Path
    bin: Path
    commit: str

    def tool(self, name: str) -> Path:
        return self.bin / name


def ensure_built(root: Path | None = None, jobs: int = 2) -> LlamaCpp:
    """Download, unpack and build llama.cpp's benchmark tools (and ``llama-completion``, for greedy
    token checks) under ``root`` unless already there."""
    root = root or cache_root()
    source = _ensure_source(root)
    commit = _git_commit(source)
    if commit != LLAMA_CPP_COMMIT:
        raise RuntimeError(f"{source} is llama.cpp {commit}, expected {LLAMA_CPP_COMMIT}")
    build = root / "build"
    if not all((build / "bin" / t).exists() for t in TARGETS):
        configure = ["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release"]
        configure += ["-G", "Ninja"] if shutil.which("ninja") else []
        configure += ["-DGGML_NATIVE=ON", "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF", "-DGGML_VULKAN=OFF"]
        configure += ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF"]
        configure += ["-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF"]
        subprocess.run(configure, check=True)
        subprocess.run(["cmake", "--build", str(build), f"-j{jobs}", "--target", *TARGETS], check=True)
    return LlamaCpp(source, build / "bin", commit)


def _ensure_source(root: Path) -> Path:
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
    source = root / name / "vendor" / "llama.cpp"
    if (source / "CMakeLists.txt").exists():
        return source
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / f"{name}.tar.gz"
    if not sdist.exists():
        download = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
        subprocess.run([*download, "-d", str(root), f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"], check=True)
    with tarfile.open(sdist) as archive:
        archive.extractall(root, filter="tar")
    return source


def _git_commit(source: Path) -> str:
    result = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else "unknown"


QWEN3_5_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
QWEN3_5_PRE_TOKENIZER = "qwen35"
"""What the GGUF calls our Qwen3.5 tokenizer's pre-tokenizer: it splits as the release's (the converter
recognises the release's by hashing its vocabulary, which ours is not)."""


def converted(llama: LlamaCpp, model_dir: Path, outtype: str, root: Path | None = None) -> Path:
    """``model_dir`` (a Kimi-Linear model in our single-file layout, or a Qwen3.5 one in the release's) as
    GGUF with ``outtype`` weights (``f32``, ``bf16``), made by the tree's ``convert_hf_to_gguf.py`` once per
    model content."""
    digest = model_digest(model_dir)
    out = (root or cache_root()) / "gguf" / f"{model_dir.name}-{digest}-{outtype}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(llama.source / "gguf-py"), str(llama.source)])}
        partial = out.with_suffix(".partial")
        qwen = json.loads((model_dir / "config.json").read_text()).get("model_type") in QWEN3_5_MODEL_TYPES
        with tempfile.TemporaryDirectory() as scratch:
            if qwen:  # the release's layout already; it has no MTP head to convert
                source, extra = model_dir, ["--unknown-pre-tokenizer", QWEN3_5_PRE_TOKENIZER, "--no-mtp"]
            else:
                source, extra = release_spelled(model_dir, Path(scratch)), []
            command = [sys.executable, str(CONVERTER), str(llama.source), str(source), *extra]
            subprocess.run([*command, "--outfile", str(partial), "--outtype", outtype], check=True, env=env)
        partial.rename(out)
    return out


def model_digest(model_dir: Path) -> str:
    """16 hex digits of a SHA-256 over the folder's ``config.json`` and weight files, in name order."""
    digest = hashlib.sha256()
    for file in [model_dir / "config.json", *sorted(model_dir.glob("*.safetensors"))]:
        digest.update(file.name.encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def release_spelled(model_dir: Path, directory: Path) -> Path:
    """A copy of ``model_dir`` whose MoE layers' tensors are named as in the Kimi-Linear release
    (``block_sparse_moe``, the names the converter maps): the same tensors, tokenizer and config, with the
    defaults the release spells out written in."""
    moe_layers = {i for i, kind in enumerate(ModelConfig.from_pretrained(model_dir).mlp_layer_types) if kind == "moe"}

    def release_name(name: str) -> str:
        parts = name.split(".")
        if len(parts) > 3 and parts[1] == "layers" and int(parts[2]) in moe_layers:
            return name.replace(".mlp.", ".block_sparse_moe.", 1)
        return name

    tensors = load_file(str(model_dir / "model.safetensors"))
    save_file({release_name(n): t for n, t in tensors.items()}, str(directory / "model.safetensors"))
    for file in model_dir.iterdir():
        if file.suffix == ".json" and file.name != "config.json":
            shutil.copy(file, directory / file.name)
    config = json.loads((model_dir / "config.json").read_text())
    # Our loader reads a missing router activation as sigmoid (the only one it serves); llama.cpp needs it written.
    config.setdefault("moe_router_activation_func", "sigmoid")
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


@dataclass(frozen=True)
class BenchResult:
    """``llama-bench -p P -n N``: prompt processing and generation tokens/s (the mean of its repetitions)."""

    pp_tokens_per_s: float
    tg_tokens_per_s: float


def llama_bench(llama: LlamaCpp, model: Path, prompt: int, new: int, threads: int, repetitions: int) -> BenchResult:
    """One ``llama-bench`` run: a ``prompt``-token prompt pass and ``new`` generated tokens, separately."""
    command = [str(llama.tool("llama-bench")), "-m", str(model), "-p", str(prompt), "-n", str(new)]
    command += ["-t", str(threads), "-r", str(repetitions), "-o", "json"]
    rows = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] == prompt and r["n_gen"] == 0)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] == new and r["n_prompt"] == 0)
    return BenchResult(pp, tg)


@dataclass(frozen=True)
class BatchedResult:
    """``llama-batched-bench``: ``sequences`` prompts of ``prompt`` tokens, then ``new`` tokens each."""

    prompt_s: float
    generate_s: float
    generated_tokens_per_s: float  # sequences × new over the whole run (prompts included)


def batched_bench(llama: LlamaCpp, model: Path, sequences: int, prompt: int, new: int, threads: int) -> BatchedResult:
    """``sequences`` separate prompts decoded together, then ``new`` steps of one token per sequence."""
    command = [str(llama.tool("llama-batched-bench")), "-m", str(model), "-c", str(sequences * (prompt + new))]
    command += ["-b", "2048", "-ub", "512", "-npp", str(prompt), "-ntg", str(new), "-npl", str(sequences)]
    command += ["-t", str(threads), "--output-format", "jsonl"]
    output = subprocess.run(command, check=True, capture_output=True, text=True)
    lines = [line for line in (output.stdout + output.stderr).splitlines() if line.startswith("{")]
    row = json.loads(lines[-1])
    return BatchedResult(row["t_pp"], row["t_tg"], sequences * new / row["t"])


def greedy_bytes(llama: LlamaCpp, model: Path, prompt: str, new: int, threads: int) -> tuple[list[int], bytes]:
    """``llama-completion``'s greedy continuation of ``prompt`` (BOS added as the GGUF says), up to ``new``
    tokens or its first end-of-generation token: the prompt's token ids as it tokenized them, and the
    generated tokens' bytes as printed (a special token prints nothing)."""
    command = [str(llama.tool("llama-completion")), "-m", str(model), "-p", prompt, "-n", str(new)]
    command += ["-t", str(threads), "--temp", "0", "-no-cnv", "--no-warmup", "--verbose-prompt"]
    command += ["--no-display-prompt", "-c", "512", "--seed", "0"]
    output = subprocess.run(command, check=True, capture_output=True)
    printed = output.stdout.removesuffix(b"\n\n")  # the tool ends its output with a blank line
    return prompt_token_ids(output.stderr.decode("utf-8", "replace")), printed


def prompt_token_ids(log: str) -> list[int]:
    """The prompt's ids from ``--verbose-prompt``'s log: after ``number of tokens in prompt = N``, the first
    N lines ``[time level] ID -> 'piece'`` (a piece with a newline continues on the next line)."""
    _, _, rest = log.partition("number of tokens in prompt = ")
    count, _, rest = rest.partition("\n")
    ids = [int(match) for match in re.findall(r"^(?:.*\s)?(\d+) -> '", rest, flags=re.MULTILINE)]
    return ids[: int(count)]


def describe(llama: LlamaCpp) -> str:
    """``llama-cpp-python <version> (llama.cpp <commit>)`` and its build flags."""
    return f"llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} (llama.cpp {llama.commit[:9]}), CPU, GGML_NATIVE=ON"
