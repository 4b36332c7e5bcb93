"""The fleet against the in-process engine on one workload, and the gateway's relay rate, in one table.

    python bench/fleet.py [--prompts 96] [--input-len 128] [--output-len 64] [--concurrency 32]
                          [--threads 1] [--relay-streams 64] [--relay-tokens 256] [--tokens-per-event 1 8]

1. engine: the load's prompts through an ``Engine`` in this process, closed loop at ``--concurrency``
   (a prompt starts when one finishes), greedy, every output ``--output-len`` tokens. TTFT is from
   ``add_request`` to the step that produced the request's first token.
2. fleet: a private ``redis-server``, ``met worker`` and ``met gateway`` processes on the same model
   (the built-in tiny one), driven by ``metrale.cli.loadgen.run_load`` over HTTP with the same prompts
   and output lengths. The difference of the TTFT medians is what the fleet adds.
3. relay: ``met gateway`` in front of ``bench/relay_worker.py``, which answers from pre-made tokens
   without a model, as fast as the gateway takes them: the tokens per second delivered to
   ``--relay-streams`` concurrent streamed clients (goal: at least 20k), once per ``--tokens-per-event``.

Everything shares this machine: the load generator, Redis and the gateway compete with the worker.
``--threads`` is torch's thread count in the worker and in the in-process engine alike. The CPU time
the gateway process spends per delivered token (Linux ``/proc``) is shown too: on a shared machine it
varies far less from run to run than the rates do.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from metrale.cli.embedded_redis import EmbeddedRedis, start_embedded_redis
from metrale.cli.loadgen import LoadSpec, make_prompts, run_load
from metrale.worker.engine.engine import Engine
from metrale.worker.engine.factory import EngineLimits, build_engine
from metrale.worker.engine.request import Request
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.model.builtin import RANDOM_MODEL_NAME, random_model_dir
from tests.integration.deployments import running_fleet
from tests.integration.processes import (
    ManagedProcess,
    free_port,
    met_environment,
    start_met,
    start_process,
    wait_ready,
)

RELAY_WORKER = Path(__file__).resolve().with_name("relay_worker.py")
RELAY_MODEL = "relay-model"
RELAY_GOAL_TOKENS_PER_S = 20_000
QUIET = {"MET_LOG_LEVEL": "WARNING"}
"""No access log line per request: the gateway's time goes to relaying."""


@dataclass(frozen=True)
class Measured:
    """One row of the table."""

    setup: str
    concurrency: int
    tokens_per_s: float
    ttft_p50_ms: float | None = None
    tpot_p50_ms: float | None = None
    failed: int = 0
    gateway_cpu_us_per_token: float | None = None


def engine_run(directory: Path, spec: LoadSpec) -> Measured:
    """The load's prompts through an in-process engine sized like the worker, closed loop."""
    engine = build_engine(directory, EngineLimits()).engine
    warm_up = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.generate(make_prompts(dataclasses.replace(spec, num_prompts=4)), warm_up)
    params = SamplingParams(max_tokens=spec.output_len, temperature=0.0, ignore_eos=True)
    return closed_loop(engine, make_prompts(spec), params, spec.concurrency)


def closed_loop(engine: Engine, prompts: Sequence[Sequence[int]], params: SamplingParams, concurrency: int) -> Measured:
    """Keep ``concurrency`` prompts running (the next starts when one finishes) until all are done."""
    queue = deque(enumerate(prompts))
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}

    def submit() -> None:
        index, prompt = queue.popleft()
        request_id = f"bench-{index}"
        sent[request_id] = time.perf_counter()
        engine.add_request(Request(request_id, tuple(prompt), params))

    start = time.perf_counter()
    for _ in range(min(concurrency, len(queue))):
        submit()
    produced = 0
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            produced += len(output.token_ids)
            if output.token_ids:
                first.setdefault(output.request_id, now)
            if output.finished:
                done[output.request_id] = now
                if queue:
                    submit()
    wall = time.perf_counter() - start
    ttft = [first[r] - sent[r] for r in sent]
    tpot = [(done[r] - first[r]) / (params.max_tokens - 1) for r in sent] if params.max_tokens > 1 else [0.0]
    return Measured("engine, in-process", concurrency, produced / wall, _ms(ttft), _ms(tpot))


def fleet_run(model_dir: Path, spec: LoadSpec, threads: int, log_dir: Path) -> Measured:
    """The load through ``met gateway`` + ``met worker`` on a private redis-server."""
    settings = {"MET_MODEL_DIR": str(model_dir), **QUIET}
    with (
        private_redis() as redis,
        running_fleet(redis.url, log_dir, settings=settings, worker_id="bench-worker", torch_threads=threads) as fleet,
    ):
        report, gateway_cpu_s = load(fleet.endpoint.base_url, spec, fleet.endpoint.headers, fleet.gateway)
    return _from_report(f"fleet: gateway + worker + {redis.kind}", spec, report, gateway_cpu_s)


def relay_run(streams: int, tokens: int, tokens_per_event: int, log_dir: Path) -> Measured:
    """Streams of ``tokens`` pre-made tokens each, through one gateway, ``streams`` at a time."""
    spec = LoadSpec(model=RELAY_MODEL, num_prompts=2 * streams, input_len=16, output_len=tokens, concurrency=streams)
    with private_redis() as redis, ExitStack() as running:
        env = met_environment({"MET_NAMESPACE": f"bench-{uuid.uuid4().hex[:8]}", **QUIET}, torch_threads=1)
        worker_command = [sys.executable, str(RELAY_WORKER), "--redis", redis.url, "--model", RELAY_MODEL]
        worker_command += ["--namespace", env["MET_NAMESPACE"], "--tokens-per-event", str(tokens_per_event)]
        worker = start_process("relay-worker", worker_command, env, log_dir)
        running.callback(worker.stop)
        port = free_port()
        gateway = start_met("relay-gateway", ["gateway", "--redis", redis.url, "--port", str(port)], env, log_dir)
        running.callback(gateway.stop)
        wait_ready(gateway, f"http://127.0.0.1:{port}", others=[worker])
        report, gateway_cpu_s = load(f"http://127.0.0.1:{port}", spec, {}, gateway)
    return _from_report(f"relay: gateway + fake worker, {tokens_per_event} tok/event", spec, report, gateway_cpu_s)


def load(
    base_url: str, spec: LoadSpec, headers: dict[str, str], gateway: ManagedProcess
) -> tuple[dict[str, Any], float]:
    """``run_load`` after a short warm-up (first requests build the gateway's tokenizer, etc.), and the
    CPU seconds ``gateway`` spent on the measured part."""
    warm_up = dataclasses.replace(spec, num_prompts=4, concurrency=4, output_len=8, seed=spec.seed + 1)
    asyncio.run(run_load(base_url, warm_up, headers))
    cpu_before = process_cpu_s(gateway.popen.pid)
    report = asyncio.run(run_load(base_url, spec, headers))
    return report, process_cpu_s(gateway.popen.pid) - cpu_before


def process_cpu_s(pid: int) -> float:
    """User plus system CPU seconds process ``pid`` has used so far (Linux ``/proc/{pid}/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5), counted from the state
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


@contextmanager
def private_redis() -> Iterator[EmbeddedRedis]:
    redis = start_embedded_redis()
    try:
        yield redis
    finally:
        redis.close()


def table(engine: Measured, fleet: Measured, relays: Sequence[Measured]) -> Table:
    result = Table(title="fleet vs in-process engine, and the gateway's relay rate")
    columns = ("setup", "concurrency", "output tok/s", "TTFT p50 (ms)", "TPOT p50 (ms)", "failed", "gateway CPU µs/tok")
    for column in columns:
        result.add_column(column, justify="left" if column == "setup" else "right")
    for row in (engine, fleet, *relays):
        result.add_row(
            row.setup,
            str(row.concurrency),
            f"{row.tokens_per_s:,.0f}",
            _cell(row.ttft_p50_ms),
            _cell(row.tpot_p50_ms),
            str(row.failed),
            _cell(row.gateway_cpu_us_per_token),
        )
    added = (fleet.ttft_p50_ms or 0.0) - (engine.ttft_p50_ms or 0.0)
    ratio = fleet.tokens_per_s / engine.tokens_per_s
    result.add_row("fleet / engine; added TTFT", "", f"{ratio:.0%}", f"{added:+.1f}", "", "", "")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, worker and in-process engine")
    parser.add_argument("--relay-streams", type=int, default=64)
    parser.add_argument("--relay-tokens", type=int, default=256)
    parser.add_argument("--tokens-per-event", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    console = Console(width=140)
    spec = LoadSpec(
        model=RANDOM_MODEL_NAME,
        num_prompts=args.prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        concurrency=args.concurrency,
    )
    work = Path(tempfile.mkdtemp(prefix="metrale-bench-fleet-"))
    directory = random_model_dir(work / "cache")
    torch.set_num_threads(args.threads)
    console.print(
        f"model={RANDOM_MODEL_NAME} prompts={args.prompts}x{args.input_len} output={args.output_len} "
        f"concurrency={args.concurrency} threads={args.threads} logs={work}"
    )
    engine = engine_run(directory, spec)
    fleet = fleet_run(directory, spec, args.threads, work)
    relays = [relay_run(args.relay_streams, args.relay_tokens, k, work) for k in args.tokens_per_event]
    console.print(table(engine, fleet, relays))
    best = max(relay.tokens_per_s for relay in relays)
    verdict = "meets" if best >= RELAY_GOAL_TOKENS_PER_S else "misses"
    console.print(f"relay: best {best:,.0f} tokens/s {verdict} the goal of {RELAY_GOAL_TOKENS_PER_S:,}")


def _from_report(setup: str, spec: LoadSpec, report: dict[str, Any], gateway_cpu_s: float) -> Measured:
    output_tokens = report["output_token_throughput"] * report["duration_s"]
    return Measured(
        setup,
        spec.concurrency,
        report["output_token_throughput"],
        report["ttft"]["median_ms"],
        report["tpot"]["median_ms"],
        report["failed"],
        1e6 * gateway_cpu_s / output_tokens if output_tokens else None,
    )


def _ms(seconds: Sequence[float]) -> float:
    return 1000 * statistics.median(seconds)


def _cell(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


if __name__ == "__main__":
    main()
