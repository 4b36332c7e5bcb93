"""Choose one token per row of logits: penalties, temperature, top-k / top-p / min-p, then a seeded draw.

Seeded draws are reproducible by construction: the noise for token ``j`` of a row is a pure function
of ``(seed, choice, position, j)`` — a counter-based generator, computed with integer tensor ops on
the logits' device. A row therefore gets the same token whatever else is in the batch, wherever it
sits in it, and whatever ran before; a worker that resumes another's request continues it exactly
(given the same logits). The generator never touches torch's global RNG.

Reported logprobs follow vLLM's default: they come from the raw model distribution
(``log_softmax`` of the logits as given, before penalties, temperature and filters), for the chosen
token and for the top-``logprobs`` alternatives.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from metrale.worker.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """One row of logits to sample.

    ``seed`` is the request's seed, or one the worker picked for it when ``params.seed`` is None;
    ``choice`` is which of the ``params.n`` completions this row extends; ``position`` is the absolute
    position of the token being sampled. ``prompt_ids`` and ``output_ids`` feed the penalties.
    """

    params: SamplingParams
    seed: int
    choice: int
    position: int
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]


@dataclass(frozen=True, slots=True)
class SampledToken:
    """The chosen token, its raw logprob, and the top alternatives (best first) when asked for."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]


class Sampler:
    """Samples one token per row; stateless, so one instance serves every step."""

    def sample(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], allowed: torch.Tensor | None = None
    ) -> list[SampledToken]:
        """Pick a token for each row of ``logits`` ``[N, V]`` (any float dtype, any device).

        ``allowed`` (bool ``[N, V]``, any device; None: every token) masks each row before the greedy
        argmax and the seeded draw (after penalties): a grammar's next tokens. A row must allow at
        least one token. Logprobs stay those of the raw logits.
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [{len(rows)}, vocab], got {list(logits.shape)}")
        if allowed is not None and allowed.shape != logits.shape:
            raise ValueError(f"allowed must be {list(logits.shape)}, got {list(allowed.shape)}")
        if not rows:
            return []
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        scores = apply_penalties(logits, rows)
        if allowed is not None:
            scores = scores.masked_fill(~allowed.to(scores.device), -math.inf)
        token_ids = scores.argmax(dim=-1)  # argmax returns the first maximum: ties go to the lowest id
        drawn = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if drawn:
            index = torch.tensor(drawn, device=logits.device)
            token_ids[index] = _draw(scores[index], [rows[i] for i in drawn])
        return _sampled_tokens(token_ids, raw_logprobs, rows)


def _draw(scores: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Gumbel-max draw from ``softmax(filtered(scores / temperature))``; ``scores`` ``[S, V]``."""
    temperature = torch.tensor([row.params.temperature for row in rows], device=scores.device)
    filtered = filter_scores(scores / temperature[:, None], [row.params for row in rows])
    keys = [sampling_key(row.seed, row.choice, row.position) for row in rows]
    return (filtered + gumbel_noise(keys, scores.shape[1], scores.device)).argmax(dim=-1)


# --- penalties -------------------------------------------------------------------------------------


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Return ``logits`` ``[N, V]`` with each row's penalties applied (vLLM's order and formulas).

    Repetition penalty (HF / vLLM), over tokens in the prompt or output: a positive logit is divided
    by it, any other multiplied. Then, over output tokens only (OpenAI):
    ``logit -= count * frequency_penalty + (count > 0) * presence_penalty``.
    Returns ``logits`` itself when no row has a penalty; never modifies it.
    """
    penalized = [i for i, row in enumerate(rows) if row.params.has_penalties]
    if not penalized:
        return logits
    params = [rows[i].params for i in penalized]
    index = torch.tensor(penalized, device=logits.device)
    vocab_size = logits.shape[1]
    scores = logits[index]
    output_counts = _token_counts([rows[i].output_ids for i in penalized], vocab_size, logits.device)
    if any(p.repetition_penalty != 1.0 for p in params):
        prompt_counts = _token_counts([rows[i].prompt_ids for i in penalized], vocab_size, logits.device)
        seen = (prompt_counts + output_counts) > 0
        penalty = _column([p.repetition_penalty for p in params], logits.device)
        repeated = torch.where(scores > 0, scores / penalty, scores * penalty)
        scores = torch.where(seen, repeated, scores)
    frequency = _column([p.frequency_penalty for p in params], logits.device)
    presence = _column([p.presence_penalty for p in params], logits.device)
    scores = scores - frequency * output_counts - presence * (output_counts > 0).float()
    penalized_logits = logits.clone()
    penalized_logits[index] = scores
    return penalized_logits


def _token_counts(id_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each list: ``[len(id_lists), vocab_size]`` float32."""
    ids = torch.tensor(list(itertools.chain.from_iterable(id_lists)), dtype=torch.long)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}) for penalties")
    lengths = torch.tensor([len(id_list) for id_list in id_lists])
    rows = torch.repeat_interleave(torch.arange(len(id_lists)), lengths)
    flat = (rows * vocab_size + ids).to(device)
    counts = torch.bincount(flat, minlength=len(id_lists) * vocab_size)
    return counts.view(len(id_lists), vocab_size).float()


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]


# --- filters ---------------------------------------------------------------------------------------


def filter_scores(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Set to ``-inf`` the tokens each row's top-k, then top-p, then min-p removes.

    ``scores`` ``[S, V]`` are temperature-scaled logits. top-k keeps the ``k`` best tokens (equal
    scores ranked by lower id); top-p keeps the smallest best-first prefix whose probability reaches
    ``top_p``; min-p keeps tokens whose probability is at least ``min_p`` times the best one's.
    The best token always survives. Returns ``scores`` itself when no row filters.
    """
    if not any(p.has_filters for p in params):
        return scores
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        scores = _mask_top_k_top_p(scores, params)
    if any(p.min_p > 0.0 for p in params):
        # p_i >= min_p * p_max  <=>  s_i - s_max >= log(min_p); log(0) = -inf removes nothing.
        log_min_p = _column([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], scores.device)
        floor = scores.max(dim=-1, keepdim=True).values + log_min_p
        scores = scores.masked_fill(scores < floor, -math.inf)
    return scores


def _mask_top_k_top_p(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    vocab_size = scores.shape[1]
    device = scores.device
    # Stable descending sort: equal scores keep ascending id order, so ties cut deterministically.
    sorted_scores, order = scores.sort(dim=-1, descending=True, stable=True)
    keep = torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params], device=device)
    removed = torch.arange(vocab_size, device=device) >= keep[:, None]
    if any(p.top_p < 1.0 for p in params):
        probs = sorted_scores.masked_fill(removed, -math.inf).softmax(dim=-1)
        cumulative = torch.cumsum(probs, dim=-1)
        mass_before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=-1)
        # top_p == 1 must remove nothing, even where rounding lets the cumulative mass reach 1.
        top_p = _column([p.top_p if p.top_p < 1.0 else math.inf for p in params], device)
        removed |= mass_before >= top_p
    removed_by_id = torch.empty_like(removed).scatter_(1, order, removed)
    return scores.masked_fill(removed_by_id, -math.inf)


# --- counter-based noise ---------------------------------------------------------------------------

_MASK32 = 0xFFFF_FFFF
_LOWBIAS32_MULTIPLIERS = (0x7FEB_352D, 0x846C_A68B)


def sampling_key(seed: int, choice: int, position: int) -> int:
    """A stable 64-bit key for one draw: BLAKE2b of ``(seed, choice, position)``, same in every process."""
    message = f"{seed}:{choice}:{position}".encode()
    digest = hashlib.blake2b(message, digest_size=8, person=b"metrale-sample").digest()
    return int.from_bytes(digest, "little")


def gumbel_noise(keys: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Standard Gumbel noise ``[len(keys), vocab_size]`` float32; entry ``[r, j]`` depends only on
    ``(keys[r], j)``."""
    uniforms = uniform_noise(keys, vocab_size, device)
    return (-torch.log(-torch.log(uniforms))).float()


def uniform_noise(keys: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Uniforms in (0, 1), ``[len(keys), vocab_size]`` float64: ``u[r, j] = (h + 0.5) / 2**32`` with
    ``h = mix32(mix32(j ^ low32(key)) ^ high32(key))``."""
    low = torch.tensor([key & _MASK32 for key in keys], dtype=torch.long, device=device)
    high = torch.tensor([key >> 32 for key in keys], dtype=torch.long, device=device)
    counters = torch.arange(vocab_size, dtype=torch.long, device=device)
    hashed = mix32(mix32(counters[None, :] ^ low[:, None]) ^ high[:, None])
    return (hashed.double() + 0.5) * 2.0**-32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """C. Wellons' ``lowbias32`` integer hash, a bijection on uint32 values held in an int64 tensor.

    Works in place on its own copy (this is the sampler's hottest loop); ``x`` is left untouched.
    """
    x = x ^ (x >> 16)
    _multiply_mod_2_32_(x, _LOWBIAS32_MULTIPLIERS[0])
    x ^= x >> 15
    _multiply_mod_2_32_(x, _LOWBIAS32_MULTIPLIERS[1])
    x ^= x >> 16
    return x


def _multiply_mod_2_32_(x: torch.Tensor, multiplier: int) -> None:
    """``x = x * multiplier mod 2**32`` in place, for ``x`` in [0, 2**32), without int64 overflow:
    each partial product is below 2**48."""
    high_part = x * (multiplier >> 16)
    high_part.bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    x.mul_(multiplier & 0xFFFF).add_(high_part).bitwise_and_(_MASK32)


# --- results ---------------------------------------------------------------------------------------


def _sampled_tokens(
    token_ids: torch.Tensor, raw_logprobs: torch.Tensor, rows: Sequence[SamplingRow]
) -> list[SampledToken]:
    chosen = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1)
    alternatives = _top_logprobs(raw_logprobs, rows)
    return [
        SampledToken(token_id, logprob, top)
        for token_id, logprob, top in zip(token_ids.tolist(), chosen.tolist(), alternatives, strict=True)
    ]


def _top_logprobs(raw_logprobs: torch.Tensor, rows: Sequence[SamplingRow]) -> list[tuple[tuple[int, float], ...]]:
    """Each row's ``params.logprobs`` most likely tokens under the raw distribution, best first,
    equal logprobs by lower id."""
    wanted = [row.params.logprobs or 0 for row in rows]
    if max(wanted) == 0:
        return [()] * len(rows)
    values, ids = raw_logprobs.topk(min(max(wanted), raw_logprobs.shape[1]), dim=-1)
    top: list[tuple[tuple[int, float], ...]] = []
    for count, row_ids, row_values in zip(wanted, ids.tolist(), values.tolist(), strict=True):
        ranked = sorted(zip(row_ids, row_values, strict=True), key=lambda pair: (-pair[1], pair[0]))
        top.append(tuple(ranked[:count]))
    return top
