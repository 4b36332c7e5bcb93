"""``MET_JOBS_REDIS_URL``: the Redis of RQ's job queues (batches, background responses), which cannot be
a Redis Cluster (issue #34)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from metrale.shared.settings import BatchRunnerSettings, GatewaySettings, load_settings

CLUSTER = "redis+cluster://10.0.0.1:7000,10.0.0.2:7000"


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MET_REDIS_URL", "MET_JOBS_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)


def gateway(redis_url: str | None, jobs_redis_url: str | None = None) -> GatewaySettings:
    return GatewaySettings(
        redis_url, {}, request_timeout_s=1.0, max_queue=1, heartbeat_ttl_s=1, jobs_redis_url=jobs_redis_url
    )


def test_jobs_live_on_the_fleets_redis_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MET_REDIS_URL", "redis://fleet:6379/0")
    assert load_settings().gateway().jobs_url == "redis://fleet:6379/0"
    monkeypatch.setenv("MET_JOBS_REDIS_URL", "redis+sentinel://s1,s2/jobs")
    settings = load_settings()
    assert settings.gateway().jobs_url == "redis+sentinel://s1,s2/jobs"
    assert settings.batch_runner().gateway.jobs_url == "redis+sentinel://s1,s2/jobs"


def test_an_embedded_redis_has_its_jobs_decided_later() -> None:
    assert gateway(None).jobs_url is None
    assert gateway(None, "redis://jobs:6379/0").jobs_url == "redis://jobs:6379/0"


@pytest.mark.parametrize("url", [CLUSTER, "rediss+cluster://a:7000,b:7000"])
def test_a_cluster_for_the_jobs_is_refused_naming_rq(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    with pytest.raises(ValueError, match="RQ cannot run on a Redis Cluster"):
        gateway("redis://fleet:6379/0", url)
    monkeypatch.setenv("MET_JOBS_REDIS_URL", url)
    with pytest.raises(ValueError, match="MET_JOBS_REDIS_URL"):
        load_settings().gateway()


def test_a_malformed_jobs_url_is_refused() -> None:
    with pytest.raises(ValueError, match="jobs_redis_url"):
        gateway("redis://fleet:6379/0", "http://jobs")


def test_the_batch_runner_takes_the_jobs_redis(tmp_path: Path) -> None:
    settings = dataclasses.replace(gateway("redis://fleet:6379/0", "redis://jobs:6379/1"), files_dir=tmp_path)
    assert BatchRunnerSettings(settings).gateway.jobs_url == "redis://jobs:6379/1"
