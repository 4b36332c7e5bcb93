"""The soak benchmark's pure helpers: the RSS slope fit and the classification of a fleet's Redis keys."""

from __future__ import annotations

import pytest

from bench.soak_measure import MIB, FleetFacts, KeyInfo, Series, classify_keys, key_family, slope_mib_per_min, summarize


def test_the_slope_of_a_line_is_its_rate_in_mib_per_minute() -> None:
    samples = [(t, 100 * MIB + t * MIB / 30) for t in range(0, 600, 5)]  # 2 MiB a minute
    assert slope_mib_per_min(samples) == pytest.approx(2.0)


def test_a_flat_noisy_series_has_a_slope_near_zero() -> None:
    samples = [(float(t), 200 * MIB + (MIB if t % 10 else -MIB)) for t in range(0, 1200, 5)]
    assert abs(slope_mib_per_min(samples) or 0.0) < 0.01


def test_no_slope_from_one_sample_or_one_instant() -> None:
    assert slope_mib_per_min([(1.0, 5.0)]) is None
    assert slope_mib_per_min([(1.0, 5.0), (1.0, 9.0)]) is None


def test_the_summary_fits_only_the_samples_after_the_warm_up() -> None:
    series = Series("worker-1", 42, 0.0, [(0.0, 10 * MIB), (5.0, 90 * MIB)])  # loading the model
    series.samples += [(float(t), 100 * MIB) for t in range(120, 300, 5)]
    summary = summarize(series, warmup_s=60, min_samples=12)
    assert summary is not None
    assert summary.slope_mib_per_min == pytest.approx(0.0)
    assert (summary.first_mib, summary.peak_mib, summary.samples_after_warmup) == (10.0, 100.0, 36)
    assert summarize(series, warmup_s=280, min_samples=12).slope_mib_per_min is None  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("key", "family"),
    [
        ("met:run:req-1", "run"),
        ("met:run:req-1:events", "run-events"),
        ("met:batch:soak:batch_1", "batch"),
        ("met:batch:soak:batch_1:results", "batch-results"),
        ("met:session:t:s1", "session"),
        ("met:session:t:s1:transcript", "session-transcript"),
        ("met:req:interactive", "req:interactive"),
        ("met:running:info", "running:info"),
        ("met:running", "running"),
        ("met:metrics:failover", "metrics:failover"),
        ("met:ckpt:fp:t:abc", "ckpt"),
        ("met:worker:w1", "worker"),
        ("rq:job:met--batch_1", "rq:job"),
        ("other:thing", "other"),
    ],
)
def test_key_families(key: str, family: str) -> None:
    assert key_family(key, "met") == family


def test_a_record_without_ttl_and_a_finished_batch_s_results_are_leaks() -> None:
    keys = [
        KeyInfo("met:run:a", 3500),
        KeyInfo("met:run:b", -1),
        KeyInfo("met:batch:soak:b1", -1),
        KeyInfo("met:batch:soak:b1:results", -1),
        KeyInfo("met:batch:soak:b2:results", -1),
        KeyInfo("met:model:tiny", -1),
    ]
    facts = FleetFacts(terminal_batches=frozenset({"soak:b1"}))
    scan = classify_keys(keys, "met", facts)
    assert scan.families == {"batch": 1, "batch-results": 2, "model": 1, "run": 2}
    assert scan.without_ttl == {"batch": 1, "batch-results": 2, "model": 1, "run": 1}
    assert scan.leaks == ["met:run:b: no TTL", "met:batch:soak:b1:results: results of a finished batch"]


def test_entries_an_idle_fleet_should_not_hold_are_leaks() -> None:
    facts = FleetFacts(
        running=2,
        running_info=1,
        active_batches=["soak:b1", "soak:b2"],
        terminal_batches=frozenset({"soak:b1"}),
        stream_lengths={"met:req:interactive": 0, "met:req:batch": 3},
        stream_pending={"met:req:interactive": 1, "met:req:batch": 0},
        lost_worker_ages_s=[30.0, 5000.0],
    )
    leaks = classify_keys([], "met", facts).leaks
    assert len(leaks) == 5, leaks
    assert "active-batches: soak:b1 has ended" in leaks
    assert not any("soak:b2" in leak for leak in leaks)


def test_a_clean_idle_fleet_has_no_leaks() -> None:
    keys = [KeyInfo("met:run:a", 100), KeyInfo("met:req:batch", -1), KeyInfo("met:workers", -1)]
    facts = FleetFacts(stream_lengths={"met:req:batch": 0}, lost_worker_ages_s=[100.0])
    assert classify_keys(keys, "met", facts).leaks == []
