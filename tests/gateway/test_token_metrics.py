"""The lock-free per-token metrics expose what prometheus_client's Counter and Histogram (their twins)
expose for the same updates."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from metrale.gateway.token_metrics import UnlockedCounter, UnlockedHistogram

PROPERTY = settings(derandomize=True, deadline=None, max_examples=200)
BUCKETS = (0.001, 0.005, 0.01, 0.1, 1.0, 5.0)


def _exposition(registry: CollectorRegistry) -> list[str]:
    """The exposition's lines without ``_created`` values (a creation time differs between two metrics)."""
    lines = generate_latest(registry).decode().splitlines()
    return [line.rsplit(" ", 1)[0] if "_created" in line and not line.startswith("#") else line for line in lines]


@PROPERTY
@given(amounts=st.lists(st.floats(0, 1e6) | st.integers(0, 1000).map(float), max_size=30))
def test_the_counter_exposes_what_prometheus_clients_does(amounts: list[float]) -> None:
    reference, unlocked = CollectorRegistry(), CollectorRegistry()
    twin = Counter("metrale_tokens", "Tokens.", registry=reference)
    counter = UnlockedCounter("metrale_tokens", "Tokens.")
    unlocked.register(counter)
    for amount in amounts:
        twin.inc(amount)
        counter.inc(amount)
    assert _exposition(unlocked) == _exposition(reference)
    assert unlocked.get_sample_value("metrale_tokens_total") == reference.get_sample_value("metrale_tokens_total")


# Bounds themselves, values between and beyond them, zero, huge, infinite and NaN observations.
observations = st.sampled_from([*BUCKETS, 0.0, 1e9, float("inf"), float("nan")]) | st.floats(0, 10)


@PROPERTY
@given(amounts=st.lists(observations, max_size=40))
def test_the_histogram_exposes_what_prometheus_clients_does(amounts: list[float]) -> None:
    reference, unlocked = CollectorRegistry(), CollectorRegistry()
    twin = Histogram("metrale_gap_seconds", "Gaps.", buckets=BUCKETS, registry=reference)
    histogram = UnlockedHistogram("metrale_gap_seconds", "Gaps.", BUCKETS)
    unlocked.register(histogram)
    for amount in amounts:
        twin.observe(amount)
        histogram.observe(amount)
    assert _exposition(unlocked) == _exposition(reference)


def test_a_counter_refuses_to_go_down() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        UnlockedCounter("metrale_tokens", "Tokens.").inc(-1)


@pytest.mark.parametrize("buckets", [(), (1.0, 0.5), (-1.0, 1.0)], ids=["none", "unsorted", "below-zero"])
def test_a_histogram_refuses_buckets_it_cannot_count_into(buckets: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="buckets"):
        UnlockedHistogram("metrale_gap_seconds", "Gaps.", buckets)
