from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from metrale.worker.engine.sampling_params import SamplingParams


def test_defaults_are_valid_and_sample_plainly() -> None:
    params = SamplingParams()
    assert not params.is_greedy
    assert not params.has_penalties
    assert not params.has_filters


def test_params_are_frozen_and_hashable() -> None:
    params = SamplingParams(stop_token_ids=(3, 4))
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.0  # type: ignore[misc]
    assert hash(params) == hash(SamplingParams(stop_token_ids=(3, 4)))


def test_stop_token_ids_from_a_list_become_a_tuple() -> None:
    params = SamplingParams(stop_token_ids=[7, 9])  # type: ignore[arg-type]
    assert params.stop_token_ids == (7, 9)


@pytest.mark.parametrize(
    ("temperature", "greedy"),
    [(0.0, True), (1e-6, True), (1e-4, False), (1.0, False), (5.0, False)],
    ids=["zero", "below-epsilon", "small", "one", "large"],
)
def test_is_greedy(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).is_greedy is greedy


@pytest.mark.parametrize(
    "fields",
    [{"presence_penalty": 0.1}, {"frequency_penalty": -0.1}, {"repetition_penalty": 1.1}],
    ids=["presence", "frequency", "repetition"],
)
def test_has_penalties(fields: dict[str, Any]) -> None:
    assert SamplingParams(**fields).has_penalties


@pytest.mark.parametrize("fields", [{"top_k": 5}, {"top_p": 0.9}, {"min_p": 0.1}], ids=["top_k", "top_p", "min_p"])
def test_has_filters(fields: dict[str, Any]) -> None:
    assert SamplingParams(**fields).has_filters


@pytest.mark.parametrize(
    "fields",
    [
        {"max_tokens": 1, "temperature": 0.0, "top_p": 1e-9, "min_p": 1.0, "top_k": 1},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0, "repetition_penalty": 1e-3},
        {"seed": -(2**70), "n": 8, "logprobs": 0},
        {"seed": 2**70, "logprobs": 20, "ignore_eos": True, "stop_token_ids": (0,)},
    ],
    ids=["edge-filters", "edge-penalties", "negative-huge-seed", "max-logprobs"],
)
def test_accepts_values_at_the_edges(fields: dict[str, Any]) -> None:
    SamplingParams(**fields)


INVALID_VALUES = [
    ("max_tokens", 0),
    ("max_tokens", 2.5),
    ("max_tokens", True),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "hot"),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", math.nan),
    ("top_k", -1),
    ("top_k", 3.0),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("frequency_penalty", 3.0),
    ("frequency_penalty", math.nan),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("stop_token_ids", (1, -2)),
    ("stop_token_ids", (1.0,)),
    ("ignore_eos", 1),
    ("seed", 1.5),
    ("seed", False),
    ("n", 0),
    ("logprobs", -1),
    ("logprobs", 21),
]


@pytest.mark.parametrize(
    ("field", "value"),
    [pytest.param(field, value, id=f"{field}={value!r}") for field, value in INVALID_VALUES],
)
def test_rejects_out_of_range_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        invalid: dict[str, Any] = {field: value}
        SamplingParams(**invalid)


def test_logit_bias_becomes_a_tuple_of_pairs() -> None:
    params = SamplingParams(logit_bias=[[5, 1.0], (7, -2)])  # type: ignore[list-item]
    assert params.logit_bias == ((5, 1.0), (7, -2))
    hash(params)


@pytest.mark.parametrize(
    ("logit_bias", "message"),
    [
        (((1, 100.5),), "logit_bias"),
        (((1, -101.0),), "logit_bias"),
        (((1, math.nan),), "logit_bias"),
        (((-1, 1.0),), "logit_bias token id"),
        (((1, 1.0), (1, 2.0)), "more than once"),
        (tuple((i, 1.0) for i in range(301)), "at most 300"),
    ],
)
def test_rejects_bad_logit_bias(logit_bias: tuple[tuple[int, float], ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=logit_bias)


def test_accepts_logit_bias_at_the_edges() -> None:
    SamplingParams(logit_bias=tuple((i, 100.0 if i % 2 else -100.0) for i in range(300)))
