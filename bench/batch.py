"""A batch through the fleet against ``met generate`` on the same lines, and what the batch does to
interactive requests' TTFT — in one run.

    python bench/batch.py [--model random|medium] [--lines 1000] [--prompt-len 32] [--max-tokens 32] [--threads 1]
                          [--window 64] [--interactive 32] [--concurrency 4] [--interactive-tokens 16]

1. offline: the batch file through ``met generate``'s code in this process (``offline_batch.py``: the
   lines checked, the engine's ``generate`` over all of them, the answers rendered), timed from the
   first step to the last answer; model loading not counted.
2. fleet, idle: a private ``redis-server``, ``met worker``, ``met gateway`` and ``met batch-runner``
   processes on the same model (the random-weight tiny one); interactive streamed completions at
   ``--concurrency`` (``metrale.cli.loadgen``), TTFT p50.
3. fleet, batch alone: the same file uploaded and run as a batch (``--window`` lines in flight), timed
   from ``POST /v1/batches`` to ``completed``; output tokens from the answers' ``usage``. Goal: at
   least 80 % of (1)'s tokens/s.
4. fleet, batch + interactive: the batch again, and once it runs, the interactive load of (2). Goal:
   TTFT p50 at most 1.5x (2)'s.

Every line is a ``/v1/completions`` body with token-id prompts, greedy, ``ignore_eos`` (so every line
makes exactly ``--max-tokens`` tokens). ``--threads`` is torch's thread count in the worker and in the
offline engine alike. CPU seconds of each process over each phase come from Linux ``/proc``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fleet import private_redis, process_cpu_s
from bench.models import bench_model
from metrale.cli.loadgen import LoadSpec, run_load
from metrale.cli.offline_batch import read_batch_file, run_batch_file, served_model
from metrale.worker.engine.factory import EngineLimits, build_engine
from metrale.worker.model.builtin import random_model_dir
from tests.integration.deployments import API_KEY, TENANT, Endpoint, running_fleet
from tests.integration.processes import ManagedProcess, met_environment, start_met

QUIET = {"MET_LOG_LEVEL": "WARNING"}
THROUGHPUT_GOAL = 0.8
TTFT_GOAL = 1.5


@dataclass(frozen=True)
class Row:
    """One line of the table."""

    setup: str
    tokens_per_s: float | None = None
    ttft_p50_ms: float | None = None
    seconds: float | None = None
    cpu: str = ""


def batch_file(path: Path, model: str, lines: int, prompt_len: int, max_tokens: int) -> Path:
    rng = random.Random(14)
    with path.open("w") as out:
        for i in range(lines):
            prompt = [rng.randrange(20, 500) for _ in range(prompt_len)]
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
            body["ignore_eos"] = True
            line = {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions", "body": body}
            out.write(json.dumps(line) + "\n")
    return path


def offline(directory: Path, path: Path, max_seqs: int) -> Row:
    """``met generate --input`` on the file, in this process."""
    loaded = build_engine(directory, EngineLimits(max_seqs=max_seqs))
    lines = read_batch_file(path, served_model(loaded, directory.name))
    list(run_batch_file(loaded, lines[:8], seed=0))  # warm-up
    cpu, start = time.process_time(), time.perf_counter()
    answers = [json.loads(answer) for answer in run_batch_file(loaded, lines, seed=0)]
    seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(answer["response"]["body"]["usage"]["completion_tokens"] for answer in answers)
    return Row("offline: met generate --input", tokens / seconds, None, seconds, f"this process {cpu_s:.1f}")


@dataclass
class Deployment:
    endpoint: Endpoint
    processes: dict[str, ManagedProcess]

    def cpu(self) -> dict[str, float]:
        return {name: process_cpu_s(process.popen.pid) for name, process in self.processes.items()}


@contextmanager
def deployment(
    directory: Path, work: Path, threads: int, window: int, max_seqs: int, extra: tuple[str, ...] = ()
) -> Iterator[Deployment]:
    """A private redis-server, ``met worker`` (with ``extra`` arguments), ``met gateway`` and ``met batch-runner``."""
    settings = {"MET_MODEL_DIR": str(directory), "MET_FILES_DIR": str(work / "files"), **QUIET}
    settings |= {"MET_BATCH_WINDOW": str(window), "MET_CACHE_DIR": str(work / "cache")}
    worker_args = ["--max-seqs", str(max_seqs), *extra]
    with ExitStack() as stack:
        redis = stack.enter_context(private_redis())
        fleet = stack.enter_context(
            running_fleet(redis.url, work, settings=settings, worker_args=worker_args, torch_threads=threads)
        )
        env = met_environment(
            {**settings, "MET_NAMESPACE": fleet.keys.namespace, "MET_API_KEYS": f"{API_KEY}:{TENANT}"},
            torch_threads=threads,
        )
        runner = start_met("batch-runner", ["batch-runner", "--redis", redis.url], env, work)
        stack.callback(runner.stop)
        yield Deployment(fleet.endpoint, {"worker": fleet.worker, "gateway": fleet.gateway, "runner": runner})


def interactive(endpoint: Endpoint, spec: LoadSpec) -> dict[str, Any]:
    return asyncio.run(run_load(endpoint.base_url, spec, endpoint.headers))


def submit(http: httpx.Client, path: Path) -> str:
    uploaded = http.post("/v1/files", files={"file": (path.name, path.read_bytes())}, data={"purpose": "batch"})
    uploaded.raise_for_status()
    body = {"input_file_id": uploaded.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
    created = http.post("/v1/batches", json=body)
    created.raise_for_status()
    return str(created.json()["id"])


def wait(http: httpx.Client, batch_id: str, until: Any) -> dict[str, Any]:
    while not until(batch := http.get(f"/v1/batches/{batch_id}").json()):
        time.sleep(0.05)
    return batch  # type: ignore[no-any-return]


def finished(batch: dict[str, Any]) -> bool:
    return batch["status"] in ("completed", "failed", "cancelled", "expired")


def output_tokens(http: httpx.Client, batch: dict[str, Any]) -> int:
    assert batch["status"] == "completed" and batch["request_counts"]["failed"] == 0, batch
    text = http.get(f"/v1/files/{batch['output_file_id']}/content").text
    return sum(json.loads(line)["response"]["body"]["usage"]["completion_tokens"] for line in text.splitlines())


def run_batch(http: httpx.Client, path: Path) -> tuple[float, int]:
    start = time.perf_counter()
    batch = wait(http, submit(http, path), finished)
    return time.perf_counter() - start, output_tokens(http, batch)


def cpu_text(before: dict[str, float], after: dict[str, float]) -> str:
    return ", ".join(f"{name} {after[name] - before[name]:.1f}" for name in before)


def fleet_rows(fleet: Deployment, path: Path, spec: LoadSpec) -> list[Row]:
    """Idle TTFT, the batch alone, then the batch with the interactive load."""
    warm = LoadSpec(model=spec.model, num_prompts=4, input_len=spec.input_len, output_len=4, concurrency=4, seed=9)
    interactive(fleet.endpoint, warm)
    rows = []
    before = fleet.cpu()
    idle = interactive(fleet.endpoint, spec)
    rows.append(
        Row(
            "fleet idle: interactive",
            None,
            idle["ttft"]["median_ms"],
            idle["duration_s"],
            cpu_text(before, fleet.cpu()),
        )
    )
    with httpx.Client(base_url=fleet.endpoint.base_url, headers=fleet.endpoint.headers, timeout=120) as http:
        before = fleet.cpu()
        seconds, tokens = run_batch(http, path)
        rows.append(Row("fleet: batch alone", tokens / seconds, None, seconds, cpu_text(before, fleet.cpu())))
        start = time.perf_counter()
        batch_id = submit(http, path)
        wait(http, batch_id, lambda b: b["request_counts"]["completed"] >= 64 or finished(b))
        before = fleet.cpu()
        busy = interactive(fleet.endpoint, spec)
        during = cpu_text(before, fleet.cpu())
        still = http.get(f"/v1/batches/{batch_id}").json()
        assert still["status"] == "in_progress", f"the batch ended before the interactive load did: {still}"
        batch = wait(http, batch_id, finished)
        seconds = time.perf_counter() - start
        rows.append(
            Row("fleet: interactive during the batch", None, busy["ttft"]["median_ms"], busy["duration_s"], during)
        )
        rows.append(Row("fleet: batch with interactive load", output_tokens(http, batch) / seconds, None, seconds))
    assert not idle["failed"] and not busy["failed"], (idle["errors"], busy["errors"])
    return rows


def table(rows: list[Row]) -> Table:
    result = Table(title="a batch through the fleet vs met generate; interactive TTFT with and without it")
    for column in ("setup", "output tok/s", "TTFT p50 (ms)", "seconds", "CPU s"):
        result.add_column(column, justify="left" if column in ("setup", "CPU s") else "right")
    for row in rows:
        result.add_row(
            row.setup,
            _cell(row.tokens_per_s, "{:,.0f}"),
            _cell(row.ttft_p50_ms, "{:.1f}"),
            _cell(row.seconds, "{:.1f}"),
            row.cpu,
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument(
        "--model", choices=["random", "medium"], default="random",
        help="random: the random-weight tiny model; medium: bench/models.py's medium shape (random weights)",
    )  # fmt: skip
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, worker and offline engine")
    parser.add_argument("--window", type=int, default=64, help="MET_BATCH_WINDOW")
    parser.add_argument("--max-seqs", type=int, default=64, help="worker and offline engine")
    parser.add_argument("--interactive", type=int, default=32, help="interactive requests per measurement")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--interactive-tokens", type=int, default=16)
    parser.add_argument("--worker-arg", action="append", default=[], help="extra met worker argument (repeatable)")
    args = parser.parse_args()
    console = Console(width=150)
    work = Path(tempfile.mkdtemp(prefix="metrale-bench-batch-"))
    models = {"random": lambda: random_model_dir(work / "cache"), "medium": lambda: bench_model("medium", work)}
    directory = models[args.model]()
    path = batch_file(work / "batch.jsonl", directory.name, args.lines, args.prompt_len, args.max_tokens)
    torch.set_num_threads(args.threads)
    spec = LoadSpec(
        model=directory.name,
        num_prompts=args.interactive,
        input_len=args.prompt_len,
        output_len=args.interactive_tokens,
        concurrency=args.concurrency,
    )
    console.print(
        f"model={directory.name} lines={args.lines} prompt={args.prompt_len} max_tokens={args.max_tokens} "
        f"threads={args.threads} window={args.window} max_seqs={args.max_seqs} interactive={args.interactive}"
        f"x{args.interactive_tokens} at concurrency {args.concurrency} worker args={args.worker_arg} logs={work}"
    )
    rows = [offline(directory, path, args.max_seqs)]
    with deployment(directory, work, args.threads, args.window, args.max_seqs, tuple(args.worker_arg)) as fleet:
        rows += fleet_rows(fleet, path, spec)
    console.print(table(rows))
    throughput = (rows[2].tokens_per_s or 0.0) / (rows[0].tokens_per_s or 1.0)
    ttft = (rows[3].ttft_p50_ms or 0.0) / (rows[1].ttft_p50_ms or 1.0)
    console.print(
        f"batch alone / offline: {throughput:.0%} (goal >= {THROUGHPUT_GOAL:.0%}: "
        f"{'met' if throughput >= THROUGHPUT_GOAL else 'missed'})"
    )
    console.print(
        f"interactive TTFT p50 during / idle: {ttft:.2f}x (goal <= {TTFT_GOAL}x: "
        f"{'met' if ttft <= TTFT_GOAL else 'missed'})"
    )


def _cell(value: float | None, form: str) -> str:
    return "" if value is None else form.format(value)


if __name__ == "__main__":
    main()
