from __future__ import annotations

import hashlib
import math
import random
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from metrale.worker.engine.sampler import (
    Sampler,
    SamplingRow,
    apply_logit_bias,
    apply_penalties,
    filter_scores,
    mix32,
    sampling_key,
    uniform_noise,
)
from metrale.worker.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")
# Chi-square critical value at p = 0.001 for up to 7 degrees of freedom: a correct sampler fails a
# given fixed-seed case with probability under 0.1%, and the seeds are fixed, so it never flakes.
CHI_SQUARE_CRITICAL = 24.32


def make_row(
    params: SamplingParams,
    *,
    seed: int = 1234,
    choice: int = 0,
    position: int = 0,
    prompt_ids: Sequence[int] = (),
    output_ids: Sequence[int] = (),
) -> SamplingRow:
    return SamplingRow(params, seed, choice, position, prompt_ids, output_ids)


def log_softmax_reference(values: Sequence[float]) -> list[float]:
    top = max(values)
    log_total = top + math.log(sum(math.exp(v - top) for v in values))
    return [v - log_total for v in values]


def softmax_reference(values: Sequence[float], ids: Sequence[int]) -> dict[int, float]:
    """The softmax of ``values`` restricted to ``ids``, by id."""
    logprobs = log_softmax_reference([values[j] for j in ids])
    return {j: math.exp(lp) for j, lp in zip(ids, logprobs, strict=True)}


def kept_ids_reference(scores: Sequence[float], params: SamplingParams) -> set[int]:
    """Top-k, then top-p, then min-p, by hand: the ids that survive."""
    ranked = sorted(range(len(scores)), key=lambda j: (-scores[j], j))
    if params.top_k > 0:
        ranked = ranked[: params.top_k]
    probs = softmax_reference(scores, ranked)
    if params.top_p < 1.0:
        mass, nucleus = 0.0, []
        for j in ranked:
            if mass >= params.top_p:
                break
            nucleus.append(j)
            mass += probs[j]
        ranked = nucleus
    best = probs[ranked[0]]
    return {j for j in ranked if probs[j] >= params.min_p * best}


def penalties_reference(
    logits: Sequence[float], params: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int]
) -> list[float]:
    penalized = list(logits)
    for token in set(prompt_ids) | set(output_ids):
        if penalized[token] > 0:
            penalized[token] /= params.repetition_penalty
        else:
            penalized[token] *= params.repetition_penalty
    for token, count in Counter(output_ids).items():
        penalized[token] -= count * params.frequency_penalty + params.presence_penalty
    return penalized


def chi_square(observed: Counter[int], expected_probs: dict[int, float], total: int) -> float:
    return sum((observed[j] - total * p) ** 2 / (total * p) for j, p in expected_probs.items())


# --- greedy ----------------------------------------------------------------------------------------


def test_greedy_picks_the_argmax_of_each_row() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    rows = [make_row(SamplingParams(temperature=0.0), position=i) for i in range(8)]
    tokens = Sampler().sample(logits, rows)
    for values, token in zip(logits.tolist(), tokens, strict=True):
        assert token.token_id == max(range(50), key=lambda j: values[j])


@pytest.mark.parametrize("temperature", [0.0, 1e-7], ids=["zero", "below-epsilon"])
def test_greedy_breaks_ties_by_lowest_id(temperature: float) -> None:
    logits = torch.tensor([[0.5, 1.0, 3.0, -1.0, 3.0, 3.0]])
    [token] = Sampler().sample(logits, [make_row(SamplingParams(temperature=temperature))])
    assert token.token_id == 2


def test_greedy_applies_penalties_like_vllm() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    params = SamplingParams(temperature=0.0, presence_penalty=0.5)
    [token] = Sampler().sample(logits, [make_row(params, output_ids=[0])])
    assert token.token_id == 1


# --- penalties -------------------------------------------------------------------------------------

PENALTY_CASES = {
    "repetition-up": SamplingParams(repetition_penalty=1.3),
    "repetition-down": SamplingParams(repetition_penalty=0.7),
    "presence": SamplingParams(presence_penalty=0.8),
    "frequency": SamplingParams(frequency_penalty=0.6),
    "negative-frequency": SamplingParams(frequency_penalty=-1.1),
    "all": SamplingParams(repetition_penalty=1.5, presence_penalty=-0.4, frequency_penalty=0.9),
    "none": SamplingParams(),
}


@pytest.mark.parametrize("params", PENALTY_CASES.values(), ids=PENALTY_CASES.keys())
def test_penalties_match_the_reference(params: SamplingParams) -> None:
    rng = random.Random(7)
    vocab = 40
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(7))
    # The penalized row sits between unpenalized ones, which must come back untouched.
    prompt_ids = [rng.randrange(vocab) for _ in range(12)]
    output_ids = [rng.randrange(vocab // 2) for _ in range(25)]
    plain = SamplingParams()
    rows = [
        make_row(plain, prompt_ids=[1, 2], output_ids=[3, 3]),
        make_row(params, prompt_ids=prompt_ids, output_ids=output_ids),
        make_row(plain, output_ids=[0]),
    ]
    original = logits.clone()

    penalized = apply_penalties(logits, rows)

    expected_middle = penalties_reference(logits[1].tolist(), params, prompt_ids, output_ids)
    torch.testing.assert_close(penalized[1], torch.tensor(expected_middle))
    torch.testing.assert_close(penalized[[0, 2]], original[[0, 2]], rtol=0, atol=0)
    torch.testing.assert_close(logits, original, rtol=0, atol=0)


def test_penalties_reject_token_ids_outside_the_vocabulary() -> None:
    row = make_row(SamplingParams(presence_penalty=1.0), output_ids=[3, 10])
    with pytest.raises(ValueError, match="token ids"):
        apply_penalties(torch.zeros(1, 10), [row])


# --- logit bias ------------------------------------------------------------------------------------


def logit_bias_reference(logits: Sequence[float], params: SamplingParams) -> list[float]:
    biased = list(logits)
    for token_id, bias in params.logit_bias:
        biased[token_id] += bias
    return biased


def test_logit_bias_matches_the_reference_row_by_row() -> None:
    vocab = 40
    rows = [
        make_row(SamplingParams(logit_bias=((3, 100.0), (7, -100.0)))),
        make_row(SamplingParams()),
        make_row(SamplingParams(logit_bias=((0, 2.5), (39, -0.25), (3, 1.0)))),
    ]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(11))
    original = logits.clone()
    biased = apply_logit_bias(logits, rows)
    for i, row in enumerate(rows):
        expected = torch.tensor(logit_bias_reference(logits[i].tolist(), row.params))
        torch.testing.assert_close(biased[i], expected)
    torch.testing.assert_close(logits, original, rtol=0, atol=0)


def test_no_logit_bias_returns_the_logits_themselves() -> None:
    logits = torch.zeros(2, 5)
    assert apply_logit_bias(logits, [make_row(SamplingParams()), make_row(SamplingParams())]) is logits


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_bias_of_100_makes_that_token_the_output(temperature: float) -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(12)) * 5
    params = SamplingParams(temperature=temperature, logit_bias=((17, 100.0),))
    tokens = Sampler().sample(logits, [make_row(params, position=p) for p in range(4)])
    assert [t.token_id for t in tokens] == [17] * 4


def test_a_bias_of_minus_100_bans_the_best_token() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    [token] = Sampler().sample(logits, [make_row(SamplingParams(temperature=0.0, logit_bias=((1, -100.0),)))])
    assert token.token_id == 2


def test_logit_bias_comes_before_the_penalties() -> None:
    # The repetition penalty divides the biased logit: (1 + 3) / 4 = 1 < 1.5 (biased after it: 3.25).
    logits = torch.tensor([[1.0, 1.5]])
    params = SamplingParams(temperature=0.0, repetition_penalty=4.0, logit_bias=((0, 3.0),))
    [token] = Sampler().sample(logits, [make_row(params, output_ids=[0])])
    assert token.token_id == 1


def test_logit_bias_leaves_seeded_draws_of_other_rows_and_the_raw_logprobs_unchanged() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(13))
    plain = [make_row(SamplingParams(logprobs=2), position=p) for p in range(6)]
    without = Sampler().sample(logits, plain)
    biased_row = make_row(SamplingParams(logprobs=2, logit_bias=((9, 50.0),)), position=0)
    with_bias = Sampler().sample(logits, [biased_row, *plain[1:]])
    assert with_bias[1:] == without[1:]
    assert with_bias[0].token_id == 9
    assert with_bias[0].top_logprobs == without[0].top_logprobs  # raw distribution, before the bias


def test_logit_bias_refuses_token_ids_outside_the_vocabulary() -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        apply_logit_bias(torch.zeros(1, 10), [make_row(SamplingParams(logit_bias=((10, 1.0),)))])


# --- filters ---------------------------------------------------------------------------------------

FILTER_CASES = {
    "top_k=1": SamplingParams(top_k=1),
    "top_k=5": SamplingParams(top_k=5),
    "top_k>vocab": SamplingParams(top_k=500),
    "top_p=0.3": SamplingParams(top_p=0.3),
    "top_p=0.9": SamplingParams(top_p=0.9),
    "min_p=0.1": SamplingParams(min_p=0.1),
    "min_p=0.6": SamplingParams(min_p=0.6),
    "top_k+top_p+min_p": SamplingParams(top_k=12, top_p=0.8, min_p=0.05),
    "none": SamplingParams(),
}


def test_filters_match_the_reference_row_by_row_in_one_batch() -> None:
    scores = 2.0 * torch.randn(len(FILTER_CASES), 30, generator=torch.Generator().manual_seed(3))
    params = list(FILTER_CASES.values())

    filtered = filter_scores(scores, params)

    for name, values, filtered_values, row_params in zip(
        FILTER_CASES, scores.tolist(), filtered.tolist(), params, strict=True
    ):
        kept = {j for j, v in enumerate(filtered_values) if v != -math.inf}
        assert kept == kept_ids_reference(values, row_params), name
        assert all(filtered_values[j] == values[j] for j in kept), name


def test_top_k_cuts_ties_by_lowest_id() -> None:
    scores = torch.tensor([[1.0, 2.0, 2.0, 0.5, 2.0]])
    filtered = filter_scores(scores, [SamplingParams(top_k=2)])
    assert torch.isfinite(filtered[0]).tolist() == [False, True, True, False, False]


def test_top_p_of_one_keeps_a_vanishing_tail() -> None:
    scores = torch.tensor([[0.0] + [-40.0] * 9] * 2)
    # The second row's top_p < 1 makes the batch compute cumulative mass, which rounds to 1 early.
    filtered = filter_scores(scores, [SamplingParams(top_p=1.0), SamplingParams(top_p=0.5)])
    assert torch.isfinite(filtered[0]).all()
    assert torch.isfinite(filtered[1]).tolist() == [True] + [False] * 9


def test_min_p_of_one_keeps_exactly_the_best_tokens() -> None:
    scores = torch.tensor([[1.0, 3.0, 2.9, 3.0]])
    filtered = filter_scores(scores, [SamplingParams(min_p=1.0)])
    assert torch.isfinite(filtered[0]).tolist() == [False, True, False, True]


# --- the sampled distribution ----------------------------------------------------------------------

LOGITS_6 = [1.2, 0.9, 0.3, 0.0, -0.6, -1.5]
DISTRIBUTION_CASES = {
    "plain": SamplingParams(),
    "temperature=0.5": SamplingParams(temperature=0.5),
    "temperature=2": SamplingParams(temperature=2.0),
    "top_k=3": SamplingParams(top_k=3),
    "top_p=0.7": SamplingParams(top_p=0.7),
    "min_p=0.3": SamplingParams(min_p=0.3),
}


@pytest.mark.parametrize("params", DISTRIBUTION_CASES.values(), ids=DISTRIBUTION_CASES.keys())
def test_draws_follow_the_filtered_softmax(params: SamplingParams) -> None:
    draws = 6000
    logits = torch.tensor([LOGITS_6]).expand(draws, -1)
    rows = [make_row(params, seed=99, position=p) for p in range(draws)]

    observed = Counter(t.token_id for t in Sampler().sample(logits, rows))

    scaled = [v / params.temperature for v in LOGITS_6]
    kept = sorted(kept_ids_reference(scaled, params))
    expected = softmax_reference(scaled, kept)
    assert set(observed) <= set(kept)
    assert chi_square(observed, expected, draws) < CHI_SQUARE_CRITICAL


# --- seeded, batch-independent draws ---------------------------------------------------------------


def mixed_rows(count: int, rng: random.Random) -> list[SamplingRow]:
    choices = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.3, top_k=20),
        SamplingParams(top_p=0.9, min_p=0.02),
        SamplingParams(temperature=0.7, presence_penalty=0.5, repetition_penalty=1.2),
    ]
    return [
        make_row(
            rng.choice(choices),
            seed=rng.randrange(2**32),
            choice=rng.randrange(2),
            position=rng.randrange(4096),
            prompt_ids=[rng.randrange(64) for _ in range(5)],
            output_ids=[rng.randrange(64) for _ in range(5)],
        )
        for _ in range(count)
    ]


def test_a_row_draws_the_same_token_alone_or_anywhere_in_any_batch() -> None:
    rng = random.Random(5)
    vocab = 64
    rows = mixed_rows(24, rng)
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(5))
    sampler = Sampler()
    alone = [sampler.sample(logits[i : i + 1], [row])[0].token_id for i, row in enumerate(rows)]

    others = mixed_rows(40, rng)
    other_logits = torch.randn(len(others), vocab, generator=torch.Generator().manual_seed(6))
    batch = [(row, logits[i]) for i, row in enumerate(rows)] + list(zip(others, other_logits, strict=True))
    rng.shuffle(batch)
    tokens = sampler.sample(torch.stack([l for _, l in batch]), [row for row, _ in batch])

    in_batch = {id(row): token.token_id for (row, _), token in zip(batch, tokens, strict=True)}
    assert [in_batch[id(row)] for row in rows] == alone
    assert len(set(alone)) > 5  # the rows really were sampled, not all greedy on one token


def test_draws_ignore_and_preserve_torchs_global_rng() -> None:
    rows = mixed_rows(16, random.Random(8))
    logits = torch.randn(16, 64, generator=torch.Generator().manual_seed(8))
    torch.manual_seed(1)
    first = Sampler().sample(logits, rows)
    torch.manual_seed(2)
    state = torch.get_rng_state()
    second = Sampler().sample(logits, rows)
    assert first == second
    assert torch.equal(torch.get_rng_state(), state)


def test_positions_choices_and_seeds_give_independent_streams() -> None:
    vocab, positions = 64, 400
    logits = torch.zeros(positions, vocab)
    params = SamplingParams()

    def stream(seed: int, choice: int) -> list[int]:
        rows = [make_row(params, seed=seed, choice=choice, position=p) for p in range(positions)]
        return [t.token_id for t in Sampler().sample(logits, rows)]

    base = stream(seed=1, choice=0)
    assert len(set(base)) > 50  # about 63 of 64 tokens turn up in 400 uniform draws
    for other in (stream(seed=1, choice=1), stream(seed=2, choice=0)):
        matches = sum(a == b for a, b in zip(base, other, strict=True))
        assert matches < 20  # independent streams agree about positions / vocab = 6 times


# --- the counter-based generator -------------------------------------------------------------------


def lowbias32_reference(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_mix32_matches_lowbias32_on_python_integers() -> None:
    rng = random.Random(11)
    values = [0, 1, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF]
    values += [rng.randrange(2**32) for _ in range(500)]
    inputs = torch.tensor(values)
    assert mix32(inputs).tolist() == [lowbias32_reference(v) for v in values]
    assert inputs.tolist() == values


def test_sampling_key_is_blake2b_of_seed_choice_position() -> None:
    # The key format is part of the resume contract: another worker, version or process must agree.
    digest = hashlib.blake2b(b"42:1:1000", digest_size=8, person=b"metrale-sample").digest()
    assert sampling_key(42, 1, 1000) == int.from_bytes(digest, "little")


def test_uniform_noise_is_uniform_and_independent_of_vocab_size() -> None:
    keys = [sampling_key(3, 0, p) for p in range(200)]
    uniforms = uniform_noise(keys, 100, CPU)
    assert bool(((uniforms > 0) & (uniforms < 1)).all())
    bins = Counter((uniforms * 10).long().flatten().tolist())
    total = uniforms.numel()
    assert chi_square(bins, {b: 0.1 for b in range(10)}, total) < 27.88  # df 9, p = 0.001
    torch.testing.assert_close(uniform_noise(keys, 10, CPU), uniforms[:, :10], rtol=0, atol=0)


def test_uniform_noise_follows_its_documented_formula() -> None:
    # Like the key, the generator is part of the resume contract: pinned here on Python integers.
    keys = [sampling_key(5, 0, 7), 0, 2**64 - 1]
    uniforms = uniform_noise(keys, 50, CPU).tolist()
    for key, row in zip(keys, uniforms, strict=True):
        low, high = key & 0xFFFFFFFF, key >> 32
        hashed = [lowbias32_reference(lowbias32_reference(j ^ low) ^ high) for j in range(50)]
        assert row == [(h + 0.5) / 2**32 for h in hashed]


# --- logprobs --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.4, top_k=2, repetition_penalty=2.0, logprobs=5),
    ],
    ids=["greedy", "processed"],
)
def test_logprobs_come_from_the_raw_distribution(params: SamplingParams) -> None:
    values = [0.3, 2.0, -1.0, 1.5, 0.9, 1.5, -0.2]
    row = make_row(params, prompt_ids=[1], output_ids=[3])

    [token] = Sampler().sample(torch.tensor([values]), [row])

    raw = log_softmax_reference(values)
    assert token.logprob == pytest.approx(raw[token.token_id], abs=1e-6)
    assert params.logprobs is not None
    expected_ids = sorted(range(len(values)), key=lambda j: (-raw[j], j))[: params.logprobs]
    assert [j for j, _ in token.top_logprobs] == expected_ids
    assert [lp for _, lp in token.top_logprobs] == pytest.approx([raw[j] for j in expected_ids], abs=1e-6)


@pytest.mark.parametrize("logprobs", [None, 0], ids=["none", "zero"])
def test_no_alternatives_unless_asked(logprobs: int | None) -> None:
    rows = [make_row(SamplingParams(logprobs=logprobs)), make_row(SamplingParams(logprobs=2))]
    first, second = Sampler().sample(torch.randn(2, 9, generator=torch.Generator().manual_seed(4)), rows)
    assert first.top_logprobs == ()
    assert len(second.top_logprobs) == 2


# --- the call itself -------------------------------------------------------------------------------


def test_rejects_logits_that_do_not_match_the_rows() -> None:
    with pytest.raises(ValueError, match="logits"):
        Sampler().sample(torch.zeros(3, 10), [make_row(SamplingParams())])
    with pytest.raises(ValueError, match="logits"):
        Sampler().sample(torch.zeros(10), [make_row(SamplingParams())])


def test_no_rows_no_tokens() -> None:
    assert Sampler().sample(torch.zeros(0, 10), []) == []


def test_bf16_logits_are_accepted() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0]], dtype=torch.bfloat16)
    [token] = Sampler().sample(logits, [make_row(SamplingParams(temperature=0.0, logprobs=1))])
    assert token.token_id == 1
    assert token.top_logprobs[0][0] == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_draws_the_same_tokens_as_cpu() -> None:
    rows = mixed_rows(64, random.Random(12))
    logits = torch.randn(64, 4096, generator=torch.Generator().manual_seed(12))
    on_cpu = Sampler().sample(logits, rows)
    on_cuda = Sampler().sample(logits.cuda(), rows)
    assert [t.token_id for t in on_cuda] == [t.token_id for t in on_cpu]
    assert [t.logprob for t in on_cuda] == pytest.approx([t.logprob for t in on_cpu], abs=1e-5)
