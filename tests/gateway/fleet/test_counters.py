"""Fleet counter hashes become Prometheus counters, misses labelled by reason."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from metrale.gateway.fleet.counters import checkpoint_counters, failover_counters, speculation_counters


def test_checkpoint_hash_is_exported_with_misses_by_reason() -> None:
    collector = checkpoint_counters()
    registry = CollectorRegistry()
    registry.register(collector)
    collector.update({b"lookups": b"5", b"hits": b"3", b"miss:checksum": b"1", b"miss:none": b"1", b"junk": b"x"})
    text = generate_latest(registry).decode()
    assert "metrale_checkpoint_lookups_total 5.0" in text
    assert "metrale_checkpoint_hits_total 3.0" in text
    assert 'metrale_checkpoint_misses_total{reason="checksum"} 1.0' in text
    assert 'metrale_checkpoint_misses_total{reason="none"} 1.0' in text
    assert "metrale_checkpoint_saves_total 0.0" in text


def test_failover_hash_is_exported() -> None:
    collector = failover_counters()
    registry = CollectorRegistry()
    registry.register(collector)
    collector.update({"resumed_requests": "2"})
    text = generate_latest(registry).decode()
    assert "metrale_resumed_requests_total 2.0" in text
    assert "metrale_dead_lettered_requests_total 0.0" in text


def test_speculation_hash_is_exported_under_vllms_names_with_positions_labelled() -> None:
    collector = speculation_counters()
    registry = CollectorRegistry()
    registry.register(collector)
    collector.update({b"num_drafts": b"4", b"num_draft_tokens": b"12", b"pos:0": b"3", b"pos:1": b"1"})
    text = generate_latest(registry).decode()
    assert "metrale_spec_decode_num_drafts_total 4.0" in text
    assert "metrale_spec_decode_num_draft_tokens_total 12.0" in text
    assert "metrale_spec_decode_num_accepted_tokens_total 0.0" in text
    assert 'metrale_spec_decode_num_accepted_tokens_per_pos_total{position="0"} 3.0' in text
    assert 'metrale_spec_decode_num_accepted_tokens_per_pos_total{position="1"} 1.0' in text
