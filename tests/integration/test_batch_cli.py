"""``met batch`` (in-process, ``CliRunner``) against a real ``met serve`` with its batch runner thread,
on the real Redis: submit and wait, download, a failed batch's line errors, a 404, list, cancel, and
the API key from ``MET_API_KEY``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from typer.testing import CliRunner, Result

from metrale.cli.main import app
from tests.integration.test_batches import KEY_A, Served, chat_line, completion_line, jsonl, served, without_ids

pytestmark = [pytest.mark.slow, pytest.mark.redis]


@pytest.fixture(scope="module")
def serve(fleet_redis_url: str, integration_dir: Path, model_settings: dict[str, str]) -> Iterator[Served]:
    with served(fleet_redis_url, integration_dir, model_settings, runner_thread=True) as running:
        yield running


def met_batch(serve: Served, *args: str, key: str | None = KEY_A) -> Result:
    env = {"MET_API_KEY": key} if key is not None else {}
    return CliRunner().invoke(app, ["batch", *args, "--url", serve.base_url], env=env)


def write(path: Path, lines: list[Any]) -> Path:
    path.write_bytes(jsonl(lines))
    return path


def test_submit_wait_and_download_give_the_online_answers(serve: Served, tmp_path: Path) -> None:
    lines = [completion_line(f"c-{i}", f"The tide rose {i} times", seed=i) for i in range(4)]
    submitted = met_batch(serve, "submit", str(write(tmp_path / "in.jsonl", lines)), "--wait")
    assert submitted.exit_code == 0, submitted.output
    batch_id = submitted.stdout.strip()
    assert batch_id.startswith("batch_")
    assert f"{batch_id}: completed (4 of 4 lines answered, 0 failed)" in submitted.stderr
    assert f"met batch download {batch_id} --url {serve.base_url} --output output.jsonl" in submitted.stderr

    shown = met_batch(serve, "status", batch_id, "--json")
    assert shown.exit_code == 0 and json.loads(shown.stdout)["endpoint"] == "/v1/completions"  # from the file

    out = tmp_path / "out.jsonl"
    downloaded = met_batch(serve, "download", batch_id, "--output", str(out))
    assert downloaded.exit_code == 0, downloaded.output
    answered = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["custom_id"] for line in answered] == [line["custom_id"] for line in lines]
    headers = {"Authorization": f"Bearer {KEY_A}"}
    online = httpx.post(f"{serve.base_url}/v1/completions", json=lines[0]["body"], headers=headers, timeout=60)
    assert without_ids(answered[0]["response"]["body"]) == without_ids(online.json())

    to_stdout = met_batch(serve, "download", batch_id)
    assert to_stdout.exit_code == 0 and to_stdout.stdout == out.read_text()
    listed = met_batch(serve, "list", "--json")
    assert batch_id in [json.loads(line)["id"] for line in listed.stdout.splitlines()]
    table = met_batch(serve, "list")  # not a terminal: each row whole, on one line
    row = next(line.split() for line in table.stdout.splitlines() if batch_id in line)
    assert row[:5] == [batch_id, "completed", "/v1/completions", "4/4", "0"], table.stdout


def test_a_failed_batch_names_each_bad_line(serve: Served, tmp_path: Path) -> None:
    wrong_url = {**chat_line("b", "x", seed=1), "url": "/v1/completions"}
    path = write(tmp_path / "bad.jsonl", [chat_line("a", "x", seed=1), chat_line("a", "y", seed=2), wrong_url])
    result = met_batch(serve, "submit", str(path), "--wait")
    assert result.exit_code == 1
    assert ": failed (0 of 0 lines answered, 0 failed)" in result.stderr
    assert "  line 2: duplicate_custom_id: custom_id 'a' appears twice" in result.stderr
    assert "  line 3: invalid_url: url must be the batch's endpoint" in result.stderr


def test_an_unknown_batch_and_a_wrong_key_are_one_line(serve: Served) -> None:
    missing = met_batch(serve, "status", "batch_nope")
    assert (missing.exit_code, missing.stderr) == (1, "error: HTTP 404: No such batch: 'batch_nope'.\n")
    unauthorized = met_batch(serve, "list", key="sk-wrong")
    assert (unauthorized.exit_code, unauthorized.stderr) == (1, "error: HTTP 401: Invalid API key.\n")


def test_cancel_then_download_answers_and_errors(serve: Served, tmp_path: Path) -> None:
    lines = [chat_line(f"long-{i}", f"tell a long tale {i}", seed=i, max_tokens=200) for i in range(20)]
    submitted = met_batch(serve, "submit", str(write(tmp_path / "long.jsonl", lines)))
    assert submitted.exit_code == 0, submitted.output
    batch_id = submitted.stdout.strip()
    not_yet = met_batch(serve, "download", batch_id)
    assert not_yet.exit_code == 1 and f"wait for it (met batch status {batch_id} --wait)" in not_yet.stderr
    cancelled = met_batch(serve, "cancel", batch_id)
    assert cancelled.exit_code == 0 and cancelled.stderr.strip() in (
        f"{batch_id}: cancelling",
        f"{batch_id}: cancelled",
    )
    waited = met_batch(serve, "status", batch_id, "--wait")
    assert waited.exit_code == 1 and f"{batch_id}: cancelled" in waited.stderr
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    downloaded = met_batch(serve, "download", batch_id, "--output", str(out), "--errors", str(errors))
    assert downloaded.exit_code == 0, downloaded.output
    ids = [
        json.loads(line)["custom_id"]
        for path in (out, errors)
        if path.exists()
        for line in path.read_text().splitlines()
    ]
    assert sorted(ids) == sorted(line["custom_id"] for line in lines)
    assert {json.loads(line)["error"]["code"] for line in errors.read_text().splitlines()} == {"batch_cancelled"}


@pytest.mark.parametrize(
    ("make", "extra"),
    [(completion_line, {"logprobs": 2}), (chat_line, {"stop": ["e"]})],
    ids=["completions", "chat-with-a-stop-string"],
)
def test_met_generate_writes_what_the_online_batch_writes(
    serve: Served, tmp_path: Path, model_settings: dict[str, str], make: Any, extra: dict[str, Any]
) -> None:
    lines = [make(f"o-{i}", f"The gulls circled {i} times", seed=40 + i) for i in range(4)]
    for line in lines:
        line["body"] |= extra
    path = write(tmp_path / "in.jsonl", lines)
    online = met_batch(serve, "submit", str(path), "--wait")
    assert online.exit_code == 0, online.output
    online_out = tmp_path / "online.jsonl"
    assert met_batch(serve, "download", online.stdout.strip(), "-o", str(online_out)).exit_code == 0
    offline_out = tmp_path / "offline.jsonl"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the served worker (OMP_NUM_THREADS=1): the same float reductions
    try:
        args = [
            "generate",
            "--model",
            model_settings["MET_MODEL_DIR"],
            "--input",
            str(path),
            "--output",
            str(offline_out),
        ]
        offline = CliRunner().invoke(app, args)
    finally:
        torch.set_num_threads(threads)
    assert offline.exit_code == 0, offline.output
    for mine, theirs in zip(_answers(offline_out), _answers(online_out), strict=True):
        assert mine["custom_id"] == theirs["custom_id"] and mine["error"] is theirs["error"] is None
        assert mine["response"]["status_code"] == theirs["response"]["status_code"] == 200
        mine_body, their_body = without_ids(mine["response"]["body"]), without_ids(theirs["response"]["body"])
        mine_logprobs, their_logprobs = _pop_logprobs(mine_body), _pop_logprobs(their_body)
        assert mine_body == their_body
        # the same tokens; their logprobs within float32 rounding (the batch's composition changes the matmul blocking)
        assert mine_logprobs == pytest.approx(their_logprobs, rel=1e-5)


def _pop_logprobs(body: dict[str, Any]) -> list[float]:
    """The body's logprob values (the rest of each ``logprobs`` object stays for an exact comparison)."""
    values: list[float] = []
    for choice in body["choices"]:
        logprobs = choice.get("logprobs") or {}
        values += logprobs.pop("token_logprobs", [])
        for alternatives in logprobs.get("top_logprobs", []):
            values += list(alternatives.values())
            alternatives.update(dict.fromkeys(alternatives, 0.0))
    return values


def _answers(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]
