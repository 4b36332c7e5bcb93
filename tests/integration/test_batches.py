"""Batches end to end with the official ``openai`` client: ``met serve`` (gateway, worker and batch
runner thread) on the real Redis; and ``met serve --no-batch-runner`` with a separate ``met
batch-runner`` that is killed with ``kill -9`` mid-batch and replaced.

Outputs are compared with the online endpoint's answer to the same (seeded) request, ignoring
``id`` and ``created``.
"""

from __future__ import annotations

import io
import json
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from metrale.shared.keys import Keys
from metrale.worker.model.builtin import RANDOM_MODEL_NAME
from tests.integration.processes import ManagedProcess, free_port, met_environment, start_met, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.redis]

KEY_A, KEY_B = "sk-batch-a", "sk-batch-b"
LEASE_S = 2
LINES = 200
"""Lines of the batch compared with the online endpoint, per endpoint."""
POLL_S = 0.1


@dataclass
class Served:
    base_url: str
    keys: Keys
    env: dict[str, str]
    redis_url: str
    log_dir: Path
    serve: ManagedProcess

    def client(self, key: str = KEY_A) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=key, max_retries=0, timeout=60)

    def runner(self, name: str) -> ManagedProcess:
        return start_met(name, ["batch-runner", "--redis", self.redis_url], self.env, self.log_dir)


@contextmanager
def served(redis_url: str, log_dir: Path, model_settings: dict[str, str], *, runner_thread: bool) -> Iterator[Served]:
    keys = Keys(f"met-test-{uuid.uuid4().hex[:12]}")
    files = log_dir / f"files-{keys.namespace}"
    settings = {
        **model_settings,
        "MET_NAMESPACE": keys.namespace,
        "MET_API_KEYS": f"{KEY_A}:tenant-a,{KEY_B}:tenant-b",
        "MET_FILES_DIR": str(files),
        "MET_BATCH_LEASE_S": str(LEASE_S),
        "MET_BATCH_WINDOW": "2",
    }
    env = met_environment(settings, torch_threads=1)
    port = free_port()
    args = ["serve", "--redis", redis_url, "--port", str(port), "--max-seqs", "8"]
    name = f"serve-{keys.namespace}"
    serve = start_met(name, [*args, *([] if runner_thread else ["--no-batch-runner"])], env, log_dir)
    with ExitStack() as stack:
        stack.callback(_delete_namespace, redis_url, keys)
        stack.callback(serve.stop)
        wait_ready(serve, f"http://127.0.0.1:{port}")
        yield Served(f"http://127.0.0.1:{port}", keys, env, redis_url, log_dir, serve)


def _delete_namespace(url: str, keys: Keys) -> None:
    client = redis.Redis.from_url(url)
    stale = list(client.scan_iter(match=f"{keys.namespace}:*", count=1000))
    stale += list(client.scan_iter(match=f"rq:*{keys.namespace.replace('-', '?')}*", count=1000))
    if stale:
        client.delete(*stale)
    client.close()


@pytest.fixture(scope="module")
def serve(fleet_redis_url: str, integration_dir: Path, model_settings: dict[str, str]) -> Iterator[Served]:
    with served(fleet_redis_url, integration_dir, model_settings, runner_thread=True) as running:
        yield running


def chat_line(custom_id: str, text: str, *, seed: int, max_tokens: int = 12) -> dict[str, Any]:
    messages = [{"role": "user", "content": text}]
    body = {"model": RANDOM_MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "seed": seed}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def completion_line(custom_id: str, text: str, *, seed: int) -> dict[str, Any]:
    body = {"model": RANDOM_MODEL_NAME, "prompt": text, "max_tokens": 12, "temperature": 0.0, "seed": seed}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def jsonl(lines: list[Any]) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)


def submit(client: openai.OpenAI, content: bytes, endpoint: str) -> str:
    uploaded = client.files.create(file=("input.jsonl", io.BytesIO(content)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]
    assert batch.status == "validating"
    return batch.id


def wait_for(client: openai.OpenAI, batch_id: str, done: Callable[[Any], bool], timeout_s: float = 180.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if done(batch):
            return batch
        assert time.monotonic() < deadline, f"batch {batch_id} stuck at {batch.status}: {batch}"
        time.sleep(POLL_S)


def final(batch: Any) -> bool:
    return batch.status in ("completed", "failed", "expired", "cancelled")


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def without_ids(body: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in body.items() if name not in ("id", "created")}


@pytest.mark.parametrize(
    ("endpoint", "make"),
    [("/v1/chat/completions", chat_line), ("/v1/completions", completion_line)],
    ids=["chat", "completions"],
)
def test_a_batch_answers_each_line_as_the_online_endpoint(
    serve: Served, endpoint: str, make: Callable[..., dict[str, Any]]
) -> None:
    client = serve.client()
    lines = [make(f"line-{i}", f"The keeper counted {i} waves", seed=100 + i) for i in range(LINES)]
    for line in lines[::2]:  # half of them sampled with their seed, half greedy
        line["body"]["temperature"] = 0.0 if line["body"].get("temperature") is None else 0.8
    batch = wait_for(client, submit(client, jsonl(lines), endpoint), final, timeout_s=600)
    assert batch.status == "completed", batch
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (LINES, LINES, 0)
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at and batch.error_file_id is None
    output = lines_of(client, batch.output_file_id)
    assert [line["custom_id"] for line in output] == [line["custom_id"] for line in lines]

    def online(line: dict[str, Any]) -> dict[str, Any]:
        answer = httpx.post(f"{serve.base_url}{endpoint}", json=line["body"], headers=_auth(KEY_A), timeout=120)
        assert answer.status_code == 200, answer.text
        return without_ids(answer.json())

    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(online, lines))
    for answered, expected in zip(output, answers, strict=True):
        assert answered["response"]["status_code"] == 200 and answered["error"] is None
        assert without_ids(answered["response"]["body"]) == expected


def test_bad_lines_fail_the_batch_naming_each_line(serve: Served) -> None:
    client = serve.client()
    wrong_url = {**chat_line("c", "x", seed=1), "url": "/v1/completions"}
    streamed = chat_line("d", "x", seed=1)
    streamed["body"]["stream"] = True
    lines = [chat_line("a", "x", seed=1), chat_line("a", "y", seed=2), wrong_url, streamed, b'{"custom_id": ']
    batch = wait_for(client, submit(client, jsonl(lines), "/v1/chat/completions"), final)
    assert batch.status == "failed" and batch.failed_at
    errors = batch.errors.data
    assert [error.line for error in errors] == [2, 3, 4, 5]
    assert [error.code for error in errors][:2] == ["duplicate_custom_id", "invalid_url"]
    assert batch.output_file_id is None


def test_another_tenant_sees_no_file_and_no_batch(serve: Served) -> None:
    owner, other = serve.client(KEY_A), serve.client(KEY_B)
    batch_id = submit(owner, jsonl([chat_line("only", "x", seed=3)]), "/v1/chat/completions")
    file_id = owner.batches.retrieve(batch_id).input_file_id
    for call in (
        lambda: other.files.retrieve(file_id),
        lambda: other.files.content(file_id),
        lambda: other.files.delete(file_id),
        lambda: other.batches.retrieve(batch_id),
        lambda: other.batches.cancel(batch_id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert batch_id not in [batch.id for batch in other.batches.list()]
    assert batch_id in [batch.id for batch in owner.batches.list()]
    wait_for(owner, batch_id, final)


def test_cancel_mid_batch_keeps_what_finished(serve: Served) -> None:
    client = serve.client()
    lines = [chat_line(f"long-{i}", f"tell a long tale {i}", seed=i, max_tokens=200) for i in range(30)]
    batch_id = submit(client, jsonl(lines), "/v1/chat/completions")
    wait_for(client, batch_id, lambda b: b.request_counts.completed >= 2 or final(b))
    asked = time.monotonic()
    assert client.batches.cancel(batch_id).status in ("cancelling", "cancelled")
    batch = wait_for(client, batch_id, final, timeout_s=5.0)
    assert batch.status == "cancelled" and time.monotonic() - asked < 5.0 and batch.cancelled_at
    output, errors = lines_of(client, batch.output_file_id), lines_of(client, batch.error_file_id)
    assert len(output) == batch.request_counts.completed >= 2
    assert {line["error"]["code"] for line in errors} == {"batch_cancelled"}
    assert sorted(line["custom_id"] for line in output + errors) == sorted(line["custom_id"] for line in lines)


def test_a_runner_killed_mid_batch_is_replaced_and_nothing_runs_twice(
    fleet_redis_url: str, integration_dir: Path, model_settings: dict[str, str]
) -> None:
    with served(fleet_redis_url, integration_dir, model_settings, runner_thread=False) as deployment:
        client = deployment.client()
        lines = [chat_line(f"k-{i}", f"count the gulls {i}", seed=i, max_tokens=48) for i in range(16)]
        first = deployment.runner("batch-runner-1")
        try:
            batch_id = submit(client, jsonl(lines), "/v1/chat/completions")
            wait_for(client, batch_id, lambda b: b.request_counts.completed >= 3 or final(b))
            os.kill(first.popen.pid, signal.SIGKILL)
            first.popen.wait()
        finally:
            first.stop()
        killed_at = client.batches.retrieve(batch_id)
        assert killed_at.status == "in_progress" and killed_at.request_counts.completed < len(lines)
        second = deployment.runner("batch-runner-2")
        try:
            batch = wait_for(client, batch_id, final)
        finally:
            second.stop()
        assert batch.status == "completed", batch
        assert (batch.request_counts.total, batch.request_counts.completed) == (16, 16)
        output = lines_of(client, batch.output_file_id)
        assert sorted(line["custom_id"] for line in output) == sorted(line["custom_id"] for line in lines)
        _assert_each_line_generated_once(deployment, [line["response"]["request_id"] for line in output])


def _assert_each_line_generated_once(deployment: Served, request_ids: list[str]) -> None:
    """Every line's record holds each event once: no line was submitted (and generated) again."""
    client = redis.Redis.from_url(deployment.redis_url)
    try:
        for request_id in request_ids:
            raw = client.lrange(deployment.keys.run_events(request_id), 0, -1)
            assert raw, request_id
            from metrale.shared.codec import decode

            seqs = [decode(entry).seq for entry in raw]  # type: ignore[union-attr]
            assert sorted(seqs) == list(range(len(seqs))), (request_id, seqs)
    finally:
        client.close()


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
