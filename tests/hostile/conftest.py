"""The hostile suite: a real ``met serve`` (gateway, worker and embedded Redis in one process, the
built-in model) with three tenants, attacked the way a hostile client or a careless load test would.

Every case runs under ``watching_health``: whatever the request does, it is refused or served, and the
gateway's ``/health`` keeps answering (p99 < 50 ms, max < 250 ms) while it happens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from metrale.worker.model.builtin import BUILTIN_MODEL_NAME
from tests.integration.processes import ManagedProcess, free_port, met_environment, start_met, wait_ready

ALPHA = "sk-alpha"
BETA = "sk-beta"
"""A rate-limited tenant: one request in flight at once."""
GAMMA = "sk-gamma"
API_KEYS = f"{ALPHA}:alpha,{BETA}:beta:1:100000,{GAMMA}:gamma"
TENANT_FILE_BYTES = 3_000_000
"""Each tenant's file quota on the package's server (``MET_TENANT_MAX_FILE_BYTES``)."""


@dataclass(frozen=True)
class Server:
    """A running ``met serve`` and what its tests send it."""

    base_url: str
    process: ManagedProcess
    model: str = BUILTIN_MODEL_NAME

    def client(self, key: str = ALPHA, timeout_s: float = 60) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=timeout_s)

    def post(self, path: str, body: Mapping[str, Any], key: str = ALPHA, timeout_s: float = 60) -> httpx.Response:
        with self.client(key, timeout_s) as client:
            return client.post(path, json=dict(body))

    def log(self) -> str:
        return self.process.log_path.read_text(errors="replace")


@contextlib.contextmanager
def hostile_serve(log_dir: Path, settings: Mapping[str, str] | None = None) -> Iterator[Server]:
    """``met serve`` with the three tenants' keys and ``settings``, ready; stopped at the end."""
    environment = met_environment({"MET_API_KEYS": API_KEYS, **(settings or {})}, torch_threads=1)
    port = free_port()
    process = start_met("serve", ["serve", "--port", str(port)], environment, log_dir)
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_ready(process, base_url)
        yield Server(base_url, process)
    finally:
        process.stop()


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The package's shared ``met serve`` (default limits), warmed up with one request."""
    settings = {"MET_TENANT_MAX_FILE_BYTES": str(TENANT_FILE_BYTES)}
    with hostile_serve(tmp_path_factory.mktemp("hostile"), settings) as served:
        warm = served.post("/v1/completions", {"model": served.model, "prompt": "def f(", "max_tokens": 4})
        assert warm.status_code == 200, warm.text
        yield served


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The OpenAI error object of a refusal."""
    error = response.json()["error"]
    assert isinstance(error, dict)
    return error
