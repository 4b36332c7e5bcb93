"""The client compatibility suite (issue #31): the agent frameworks and the evaluation harness people
build on, unchanged, driven against one real ``met serve`` on the built-in tiny model.

The model talks nonsense, so the tests assert on protocol behaviour — the request was accepted, the
call was made, the tool ran with arguments that validated, the structured output parsed, the run came
to an end — never on wording. Every schema here is bounded (enums, small integer ranges) so that a
forced call or a constrained answer always closes within the short ``max_tokens`` the tests send.

Nothing reaches the network: the clients' telemetry, tracing and price-list downloads are turned off
here, before any of them is imported, and Hugging Face libraries run offline.
"""

from __future__ import annotations

import os

# Before any client package is imported (they read these at import time).
os.environ.update(
    {
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "OPENAI_AGENTS_DISABLE_TRACING": "1",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_TELEMETRY": "False",
        "LANGSMITH_TRACING": "false",
        "LANGCHAIN_TRACING_V2": "false",
        "DO_NOT_TRACK": "1",
    }
)

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from metrale.worker.model.builtin import BUILTIN_MODEL_NAME
from tests.integration.processes import ManagedProcess, free_port, met_environment, start_met, wait_ready

API_KEY = "sk-clients"
"""The one tenant's key; every client sends it as its OpenAI API key."""


@dataclass(frozen=True)
class Server:
    """The package's running ``met serve`` and how a client reaches it."""

    base_url: str
    process: ManagedProcess
    model: str = BUILTIN_MODEL_NAME
    api_key: str = API_KEY

    @property
    def v1(self) -> str:
        """The OpenAI base URL clients take (``…/v1``)."""
        return f"{self.base_url}/v1"

    def log(self) -> str:
        return self.process.log_path.read_text(errors="replace")


@pytest.fixture(scope="package")
def anyio_backend() -> str:
    """The async scenarios run on asyncio, as the clients' users run them."""
    return "asyncio"


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One ``met serve`` (built-in model, embedded Redis, no batch runner) for the whole package,
    warmed up with one request."""
    logs = tmp_path_factory.mktemp("clients-serve")
    settings = {"MET_API_KEYS": f"{API_KEY}:clients", "MET_CACHE_DIR": str(logs / "cache")}
    port = free_port()
    process = start_met(
        "serve", ["serve", "--port", str(port), "--no-batch-runner"], met_environment(settings, torch_threads=1), logs
    )
    try:
        served = Server(f"http://127.0.0.1:{port}", process)
        wait_ready(process, served.base_url)
        warm = httpx.post(
            f"{served.v1}/completions",
            json={"model": served.model, "prompt": "def f(", "max_tokens": 2},
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=120,
        )
        assert warm.status_code == 200, warm.text
        yield served
    finally:
        process.stop()
