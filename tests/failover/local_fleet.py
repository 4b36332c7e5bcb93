"""A fleet of real ``met`` processes for one test: a gateway and named workers of the tiny model on
the test's own Redis (or Redis Cluster), in a key namespace of their own, with a short heartbeat TTL."""

from __future__ import annotations

import functools
import re
import signal
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import torch

from metrale.shared.keys import Keys
from metrale.shared.redis_connect import SyncClient, connect_sync
from metrale.text.detokenizer import IncrementalDetokenizer
from metrale.worker.engine.factory import LoadedModel
from metrale.worker.engine.sampling_params import SamplingParams
from tests.failover.processes import MET, Process, free_port, met_environment, ready, spawn

MODEL = "tiny"
HEARTBEAT_TTL_S = 2
DECODE_INTERVAL = 8


class LocalFleet:
    """Processes started here are stopped by ``close``; each worker runs up to ``max_seqs`` requests, with
    speculative decoding when ``speculative_config`` is given (``met worker --speculative-config``);
    ``settings`` are extra ``MET_*`` variables."""

    def __init__(
        self,
        redis_url: str,
        model_dir: Path,
        log_dir: Path,
        *,
        max_seqs: int = 48,
        speculative_config: str | None = None,
        **settings: str,
    ) -> None:
        self.redis_url, self.model_dir, self.log_dir = redis_url, model_dir, log_dir
        self.max_seqs = max_seqs
        self.speculative_config = speculative_config
        self.keys = Keys.for_redis(redis_url, f"met-failover-{uuid.uuid4().hex[:8]}")
        self.environment = met_environment(
            {
                "MET_NAMESPACE": self.keys.namespace,
                "MET_CACHE_DIR": str(log_dir / "cache"),
                "MET_HEARTBEAT_TTL_S": str(HEARTBEAT_TTL_S),
                "MET_DECODE_CHECKPOINT_INTERVAL": str(DECODE_INTERVAL),
                "MET_DRAIN_HANDOFF": "true",
                "MET_REQUEST_TIMEOUT_S": "120",
                **settings,
            }
        )
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.workers: dict[str, Process] = {}
        self.gateway: Process | None = None

    def start(self, worker_names: Sequence[str]) -> None:
        """Start the workers and the gateway; return once the gateway is ready and every worker beats."""
        for name in worker_names:
            self.workers[name] = spawn(name, self._worker_command(name), self.environment, self.log_dir)
        gateway = [str(MET), "gateway", "--redis", self.redis_url, "--port", str(self.port)]
        self.gateway = spawn("gateway", gateway, self.environment, self.log_dir)
        self.gateway.wait_until(lambda: ready(self.base_url), "the gateway to be ready")
        client = connect_sync(self.redis_url)
        for name, worker in self.workers.items():
            worker.wait_until(functools.partial(_exists, client, self.keys.worker(name)), "its heartbeat")
        client.close()

    def add_worker(self, name: str) -> None:
        """Start one more worker (after ``start``); return once it beats."""
        self.workers[name] = spawn(name, self._worker_command(name), self.environment, self.log_dir)
        client = connect_sync(self.redis_url)
        self.workers[name].wait_until(lambda: bool(client.exists(self.keys.worker(name))), "its heartbeat")
        client.close()

    def _worker_command(self, name: str) -> list[str]:
        command = [str(MET), "worker", "--redis", self.redis_url, "--model", str(self.model_dir)]
        command += ["--served-model-name", MODEL, "--name", name, "--max-seqs", str(self.max_seqs)]
        command += ["--num-blocks", "1024"]
        if self.speculative_config is not None:
            command += ["--speculative-config", self.speculative_config]
        return command

    def signal(self, name: str, signum: signal.Signals) -> None:
        """Send one worker ``signum``."""
        self.workers[name].signal(signum)

    def kill(self, name: str) -> None:
        """``kill -9`` one worker."""
        self.workers[name].signal(signal.SIGKILL)
        self.workers[name].popen.wait(10)

    def metric(self, name: str) -> float:
        """The value of one unlabelled metric on the gateway's ``/metrics``."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=5).text
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        assert match is not None, f"{name} is not exported"
        return float(match.group(1))

    def logs(self) -> str:
        return "\n".join(p.log_tail() for p in [*self.workers.values(), *([self.gateway] if self.gateway else [])])

    def close(self) -> None:
        for process in [*self.workers.values(), *([self.gateway] if self.gateway else [])]:
            process.stop()


def _exists(client: SyncClient, key: str) -> bool:
    return bool(client.exists(key))


def completion_body(index: int, prompt: list[int], *, max_tokens: int, seeded: bool) -> dict[str, Any]:
    """A sampled completion of ``prompt``; ``seeded`` ones bring a seed, the others get one drawn."""
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
    body |= {"temperature": 0.8, "ignore_eos": True}
    return body | ({"seed": 1000 + index} if seeded else {})


def reference_tokens(model: LoadedModel, bodies: Sequence[dict[str, Any]], seeds: Sequence[int]) -> list[list[int]]:
    """What each body produces alone and undisturbed with the seed it was served with (its ``top_p`` and
    ``top_k`` too: a body that leaves them out must be served by a folder without sampling defaults)."""
    params = [
        SamplingParams(
            max_tokens=b["max_tokens"],
            temperature=b["temperature"],
            top_p=b.get("top_p", 1.0),
            top_k=b.get("top_k", 0),
            seed=seed,
            ignore_eos=True,
        )
        for b, seed in zip(bodies, seeds, strict=True)
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the workers (OMP_NUM_THREADS=1): the same float reductions
    try:
        results = model.engine.generate([body["prompt"] for body in bodies], params)
    finally:
        torch.set_num_threads(threads)
    return [result.completions[0].token_ids for result in results]


def text_of(model: LoadedModel, prompt: list[int], tokens: list[int]) -> str:
    """The text a client reads for ``tokens`` after ``prompt``."""
    detokenizer = IncrementalDetokenizer(model.tokenizer, prompt)
    return detokenizer.push(tokens) + detokenizer.flush()
