"""CPU per delivered token of every fleet process at 64 streams, and the fleet's rate ÷ the engine's at 1.

    python bench/fleet_cpu.py [--model tiny|medium] [--streams 64] [--prompts 128] [--input-len 128]
                              [--output-len 128] [--threads 1] [--single-prompts 16] [--profile DIR] [--pin]

CPU time is read from Linux ``/proc`` (user + system, all threads) before and after each measured load,
so it holds on a shared, noisy machine where rates do not. Four measurements, one after the other:

1. engine: the load's prompts through an in-process ``Engine`` sized like the worker, closed loop at
   ``--streams``; its CPU per generated token is the model's own cost.
2. fleet: a private ``redis-server``, ``met worker`` and ``met gateway`` on the same model, driven by
   ``metrale.cli.loadgen`` (in this process) at ``--streams``: CPU µs per delivered token of the worker,
   the gateway, Redis and the load generator. The worker's transport and bookkeeping is its CPU per
   token less the engine's (1.).
3. relay: the same gateway path in front of ``bench/relay_worker.py`` (the real ``RedisTransport``, one
   token per event, no model), so that worker's CPU is transport only — measured directly.
4. concurrency 1: ``--single-prompts`` prompts one at a time through the engine and through the fleet
   (the same processes as 2.); the goal is fleet ÷ engine ≥ 0.9.

``--profile DIR`` samples the worker and the gateway with py-spy (``pip install py-spy``; not a project
dependency) during 2. and 3. and writes collapsed stacks there: only the thread holding the GIL, so
Python work, not threads blocked in a socket read; torch releases the GIL, so model work is missing
(``FLEET_CPU_PROFILE_GIL=0``: every thread that is not idle, torch's work included).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fleet import QUIET, RELAY_MODEL, RELAY_WORKER, closed_loop, private_redis, process_cpu_s
from bench.models import bench_model
from metrale.cli.loadgen import LoadSpec, make_prompts, run_load
from metrale.worker.engine.factory import EngineLimits, build_engine
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.model.builtin import RANDOM_MODEL_NAME, random_model_dir
from tests.integration.deployments import running_fleet
from tests.integration.processes import ManagedProcess, free_port, met_environment, start_met, start_process, wait_ready

GOALS = {"worker transport": 20.0, "gateway": 25.0}
"""µs of CPU per delivered token at 64 streams (issue #19)."""
SINGLE_STREAM_GOAL = 0.9


@dataclass(frozen=True)
class Measured:
    """One load: its rate and each process's CPU µs per delivered token."""

    setup: str
    concurrency: int
    tokens: int
    tokens_per_s: float
    cpu_us_per_token: dict[str, float]
    ttft_p50_ms: float | None = None
    tpot_p50_ms: float | None = None


def engine_measure(directory: Path, spec: LoadSpec) -> Measured:
    """The load through an in-process engine sized like the worker; CPU of this process."""
    engine = build_engine(directory, EngineLimits()).engine
    engine.generate(make_prompts(dataclasses.replace(spec, num_prompts=4)), SamplingParams(max_tokens=8))
    params = SamplingParams(max_tokens=spec.output_len, temperature=0.0, ignore_eos=True)
    cpu = time.process_time()
    run = closed_loop(engine, make_prompts(spec), params, spec.concurrency)
    tokens = spec.num_prompts * spec.output_len
    return Measured(
        "engine, in-process",
        spec.concurrency,
        tokens,
        run.tokens_per_s,
        {"engine": 1e6 * (time.process_time() - cpu) / tokens},
        run.ttft_p50_ms,
        run.tpot_p50_ms,
    )


def load_measure(setup: str, base_url: str, spec: LoadSpec, headers: dict[str, str], pids: dict[str, int]) -> Measured:
    """``run_load`` after a short warm-up; CPU µs per delivered token of each of ``pids`` and of this
    process (the load generator)."""
    # At the load's concurrency, so the gateway's Redis connection pool has grown to it before measuring.
    warm_up = dataclasses.replace(spec, num_prompts=spec.concurrency, output_len=8, seed=spec.seed + 1)
    asyncio.run(run_load(base_url, warm_up, headers))
    before = {name: process_cpu_s(pid) for name, pid in pids.items()}
    client = time.process_time()
    report = asyncio.run(run_load(base_url, spec, headers))
    used = {name: process_cpu_s(pid) - before[name] for name, pid in pids.items()}
    used["load generator"] = time.process_time() - client
    if report["failed"]:
        raise RuntimeError(f"{setup}: {report['failed']} requests failed")
    tokens = round(report["output_token_throughput"] * report["duration_s"])
    per_token = {name: 1e6 * seconds / tokens for name, seconds in used.items()}
    ttft, tpot = report["ttft"]["median_ms"], report["tpot"]["median_ms"]
    return Measured(setup, spec.concurrency, tokens, report["output_token_throughput"], per_token, ttft, tpot)


def redis_pid(url: str) -> int:
    return int(redis.Redis.from_url(url).info("server")["process_id"])


@contextmanager
def profiled(directory: Path | None, label: str, pids: dict[str, int]) -> Iterator[None]:
    """py-spy samples each of ``pids`` while the block runs (nothing when ``directory`` is None)."""
    if directory is None:
        yield
        return
    directory.mkdir(parents=True, exist_ok=True)
    spies = [
        subprocess.Popen(
            [
                shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy")),
                "record",
                *(["--gil"] if os.environ.get("FLEET_CPU_PROFILE_GIL", "1") == "1" else []),
                "-p",
                str(pid),
                "-r",
                "200",
                "-f",
                "raw",
                "-o",
                str(directory / f"{label}-{name}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name, pid in pids.items()
    ]
    try:
        yield
    finally:
        for spy in spies:
            spy.send_signal(signal.SIGINT)
        for spy in spies:
            spy.wait(30)


def profile_summary(path: Path, top: int = 10) -> list[str]:
    """The frames of a py-spy collapsed-stack file that hold the most samples: by their own time (the
    innermost frame), then ``metrale`` frames by inclusive time; as ``percent frame`` lines."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        samples = int(count)
        total += samples
        own[frames[-1]] += samples
        for frame in set(frames):
            if "metrale/" in frame:
                inclusive[frame] += samples
    lines = [f"{100 * n / total:5.1f}% own  {frame}" for frame, n in own.most_common(top)]
    return lines + [f"{100 * n / total:5.1f}% incl {frame}" for frame, n in inclusive.most_common(top)]


def fleet_measure(
    model_dir: Path,
    spec: LoadSpec,
    single: LoadSpec,
    threads: int,
    work: Path,
    profile: Path | None,
    worker_args: list[str],
) -> tuple[Measured, Measured]:
    """The load, then the one-at-a-time load, through gateway + worker on a private redis-server."""
    settings = {"MET_MODEL_DIR": str(model_dir), **QUIET}
    with (
        private_redis() as server,
        running_fleet(
            server.url,
            work,
            settings=settings,
            worker_args=worker_args,
            worker_id="bench-worker",
            torch_threads=threads,
        ) as fleet,
    ):
        pids = {"worker": fleet.worker.popen.pid, "gateway": fleet.gateway.popen.pid, "redis": redis_pid(server.url)}
        headers = fleet.endpoint.headers
        with profiled(profile, "fleet", {k: pids[k] for k in ("worker", "gateway")}):
            loaded = load_measure("fleet", fleet.endpoint.base_url, spec, headers, pids)
        with profiled(profile, "fleet-c1", {k: pids[k] for k in ("worker", "gateway")}):
            alone = load_measure("fleet", fleet.endpoint.base_url, single, headers, pids)
    return loaded, alone


def relay_measure(streams: int, tokens: int, work: Path, profile: Path | None) -> Measured:
    """``streams`` streams of ``tokens`` pre-made tokens, one per event, through one gateway."""
    spec = LoadSpec(model=RELAY_MODEL, num_prompts=2 * streams, input_len=16, output_len=tokens, concurrency=streams)
    with private_redis() as server, ExitStack() as running:
        env = met_environment({"MET_NAMESPACE": f"bench-{uuid.uuid4().hex[:8]}", **QUIET}, torch_threads=1)
        command = [sys.executable, str(RELAY_WORKER), "--redis", server.url, "--model", RELAY_MODEL]
        worker: ManagedProcess = start_process(
            "relay-worker", [*command, "--namespace", env["MET_NAMESPACE"]], env, work
        )
        running.callback(worker.stop)
        port = free_port()
        gateway = start_met("relay-gateway", ["gateway", "--redis", server.url, "--port", str(port)], env, work)
        running.callback(gateway.stop)
        wait_ready(gateway, f"http://127.0.0.1:{port}", others=[worker])
        pids = {"relay worker": worker.popen.pid, "gateway": gateway.popen.pid, "redis": redis_pid(server.url)}
        with profiled(profile, "relay", {k: pids[k] for k in ("relay worker", "gateway")}):
            return load_measure("relay, 1 tok/event", f"http://127.0.0.1:{port}", spec, {}, pids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", choices=["tiny", "medium"])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, worker and in-process engine")
    parser.add_argument("--single-prompts", type=int, default=16, help="prompts of the concurrency-1 load")
    parser.add_argument("--profile", type=Path, default=None, help="folder for py-spy's collapsed stacks")
    parser.add_argument(
        "--parts",
        default="engine,fleet,relay",
        help="comma-separated measurements to run: engine (in-process, 64 and 1), fleet (64 and 1), relay",
    )
    parser.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        help="an extra argument of `met worker` in the fleet (repeatable), e.g. --worker-arg=--no-checkpoints",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the engine (in-process) and the fleet's worker (met worker --cpus) on CPU 0, the gateway, Redis and "
        "the load generator on the others",
    )
    parser.add_argument("--relay-repeats", type=int, default=1, help="relay measurements, one after the other")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="metrale-bench-fleet-cpu-"))
    if args.model == "tiny":
        directory, name = random_model_dir(work / "cache"), RANDOM_MODEL_NAME
    else:
        directory = bench_model(args.model, Path(tempfile.gettempdir()) / "metrale-bench")
        name = directory.name
    spec = LoadSpec(name, args.prompts, args.input_len, args.output_len, concurrency=args.streams)
    single = dataclasses.replace(spec, num_prompts=args.single_prompts, concurrency=1)
    parts = set(args.parts.split(","))
    rows: list[Measured] = []
    summary: dict[str, float] = {}
    everywhere = os.sched_getaffinity(0)
    worker_cpu, others = min(everywhere), everywhere - {min(everywhere)}
    if args.pin and not others:
        parser.error("--pin needs two CPUs or more")
    if "engine" in parts:
        if args.pin:
            os.sched_setaffinity(0, {worker_cpu})
        engine, engine_single = engine_measure(directory, spec), engine_measure(directory, single)
        rows += [engine, engine_single]
    if "fleet" in parts:
        worker_args = [*args.worker_arg, *(["--cpus", str(worker_cpu)] if args.pin else [])]
        if args.pin:
            os.sched_setaffinity(0, others)  # inherited by the gateway and Redis started from here
        fleet, fleet_single = fleet_measure(directory, spec, single, args.threads, work, args.profile, worker_args)
        rows += [fleet, fleet_single]
        summary["gateway (fleet)"] = fleet.cpu_us_per_token["gateway"]
    os.sched_setaffinity(0, everywhere)
    if "engine" in parts and "fleet" in parts:
        summary["worker transport (fleet worker − engine)"] = (
            fleet.cpu_us_per_token["worker"] - engine.cpu_us_per_token["engine"]
        )
        summary["fleet ÷ engine at concurrency 1"] = fleet_single.tokens_per_s / engine_single.tokens_per_s
        summary[f"fleet ÷ engine at concurrency {args.streams}"] = fleet.tokens_per_s / engine.tokens_per_s
    for repeat in range(args.relay_repeats if "relay" in parts else 0):
        relay = relay_measure(args.streams, args.output_len * 2, work, args.profile)
        rows.append(relay)
        summary[f"worker transport (relay worker) #{repeat + 1}"] = relay.cpu_us_per_token["relay worker"]
        summary[f"gateway (relay) #{repeat + 1}"] = relay.cpu_us_per_token["gateway"]
    load = f"{args.prompts}x({args.input_len}+{args.output_len})"
    setup = f"model={name} streams={args.streams} load={load} threads={args.threads} pin={args.pin} logs={work}"
    if args.json:
        print(json.dumps({"setup": setup, "rows": [dataclasses.asdict(r) for r in rows], "summary": summary}, indent=2))
        return
    print(setup)
    print("| load | concurrency | tokens | tok/s | TTFT p50 ms | TPOT p50 ms | CPU µs per delivered token |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for row in rows:
        cpu = ", ".join(f"{k} {v:.1f}" for k, v in row.cpu_us_per_token.items())
        latency = " | ".join("–" if ms is None else f"{ms:.1f}" for ms in (row.ttft_p50_ms, row.tpot_p50_ms))
        print(f"| {row.setup} | {row.concurrency} | {row.tokens:,} | {row.tokens_per_s:,.0f} | {latency} | {cpu} |")
    for label, value in summary.items():
        print(f"{label}: {value:.2f}")
    for path in sorted(args.profile.glob("*.txt")) if args.profile else []:
        print(f"\nprofile {path.name}:", *profile_summary(path), sep="\n  ")
    print("goals: worker transport ≤ 20 µs, gateway ≤ 25 µs per token at 64 streams; fleet ÷ engine at 1 ≥ 0.9")


if __name__ == "__main__":
    main()
