"""End to end: the engine on the built-in tiny model decodes the same greedy tokens with Triton kernels
(under the interpreter) as with the torch kernels."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from metrale.shared.settings import KernelBackend
from metrale.worker.engine.factory import EngineLimits, build_engine
from metrale.worker.engine.request import Completion
from metrale.worker.engine.sampling_params import SamplingParams

# The 40-token prompt is prefilled in 16-token chunks that carry KDA, conv and MLA state from one step
# to the next, while the short prompt is already decoding beside it.
PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [(31 * i + 11) % 500 for i in range(40)]]
LIMITS = EngineLimits(max_seqs=4, max_batch_tokens=16, num_blocks=16, block_size=16)


def _greedy(model_dir: Path) -> list[Completion]:
    engine = build_engine(model_dir, LIMITS, seed=0).engine
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0)
    return [result.completions[0] for result in engine.generate(PROMPTS, params)]


@pytest.mark.slow
@pytest.mark.triton
def test_triton_engine_greedy_tokens_match_torch_kernels(
    tiny_model_dir: Path, use_backend: Callable[[KernelBackend], None]
) -> None:
    use_backend(KernelBackend.TORCH)
    expected = _greedy(tiny_model_dir)
    use_backend(KernelBackend.TRITON)
    actual = _greedy(tiny_model_dir)

    assert [c.token_ids for c in actual] == [c.token_ids for c in expected]
    assert all(len(c.token_ids) == 6 for c in actual)
    for got, want in zip(actual, expected, strict=True):
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
