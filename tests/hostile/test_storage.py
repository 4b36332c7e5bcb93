"""What a tenant can make the server keep: metadata within OpenAI's limits, files within a quota, and
batches that end whatever happens to their input."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from tests.hostile.conftest import ALPHA, BETA, TENANT_FILE_BYTES, Server, error_of
from tests.hostile.health_watch import watching_health

pytestmark = [pytest.mark.slow]

BATCH_END_S = 30.0
FINAL = {"completed", "failed", "cancelled", "expired"}


def _response_body(server: Server, metadata: dict[str, str]) -> dict[str, Any]:
    return {"model": server.model, "input": "def f(", "max_output_tokens": 4, "metadata": metadata}


@pytest.mark.parametrize(
    "metadata",
    [
        {f"k{i}": "v" for i in range(17)},
        {"k" * 1000: "v"},
        {"k": "v" * 1_000_000},
    ],
    ids=["17-keys", "1000-char-key", "1-MB-value"],
)
def test_responses_metadata_beyond_openais_limits(server: Server, metadata: dict[str, str]) -> None:
    with watching_health(server.base_url) as health:
        response = server.post("/v1/responses", _response_body(server, metadata))
    assert response.status_code == 400, response.text[:300]
    assert "metadata" in error_of(response)["message"]
    health[0].assert_responsive()


def _upload(client: httpx.Client, lines: list[dict[str, Any]]) -> str:
    payload = "\n".join(json.dumps(line) for line in lines).encode()
    response = client.post("/v1/files", files={"file": ("in.jsonl", payload)}, data={"purpose": "batch"})
    assert response.status_code == 200, response.text
    return str(response.json()["id"])


def _line(server: Server, index: int, **extra: Any) -> dict[str, Any]:
    body = {"model": server.model, "messages": [{"role": "user", "content": "def f("}], "max_tokens": 4, **extra}
    return {"custom_id": f"q{index}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def _create_batch(client: httpx.Client, file_id: str, **extra: Any) -> httpx.Response:
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **extra}
    return client.post("/v1/batches", json=body)


def _final(client: httpx.Client, batch_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + BATCH_END_S
    while (batch := client.get(f"/v1/batches/{batch_id}").json())["status"] not in FINAL:
        assert time.monotonic() < deadline, f"batch still {batch['status']} after {BATCH_END_S:.0f} s"
        time.sleep(0.2)
    return dict(batch)


def test_batch_metadata_of_seven_megabytes(server: Server) -> None:
    with watching_health(server.base_url) as health, server.client(ALPHA) as client:
        file_id = _upload(client, [_line(server, 0)])
        response = _create_batch(client, file_id, metadata={"note": "x" * 7_000_000})
    assert response.status_code in (400, 413), response.text[:300]
    health[0].assert_responsive()


def test_a_batch_whose_input_is_deleted_at_once_ends(server: Server) -> None:
    with watching_health(server.base_url) as health, server.client(ALPHA) as client:
        file_id = _upload(client, [_line(server, i) for i in range(20)])
        batch = _create_batch(client, file_id).json()
        deleted = client.delete(f"/v1/files/{file_id}")
        assert deleted.status_code in (200, 409), deleted.text
        if deleted.status_code == 200:
            assert _final(client, batch["id"])["status"] == "failed"
        cancelled = client.post(f"/v1/batches/{batch['id']}/cancel")
        assert cancelled.status_code in (200, 400), cancelled.text
        assert _final(client, batch["id"])["status"] in {"cancelled", "completed", "failed"}
    health[0].assert_responsive()


def test_a_batch_line_asking_for_interactive_priority_is_an_error(server: Server) -> None:
    """As any invalid line: the input fails validation, naming the line and the field (OpenAI's way)."""
    with server.client(ALPHA) as client:
        file_id = _upload(client, [_line(server, 0), _line(server, 1, priority="interactive")])
        batch = _final(client, _create_batch(client, file_id).json()["id"])
    assert batch["status"] == "failed", batch
    errors = batch["errors"]["data"]
    assert any(error["line"] == 2 and "priority" in error["message"] for error in errors), errors


def test_a_tenant_uploading_past_its_file_quota(server: Server) -> None:
    """Megabyte files until the quota refuses one; the other tenants' quota is their own."""
    megabyte = ("x" * 1023 + "\n").encode() * 1024
    with watching_health(server.base_url) as health, server.client(BETA) as client:
        statuses = []
        for index in range(TENANT_FILE_BYTES // len(megabyte) + 1):
            upload = client.post("/v1/files", files={"file": (f"f{index}.txt", megabyte)}, data={"purpose": "batch"})
            statuses.append(upload.status_code)
    assert statuses[:-1] == [200] * (len(statuses) - 1), statuses
    assert statuses[-1] == 400, upload.text
    assert "MET_TENANT_MAX_FILE_BYTES" in error_of(upload)["message"]
    health[0].assert_responsive()
    with server.client(ALPHA) as client:
        assert _upload(client, [_line(server, 0)])
