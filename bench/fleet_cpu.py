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
   token per event, no model), so that worker's CPU is transport only — measured directly. On each
   ``--relay-redis``: ``one`` (a private ``redis-server``) and/or ``cluster`` (a private Redis Cluster of
   3 primaries and 3 replicas, ``tests/failover/cluster.py``; ``MET_TEST_CLUSTER_PORTS`` names its first
   port); Redis's CPU is every ``redis-server`` process of it summed (``redis``), and each node's too
   (``redis primary :PORT``, ``redis replica :PORT``). The relay worker's steps that published (its
   ``--stats`` counts, read before and after the load) give Redis's CPU per step.
4. concurrency 1: ``--single-prompts`` prompts one at a time through the engine and through the fleet
   (the same processes as 2.); the goal is fleet ÷ engine ≥ 0.9.
5. ``--parts c1`` (alone): concurrency 1 measured in ``--c1-rounds`` alternating rounds, the engine's
   ``--single-prompts`` prompts then the fleet's, one after the other on a fleet started once, so that
   each ratio compares two runs a few seconds apart (on a shared machine the load moves between the
   measurements of 1. and 2.); prints each round's rates, CPU per token and ratio, and their median, and
   the worker's CPU per token over the engine's (what bounds the ratio where the CPU is shared).

``--command-stats`` also prints, per measured load, Redis's own count and time of each command per
delivered token (``INFO commandstats``, reset after the warm-up; a command inside ``MULTI`` is counted
both on its own and in its ``EXEC``).

``--profile DIR`` samples the worker and the gateway with py-spy (``pip install py-spy``; not a project
dependency) during 2. and 3. and writes collapsed stacks there: only the thread holding the GIL, so
Python work, not threads blocked in a socket read; torch releases the GIL, so model work is missing
(``FLEET_CPU_PROFILE_GIL=0``: every thread that is not idle, torch's work included; with
``FLEET_CPU_PROFILE_IDLE=1`` too: idle threads as well, so where a process waits shows);
``FLEET_CPU_PROFILE_RATE`` samples per second (200).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import unittest.mock
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fleet import QUIET, RELAY_MODEL, RELAY_WORKER, closed_loop, private_redis, process_cpu_s
from bench.models import bench_model
from metrale.cli.loadgen import LoadSpec, make_prompts, run_load
from metrale.worker.engine.engine import Engine
from metrale.worker.engine.factory import EngineLimits, build_engine
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.model.builtin import RANDOM_MODEL_NAME, random_model_dir
from tests.failover import cluster as cluster_harness
from tests.integration.deployments import Fleet, running_fleet
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
    redis_commands: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    """Per Redis command (with ``--command-stats``): calls and µs of Redis's time per delivered token."""
    worker_counts: dict[str, int] = dataclasses.field(default_factory=dict)
    """The relay worker's counts over the load (``WorkerCounts``: steps, events, tokens); empty elsewhere."""
    cpu_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """Each process's CPU seconds over the load (what ``cpu_us_per_token`` divides)."""
    wall_s: float = 0.0

    @property
    def steps_per_s(self) -> float | None:
        """The relay worker's publishing steps per second of the load."""
        steps = self.worker_counts.get("steps")
        return steps / self.wall_s if steps and self.wall_s > 0 else None

    def cpu_us_per_step(self, name: str) -> float | None:
        """Process ``name``'s CPU µs per relay-worker step."""
        steps = self.worker_counts.get("steps")
        return 1e6 * self.cpu_s[name] / steps if steps else None


def warm_engine(directory: Path, spec: LoadSpec) -> Engine:
    """An in-process engine sized like the worker, after a short warm-up."""
    engine = build_engine(directory, EngineLimits()).engine
    engine.generate(make_prompts(dataclasses.replace(spec, num_prompts=4)), SamplingParams(max_tokens=8))
    return engine


def engine_measure(directory: Path, spec: LoadSpec, engine: Engine | None = None) -> Measured:
    """The load through an in-process engine sized like the worker (``engine``, else a new one); CPU of
    this process."""
    engine = engine if engine is not None else warm_engine(directory, spec)
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


def load_measure(
    setup: str,
    base_url: str,
    spec: LoadSpec,
    headers: dict[str, str],
    pids: dict[str, int],
    redis_urls: Sequence[str] = (),
    counts: Callable[[], dict[str, int]] | None = None,
) -> Measured:
    """``run_load`` after a short warm-up; CPU µs per delivered token of each of ``pids`` and of this
    process (the load generator); with ``redis_urls`` (each node of one Redis or a cluster), their command
    statistics summed; with ``counts``, how much they grew over the load."""
    # At the load's concurrency, so the gateway's Redis connection pool has grown to it before measuring.
    warm_up = dataclasses.replace(spec, num_prompts=spec.concurrency, output_len=8, seed=spec.seed + 1)
    asyncio.run(run_load(base_url, warm_up, headers))
    for url in redis_urls:
        redis.Redis.from_url(url).config_resetstat()
    counted = counts() if counts is not None else {}
    before = {name: process_cpu_s(pid) for name, pid in pids.items()}
    client = time.process_time()
    began = time.perf_counter()
    report = asyncio.run(run_load(base_url, spec, headers))
    wall = time.perf_counter() - began
    used = {name: process_cpu_s(pid) - before[name] for name, pid in pids.items()}
    used["load generator"] = time.process_time() - client
    grown = {name: value - counted[name] for name, value in counts().items()} if counts is not None else {}
    if report["failed"]:
        raise RuntimeError(f"{setup}: {report['failed']} requests failed: {report['errors']}")
    tokens = round(report["output_token_throughput"] * report["duration_s"])
    per_token = {name: 1e6 * seconds / tokens for name, seconds in used.items()}
    ttft, tpot = report["ttft"]["median_ms"], report["tpot"]["median_ms"]
    calls: Counter[str] = Counter()
    usec: Counter[str] = Counter()
    for url in redis_urls:
        for name, stat in redis.Redis.from_url(url).info("commandstats").items():
            calls[name.removeprefix("cmdstat_")] += stat["calls"]
            usec[name.removeprefix("cmdstat_")] += stat["usec"]
    commands = {name: (calls[name] / tokens, usec[name] / tokens) for name in calls}
    throughput = report["output_token_throughput"]
    return Measured(setup, spec.concurrency, tokens, throughput, per_token, ttft, tpot, commands, grown, used, wall)


def redis_pid(url: str) -> int:
    return int(redis.Redis.from_url(url).info("server")["process_id"])


@dataclass(frozen=True)
class RelayRedis:
    """Where the relay bench's worker and gateway meet: one Redis or a Redis Cluster."""

    kind: str
    """``one`` or ``cluster``."""
    url: str
    """The ``MET_REDIS_URL`` the processes take."""
    pids: dict[str, int]
    """Every ``redis-server`` process by name: ``redis`` (one Redis), or ``redis primary :PORT`` and
    ``redis replica :PORT`` (each node of a cluster)."""
    node_urls: list[str]
    """Each node's own URL (for its ``INFO``)."""

    @property
    def label(self) -> str:
        return "one Redis" if self.kind == "one" else f"cluster, {sum('primary' in n for n in self.pids)} shards"


@contextmanager
def relay_redis(kind: str, work: Path, primaries: int = cluster_harness.PRIMARIES) -> Iterator[RelayRedis]:
    """A private ``redis-server`` (``one``) or a private cluster of ``primaries`` primaries with a replica
    each (``cluster``), stopped on exit."""
    if kind == "one":
        with private_redis() as server:
            yield RelayRedis(kind, server.url, {"redis": redis_pid(server.url)}, [server.url])
        return
    if kind != "cluster":
        raise ValueError(f"a relay Redis is 'one' or 'cluster', not {kind!r}")
    log_dir = work / f"cluster-{uuid.uuid4().hex[:8]}"
    log_dir.mkdir(parents=True)
    # The harness sizes its cluster by its module's NODES (3 + 3); another size here is that constant set
    # while the group picks its ports, as `--cluster-replicas 1` makes half of the nodes primaries.
    with unittest.mock.patch.object(cluster_harness, "NODES", 2 * primaries):
        group = cluster_harness.ClusterGroup(log_dir)
    try:
        group.start()
        primary_ports = set(group.primary_ports())
        roles = {port: "primary" if port in primary_ports else "replica" for port in group.ports}
        ordered = sorted(group.ports, key=lambda port: (roles[port] != "primary", port))
        pids = {f"redis {roles[port]} :{port}": group.nodes[port].popen.pid for port in ordered}
        yield RelayRedis(kind, group.url, pids, [f"redis://127.0.0.1:{port}" for port in ordered])
    finally:
        group.stop()


def redis_total(row: Measured) -> float:
    """Redis's CPU µs per delivered token, every ``redis-server`` process summed."""
    return sum(us for name, us in row.cpu_us_per_token.items() if name.startswith("redis"))


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
                *(["--idle"] if os.environ.get("FLEET_CPU_PROFILE_IDLE", "0") == "1" else []),
                "-p",
                str(pid),
                "-r",
                os.environ.get("FLEET_CPU_PROFILE_RATE", "200"),
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


@contextmanager
def bench_fleet(
    model_dir: Path, work: Path, worker_args: list[str], threads: int
) -> Iterator[tuple[Fleet, str, dict[str, int]]]:
    """``met worker`` (``threads`` torch threads) and ``met gateway`` serving ``model_dir`` on a private
    redis-server: the fleet, the Redis URL and the pids of the worker, the gateway and Redis."""
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
        yield fleet, server.url, pids


def fleet_measure(
    model_dir: Path,
    spec: LoadSpec,
    single: LoadSpec,
    threads: int,
    work: Path,
    profile: Path | None,
    worker_args: list[str],
    command_stats: bool = False,
) -> tuple[Measured, Measured]:
    """The load, then the one-at-a-time load, through gateway + worker on a private redis-server."""
    with bench_fleet(model_dir, work, worker_args, threads) as (fleet, server_url, pids):
        headers = fleet.endpoint.headers
        urls = [server_url] if command_stats else []
        with profiled(profile, "fleet", {k: pids[k] for k in ("worker", "gateway")}):
            loaded = load_measure("fleet", fleet.endpoint.base_url, spec, headers, pids, urls)
        with profiled(profile, "fleet-c1", {k: pids[k] for k in ("worker", "gateway")}):
            alone = load_measure("fleet", fleet.endpoint.base_url, single, headers, pids, urls)
    return loaded, alone


@dataclass(frozen=True)
class SingleRound:
    """One round of ``--parts c1``: the engine's run and the fleet's, one after the other."""

    engine: Measured
    fleet: Measured

    @property
    def ratio(self) -> float:
        return self.fleet.tokens_per_s / self.engine.tokens_per_s


def alternating_single(
    model_dir: Path,
    single: LoadSpec,
    rounds: int,
    threads: int,
    work: Path,
    worker_args: list[str],
    profile: Path | None = None,
    pin: tuple[set[int], set[int]] | None = None,
) -> list[SingleRound]:
    """``rounds`` times: ``single`` through the in-process engine, then through gateway + worker (started
    once, on a private redis-server); the engine waits idle while the fleet runs and the fleet's worker
    waits idle (a blocking read) while the engine runs. With ``pin`` (the engine's and worker's CPUs,
    the others'), this process runs the engine on the first and the load generator on the second, and
    the gateway and Redis start on the second."""
    engine_cpus, other_cpus = pin if pin is not None else (os.sched_getaffinity(0), os.sched_getaffinity(0))
    engine = warm_engine(model_dir, single)
    measured = []
    os.sched_setaffinity(0, other_cpus)
    with bench_fleet(model_dir, work, worker_args, threads) as (fleet, _, pids):
        for round_ in range(rounds):
            seeded = dataclasses.replace(single, seed=single.seed + round_)
            os.sched_setaffinity(0, engine_cpus)
            in_process = engine_measure(model_dir, seeded, engine)
            os.sched_setaffinity(0, other_cpus)
            with profiled(profile, f"c1-round{round_ + 1}", {k: pids[k] for k in ("worker", "gateway")}):
                through_fleet = load_measure("fleet", fleet.endpoint.base_url, seeded, fleet.endpoint.headers, pids)
            measured.append(SingleRound(in_process, through_fleet))
    return measured


def relay_measure(
    streams: int,
    tokens: int,
    work: Path,
    profile: Path | None,
    command_stats: bool = False,
    target: RelayRedis | None = None,
    prompts: int | None = None,
    worker_args: Sequence[str] = (),
) -> Measured:
    """``streams`` streams of ``tokens`` pre-made tokens, one per event, through one gateway and one relay
    worker meeting in ``target`` (a fresh private Redis when None), in a key space of their own;
    ``prompts`` requests in all (``2 * streams`` when None); ``worker_args``: more arguments of
    ``bench/relay_worker.py`` (``--step-ms``)."""
    with ExitStack() as running:
        if target is None:
            target = running.enter_context(relay_redis("one", work))
        spec = LoadSpec(
            model=RELAY_MODEL,
            num_prompts=prompts if prompts is not None else 2 * streams,
            input_len=16,
            output_len=tokens,
            concurrency=streams,
        )
        env = met_environment({"MET_NAMESPACE": f"bench-{uuid.uuid4().hex[:8]}", **QUIET}, torch_threads=1)
        stats = work / f"relay-counts-{env['MET_NAMESPACE']}.json"
        command = [sys.executable, str(RELAY_WORKER), "--redis", target.url, "--model", RELAY_MODEL]
        command += ["--namespace", env["MET_NAMESPACE"], "--stats", str(stats), *worker_args]
        worker: ManagedProcess = start_process("relay-worker", command, env, work)
        running.callback(worker.stop)
        port = free_port()
        gateway = start_met("relay-gateway", ["gateway", "--redis", target.url, "--port", str(port)], env, work)
        running.callback(gateway.stop)
        wait_ready(gateway, f"http://127.0.0.1:{port}", others=[worker])
        pids = {"relay worker": worker.popen.pid, "gateway": gateway.popen.pid, **target.pids}
        with profiled(profile, "relay", {k: pids[k] for k in ("relay worker", "gateway")}):
            urls = target.node_urls if command_stats else []
            counts = functools.partial(relay_counts, worker, stats)
            setup = f"relay, 1 tok/event, {target.label}"
            return load_measure(setup, f"http://127.0.0.1:{port}", spec, {}, pids, urls, counts)


def relay_counts(worker: ManagedProcess, stats: Path, timeout_s: float = 10.0) -> dict[str, int]:
    """The relay worker's counts now: asked for by SIGUSR1, read once it has written them."""
    stats.unlink(missing_ok=True)
    worker.popen.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + timeout_s
    while not stats.exists():
        if time.monotonic() > deadline or worker.popen.poll() is not None:
            raise RuntimeError(f"the relay worker wrote no counts to {stats} within {timeout_s} s")
        time.sleep(0.005)
    counts: dict[str, int] = json.loads(stats.read_text())
    return counts


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
        help="comma-separated measurements to run: engine (in-process, 64 and 1), fleet (64 and 1), relay; "
        "c1 (alternating rounds at concurrency 1, see 5.)",
    )
    parser.add_argument("--c1-rounds", type=int, default=4, help="alternating rounds of --parts c1")
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
    parser.add_argument(
        "--relay-redis",
        default="one",
        help="comma-separated Redis setups of the relay part, measured in turn each repeat: one (a redis-server), "
        "cluster (3 primaries + 3 replicas)",
    )
    parser.add_argument("--command-stats", action="store_true", help="Redis's commands per delivered token")
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
    relay_kinds = args.relay_redis.split(",")
    if not set(relay_kinds) <= {"one", "cluster"}:
        parser.error(f"--relay-redis takes one and/or cluster, not {args.relay_redis!r}")
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
        fleet, fleet_single = fleet_measure(
            directory, spec, single, args.threads, work, args.profile, worker_args, args.command_stats
        )
        rows += [fleet, fleet_single]
        summary["gateway (fleet)"] = fleet.cpu_us_per_token["gateway"]
    os.sched_setaffinity(0, everywhere)
    if "c1" in parts:
        pinned = ({worker_cpu}, others) if args.pin else None
        worker_args = [*args.worker_arg, *(["--cpus", str(worker_cpu)] if args.pin else [])]
        alternating = alternating_single(
            directory, single, args.c1_rounds, args.threads, work, worker_args, args.profile, pinned
        )
        os.sched_setaffinity(0, everywhere)
        for number, round_ in enumerate(alternating, start=1):
            rows += [round_.engine, round_.fleet]
            summary[f"fleet ÷ engine at concurrency 1, round {number}"] = round_.ratio
        summary["fleet ÷ engine at concurrency 1, median of rounds"] = statistics.median(r.ratio for r in alternating)
        summary["worker CPU ÷ engine CPU per token at concurrency 1, median of rounds"] = statistics.median(
            r.fleet.cpu_us_per_token["worker"] / r.engine.cpu_us_per_token["engine"] for r in alternating
        )
    if "engine" in parts and "fleet" in parts:
        summary["worker transport (fleet worker − engine)"] = (
            fleet.cpu_us_per_token["worker"] - engine.cpu_us_per_token["engine"]
        )
        summary["fleet ÷ engine at concurrency 1"] = fleet_single.tokens_per_s / engine_single.tokens_per_s
        summary[f"fleet ÷ engine at concurrency {args.streams}"] = fleet.tokens_per_s / engine.tokens_per_s
    with ExitStack() as servers:
        targets = [servers.enter_context(relay_redis(kind, work)) for kind in relay_kinds] if "relay" in parts else []
        for repeat in range(args.relay_repeats if "relay" in parts else 0):
            for target in targets:
                relay = relay_measure(args.streams, args.output_len * 2, work, args.profile, args.command_stats, target)
                rows.append(relay)
                tag = f"{target.label} #{repeat + 1}"
                summary[f"worker transport (relay worker), {tag}"] = relay.cpu_us_per_token["relay worker"]
                summary[f"gateway (relay), {tag}"] = relay.cpu_us_per_token["gateway"]
                summary[f"Redis, every process (relay), {tag}"] = redis_total(relay)
                per_step = 1e6 * sum(us for name, us in relay.cpu_s.items() if name.startswith("redis"))
                summary[f"Redis µs per relay step, {tag}"] = per_step / max(1, relay.worker_counts["steps"])
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
    for row in rows:
        busiest = sorted(row.redis_commands.items(), key=lambda item: -item[1][1])[:8]
        if busiest:
            print(f"Redis commands, {row.setup} at {row.concurrency}, per token (calls, µs): ", end="")
            print(", ".join(f"{name} {calls:.3f} / {us:.2f}" for name, (calls, us) in busiest))
    for label, value in summary.items():
        print(f"{label}: {value:.2f}")
    for path in sorted(args.profile.glob("*.txt")) if args.profile else []:
        print(f"\nprofile {path.name}:", *profile_summary(path), sep="\n  ")
    print("goals: worker transport ≤ 20 µs, gateway ≤ 25 µs per token at 64 streams; fleet ÷ engine at 1 ≥ 0.9")


if __name__ == "__main__":
    main()
