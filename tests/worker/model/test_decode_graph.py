"""The compiled decode step (``model.decode_graph``) against its plain twin, the eager forward.

Compiling takes tens of seconds per bucket, so one module fixture compiles two buckets (1 and 4) once.
The graph's MoE sums its products in another order than the eager one, so the numbers agree to rounding:
logits within 1e-4 of the eager step's (fp32), greedy tokens identical over 32 steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from metrale.shared.settings import KernelBackend
from metrale.worker.kernels import ops
from metrale.worker.model.decode_graph import decode_layout
from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.interface import ForwardChunk
from metrale.worker.model.loader import load_model
from tests.worker.model.helpers import blocks_for

pytestmark = pytest.mark.slow

BLOCK = 16
TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}


@dataclass
class Twins:
    eager: ModelExecutor
    compiled: ModelExecutor
    pool_before_warm_up: dict[str, torch.Tensor]
    warm_up_seconds: dict[int, float]


def _pool_tensors(executor: ModelExecutor) -> dict[str, torch.Tensor]:
    pool = executor.pool
    named = {f"recurrent.{i}": t for i, t in pool.recurrent.items()}
    named |= {f"conv.{i}": t for i, t in pool.conv.items()}
    return named | {f"kv.{i}": t for i, t in pool.kv.items()}


@pytest.fixture(scope="module")
def twins(tiny_model_dir: Path) -> Iterator[Twins]:
    previous = ops.kernel_backend()
    ops.set_kernel_backend(KernelBackend.AUTO)  # the C kernels (an earlier test may have left another set)
    model = load_model(tiny_model_dir)
    eager = ModelExecutor(model, num_slots=6, num_blocks=64, block_size=BLOCK)
    compiled = ModelExecutor(model, num_slots=6, num_blocks=64, block_size=BLOCK, decode_buckets=(1, 4))
    generator = torch.Generator().manual_seed(0)
    for tensor in _pool_tensors(compiled).values():  # garbage everywhere: the warm-up must not touch it
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    before = {name: t.clone() for name, t in _pool_tensors(compiled).items()}
    seconds = compiled.warm_up()
    yield Twins(eager, compiled, before, seconds)
    ops.set_kernel_backend(previous)


def _prompt(length: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_warm_up_compiles_every_bucket_and_touches_no_state(twins: Twins) -> None:
    assert set(twins.warm_up_seconds) == {1, 4}
    for name, tensor in _pool_tensors(twins.compiled).items():
        assert torch.equal(tensor, twins.pool_before_warm_up[name]), name


def test_one_stream_decodes_the_eager_tokens(twins: Twins) -> None:
    prompt, steps, slot = _prompt(40, seed=1, vocab=twins.eager.vocab_size), 32, 0
    blocks = blocks_for(twins.eager, len(prompt) + steps)
    tokens: dict[str, list[int]] = {}
    logits: dict[str, list[torch.Tensor]] = {}
    for name, executor in (("eager", twins.eager), ("compiled", twins.compiled)):
        out = executor.forward([ForwardChunk(slot, blocks, 0, prompt)])  # a prefill: eager in both
        tokens[name], logits[name] = [int(out[0].argmax())], []
        for position in range(len(prompt), len(prompt) + steps):
            out = executor.forward([ForwardChunk(slot, blocks, position, [tokens[name][-1]])])
            logits[name].append(out[0])
            tokens[name].append(int(out[0].argmax()))

    assert tokens["compiled"] == tokens["eager"]
    torch.testing.assert_close(torch.stack(logits["compiled"]), torch.stack(logits["eager"]), **TOLERANCE)
    length = len(prompt) + steps
    for key, eager_state in twins.eager.export_state(slot, blocks, length).items():
        compiled_state = twins.compiled.export_state(slot, blocks, length)[key]
        torch.testing.assert_close(compiled_state, eager_state, **TOLERANCE, msg=key)


def test_padded_batch_matches_eager_and_leaves_the_other_sequences(twins: Twins) -> None:
    """Three streams decode in bucket 4 (one padding row) beside a fourth sequence that is not in the
    batch: the three match the eager step, the fourth's state and latents stay bit for bit."""
    vocab, steps = twins.eager.vocab_size, 5
    streams = {slot: _prompt(10 + 7 * slot, seed=slot, vocab=vocab) for slot in (1, 2, 3, 5)}
    blocks = {slot: blocks_for(twins.eager, len(p) + steps, first=8 * slot) for slot, p in streams.items()}
    last: dict[tuple[str, int], int] = {}
    for name, executor in (("eager", twins.eager), ("compiled", twins.compiled)):
        for slot, prompt in streams.items():
            out = executor.forward([ForwardChunk(slot, blocks[slot], 0, prompt)])
            last[name, slot] = int(out[0].argmax())
    bystander = twins.compiled.export_state(5, blocks[5], len(streams[5]))

    for step in range(steps):
        logits = {}
        for name, executor in (("eager", twins.eager), ("compiled", twins.compiled)):
            chunks = [ForwardChunk(s, blocks[s], len(streams[s]) + step, [last[name, s]]) for s in (3, 1, 2)]
            logits[name] = executor.forward(chunks)
            for row, slot in enumerate((3, 1, 2)):
                last[name, slot] = int(logits[name][row].argmax())
        torch.testing.assert_close(logits["compiled"], logits["eager"], **TOLERANCE)

    after = twins.compiled.export_state(5, blocks[5], len(streams[5]))
    for key, tensor in bystander.items():
        assert torch.equal(after[key], tensor), key


def test_steps_with_a_prefill_or_more_rows_than_a_bucket_run_eagerly(twins: Twins) -> None:
    graph = twins.compiled.decode_graph
    assert graph is not None
    assert graph.runs([ForwardChunk(0, [0], 3, [1])])
    assert not graph.runs([ForwardChunk(0, [0], 3, [1]), ForwardChunk(1, [1], 0, [1, 2])])
    assert not graph.runs([ForwardChunk(s, [s], 3, [1]) for s in range(5)])
    assert graph.bucket(3) == 4 and graph.bucket(5) is None


def test_the_compiled_step_calls_the_stateful_kernels_as_cpp_ops(twins: Twins) -> None:
    """On the CPU with the C kernels built, the graph calls ``metrale_native`` ops (no hop into Python),
    MLA's attention among them (the split C kernel, not the whole block table in torch)."""
    blocks = blocks_for(twins.compiled, 8, first=60)
    twins.compiled.forward([ForwardChunk(4, blocks, 0, [1, 2, 3])])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        twins.compiled.forward([ForwardChunk(4, blocks, 3, [4])])
    called = {event.name for event in profile.events()}

    assert {"metrale_native::kda_decode", "metrale_native::causal_conv1d_update"} <= called
    assert {"metrale_native::store_latents", "metrale_native::mla_decode_latent"} <= called
    assert not any(name.startswith("metrale::") for name in called)


def test_without_the_cpp_ops_the_graph_calls_the_python_ops_and_matches_eager(
    twins: Twins, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the C++ library could not be built (``native_graph_ops.loaded`` False), a graph traces the
    Python ops instead, with the same results."""
    from metrale.worker.kernels.native import graph_ops as native_graph_ops

    monkeypatch.setattr(native_graph_ops, "load", lambda: False)
    monkeypatch.setattr(native_graph_ops, "loaded", False)
    compiled = ModelExecutor(
        load_model(tiny_model_dir), num_slots=6, num_blocks=64, block_size=BLOCK, decode_buckets=(1,)
    )
    prompt, blocks = _prompt(12, seed=7, vocab=twins.eager.vocab_size), [52, 53]
    tokens = {}
    for name, executor in (("eager", twins.eager), ("compiled", compiled)):
        out = executor.forward([ForwardChunk(2, blocks, 0, prompt)])
        tokens[name] = int(out[0].argmax())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        got = compiled.forward([ForwardChunk(2, blocks, len(prompt), [tokens["compiled"]])])
    expected = twins.eager.forward([ForwardChunk(2, blocks, len(prompt), [tokens["eager"]])])

    called = {event.name for event in profile.events()}
    assert "metrale::kda_decode" in called and not any(name.startswith("metrale_native::") for name in called)
    assert tokens["compiled"] == tokens["eager"]
    torch.testing.assert_close(got, expected, **TOLERANCE)


def test_a_step_calls_dynamos_bytecode_directly_and_gets_what_dynamo_s_entry_gets(twins: Twins) -> None:
    """Once compiled, a step runs the bytecode Dynamo made as a plain function (no frame entry); it calls
    the same compiled graph as the ``torch.compile`` wrapper: the same logits and state, bit for bit."""
    graph = twins.compiled.decode_graph
    assert graph is not None
    step = graph.compiled_step(1)
    assert step is not None and step.direct is not None, "Dynamo's bytecode was not seen: steps enter Dynamo"
    blocks = blocks_for(twins.compiled, 8, first=60)
    twins.compiled.forward([ForwardChunk(4, blocks, 0, [1, 2, 3])])
    before = twins.compiled.export_state(4, blocks, 3)
    results = {}
    for name, call in (("direct", step.direct), ("through Dynamo", step.through_dynamo)):
        twins.compiled.import_state(before, 4, blocks)
        with torch.inference_mode():  # as DecodeGraph.forward builds its layouts: inference tensors
            layout = decode_layout([ForwardChunk(4, blocks, 3, [4])], 1, BLOCK, torch.device("cpu"))
            logits = call(graph.model, layout, graph.pool)
        results[name] = (logits.clone(), twins.compiled.export_state(4, blocks, 4))
    assert torch.equal(results["direct"][0], results["through Dynamo"][0])
    for key, tensor in results["direct"][1].items():
        assert torch.equal(tensor, results["through Dynamo"][1][key]), key
