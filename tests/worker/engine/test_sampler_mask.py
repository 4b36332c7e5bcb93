"""The sampler with an allowed-token mask (a grammar's): greedy and seeded draws pick only allowed
tokens, a masked draw is the draw over the masked logits, and logprobs stay the raw model's."""

from __future__ import annotations

import math

import pytest
import torch

from metrale.worker.engine.sampler import Sampler, SamplingRow, gumbel_noise, sampling_key
from metrale.worker.engine.sampling_params import SamplingParams

VOCAB = 64
GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=1.0, seed=3)
FILTERED = SamplingParams(temperature=0.7, top_p=0.8, top_k=10, min_p=0.01, seed=9)
FILTERED_PENALIZED = SamplingParams(temperature=0.7, top_p=0.8, top_k=10, seed=9, frequency_penalty=1.0)


def rows_of(params: SamplingParams, count: int) -> list[SamplingRow]:
    return [
        SamplingRow(params, 17, choice=i % 2, position=5 + i, prompt_ids=(1, 2), output_ids=(3, i))
        for i in range(count)
    ]


def random_mask(generator: torch.Generator, rows: int) -> torch.Tensor:
    allowed = torch.rand(rows, VOCAB, generator=generator) < 0.2
    allowed[:, 7] = True  # never empty
    return allowed


@pytest.mark.parametrize("params", [GREEDY, SEEDED, FILTERED_PENALIZED], ids=["greedy", "seeded", "filtered"])
def test_only_allowed_tokens_are_sampled_and_logprobs_stay_raw(params: SamplingParams) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(16, VOCAB, generator=generator) * 4
    allowed = random_mask(generator, 16)
    rows = rows_of(SamplingParams(**{**_fields(params), "logprobs": 2}), 16)
    sampled = Sampler().sample(logits, rows, allowed)
    raw = torch.log_softmax(logits, dim=-1)
    for i, token in enumerate(sampled):
        assert allowed[i, token.token_id]
        assert math.isclose(token.logprob, raw[i, token.token_id].item(), rel_tol=1e-6)
        assert [t for t, _ in token.top_logprobs] == raw[i].topk(2).indices.tolist()  # unmasked alternatives


@pytest.mark.parametrize("params", [GREEDY, SEEDED, FILTERED], ids=["greedy", "seeded", "filtered"])
def test_a_masked_draw_is_the_draw_over_the_masked_logits(params: SamplingParams) -> None:
    """Seeded sampling stays a pure function of (seed, choice, position) and the masked logits."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(12, VOCAB, generator=generator)
    allowed = random_mask(generator, 12)
    rows = rows_of(params, 12)
    masked = Sampler().sample(logits, rows, allowed)
    by_hand = Sampler().sample(logits.masked_fill(~allowed, -math.inf), rows)
    assert [t.token_id for t in masked] == [t.token_id for t in by_hand]


def test_a_seeded_masked_draw_is_the_gumbel_argmax_over_allowed_tokens() -> None:
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(8, VOCAB, generator=generator)
    allowed = random_mask(generator, 8)
    rows = rows_of(SEEDED, 8)
    noise = gumbel_noise([sampling_key(r.seed, r.choice, r.position) for r in rows], VOCAB, torch.device("cpu"))
    expected = (logits + noise).masked_fill(~allowed, -math.inf).argmax(dim=-1).tolist()
    assert [t.token_id for t in Sampler().sample(logits, rows, allowed)] == expected


def test_each_row_is_masked_alone_whatever_else_is_in_the_batch() -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(6, VOCAB, generator=generator)
    allowed = random_mask(generator, 6)
    allowed[3] = True  # an unconstrained row in a constrained batch
    rows = rows_of(SEEDED, 6)
    together = [t.token_id for t in Sampler().sample(logits, rows, allowed)]
    alone = [Sampler().sample(logits[i : i + 1], rows[i : i + 1], allowed[i : i + 1])[0].token_id for i in range(6)]
    assert together == alone
    assert together[3] == Sampler().sample(logits[3:4], rows[3:4])[0].token_id


def test_a_mask_of_the_wrong_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="allowed must be"):
        Sampler().sample(torch.zeros(2, VOCAB), rows_of(GREEDY, 2), torch.ones(2, VOCAB - 1, dtype=torch.bool))


def _fields(params: SamplingParams) -> dict[str, object]:
    return {name: getattr(params, name) for name in params.__slots__}
