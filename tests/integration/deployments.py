"""Metrale deployments as real processes: ``met gateway`` + ``met worker`` on a given Redis, or
``met serve`` with its embedded Redis. Both are context managers that stop every process they
started, however the block ends."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from metrale.shared.keys import Keys
from metrale.worker.fleet.broker.redis_transport import redis_client
from metrale.worker.model.builtin import RANDOM_MODEL_NAME
from tests.integration.processes import ManagedProcess, free_port, met_environment, start_met, wait_ready

API_KEY = "sk-integration"
TENANT = "integration"
MAX_SEQS = 64
"""Sequences the test fleet's worker runs at once."""
HEARTBEAT_TTL_S = 3
"""Short, so heartbeats (sent every third of it) show a worker's slots soon after they change."""
TORCH_THREADS = 1
"""Threads each process gives torch. On a shared two-core machine, processes that each spin two
OpenMP threads slow one another down tenfold; the tests check behaviour, not speed."""


@dataclass(frozen=True)
class Endpoint:
    """A gateway to send requests to, and the model it serves."""

    base_url: str
    api_key: str = API_KEY
    model: str = RANDOM_MODEL_NAME

    @property
    def headers(self) -> dict[str, str]:
        """The authorization header of ``api_key``."""
        return {"Authorization": f"Bearer {self.api_key}"}


@dataclass(frozen=True)
class Fleet:
    """A gateway and a worker on a shared Redis (or Redis Cluster), and where their keys live."""

    endpoint: Endpoint
    redis_url: str
    keys: Keys
    worker_id: str
    worker: ManagedProcess
    gateway: ManagedProcess


@contextlib.contextmanager
def running_fleet(
    redis_url: str,
    log_dir: Path,
    *,
    settings: Mapping[str, str],
    worker_args: Sequence[str] = (),
    worker_id: str = "integration-worker",
    torch_threads: int = TORCH_THREADS,
) -> Iterator[Fleet]:
    """``met worker`` and ``met gateway`` (started together) under a fresh namespace of ``redis_url``,
    ready to serve. ``settings`` are extra ``MET_*`` variables for both; the API key is ``API_KEY``.
    The namespace's keys are deleted at the end."""
    keys = Keys.for_redis(redis_url, f"met-test-{uuid.uuid4().hex[:12]}")
    fleet_settings = {**settings, "MET_NAMESPACE": keys.namespace, "MET_API_KEYS": f"{API_KEY}:{TENANT}"}
    env = met_environment(fleet_settings, torch_threads=torch_threads)
    port = free_port()
    with contextlib.ExitStack() as stack:
        stack.callback(_delete_namespace, redis_url, keys)
        worker = start_met("worker", ["worker", "--redis", redis_url, "--name", worker_id, *worker_args], env, log_dir)
        stack.callback(worker.stop)
        gateway = start_met("gateway", ["gateway", "--redis", redis_url, "--port", str(port)], env, log_dir)
        stack.callback(gateway.stop)
        endpoint = Endpoint(f"http://127.0.0.1:{port}")
        wait_ready(gateway, endpoint.base_url, others=[worker])
        yield Fleet(endpoint, redis_url, keys, worker_id, worker, gateway)


@contextlib.contextmanager
def running_serve(
    log_dir: Path, *, settings: Mapping[str, str], torch_threads: int = TORCH_THREADS
) -> Iterator[Endpoint]:
    """``met serve`` with its own embedded Redis, ready to serve (the model from ``settings``'
    ``MET_MODEL_DIR``, else the built-in one)."""
    env = met_environment({**settings, "MET_API_KEYS": f"{API_KEY}:{TENANT}"}, torch_threads=torch_threads)
    port = free_port()
    serve = start_met("serve", ["serve", "--port", str(port)], env, log_dir)
    try:
        endpoint = Endpoint(f"http://127.0.0.1:{port}")
        wait_ready(serve, endpoint.base_url)
        yield endpoint
    finally:
        serve.stop()


@contextlib.contextmanager
def serving_model(
    log_dir: Path, model_dir: Path, *, tenant: str, options: Sequence[str] = ("--dtype", "float32")
) -> Iterator[Endpoint]:
    """``met serve --model model_dir`` (its own embedded Redis, no batch runner) with ``API_KEY`` for
    ``tenant``, ready to serve; ``options`` are more ``met serve`` arguments."""
    settings = {"MET_API_KEYS": f"{API_KEY}:{tenant}", "MET_CACHE_DIR": str(log_dir / "cache")}
    env = met_environment(settings, torch_threads=1)
    port = free_port()
    command = ["serve", "--port", str(port), "--model", str(model_dir), "--no-batch-runner", *options]
    serve = start_met(f"{tenant}-serve", command, env, log_dir)
    try:
        endpoint = Endpoint(f"http://127.0.0.1:{port}", model=model_dir.resolve().name)
        wait_ready(serve, endpoint.base_url)
        yield endpoint
    finally:
        serve.stop()


def _delete_namespace(url: str, keys: Keys) -> None:
    client = redis_client(url)
    try:
        stale = list(client.scan_iter(match=f"{keys.namespace}:*", count=1000))
        if stale:
            client.delete(*stale)
    finally:
        client.close()
