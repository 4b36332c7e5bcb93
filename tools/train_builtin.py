"""Train Metrale's built-in model: a tiny KimiLinear (KDA + MLA + MoE) that babbles Python.

The whole pipeline runs on a CPU with nothing downloaded: the Python standard library's own source is the
corpus; a byte-level BPE is trained on it; chat examples are cut from its functions (user: a ``def`` line
and maybe its docstring, assistant: the rest of the function); transformers' ``KimiLinearForCausalLM``
is trained on it with AdamW for a fixed wall-clock budget; and the folder (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``, ``MODEL_CARD.md``) is written in
the HF layout that ``met serve --model`` and ``transformers`` both read.

Re-train (about 23 minutes on one CPU core; the last step writes samples through ``met generate``)::

    .venv/bin/python tools/train_builtin.py --out metrale/builtin_model --minutes 21 --seed 0

Data, tokenizer and initial weights depend only on ``--seed`` and the Python version. The number of
steps depends on the machine's speed (the learning-rate schedule follows the elapsed fraction of
``--minutes``); pass ``--steps N`` for a run whose every step is reproducible.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from metrale.text.builtin_tokenizer import (
    BOS_TOKEN,
    CHAT_TEMPLATE,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    builtin_tokenizer_config,
)
from metrale.text.chat_templates.render import render_chat
from metrale.worker.model.tiny import tiny_config_dict

BPE_VOCAB_SIZE = 4096
"""Byte tokens plus learned merges; the five special tokens follow, as in ``builtin_tokenizer``."""
BOS_ID, EOS_ID, PAD_ID, IM_START_ID, IM_END_ID = range(BPE_VOCAB_SIZE, BPE_VOCAB_SIZE + len(SPECIAL_TOKENS))
VOCAB_SIZE = BPE_VOCAB_SIZE + len(SPECIAL_TOKENS)

ARCH: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_shared_experts": 1,
    "num_expert_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "linear_attn_config": {
        "kda_layers": [1, 2, 4],
        "full_attn_layers": [3],
        "num_heads": 4,
        "head_dim": 64,
        "short_conv_kernel_size": 4,
    },
    "eos_token_id": [EOS_ID, IM_END_ID],
    "bos_token_id": BOS_ID,
    "pad_token_id": PAD_ID,
}
"""Overrides of ``tiny_config_dict``: 4 layers (KDA, KDA, MLA, KDA), a dense first MLP, then MoE."""

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "encodings", "pydoc_data", "__pycache__"}
"""Test suites, installed packages, generated codec tables and the generated pydoc topics."""
MAX_FILE_BYTES = 150_000
VAL_EVERY = 50  # every 50th file (sorted order) is held out for the validation loss
MAX_FUNCTION_CHARS = 1500
KDA_CHUNK = 16
SAMPLE_PROMPTS: tuple[tuple[str, str, float, int | None], ...] = (
    ("chat", "def fibonacci(n):", 0.0, None),
    ("chat", 'def read_config(path):\n    """Read a JSON config file and return it as a dict."""', 0.0, None),
    ("chat", "def fibonacci(n):", 0.7, 1),
    ("plain", "def fibonacci(n):", 0.0, None),
    ("plain", "def is_prime(n):", 0.0, None),
    ("plain", "class Stack:", 0.7, 1),
)
"""(mode, prompt, temperature, seed) of the samples in the model card; ``chat`` wraps the prompt as a user turn."""
SAMPLE_MAX_TOKENS = 160


# --- data ------------------------------------------------------------------------------------------------


def stdlib_files(root: Path) -> list[Path]:
    """The standard library's ``*.py`` files, sorted, without test suites and huge generated files."""
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = set(path.relative_to(root).parts[:-1])
        if parts & SKIP_DIRS or path.name.startswith("_sysconfigdata") or path.stat().st_size > MAX_FILE_BYTES:
            continue
        files.append(path)
    return files


def read_sources(files: Sequence[Path]) -> list[str]:
    """File texts (undecodable bytes replaced), with Windows line ends normalized."""
    return [path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n") for path in files]


@dataclass(frozen=True)
class Function:
    """One function cut out of a source file, dedented: its header (``def`` line(s), docstring) and body."""

    signature: str
    docstring: str
    body: str

    @property
    def source(self) -> str:
        return "".join(part for part in (self.signature, self.docstring, self.body))


def functions_in(source: str) -> list[Function]:
    """Every function and method in ``source`` with a body of its own lines and a moderate size."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines(keepends=True)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            function = _cut_function(node, lines)
            if function is not None:
                found.append(function)
    return found


def _cut_function(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> Function | None:
    """Split ``node``'s lines into signature / docstring / body; None if it does not fit the examples."""
    first = node.body[0]
    has_doc = (
        isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
    )
    body_start = node.body[1].lineno if has_doc and len(node.body) > 1 else first.lineno
    if first.lineno <= node.lineno or body_start <= node.lineno or (has_doc and len(node.body) == 1):
        return None  # a one-line def, or a function that is only a docstring
    text = textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno]))
    if not text.startswith(("def ", "async def ")) or len(text) > MAX_FUNCTION_CHARS:
        return None
    own = text.splitlines(keepends=True)
    sig_len = _signature_lines(node, own, first.lineno - node.lineno)
    body_offset = body_start - node.lineno
    signature, docstring, body = "".join(own[:sig_len]), "".join(own[sig_len:body_offset]), "".join(own[body_offset:])
    return Function(signature, docstring, body) if body.strip() else None


def _signature_lines(node: ast.FunctionDef | ast.AsyncFunctionDef, own: list[str], at_most: int) -> int:
    """How many of the function's lines the ``def ...:`` header takes (comments after it are not header)."""
    ends = [getattr(n, "end_lineno", None) or node.lineno for n in ast.walk(node.args)]
    if node.returns is not None:
        ends.append(node.returns.end_lineno or node.lineno)
    for i in range(max(ends) - node.lineno, at_most):
        if own[i].split("#")[0].rstrip().endswith(":"):
            return i + 1
    return at_most


def chat_example(function: Function, with_docstring: bool) -> tuple[str, str]:
    """A ChatML conversation, the user sending the header and the assistant answering with the rest, as
    (prompt, reply): the prompt is the chat rendered with the generation prompt, as a server renders it.

    The two parts are tokenized separately, as in serving: the BPE would otherwise merge the ``\\n`` that
    ends the prompt with the reply's indentation, a token boundary the model would never see at inference.
    """
    user = (function.signature + function.docstring if with_docstring else function.signature).rstrip("\n")
    assistant = (function.body if with_docstring else function.docstring + function.body).rstrip("\n")
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    tokens = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    prompt = render_chat(CHAT_TEMPLATE, messages[:1], add_generation_prompt=True, special_tokens=tokens)
    full = render_chat(CHAT_TEMPLATE, messages, add_generation_prompt=False, special_tokens=tokens)
    if not full.startswith(prompt):
        raise RuntimeError("the chat template does not render the prompt as a prefix of the chat")
    return prompt, full[len(prompt) :]


Document = tuple[str, ...]
"""A document as text pieces (special tokens spelled out), each tokenized on its own."""


@dataclass
class Corpus:
    """Documents by kind."""

    files: list[Document] = field(default_factory=list)
    functions: list[Document] = field(default_factory=list)
    chats: list[Document] = field(default_factory=list)


def build_corpus(sources: Sequence[str], rng: random.Random) -> Corpus:
    """Whole files and single functions as plain documents (BOS … EOS), and one chat per function."""
    corpus = Corpus()
    for source in sources:
        corpus.files.append((f"{BOS_TOKEN}{source}{EOS_TOKEN}",))
        for function in functions_in(source):
            corpus.functions.append((f"{BOS_TOKEN}{function.source}{EOS_TOKEN}",))
            with_docstring = bool(function.docstring) and rng.random() < 0.5
            corpus.chats.append(chat_example(function, with_docstring))
    return corpus


# --- tokenizer -------------------------------------------------------------------------------------------


def train_tokenizer(texts: Sequence[str]) -> Tokenizer:
    """A byte-level BPE (no prefix space, so every string round-trips) plus the special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if tokenizer.get_vocab_size() != BPE_VOCAB_SIZE:
        raise RuntimeError(f"BPE training gave {tokenizer.get_vocab_size()} tokens, not {BPE_VOCAB_SIZE}")
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    if [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] != [BOS_ID, EOS_ID, PAD_ID, IM_START_ID, IM_END_ID]:
        raise RuntimeError("special tokens did not get the expected ids")
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    return tokenizer


def encode_documents(tokenizer: Tokenizer, documents: Sequence[Document]) -> list[list[int]]:
    """Token ids of each document: its pieces encoded one by one (no special tokens added), joined."""
    pieces = [piece for document in documents for piece in document]
    ids = iter(encoding.ids for encoding in tokenizer.encode_batch(pieces, add_special_tokens=False))
    return [[i for _ in document for i in next(ids)] for document in documents]


def token_stream(encoded: Sequence[list[int]], rng: random.Random) -> torch.Tensor:
    """The encoded documents in a shuffled order, concatenated."""
    order = list(encoded)
    rng.shuffle(order)
    return torch.tensor([i for ids in order for i in ids], dtype=torch.long)


def windows(stream: torch.Tensor, length: int) -> torch.Tensor:
    """Non-overlapping rows of ``length + 1`` tokens (inputs and their next-token targets)."""
    count = (len(stream) - 1) // length
    starts = torch.arange(count) * length
    return torch.stack([stream[s : s + length + 1] for s in starts.tolist()])


# --- model -----------------------------------------------------------------------------------------------


def model_config() -> dict[str, Any]:
    """The ``config.json`` of the built-in model (HF field names, ``model_type`` ``kimi_linear``)."""
    return tiny_config_dict(VOCAB_SIZE, **ARCH)


def chunk_kda_matmul(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA, the same math as transformers' torch fallback, written with matmuls for CPU training.

    transformers' fallback builds a [chunk, chunk, head_dim] decay tensor per chunk and a Python loop
    over rows; this version factors the decays around each 16-token chunk's middle token, so intra-chunk
    scores are plain matmuls (see ``_intra_chunk_scores``), and solves the WY system with ``solve_triangular``:
    a training step of this model went from ~30 s to ~1 s on 2 cores, with outputs and gradients equal to
    1e-5. Shapes as in transformers: [batch, time, heads, dim]; ``chunk_size`` is ignored (16 is used).
    """
    q, k, v, g, beta = (x.float() for x in (query, key, value, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    batch, length, heads, k_dim = k.shape
    pad, c = -length % KDA_CHUNK, KDA_CHUNK
    n = (length + pad) // c

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, D] → [B, H, N, C, D]
        return F.pad(x, (0, 0, 0, 0, 0, pad)).reshape(batch, n, c, heads, x.shape[-1]).permute(0, 3, 1, 2, 4)

    q, k, v, g, beta = chunked(q) * k_dim**-0.5, chunked(k), chunked(v), chunked(g).cumsum(-2), chunked(beta[..., None])
    qk, kk = _intra_chunk_scores(q, k, g)
    wy = torch.linalg.solve_triangular(
        beta * kk + torch.eye(c), torch.cat([v * beta, k * beta * g.exp()], -1), upper=False, unitriangular=True
    )
    u, w = wy[..., : v.shape[-1]], wy[..., v.shape[-1] :]
    last = g[..., -1:, :]
    state = torch.zeros(batch, heads, k_dim, v.shape[-1]) if initial_state is None else initial_state.float()
    outputs = []
    parts = (q * g.exp(), u, w, qk, (k * (last - g).exp()).transpose(-1, -2), last.transpose(-1, -2).exp())
    for q_i, u_i, w_i, qk_i, k_i, decay_i in zip(*(x.unbind(2) for x in parts), strict=True):
        v_new = u_i - w_i @ state
        outputs.append(q_i @ state + qk_i @ v_new)
        state = state * decay_i + k_i @ v_new
    out = torch.stack(outputs, 2).reshape(batch, heads, n * c, -1)[:, :, :length].transpose(1, 2)
    return out.contiguous().to(query.dtype), state if output_final_state else None


def _intra_chunk_scores(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q_i·k_j and k_i·k_j (j < i) weighted by the per-channel decay exp(g_i - g_j), within each chunk.

    Fast path: split the decay around the chunk's middle token, exp(g_i - g_mid) · exp(g_mid - g_j), so the
    scores are matmuls; every factor stays below e^40 while the chunk decays by less than e^-40. Chunks
    that forget faster (the gates are data-dependent) take the exact [chunk, chunk, dim] form instead.
    """
    c = q.shape[-2]
    lower = torch.tril(torch.ones(c, c, dtype=torch.bool))
    if (g[..., 0, :] - g[..., -1, :]).max().item() < 40.0:
        mid = g[..., c // 2 : c // 2 + 1, :]
        k_back = (k * (mid - g).exp()).transpose(-1, -2)
        qk = ((q * (g - mid).exp()) @ k_back).masked_fill(~lower, 0)
        return qk, ((k * (g - mid).exp()) @ k_back).tril(-1)
    decay = (g.unsqueeze(-2) - g.unsqueeze(-3)).masked_fill(~lower[..., None], float("-inf")).exp()
    qk = (q.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(-1)
    return qk, (k.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(-1).tril(-1)


def build_model(seed: int) -> torch.nn.Module:
    """transformers' ``KimiLinearForCausalLM`` from ``model_config()``, seeded, with the matmul KDA."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    from transformers.models.kimi_linear import modeling_kimi_linear

    modeling_kimi_linear.chunk_kimi_delta_attention = chunk_kda_matmul
    torch.manual_seed(seed)
    return KimiLinearForCausalLM(KimiLinearConfig.from_dict(model_config()))


class RouterBalancer:
    """Auxiliary-loss-free MoE load balancing (DeepSeek-V3): nudge each expert's routing bias toward
    equal load after every step. The bias only changes which experts are picked, never their weights."""

    def __init__(self, model: torch.nn.Module, rate: float = 1e-3) -> None:
        self.rate = rate
        self.routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
        self.counts = {id(r): torch.zeros(r.num_experts) for r in self.routers}
        for router in self.routers:
            router.register_forward_hook(self._count)

    def _count(self, router: torch.nn.Module, _inputs: Any, outputs: tuple[torch.Tensor, ...]) -> None:
        if router.training:
            self.counts[id(router)] += torch.bincount(outputs[2].flatten(), minlength=router.num_experts).float()

    @torch.no_grad()
    def step(self) -> None:
        for router in self.routers:
            counts = self.counts[id(router)]
            router.e_score_correction_bias += self.rate * torch.sign(counts.mean() - counts)
            counts.zero_()


# --- training --------------------------------------------------------------------------------------------


@dataclass
class TrainSettings:
    minutes: float
    steps: int | None
    seed: int
    batch: int = 2
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    log_points: int = 16


@dataclass
class TrainLog:
    rows: list[dict[str, float]] = field(default_factory=list)
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0


def lr_at(settings: TrainSettings, step: int, progress: float) -> float:
    """Linear warm-up over the first steps, then cosine decay to ``min_lr_ratio`` as progress goes 0 → 1."""
    warm = min(1.0, (step + 1) / settings.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return settings.lr * warm * (settings.min_lr_ratio + (1 - settings.min_lr_ratio) * cosine)


def make_optimizer(model: torch.nn.Module, settings: TrainSettings) -> torch.optim.Optimizer:
    """AdamW; matrices decay, norms / biases / gate parameters do not."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    plain = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": settings.weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=settings.lr, betas=(0.9, 0.95), eps=1e-8)


def batch_loss(model: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over a batch of ``seq_len + 1`` rows."""
    logits = model(input_ids=rows[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), rows[:, 1:].reshape(-1))


@torch.no_grad()
def validation_loss(model: torch.nn.Module, val_rows: torch.Tensor, batch: int) -> float:
    model.eval()
    losses = [batch_loss(model, val_rows[i : i + batch]).item() for i in range(0, len(val_rows), batch)]
    model.train()
    return sum(losses) / len(losses)


def batches(rows: torch.Tensor, batch: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Shuffled batches of training rows, epoch after epoch."""
    while True:
        order = torch.randperm(len(rows), generator=generator)
        for i in range(0, len(order) - batch + 1, batch):
            yield rows[order[i : i + batch]]


def train(
    model: torch.nn.Module, train_rows: torch.Tensor, val_rows: torch.Tensor, settings: TrainSettings
) -> TrainLog:
    """AdamW until the step count or the time budget is spent; logs ``log_points`` rows on the way."""
    optimizer, balancer, log = make_optimizer(model, settings), RouterBalancer(model), TrainLog()
    budget, start, next_log, window = settings.minutes * 60, time.monotonic(), 0.0, []
    progress_of: Callable[[int, float], float] = (
        (lambda step, _: step / settings.steps) if settings.steps else (lambda _, elapsed: elapsed / budget)
    )
    model.train()
    for step, rows in enumerate(batches(train_rows, settings.batch, torch.Generator().manual_seed(settings.seed))):
        progress = progress_of(step, time.monotonic() - start)
        if progress >= next_log or progress >= 1.0:
            _log_row(log, step, window, validation_loss(model, val_rows, settings.batch), start)
            window, next_log = [], next_log + 1.0 / settings.log_points
        if progress >= 1.0:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(settings, step, progress)
        loss = batch_loss(model, rows)
        if not torch.isfinite(loss):
            raise RuntimeError(f"loss is {loss.item()} at step {step}")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        balancer.step()
        window.append(loss.item())
        log.steps, log.tokens = step + 1, log.tokens + rows[:, 1:].numel()
    log.seconds = time.monotonic() - start
    return log


def _log_row(log: TrainLog, step: int, window: list[float], val: float, start: float) -> None:
    train_loss = sum(window) / len(window) if window else float("nan")
    row = {
        "step": step,
        "train_loss": train_loss,
        "val_loss": val,
        "tokens": log.tokens,
        "elapsed_s": time.monotonic() - start,
    }
    log.rows.append(row)
    print(
        f"step {step:5d}  train {train_loss:.3f}  val {val:.3f}  tokens {log.tokens:,}  "
        f"elapsed {row['elapsed_s']:.0f}s",
        flush=True,
    )


# --- output ----------------------------------------------------------------------------------------------


def write_model_folder(out: Path, model: torch.nn.Module, tokenizer: Tokenizer) -> None:
    """``config.json``, ``model.safetensors`` (HF tensor names), ``tokenizer.json``, ``tokenizer_config.json``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(model_config(), indent=2, sort_keys=True) + "\n")
    tensors = {name: t.detach().contiguous().clone() for name, t in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    config_text = json.dumps(builtin_tokenizer_config(), indent=2, ensure_ascii=False) + "\n"
    (out / "tokenizer_config.json").write_text(config_text, encoding="utf-8")


def met_generate(out: Path, mode: str, prompt: str, temperature: float, seed: int | None) -> dict[str, Any]:
    """One completion through Metrale's own engine: ``met generate --json`` (the record, plus the flags)."""
    met = Path(sys.executable).with_name("met")
    flags = ["--chat"] if mode == "chat" else []
    flags += ["--temperature", f"{temperature:g}", "--max-tokens", str(SAMPLE_MAX_TOKENS)]
    flags += ["--seed", str(seed)] if seed is not None else []
    command = [str(met if met.exists() else shutil.which("met") or "met"), "generate", "--model", str(out), *flags]
    result = subprocess.run([*command, "--json", prompt], check=True, capture_output=True, text=True)
    record = json.loads(result.stdout.strip().splitlines()[-1])
    return {**record, "mode": mode, "greedy": temperature == 0, "flags": " ".join(flags)}


def _shell_quote(text: str) -> str:
    """``text`` as one bash word; ANSI-C quoting (``$'...'``) when it has newlines."""
    if "\n" not in text:
        return shlex.quote(text)
    return "$'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def check_with_transformers(out: Path, samples: list[dict[str, Any]]) -> dict[str, bool]:
    """transformers loads the folder; its tokenizer gives our ids; its greedy tokens match Metrale's."""
    from transformers import AutoTokenizer, KimiLinearForCausalLM

    hf_tok, ours = AutoTokenizer.from_pretrained(out), Tokenizer.from_file(str(out / "tokenizer.json"))
    texts = ["def fibonacci(n):\n    return n", "héllo wörld ✓ 🐍", "<|im_start|>user\nhi<|im_end|>\n", "  \t x=1\r\n"]
    same_ids = all(hf_tok(t)["input_ids"] == ours.encode(t).ids for t in texts)
    round_trip = all(ours.decode(ours.encode(t, add_special_tokens=False).ids) == t for t in texts[:2] + texts[3:])
    model = KimiLinearForCausalLM.from_pretrained(out).eval()
    same_tokens = True
    for sample in (s for s in samples if s["greedy"]):
        prompt_ids = (
            hf_tok.apply_chat_template(
                [{"role": "user", "content": sample["prompt"]}],
                tokenize=True,
                add_generation_prompt=True,
                return_dict=False,
            )
            if sample["mode"] == "chat"
            else hf_tok(sample["prompt"])["input_ids"]
        )
        with torch.no_grad():
            ids = model.generate(
                torch.tensor([list(prompt_ids)]),
                max_new_tokens=len(sample["token_ids"]),
                do_sample=False,
                eos_token_id=[EOS_ID, IM_END_ID],
                pad_token_id=PAD_ID,
            )
        same_tokens &= ids[0, len(prompt_ids) :].tolist() == sample["token_ids"]
    return {"hf_tokenizer_same_ids": same_ids, "round_trip": round_trip, "hf_greedy_matches_metrale": same_tokens}


# --- model card ------------------------------------------------------------------------------------------


@dataclass
class RunFacts:
    """What the model card reports about one run."""

    settings: TrainSettings
    log: TrainLog
    files: dict[str, int]
    documents: dict[str, int]
    tokens: dict[str, int]
    parameters: int
    safetensors_bytes: int
    wall_minutes: float
    samples: list[dict[str, Any]]
    checks: dict[str, bool]


def model_card(facts: RunFacts) -> str:
    """``MODEL_CARD.md``: what the model is, its data, architecture, training, loss curve and samples."""
    return "\n".join(
        [
            _card_intro(),
            _card_data(facts),
            _card_architecture(facts),
            _card_training(facts),
            _card_curve(facts.log),
            _card_samples(facts),
            _card_retrain(facts),
        ]
    )


def _card_intro() -> str:
    return textwrap.dedent("""\
        # metrale-tiny: the built-in toy model

        A ~5M-parameter KimiLinear model (KDA + MLA + MoE, the architecture of Kimi-Linear-48B-A3B) trained in
        about 21 minutes on one CPU core on the Python standard library's source code. It exists so that
        `met serve` and `met generate` answer with something readable without downloading anything: it writes
        code-shaped babble (plausible Python syntax and stdlib idioms, no real understanding) and, in chat,
        answers a `def` line with a function body and then stops. Do not use it for anything else.

        To serve a real model instead, point Metrale at any KimiLinear checkpoint folder in the HF layout,
        e.g. `met serve --model /models/Kimi-Linear-48B-A3B-Instruct` (or `met generate --model DIR ...`).
        """)


def _card_data(facts: RunFacts) -> str:
    f, d, t = facts.files, facts.documents, facts.tokens
    return textwrap.dedent(f"""\
        ## Data

        The `*.py` files of the Python {sys.version.split()[0]} standard library (`sysconfig.get_paths()["stdlib"]`),
        sorted by path, without test suites (`test/`, `tests/`, `idle_test/`), `site-packages/`, the generated
        codec tables (`encodings/`), the pydoc topics, `_sysconfigdata*` and files over {MAX_FILE_BYTES:,} bytes:
        {f["train"] + f["val"]} files, {f["bytes"]:,} bytes. Every {VAL_EVERY}th file ({f["val"]}) is held out for the
        validation loss; the tokenizer and the training set see only the other {f["train"]}.

        Three kinds of documents are made from each file, then shuffled together and cut into rows of
        {facts.settings.seq_len} + 1 tokens:

        | kind | documents (train) | tokens (train) | tokens (val) |
        |---|---:|---:|---:|
        | whole file: `<|bos|>` source `<|eos|>` | {d["files"]:,} | {t["files"]:,} | {t["val_files"]:,} |
        | one function: `<|bos|>` source `<|eos|>` | {d["functions"]:,} | {t["functions"]:,} | {t["val_functions"]:,} |
        | chat (ChatML template, see below) | {d["chats"]:,} | {t["chats"]:,} | {t["val_chats"]:,} |

        Chat examples: for every function and method (found with `ast`, dedented, at most {MAX_FUNCTION_CHARS}
        characters, with a body on lines of its own) the user message is its `def ...:` header - with its
        docstring for half of the functions that have one - and the assistant message is the rest of the
        function, rendered with the chat template as
        `<|bos|><|im_start|>user\\n{{def line}}<|im_end|>\\n<|im_start|>assistant\\n{{body}}<|im_end|>\\n`.
        The prompt (up to `<|im_start|>assistant\\n`) and the reply are tokenized separately, as in serving, so
        that the reply's first token is one the model will be asked for. The loss is on every token.
        """)


def _card_architecture(facts: RunFacts) -> str:
    a, lin = ARCH, ARCH["linear_attn_config"]
    return textwrap.dedent(f"""\
        ## Tokenizer and architecture

        Tokenizer: byte-level BPE trained with `tokenizers` on the training files ({BPE_VOCAB_SIZE} tokens: 256
        bytes + merges; GPT-2 `ByteLevel` pre-tokenizer and decoder, no prefix space, so every string
        round-trips), then `<|bos|>` {BOS_ID}, `<|eos|>` {EOS_ID}, `<|pad|>` {PAD_ID}, `<|im_start|>` {IM_START_ID},
        `<|im_end|>` {IM_END_ID}: {VOCAB_SIZE} ids. The post-processor adds `<|bos|>`; the chat template is
        ChatML (`metrale.text.builtin_tokenizer.CHAT_TEMPLATE`). Generation stops at `<|eos|>` or `<|im_end|>`
        (both are `eos_token_id` in `config.json`).

        Model (`KimiLinearForCausalLM`, fp32): {facts.parameters:,} parameters, `model.safetensors`
        {facts.safetensors_bytes / 1e6:.1f} MB.

        - hidden {a["hidden_size"]}, {a["num_hidden_layers"]} layers: KDA at layers {lin["kda_layers"]}, MLA at
          {lin["full_attn_layers"]} (1-based)
        - KDA: {lin["num_heads"]} heads × {lin["head_dim"]}, short conv {lin["short_conv_kernel_size"]}
        - MLA: {a["num_attention_heads"]} heads, kv_lora_rank {a["kv_lora_rank"]}, qk nope/rope
          {a["qk_nope_head_dim"]}/{a["qk_rope_head_dim"]}, v {a["v_head_dim"]}, no q LoRA
        - MLP: layer 1 dense SwiGLU ({a["intermediate_size"]}); layers 2-4 MoE: {a["num_experts"]} experts of
          {a["moe_intermediate_size"]}, top-{a["num_experts_per_token"]} in {a["num_expert_group"]} groups
          (top-{a["topk_group"]} group), {a["num_shared_experts"]} shared expert, sigmoid router, scaling 2.446
        - untied embeddings and LM head
        """)


def _card_training(facts: RunFacts) -> str:
    s, log = facts.settings, facts.log
    budget = f"{s.steps} steps" if s.steps else f"{s.minutes:g}-minute time budget"
    return textwrap.dedent(f"""\
        ## Training

        transformers {_version("transformers")} `KimiLinearForCausalLM` (torch {torch.__version__}, CPU), its
        chunked-KDA fallback swapped for an equivalent matmul form (`chunk_kda_matmul` in the script).
        AdamW (β 0.9/0.95, weight decay {s.weight_decay} on matrices), peak lr {s.lr}, {s.warmup_steps} warm-up
        steps, cosine decay to {s.min_lr_ratio:g}× over the {budget}, gradient clipping 1.0, batches of
        {s.batch} × {s.seq_len} tokens; MoE load balanced by DeepSeek-V3's routing-bias update (no auxiliary
        loss). Seed {s.seed}.

        {log.steps} steps, {log.tokens:,} tokens, {log.seconds / 60:.1f} minutes of training,
        {facts.wall_minutes:.1f} minutes for the whole script, on {_machine()}.
        """)


def _card_curve(log: TrainLog) -> str:
    lines = [
        "## Loss curve",
        "",
        "Train loss: mean over the steps since the previous row; val loss: the held-out rows (nats per token).",
        "",
        "| step | tokens | minutes | train loss | val loss |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in log.rows:
        train_loss = "-" if math.isnan(row["train_loss"]) else f"{row['train_loss']:.3f}"
        lines.append(
            f"| {row['step']} | {row['tokens']:,} | {row['elapsed_s'] / 60:.1f} | {train_loss} "
            f"| {row['val_loss']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def _card_samples(facts: RunFacts) -> str:
    """Each sample as the command that made it, its finish reason, and prompt + completion."""
    same = "the same tokens" if facts.checks.get("hf_greedy_matches_metrale") else "DIFFERENT tokens"
    lines = [
        "## Samples",
        "",
        "Through Metrale's own engine (`met generate`); `--chat` wraps the prompt as a user turn of the chat "
        f"template. For the greedy ones, transformers' greedy `generate` on the same folder gives {same}.",
        "",
    ]
    for sample in facts.samples:
        command = f"met generate --model metrale/builtin_model {sample['flags']} {_shell_quote(sample['prompt'])}"
        completion = (sample["prompt"] + "\n" if sample["mode"] == "chat" else sample["prompt"]) + sample["text"]
        lines += [f"`{command}` (finish reason: {sample['finish_reason']})", "", "```python", completion, "```", ""]
    return "\n".join(lines)


def _card_retrain(facts: RunFacts) -> str:
    s = facts.settings
    flags = f"--minutes {s.minutes:g} --seed {s.seed}" + (f" --steps {s.steps}" if s.steps else "")
    return textwrap.dedent(f"""\
        ## Re-train

        ```
        .venv/bin/python tools/train_builtin.py --out metrale/builtin_model {flags}
        ```
        """)


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def _machine() -> str:
    """The CPU model (from ``/proc/cpuinfo`` where there is one) and the torch thread count."""
    import platform

    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    cpu = names[0] if names else platform.machine()
    threads = torch.get_num_threads()
    return f"{cpu} ({len(names) or '?'} cores, shared with other work), {threads} torch thread{'s' * (threads > 1)}"


# --- main ------------------------------------------------------------------------------------------------


@dataclass
class Prepared:
    tokenizer: Tokenizer
    train_rows: torch.Tensor
    val_rows: torch.Tensor
    files: dict[str, int]
    documents: dict[str, int]
    tokens: dict[str, int]


def prepare_data(seed: int, seq_len: int, val_rows: int = 32) -> Prepared:
    """Corpus → tokenizer → rows of token ids, for training and validation."""
    files = stdlib_files(Path(sysconfig.get_paths()["stdlib"]))
    val_files = [p for i, p in enumerate(files) if i % VAL_EVERY == VAL_EVERY - 1]
    train_files = [p for i, p in enumerate(files) if i % VAL_EVERY != VAL_EVERY - 1]
    rng = random.Random(seed)
    train_sources, val_sources = read_sources(train_files), read_sources(val_files)
    train, val = build_corpus(train_sources, rng), build_corpus(val_sources, rng)
    tokenizer = train_tokenizer(train_sources)
    encoded = {kind: encode_documents(tokenizer, getattr(train, kind)) for kind in ("files", "functions", "chats")}
    val_encoded = {kind: encode_documents(tokenizer, getattr(val, kind)) for kind in ("files", "functions", "chats")}
    tokens = {kind: sum(map(len, docs)) for kind, docs in encoded.items()}
    tokens |= {f"val_{kind}": sum(map(len, docs)) for kind, docs in val_encoded.items()}
    train_stream = token_stream([d for docs in encoded.values() for d in docs], rng)
    val_stream = token_stream([d for docs in val_encoded.values() for d in docs], rng)
    return Prepared(
        tokenizer=tokenizer,
        train_rows=windows(train_stream, seq_len),
        val_rows=windows(val_stream, seq_len)[:val_rows],
        files={"train": len(train_files), "val": len(val_files), "bytes": sum(p.stat().st_size for p in files)},
        documents={kind: len(docs) for kind, docs in encoded.items()},
        tokens=tokens,
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("metrale/builtin_model"), help="model folder to write")
    parser.add_argument("--minutes", type=float, default=21.0, help="training time budget (the loop only)")
    parser.add_argument("--steps", type=int, default=None, help="train exactly this many steps instead")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads; 1 by default: on a shared 2-core machine, 2 OpenMP threads ran 4-40x slower "
        "whenever another process took a core, 1 thread at most 1.5x",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.monotonic()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    settings = TrainSettings(minutes=args.minutes, steps=args.steps, seed=args.seed)
    data = prepare_data(args.seed, settings.seq_len)
    print(
        f"data: {data.files}, tokens {data.tokens}, rows {len(data.train_rows)} train / {len(data.val_rows)} val "
        f"({time.monotonic() - start:.0f}s)",
        flush=True,
    )
    model = build_model(args.seed)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"model: {parameters:,} parameters", flush=True)
    log = train(model, data.train_rows, data.val_rows, settings)
    with tempfile.TemporaryDirectory() as tmp:
        staging = Path(tmp) / "model"
        write_model_folder(staging, model, data.tokenizer)
        samples = [met_generate(staging, *spec) for spec in SAMPLE_PROMPTS]
        checks = check_with_transformers(staging, samples)
        print(f"checks: {checks}", flush=True)
        facts = RunFacts(
            settings,
            log,
            data.files,
            data.documents,
            data.tokens,
            parameters,
            (staging / "model.safetensors").stat().st_size,
            (time.monotonic() - start) / 60,
            samples,
            checks,
        )
        (staging / "MODEL_CARD.md").write_text(model_card(facts), encoding="utf-8")
        shutil.rmtree(args.out, ignore_errors=True)
        shutil.copytree(staging, args.out)
    print(f"wrote {args.out} ({facts.wall_minutes:.1f} minutes in all)", flush=True)


if __name__ == "__main__":
    main()
