"""The README's ACL line is enough: ``met serve`` (gateway, worker, batch runner) and ``met top`` run as
that Redis user — a streamed completion, a batch through RQ, the live view — and Redis denies nothing."""

from __future__ import annotations

import io
import json
import re
import secrets
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import redis

from metrale.shared.keys import Keys
from metrale.worker.model.builtin import RANDOM_MODEL_NAME
from tests.failover.processes import RedisServer
from tests.integration.processes import MET, free_port, met_environment, start_met, wait_ready

pytestmark = [pytest.mark.slow]

README = Path(__file__).resolve().parents[2] / "README.md"
API_KEY = "sk-acl"


@dataclass
class Served:
    base_url: str
    redis_url: str
    admin: redis.Redis


def readme_acl_line() -> str:
    (line,) = re.findall(r"^ACL SETUSER met .*$", README.read_text(), re.MULTILINE)
    return line


@pytest.fixture
def served_as_acl_user(tmp_path: Path, model_settings: dict[str, str]) -> Iterator[Served]:
    server = RedisServer(tmp_path)
    server.start()
    admin = redis.Redis.from_url(server.url, decode_responses=True)
    password = secrets.token_hex(8)
    admin.execute_command(*readme_acl_line().replace("CHANGE-ME", password).split())
    url = f"redis://met:{password}@127.0.0.1:{server.port}/0"
    settings = {**model_settings, "MET_API_KEYS": API_KEY, "MET_FILES_DIR": str(tmp_path / "files")}
    env = met_environment(settings | {"MET_BATCH_LEASE_S": "2"}, torch_threads=1)
    port = free_port()
    serve = start_met("serve-acl", ["serve", "--redis", url, "--port", str(port), "--max-seqs", "8"], env, tmp_path)
    try:
        wait_ready(serve, f"http://127.0.0.1:{port}")
        yield Served(f"http://127.0.0.1:{port}", url, admin)
    finally:
        serve.stop()
        admin.close()
        server.stop()


def test_the_fleet_runs_as_the_readme_acl_user(served_as_acl_user: Served) -> None:
    served = served_as_acl_user
    body = {"model": RANDOM_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream(
        "POST", f"{served.base_url}/v1/chat/completions", json=body | {"stream": True}, headers=headers
    ) as r:
        assert r.status_code == 200
        assert "data: [DONE]" in r.read().decode()

    client = openai.OpenAI(base_url=f"{served.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    lines = [{"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions", "body": body} for i in range(2)]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 180
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    assert batch.status == "completed" and batch.request_counts.completed == 2, batch

    top = subprocess.run([str(MET), "top", "--once", "--redis", served.redis_url], capture_output=True, text=True)
    assert top.returncode == 0, top.stderr
    assert served.redis_url.split("@")[0].split(":")[-1] not in top.stdout  # no password on screen

    denied = served.admin.execute_command("ACL", "LOG")
    assert not denied, denied
    mark = Keys().replication_mark()  # what MET_REDIS_WAIT_REPLICAS adds: an INCR of the mark, then WAIT
    for command in (["WAIT", "1", "100"], ["INCR", mark]):
        assert served.admin.execute_command("ACL", "DRYRUN", "met", *command) == "OK", command
    with redis.Redis.from_url(served.redis_url) as restricted:  # and the user is held to its keys and commands
        for forbidden in (lambda: restricted.get("other:key"), restricted.flushdb, lambda: restricted.keys("met:*")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                forbidden()
