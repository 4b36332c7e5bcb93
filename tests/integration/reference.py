"""What the fleet must answer, computed offline: the served model's own engine, run in this process
(on one torch thread, like the fleet's processes), and the text a client should see for its tokens."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from metrale.worker.engine.factory import LoadedModel
from metrale.worker.engine.request import Completion
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.scheduler.sequence import FinishReason
from tests.integration.deployments import TORCH_THREADS


def offline_outputs(
    model: LoadedModel, prompts: Sequence[Sequence[int]], params: SamplingParams
) -> list[list[Completion]]:
    """Per prompt, the choices the offline engine generates (seeded or greedy, so reproducible)."""
    with _torch_threads(TORCH_THREADS):
        results = model.engine.generate([list(prompt) for prompt in prompts], params)
    return [result.completions for result in results]


def offline_choices(model: LoadedModel, prompt_ids: Sequence[int], params: SamplingParams) -> list[Completion]:
    """The choices the offline engine generates for one prompt."""
    (choices,) = offline_outputs(model, [prompt_ids], params)
    return choices


def visible_text(model: LoadedModel, choice: Completion) -> str:
    """The text a client sees for ``choice``: a matched stop token is generated but not shown."""
    shown = choice.token_ids[:-1] if choice.finish_reason is FinishReason.STOP else choice.token_ids
    return model.tokenizer.decode(shown)


def token_texts(model: LoadedModel, token_ids: Sequence[int]) -> list[str]:
    """Each token's own text, special tokens included: what logprobs show per token."""
    return [model.tokenizer.decode([token_id], skip_special_tokens=False) for token_id in token_ids]


@contextlib.contextmanager
def _torch_threads(count: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
