"""A compiled decode step: the model's forward for a batch of decode rows only (one new token per
sequence on top of its state), captured by ``torch.compile`` (inductor: C++/OpenMP on the CPU) with
static shapes, one graph per batch-size bucket — the CPU analogue of CUDA-graph capture, and the same
buckets and padding would serve one.

A batch of ``n`` decode rows runs in the smallest bucket ``B >= n``; rows ``n..B`` are padding (token 0,
slot and cache index ``graph_ops.PAD_SLOT``, no context), which the stateful ops skip, so no state outside
the batch is touched and each real sequence's state consumes its one position once (DESIGN contract 1).
The graph is the eager model's own code: while Dynamo traces, ``kernels.ops`` sends the stateful kernels
(KDA recurrence, short conv, latent store) to the custom ops of ``kernels.graph_ops`` and MLA to its
static-shape ``mla.paged_mla_decode``, and the MoE takes its ``_gathered_experts``; everything else is
fused by inductor. The eager forward is its plain twin (equal to rounding, the same greedy tokens:
tests/worker/model/test_decode_graph.py).

The block table's width (the longest sequence's blocks) grows with the context; it is the graph's one
dynamic size (MLA's loops run to it), so a bucket compiles once.
"""

from __future__ import annotations

import contextlib
import time
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from metrale.worker.kernels.graph_ops import PAD_SLOT
from metrale.worker.kernels.native import graph_ops as native_graph_ops
from metrale.worker.model.batch import BatchLayout
from metrale.worker.model.families.kimi_linear import KimiLinearModel
from metrale.worker.model.interface import ForwardChunk
from metrale.worker.model.state import StatePool

DEFAULT_BUCKETS = (1, 2, 4, 8)
"""Batch sizes with a compiled graph. Larger decode batches run eagerly: there the per-call overhead the
graph removes is shared by many rows, and ``_gathered_experts`` reads each row's experts separately."""


def is_decode_step(chunks: Sequence[ForwardChunk]) -> bool:
    """Whether every chunk feeds one token on top of carried state (what a decode graph runs)."""
    return all(len(c.token_ids) == 1 and c.start > 0 for c in chunks)


def decode_layout(chunks: Sequence[ForwardChunk], bucket: int, block_size: int, device: torch.device) -> BatchLayout:
    """The :class:`BatchLayout` of decode ``chunks`` padded to ``bucket`` rows, in the caller's order."""
    pad = bucket - len(chunks)
    width = max([2, *(len(c.block_ids) for c in chunks)])  # >= 2: a width of 1 would be specialised on
    cache_index = [c.block_ids[c.start // block_size] * block_size + c.start % block_size for c in chunks]
    rows = torch.arange(bucket + 1, device=device)

    def tensor(values: Sequence[object], dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    block_tables = tensor([[*c.block_ids, *[0] * (width - len(c.block_ids))] for c in chunks] + [[0] * width] * pad)
    torch._dynamo.mark_dynamic(block_tables, 1)
    return BatchLayout(
        token_ids=tensor([c.token_ids[0] for c in chunks] + [0] * pad),
        cu_seqlens=rows,
        slots=tensor([c.slot for c in chunks] + [PAD_SLOT] * pad),
        has_initial_state=tensor([True] * bucket, torch.bool),
        context_lens=tensor([c.end for c in chunks] + [0] * pad),
        block_tables=block_tables,
        slot_mapping=tensor(cache_index + [PAD_SLOT] * pad),
        last_rows=rows[:bucket],
        order=tuple(range(bucket)),
        num_decode=bucket,
    )


def _decode_logits(model: KimiLinearModel, layout: BatchLayout, pool: StatePool) -> torch.Tensor:
    """``KimiLinearModel.forward`` for a decode layout (every row's logits), as the graph captures it."""
    x = model.embed_tokens(layout.token_ids)
    for layer in model.layers:
        x = layer(x, layout, pool)
    return model.lm_head(model.norm(x))


class DecodeGraph:
    """The compiled decode step of one model over one state pool: a graph per bucket in ``buckets`` and
    per thread count (inductor's C++ kernels are built for the thread count of their compile).

    Each graph has a code object of its own, so Dynamo keeps exactly one compiled entry per graph. Once
    compiled, a step calls the bytecode Dynamo made for that code object directly (a :class:`CompiledStep`):
    it gathers the graph's inputs and calls the compiled graph, without Dynamo's frame entry (~5 % of a
    one-row step of the medium model) and without its guards, which need no checking here: the inputs
    are built here, always alike (the same model, pool, dtypes and shapes), and the block table's width,
    the one dynamic size, is read from the table by that bytecode.
    """

    def __init__(self, model: KimiLinearModel, pool: StatePool, buckets: Sequence[int] = DEFAULT_BUCKETS) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError(f"decode buckets must be positive batch sizes, got {buckets}")
        self.model, self.pool = model, pool
        self.buckets = tuple(sorted(set(buckets)))
        self.device = model.embed_tokens.weight.device
        self._steps: dict[tuple[int, int], CompiledStep] = {}

    def bucket(self, batch: int) -> int | None:
        """The smallest bucket holding ``batch`` rows, or None when the batch is larger than every bucket."""
        return next((b for b in self.buckets if b >= batch), None)

    def runs(self, chunks: Sequence[ForwardChunk]) -> bool:
        """Whether this step is one for the graph: decode rows only, no more than the largest bucket."""
        return len(chunks) <= self.buckets[-1] and is_decode_step(chunks)

    @torch.inference_mode()
    def forward(self, chunks: Sequence[ForwardChunk]) -> torch.Tensor:
        """Logits ``[len(chunks), vocab]`` (weight dtype) of decode ``chunks``, in the order given; every
        chunk's state advanced by its one token. The first step of a bucket compiles its graph."""
        bucket = self.bucket(len(chunks))
        assert bucket is not None and is_decode_step(chunks), "runs() first"
        layout = decode_layout(chunks, bucket, self.pool.block_size, self.device)
        return self._run(bucket, layout)[: len(chunks)]

    @torch.inference_mode()
    def warm_up(self) -> dict[int, float]:
        """Compile every bucket now, on padding rows only (no state is touched); wall seconds per bucket."""
        seconds: dict[int, float] = {}
        for bucket in self.buckets:
            start = time.perf_counter()
            self._run(bucket, decode_layout([], bucket, self.pool.block_size, self.device))
            seconds[bucket] = time.perf_counter() - start
        return seconds

    def compiled_step(self, bucket: int) -> CompiledStep | None:
        """The compiled step of ``bucket`` at the current thread count, once it has run."""
        return self._steps.get((bucket, torch.get_num_threads()))

    def _run(self, bucket: int, layout: BatchLayout) -> torch.Tensor:
        key = (bucket, torch.get_num_threads())
        step = self._steps.get(key)
        if step is None:  # compile (Dynamo traces with fake tensors: the state is advanced once, by the run)
            if self.device.type == "cpu":
                native_graph_ops.load()  # before tracing: the traced code only reads whether it loaded
            code = _own_code(_decode_logits)
            compiled = torch.compile(code, fullgraph=True, dynamic=False, options=INDUCTOR_OPTIONS)
            with _bytecode_made_for(code) as made:
                logits = compiled(self.model, layout, self.pool)
            self._steps[key] = CompiledStep(compiled, made[0] if len(made) == 1 else None)
            return logits
        return step(self.model, layout, self.pool)


class CompiledStep:
    """A compiled decode step: ``through_dynamo`` (the ``torch.compile`` wrapper, guards not checked) and
    ``direct``, the same bytecode called as a plain function (None where Dynamo's bytecode was not seen:
    then calls go through Dynamo). Both call the same compiled graph (equal bit for bit: tested)."""

    def __init__(self, compiled: Callable[..., torch.Tensor], direct: Callable[..., torch.Tensor] | None) -> None:
        self.compiled, self.direct = compiled, direct

    def __call__(self, model: KimiLinearModel, layout: BatchLayout, pool: StatePool) -> torch.Tensor:
        if self.direct is not None:
            return self.direct(model, layout, pool)
        return self.through_dynamo(model, layout, pool)

    def through_dynamo(self, model: KimiLinearModel, layout: BatchLayout, pool: StatePool) -> torch.Tensor:
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return self.compiled(model, layout, pool)


@contextlib.contextmanager
def _bytecode_made_for(function: types.FunctionType) -> Iterator[list[Callable[..., torch.Tensor]]]:
    """While open, collect the functions Dynamo makes of ``function``'s code (its transformed bytecode,
    in ``function``'s globals, where Dynamo puts the compiled graph it calls)."""
    made: list[Callable[..., torch.Tensor]] = []

    def hook(code: types.CodeType, new_code: types.CodeType) -> types.CodeType | None:
        if code is function.__code__:
            made.append(types.FunctionType(new_code, function.__globals__, function.__name__))
        return None  # Dynamo keeps its bytecode

    handle = torch._dynamo.convert_frame.register_bytecode_hook(hook)
    try:
        yield made
    finally:
        handle.remove()


INDUCTOR_OPTIONS: dict[str, Any] = {
    "cpp_wrapper": True,
    "emulate_precision_casts": True,
    "post_grad_fusion_options": {"decompose_mm_pass": {}},
}
"""``cpp_wrapper``: the graph's wrapper in C++ too (it calls kernels and matmuls without Python between
them). ``emulate_precision_casts``: the eager code's casts round where they stand (bf16: a fused chain of
ops rounds as the eager ops do). ``decompose_mm_pass``: a one-row product (bucket 1) with both weight
dimensions up to 2048 becomes a multiply-and-sum that inductor fuses with its neighbours — at batch 1 a
matmul is a matrix-vector product bound by reading the weight, and inductor's vectorized loop streams the
weight ~2x faster than the BLAS call on this model (bench/decode.py)."""


def _own_code(function: Callable[..., torch.Tensor]) -> types.FunctionType:
    """A copy of ``function`` with a code object of its own (Dynamo caches compiled code per code object)."""
    return types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__)
