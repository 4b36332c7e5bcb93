"""``met bench``'s speculative decoding report: read from a gateway's real ``/metrics`` exposition, the
growth over a run, and what ``vllm bench serve`` reports of it."""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import pytest
from rich.console import Console

from metrale.cli.bench_cmd import _table
from metrale.cli.spec_decode_metrics import SpeculationCounts, parse_speculation_counts
from metrale.gateway.metrics import GatewayMetrics


def _exposition(fields: Mapping[bytes | str, bytes | str]) -> str:
    metrics = GatewayMetrics()
    metrics.speculation.update(fields)
    return metrics.exposition().decode()


def test_the_counters_are_read_from_the_gateways_exposition() -> None:
    text = _exposition({"num_drafts": "10", "num_draft_tokens": "40", "num_accepted_tokens": "13", "pos:0": "8"})
    counts = parse_speculation_counts(text)
    assert counts == SpeculationCounts(10, 40, 13, (8,))


def test_a_server_without_them_says_nothing() -> None:
    assert parse_speculation_counts("# HELP other_total x\n# TYPE other_total counter\nother_total 3.0\n") is None


def test_a_run_reports_its_growth_as_vllm_bench_serve_does() -> None:
    before = SpeculationCounts(10, 40, 13, (8, 5))
    after = SpeculationCounts(30, 120, 53, (24, 17, 8, 4))
    report = after.since(before).report()
    assert report == {
        "acceptance_rate": pytest.approx(40 / 80),
        "acceptance_length": pytest.approx(1 + 40 / 20),
        "drafts": 20,
        "draft_tokens": 80,
        "accepted_tokens": 40,
        "per_position_acceptance_rate": pytest.approx([16 / 20, 12 / 20, 8 / 20, 4 / 20]),
    }


def test_a_run_that_drafted_nothing_has_no_report() -> None:
    counts = SpeculationCounts(10, 40, 13, (8,))
    assert counts.since(counts).report() is None


def test_the_table_shows_the_acceptance_when_the_report_has_it() -> None:
    stats = {"mean_ms": 1.0, "median_ms": 1.0, "p99_ms": 1.0}
    report = {
        **{name: stats for name in ("ttft", "tpot", "itl", "e2e")},
        "request_throughput": 1.0,
        "output_token_throughput": 1.0,
        "total_token_throughput": 1.0,
        "completed": 1,
        "failed": 0,
    }
    spec = SpeculationCounts(4, 16, 8, (4, 2, 1, 1)).report()
    lines = _printed({**report, "spec_decode": spec}).splitlines()
    assert any("draft acceptance (%)" in line and "50.0" in line for line in lines)
    assert any("acceptance length" in line and "3.00" in line for line in lines)
    assert any("per-position acceptance (%)" in line and "100 50 25 25" in line for line in lines)
    assert "acceptance" not in _printed({**report, "spec_decode": None})


def _printed(report: dict[str, Any]) -> str:
    out = io.StringIO()
    Console(file=out, width=120).print(_table(report))
    return out.getvalue()
