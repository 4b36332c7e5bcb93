"""``met worker``: clear errors for bad options, and a real process that drains on SIGTERM."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from typer.testing import CliRunner

from metrale.cli.main import app
from metrale.shared.codec import encode
from metrale.shared.keys import Keys
from metrale.shared.messages import FinishReason, GenerateRequest, Priority
from metrale.shared.record import RunStatus, read_record
from metrale.worker.fleet.broker.redis_transport import redis_client

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


@contextlib.contextmanager
def worker_process(
    redis_url: str, model_dir: Path, name: str, *options: str, env: dict[str, str]
) -> Iterator[subprocess.Popen[bytes]]:
    """A real ``met worker`` named ``name`` whose heartbeat is up; killed after the block if it still runs."""
    met = Path(sys.executable).with_name("met")
    command = [str(met), "worker", "--redis", redis_url, "--model", str(model_dir), "--name", name, *options]
    client = redis_client(redis_url)
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        keys = Keys(env["MET_NAMESPACE"])
        _wait_until(lambda: client.exists(keys.worker(name)), "the heartbeat", process)
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        client.close()


def stopped(process: subprocess.Popen[bytes]) -> str:
    """SIGTERM ``process`` and wait for it to exit; its output."""
    process.send_signal(signal.SIGTERM)
    return process.communicate(timeout=STARTUP_TIMEOUT_S)[0].decode(errors="replace")


@pytest.mark.redis
def test_sigterm_finishes_the_running_request_then_exits_cleanly(real_redis_url: str, tiny_model_dir: Path) -> None:
    keys = Keys(f"met-test-{uuid.uuid4().hex}")
    env = {**os.environ, "MET_NAMESPACE": keys.namespace, "MET_HEARTBEAT_TTL_S": "3", "MET_DRAIN_TIMEOUT_S": "60"}
    options = ["--served-model-name", "tiny-model", "--max-seqs", "2", "--num-blocks", "64"]
    client = redis_client(real_redis_url)
    with worker_process(real_redis_url, tiny_model_dir, "cli-w", *options, env=env) as process:
        message = GenerateRequest(
            "cmpl-sigterm", "tiny-model", "default", [5, 6, 7], max_tokens=SIGTERM_REQUEST_TOKENS, ignore_eos=True
        )
        client.xadd(keys.request_stream(Priority.INTERACTIVE), {"msg": encode(message)})
        _wait_until(lambda: _status(client, keys, message.request_id) is RunStatus.RUNNING, "the request", process)
        output = stopped(process)

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
    cpu = min(os.sched_getaffinity(0))
    options = ["--max-seqs", "2", "--num-blocks", "64", "--cpus", str(cpu)]
    with worker_process(real_redis_url, tiny_model_dir, "pinned", *options, env=env) as process:
        tasks = list(Path(f"/proc/{process.pid}/task").iterdir())
        allowed = {_cpus_allowed(task / "status") for task in tasks}
        output = stopped(process)
    assert process.returncode == 0, output
    assert len(tasks) > 1 and allowed == {str(cpu)}, (len(tasks), allowed)
    client = redis_client(real_redis_url)
    client.delete(*client.scan_iter(f"{keys.namespace}:*"))
    client.close()


def _cpus_allowed(status: Path) -> str:
    return next(
        line.split(":", 1)[1].strip()
        for line in status.read_text().splitlines()
        if line.startswith("Cpus_allowed_list")
    )
