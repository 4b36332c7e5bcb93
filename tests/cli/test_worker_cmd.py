"""``met worker``: clear errors for bad options, and a real process that drains on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from typer.testing import CliRunner

from metrale.cli.main import app
from metrale.shared.codec import encode
from metrale.shared.keys import Keys
from metrale.shared.messages import FinishReason, GenerateRequest, Priority
from metrale.shared.record import RunStatus, read_record
from metrale.worker.fleet.redis_transport import redis_client

runner = CliRunner()
STARTUP_TIMEOUT_S = 60
# Long enough that the request is still running when a 50 ms poll sees it start: the tiny model
# decodes 24 tokens in well under 50 ms, so a short request could finish between two polls.
SIGTERM_REQUEST_TOKENS = 600


def test_without_a_redis_url_it_says_how_to_give_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MET_REDIS_URL", raising=False)
    result = runner.invoke(app, ["worker"])
    assert result.exit_code == 1
    assert "--redis" in result.output and "MET_REDIS_URL" in result.output


@pytest.mark.parametrize("option", ["--name", "--served-model-name"], ids=["worker-name", "served-name"])
def test_a_name_that_cannot_be_a_redis_key_is_refused(option: str, tiny_model_dir: Path) -> None:
    args = ["worker", "--redis", "redis://127.0.0.1:1/15", "--model", str(tiny_model_dir), option, "a:b"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    assert "'a:b'" in result.output


@pytest.mark.parametrize(("cpus", "says"), [("999", "CPUs 999 are not available here"), ("0-x", "not a CPU list")])
def test_cpus_it_cannot_run_on_are_refused(cpus: str, says: str) -> None:
    result = runner.invoke(app, ["worker", "--redis", "redis://127.0.0.1:1/15", "--cpus", cpus])
    assert result.exit_code == 1
    assert says in result.output


def _wait_until(condition: Callable[[], object], what: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not condition():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            output = process.communicate()[0].decode(errors="replace")
            pytest.fail(f"gave up waiting for {what}; worker output:\n{output}")
        time.sleep(0.05)


@pytest.mark.redis
def test_sigterm_finishes_the_running_request_then_exits_cleanly(real_redis_url: str, tiny_model_dir: Path) -> None:
    keys = Keys(f"met-test-{uuid.uuid4().hex}")
    env = {**os.environ, "MET_NAMESPACE": keys.namespace, "MET_HEARTBEAT_TTL_S": "3", "MET_DRAIN_TIMEOUT_S": "60"}
    met = Path(sys.executable).with_name("met")
    command = [str(met), "worker", "--redis", real_redis_url, "--model", str(tiny_model_dir), "--name", "cli-w"]
    command += ["--served-model-name", "tiny-model", "--max-seqs", "2", "--num-blocks", "64"]
    client = redis_client(real_redis_url)
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_until(lambda: client.exists(keys.worker("cli-w")), "the heartbeat", process)
        message = GenerateRequest(
            "cmpl-sigterm", "tiny-model", "default", [5, 6, 7], max_tokens=SIGTERM_REQUEST_TOKENS, ignore_eos=True
        )
        client.xadd(keys.request_stream(Priority.INTERACTIVE), {"msg": encode(message)})
        _wait_until(lambda: _status(client, keys, message.request_id) is RunStatus.RUNNING, "the request", process)

        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=STARTUP_TIMEOUT_S)[0].decode(errors="replace")
    finally:
        if process.poll() is None:
            process.kill()

    assert process.returncode == 0, output
    record = read_record(client, message.request_id, keys=keys)
    assert record is not None and record.finish_reason is FinishReason.LENGTH
    assert len(record.token_ids()) == SIGTERM_REQUEST_TOKENS
    assert not client.exists(keys.worker("cli-w"))
    assert "draining" in output
    client.delete(*client.scan_iter(f"{keys.namespace}:*"))
    client.close()


def _status(client: redis.Redis, keys: Keys, request_id: str) -> RunStatus | None:
    record = read_record(client, request_id, keys=keys)
    return record.status if record is not None else None


@pytest.mark.redis
def test_a_worker_given_cpus_runs_every_thread_on_them(real_redis_url: str, tiny_model_dir: Path) -> None:
    keys = Keys(f"met-test-{uuid.uuid4().hex}")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {"MET_NAMESPACE": keys.namespace}
    met = Path(sys.executable).with_name("met")
    cpu = min(os.sched_getaffinity(0))
    command = [str(met), "worker", "--redis", real_redis_url, "--model", str(tiny_model_dir), "--name", "pinned"]
    command += ["--max-seqs", "2", "--num-blocks", "64", "--cpus", str(cpu)]
    client = redis_client(real_redis_url)
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_until(lambda: client.exists(keys.worker("pinned")), "the heartbeat", process)
        tasks = list(Path(f"/proc/{process.pid}/task").iterdir())
        allowed = {_cpus_allowed(task / "status") for task in tasks}
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=STARTUP_TIMEOUT_S)[0].decode(errors="replace")
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    assert len(tasks) > 1 and allowed == {str(cpu)}, (len(tasks), allowed)
    client.delete(*client.scan_iter(f"{keys.namespace}:*"))
    client.close()


def _cpus_allowed(status: Path) -> str:
    return next(
        line.split(":", 1)[1].strip()
        for line in status.read_text().splitlines()
        if line.startswith("Cpus_allowed_list")
    )
