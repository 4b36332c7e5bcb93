"""``met batch`` without a gateway: one-line errors for a gateway that is down and for a missing
file, and the endpoint taken from the file. (Against a real gateway: ``tests/integration/test_batch_cli.py``.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from metrale.cli.batch_client import endpoint_of
from metrale.cli.main import app
from tests.integration.processes import free_port

runner = CliRunner()


@pytest.mark.parametrize(
    "command",
    [["status", "batch_x"], ["list"], ["cancel", "batch_x"], ["download", "batch_x"]],
    ids=["status", "list", "cancel", "download"],
)
def test_a_gateway_that_is_down_is_one_line(command: list[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = runner.invoke(app, ["batch", *command, "--url", url])
    assert result.exit_code == 1
    assert result.stderr.strip() == f"error: cannot reach the gateway at {url} (is it running? see --url)"


def test_a_missing_file_is_one_line(tmp_path: Path) -> None:
    result = runner.invoke(app, ["batch", "submit", str(tmp_path / "absent.jsonl")])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: [Errno 2] No such file or directory") and result.stderr.count("\n") == 1


def test_an_unknown_endpoint_is_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text("{}\n")
    result = runner.invoke(app, ["batch", "submit", str(path), "--endpoint", "/v1/embeddings", "--url", "http://x"])
    assert result.exit_code == 2 and "--endpoint" in result.output


@pytest.mark.parametrize(
    ("content", "endpoint"),
    [
        ("\n" + json.dumps({"url": "/v1/completions"}) + "\n", "/v1/completions"),
        (json.dumps({"url": "/v1/chat/completions"}) + "\n", "/v1/chat/completions"),
        (json.dumps({"url": "/v1/embeddings"}) + "\n", None),
        ("not json\n", None),
        ("[1]\n", None),
        ("", None),
    ],
    ids=["completions", "chat", "other-url", "not-json", "not-an-object", "empty"],
)
def test_the_endpoint_is_the_first_line_url(tmp_path: Path, content: str, endpoint: str | None) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(content)
    assert endpoint_of(path) == endpoint
