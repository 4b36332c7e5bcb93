"""``met top`` and ``met batch-runner`` on a Redis Cluster (issue #34): top reads a fleet whose requests
are spread over the shards; RQ's Redis must be a plain or Sentinel one (``--jobs-redis`` /
``MET_JOBS_REDIS_URL``), and each says so in one line when it is missing or a cluster."""

from __future__ import annotations

import uuid

import pytest
from typer.testing import CliRunner

from metrale.cli.main import app
from metrale.shared.keys import Keys
from metrale.shared.redis_connect import connect_sync
from tests.failover.cluster import ClusterGroup
from tests.top.conftest import NOW, populate
from tests.top.fake_fleet import FakeFleet

NO_NODE = "redis+cluster://127.0.0.1:1,127.0.0.1:2"


@pytest.fixture(autouse=True)
def no_redis_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MET_REDIS_URL", "MET_JOBS_REDIS_URL", "MET_NAMESPACE"):
        monkeypatch.delenv(name, raising=False)


def one_line_error(output: str) -> str:
    assert "Traceback" not in output, output
    return " ".join(output.replace("│", " ").split())


def test_top_once_shows_a_fleet_spread_over_a_clusters_shards(redis_cluster: ClusterGroup, real_redis_url: str) -> None:
    keys = Keys.for_redis(redis_cluster.url, f"cli-top-{uuid.uuid4().hex[:8]}")
    client = connect_sync(redis_cluster.url)
    populate(FakeFleet(client, keys, NOW))
    client.close()
    args = [
        "top",
        "--once",
        "--redis",
        redis_cluster.url,
        "--jobs-redis",
        real_redis_url,
        "--namespace",
        keys.namespace,
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    for shown in ("gpu-a", "gpu-d", "chat-4", "batch_abc", "jobs: 0 queued, 0 running"):
        assert shown in result.output, shown


def test_top_on_a_cluster_no_node_of_which_answers_says_so() -> None:
    result = CliRunner().invoke(app, ["top", "--once", "--redis", NO_NODE])
    assert result.exit_code == 1
    assert "error:" in one_line_error(result.output)


@pytest.mark.parametrize("command", [["top", "--once"], ["batch-runner"]])
def test_a_cluster_for_rqs_jobs_is_refused(command: list[str]) -> None:
    result = CliRunner().invoke(app, [*command, "--redis", "redis://127.0.0.1:1/0", "--jobs-redis", NO_NODE])
    assert result.exit_code != 0
    assert "RQ cannot run on a Redis Cluster" in one_line_error(result.output)


def test_the_batch_runner_on_a_cluster_asks_for_a_jobs_redis(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MET_REDIS_URL", NO_NODE)
    result = CliRunner().invoke(app, ["batch-runner"])
    assert result.exit_code != 0
    assert "set MET_JOBS_REDIS_URL to a plain or Sentinel Redis" in one_line_error(result.output)
