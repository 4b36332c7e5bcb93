"""How one request wants its tokens chosen (the OpenAI / vLLM sampling knobs), validated once.

The worker receives these from the gateway and hands them, per row of logits, to
``metrale.worker.engine.sampler.Sampler``. Ranges follow vLLM; the gateway may narrow them to OpenAI's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GREEDY_BELOW_TEMPERATURE = 1e-5
"""Temperatures under this sample greedily (as vLLM does): dividing by them would overflow."""

MAX_LOGPROBS = 20
"""The most top alternatives a request may ask for with each token (OpenAI's limit)."""

MAX_LOGIT_BIAS = 100.0
"""A ``logit_bias`` value lies in ``[-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]`` (OpenAI's range)."""

MAX_LOGIT_BIAS_ENTRIES = 300
"""The most tokens one ``logit_bias`` may name (OpenAI's limit)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling settings of one request; every field is checked in ``__post_init__``.

    ``temperature`` 0 means greedy. ``top_k`` 0, ``top_p`` 1 and ``min_p`` 0 disable their filter.
    ``presence_penalty`` / ``frequency_penalty`` (OpenAI, over generated tokens) and
    ``repetition_penalty`` (HF / vLLM, over prompt and generated tokens; 1 disables) shape the
    logits before temperature. ``seed`` None lets the worker pick one. ``n`` is the number of
    independent completions. ``logprobs`` is how many top alternatives to return with each token
    (None: none; 0: only the chosen token's logprob). ``logit_bias`` holds ``(token_id, bias)``
    pairs, distinct ids, each bias in [-100, 100]: added to the logits before the penalties (OpenAI).
    ``grammar`` (llguidance Lark text, None: free) constrains every completion to its sentences
    (``metrale.worker.engine.constraints``). ``prompt_logprobs`` (None: none) asks for the logprob of
    every prompt token after the first, with that many top alternatives (``prompt_logprobs.py``).
    ``speculative`` False keeps the request's choices off speculative decoding (they are never given
    draft tokens); True lets them verify drafts when the engine has a drafter. Either way the outputs
    are the same: it only decides how many tokens a step may emit.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: str | None = None
    prompt_logprobs: int | None = None
    speculative: bool = True

    def __post_init__(self) -> None:
        # A list from a JSON body becomes a tuple, so the params stay hashable and immutable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", tuple((token, bias) for token, bias in self.logit_bias))
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_float("temperature", self.temperature, 0.0, math.inf)
        _check_float("top_p", self.top_p, 0.0, 1.0, include_low=False)
        _check_int("top_k", self.top_k, minimum=0)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, math.inf, include_low=False)
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, minimum=0)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be a bool, got {self.speculative!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=None)
        _check_int("n", self.n, minimum=1)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0, maximum=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, minimum=0, maximum=MAX_LOGPROBS)
        _check_logit_bias(self.logit_bias)
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError(f"grammar must be a non-empty string, got {self.grammar!r}")

    @property
    def is_greedy(self) -> bool:
        """True when the token is the argmax of the (penalized) logits."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """True when any penalty changes the logits."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def has_filters(self) -> bool:
        """True when top-k, top-p or min-p removes tokens before sampling."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def _check_logit_bias(pairs: tuple[tuple[int, float], ...]) -> None:
    if len(pairs) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"logit_bias may name at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(pairs)}")
    for token_id, bias in pairs:
        _check_int("logit_bias token id", token_id, minimum=0)
        _check_float("logit_bias", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    if len({token_id for token_id, _ in pairs}) != len(pairs):
        raise ValueError("logit_bias names a token more than once")


def _check_int(name: str, value: object, minimum: int | None, maximum: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")


def _check_float(name: str, value: object, low: float, high: float, include_low: bool = True) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    low_ok = value >= low if include_low else value > low
    # Written so that NaN fails both comparisons; infinities fail isfinite.
    if not (low_ok and value <= high and math.isfinite(value)):
        opening = "[" if include_low else "("
        closing = ")" if math.isinf(high) else "]"
        raise ValueError(f"{name} must be finite and in {opening}{low}, {high}{closing}, got {value}")
