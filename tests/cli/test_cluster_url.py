"""A Redis Cluster URL is refused, with the reason and before it connects to anything, by every process
that does not serve one yet (issue #34: their transactions still span hash slots); ``met worker`` serves
one, and says so clearly when no node answers."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from metrale.cli.main import app
from metrale.shared.redis_url import CLUSTER_NOT_SERVED

CLUSTER = "redis+cluster://127.0.0.1:1,127.0.0.1:2"


@pytest.mark.parametrize(
    "args",
    [
        ["serve", "--redis", CLUSTER],
        ["serve"],
    ],
    ids=["serve", "serve-env"],
)
def test_each_process_refuses_a_cluster_url_with_the_reason(args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MET_REDIS_URL", CLUSTER)
    result = CliRunner().invoke(app, args)
    assert result.exit_code != 0
    assert CLUSTER_NOT_SERVED in " ".join(result.output.replace("│", " ").split()), result.output
    assert "Traceback" not in result.output


def test_a_worker_on_a_cluster_no_node_of_which_answers_says_so_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MET_REDIS_URL", CLUSTER)
    result = CliRunner().invoke(app, ["worker"])
    assert result.exit_code != 0
    assert "Redis Cluster cannot be connected" in result.output, result.output
    assert "Traceback" not in result.output
