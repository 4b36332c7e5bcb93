"""Redis's capacity for a fleet's tokens: the relay bench on one Redis and on a Redis Cluster (3 shards, or
``--primaries``), side by side, and the capacity model its per-step and per-token costs give (issue #34).

    MET_TEST_CLUSTER_PORTS=7930 python bench/relay_capacity.py [--primaries 3] [--worker-tokens-per-s 10000]
        [--tokens-per-step 64] [--fleet-workers 100] [--streams 16 64] [--tokens 512]
        [--prompts-per-stream 4] [--rounds 2] [--command-stats] [--json FILE]

A private ``redis-server`` and a private Redis Cluster (``--primaries`` primaries with a replica each,
``tests/failover/cluster.py``; ``MET_TEST_CLUSTER_PORTS`` names its first port, else free ports are found)
are started once. Each round measures, for each ``--streams`` count, one Redis then the cluster (the other
order on odd rounds): ``bench/fleet_cpu.py``'s ``relay_measure`` — ``met gateway`` in front of
``bench/relay_worker.py`` (the real ``RedisTransport``, one token per event, no model),
``streams x --prompts-per-stream`` requests of ``--tokens`` tokens driven by ``metrale.cli.loadgen`` at
``--streams``. The relay worker steps at the modelled worker's pace (``--step-ms`` =
``1000 · --tokens-per-step / --worker-tokens-per-s``, 6.4 ms by default), so at ``--streams`` =
``--tokens-per-step`` its steps carry about that many tokens at about that rate: the modelled worker,
without its model. CPU of every process is read from ``/proc`` over the load; the relay worker's own
counts give the steps that published and their tokens over the same window. With ``--command-stats``,
Redis's own time per command (``INFO commandstats``, every node summed, replicas included) per delivered
token too.

The model fits each Redis setup's CPU seconds over its rows as ``α·steps + β·tokens`` (least squares, no
intercept; the stream counts give different tokens per step at the same step rate, so ``α`` holds what
Redis does per step and per second at that rate, a worker's intake polls included): for one Redis its
one process, for the cluster the mean primary (replicas apart: they sit on other machines in a
deployment). A worker of ``R = --worker-tokens-per-s`` at ``T = --tokens-per-step`` (one token per request
per step: a decode batch of T) makes ``S = R/T`` steps a second, so it costs one Redis ``S·α + R·β``
core-seconds a second, and each primary of the measured cluster ``S·α_p + R·β_p``: workers per Redis
core, and per primary (every worker's steps reach every primary, so that is the whole cluster's count),
are 1 over these. For another primary count N the script gives two bounds on the primaries a fleet of
``--fleet-workers`` needs (the least N up to ``CLUSTER_SHARDS`` = 12, the request shards a fleet's
requests spread over, whose busiest primary stays within a full core): if a step's cost on a primary
stays as measured whatever N (a round trip per node), only the token part shrinking with the request
shards the busiest primary holds (``ceil(12/N)/12``); or if all of it shrinks so (a transaction and a
stream read per request shard). Two runs at different ``--primaries`` tell how much of each there is
(docs/BENCHMARKS.md does that arithmetic). A full core each: a deployment keeps headroom below that.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fleet_cpu import Measured, RelayRedis, relay_measure, relay_redis
from metrale.shared.keys import CLUSTER_SHARDS


@dataclass(frozen=True)
class Row:
    """One relay load on one Redis setup."""

    kind: str
    streams: int
    measured: Measured

    def redis_s(self, which: str) -> float:
        """Redis CPU seconds over the load: ``all`` (every process), ``primary`` (the mean primary, or the one
        Redis), ``busiest`` (the busiest primary), ``replicas`` (summed)."""
        cpu = {name: s for name, s in self.measured.cpu_s.items() if name.startswith("redis")}
        primaries = [s for name, s in cpu.items() if "replica" not in name]
        if which == "all":
            return sum(cpu.values())
        if which == "primary":
            return sum(primaries) / len(primaries)
        if which == "busiest":
            return max(primaries)
        if which == "replicas":
            return sum(s for name, s in cpu.items() if "replica" in name)
        raise ValueError(which)

    @property
    def steps(self) -> int:
        return self.measured.worker_counts["steps"]

    @property
    def worker_tokens(self) -> int:
        return self.measured.worker_counts["tokens"]

    def per_token_us(self, which: str) -> float:
        """Redis CPU µs per delivered token."""
        return 1e6 * self.redis_s(which) / self.measured.tokens

    def per_step_us(self, which: str) -> float:
        return 1e6 * self.redis_s(which) / self.steps


@dataclass(frozen=True)
class Fit:
    """Redis CPU seconds ≈ ``per_step_us``·steps + ``per_token_us``·tokens (µs), over ``rows`` loads."""

    per_step_us: float
    per_token_us: float
    rows: int


def fit(rows: Sequence[Row], which: str) -> Fit:
    """Least squares of ``α·steps + β·tokens`` (no intercept) to the rows' Redis CPU."""
    ss = sum(r.steps * r.steps for r in rows)
    tt = sum(r.worker_tokens * r.worker_tokens for r in rows)
    st = sum(r.steps * r.worker_tokens for r in rows)
    sy = sum(r.steps * r.redis_s(which) for r in rows)
    ty = sum(r.worker_tokens * r.redis_s(which) for r in rows)
    determinant = ss * tt - st * st
    if determinant <= 1e-9 * ss * tt:
        raise ValueError("the loads have the same tokens per step: give --streams two counts to split the costs")
    alpha = (sy * tt - ty * st) / determinant
    beta = (ty * ss - sy * st) / determinant
    return Fit(1e6 * alpha, 1e6 * beta, len(rows))


def busiest_share(primaries: int) -> float:
    """The part of a fleet's request shards the busiest of ``primaries`` primaries holds (``CLUSTER_SHARDS``
    spread as evenly as they go)."""
    return math.ceil(CLUSTER_SHARDS / primaries) / CLUSTER_SHARDS


@dataclass(frozen=True)
class Capacity:
    """The model's answers for workers of ``worker_tokens_per_s`` at ``tokens_per_step``, a cluster's figures
    from one of ``measured_primaries`` primaries."""

    worker_tokens_per_s: float
    tokens_per_step: float
    measured_primaries: int
    one_redis_core_s_per_worker: float
    workers_per_redis_core: float
    primary_core_s_per_worker: float
    """On a primary of the measured cluster (its mean primary's fit)."""
    workers_per_primary: float
    fleet_workers: int
    shards_if_steps_per_node: int | None
    """Primaries the fleet needs if a step's cost on a primary stays whatever the count (a round trip per
    node); None: none suffices up to ``CLUSTER_SHARDS``."""
    shards_if_steps_per_slot: int | None
    """Primaries the fleet needs if a step's cost follows the request shards a primary holds (a transaction
    and a stream read per request shard)."""


def capacity(one: Fit, primary: Fit, rate: float, tokens_per_step: float, fleet: int, measured: int) -> Capacity:
    steps = rate / tokens_per_step
    single = 1e-6 * (steps * one.per_step_us + rate * one.per_token_us)
    step_part, token_part = 1e-6 * steps * primary.per_step_us, 1e-6 * rate * primary.per_token_us
    here = busiest_share(measured)

    def needed(load: Callable[[int], float]) -> int | None:
        return next((n for n in range(1, CLUSTER_SHARDS + 1) if fleet * load(n) <= 1), None)

    per_node = needed(lambda n: step_part + token_part * busiest_share(n) / here)
    per_slot = needed(lambda n: (step_part + token_part) * busiest_share(n) / here)
    on_measured = step_part + token_part
    return Capacity(
        rate, tokens_per_step, measured, single, 1 / single, on_measured, 1 / on_measured, fleet, per_node, per_slot
    )


def measure(options: argparse.Namespace, work: Path) -> list[Row]:
    rows: list[Row] = []
    pace = ["--step-ms", f"{1000 * options.tokens_per_step / options.worker_tokens_per_s:g}"]
    with ExitStack() as servers:
        targets: list[RelayRedis] = [
            servers.enter_context(relay_redis(kind, work, options.primaries)) for kind in ("one", "cluster")
        ]
        for round_ in range(options.rounds):
            for streams in options.streams:
                for target in targets if round_ % 2 == 0 else reversed(targets):
                    prompts = streams * options.prompts_per_stream
                    measured = relay_measure(
                        streams,
                        options.tokens,
                        work,
                        None,
                        options.command_stats,
                        target=target,
                        prompts=prompts,
                        worker_args=pace,
                    )
                    rows.append(Row(target.kind, streams, measured))
                    print(f"round {round_ + 1}: {line(rows[-1])}", file=sys.stderr, flush=True)
    return rows


def line(row: Row) -> str:
    m = row.measured
    return (
        f"{m.setup} at {row.streams}: {m.tokens:,} tokens, {m.tokens_per_s:,.0f} tok/s, "
        f"{m.steps_per_s or 0:,.0f} steps/s, {row.worker_tokens / row.steps:.1f} tok/step; Redis µs/token "
        f"all {row.per_token_us('all'):.2f} primary {row.per_token_us('primary'):.2f}; Redis µs/step all "
        f"{row.per_step_us('all'):.1f}; gateway {m.cpu_us_per_token['gateway']:.1f}, relay worker "
        f"{m.cpu_us_per_token['relay worker']:.1f} µs/token"
    )


def report(rows: list[Row], options: argparse.Namespace) -> dict[str, object]:
    one = [r for r in rows if r.kind == "one"]
    cluster = [r for r in rows if r.kind == "cluster"]
    fits = {
        "one Redis": fit(one, "all"),
        "cluster, every process": fit(cluster, "all"),
        "cluster, mean primary": fit(cluster, "primary"),
        "cluster, replicas summed": fit(cluster, "replicas"),
    }
    model = capacity(
        fits["one Redis"],
        fits["cluster, mean primary"],
        options.worker_tokens_per_s,
        options.tokens_per_step,
        options.fleet_workers,
        options.primaries,
    )
    print(
        "| Redis | streams | delivered tokens | tok/s | worker steps/s | tok/step | Redis CPU µs/token: all |", end=""
    )
    print(" mean primary | busiest primary | replicas | Redis µs/step: all | mean primary | gateway µs/token |", end="")
    print(" relay worker µs/token |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in sorted(rows, key=lambda r: (r.streams, r.kind)):
        m = row.measured
        print(
            f"| {m.setup.removeprefix('relay, 1 tok/event, ')} | {row.streams} | {m.tokens:,} | "
            f"{m.tokens_per_s:,.0f} | {m.steps_per_s or 0:,.0f} | {row.worker_tokens / row.steps:.1f} | "
            f"{row.per_token_us('all'):.2f} | {row.per_token_us('primary'):.2f} | "
            f"{row.per_token_us('busiest'):.2f} | {row.per_token_us('replicas'):.2f} | "
            f"{row.per_step_us('all'):.1f} | {row.per_step_us('primary'):.1f} | "
            f"{m.cpu_us_per_token['gateway']:.1f} | {m.cpu_us_per_token['relay worker']:.1f} |"
        )
    for row in sorted(rows, key=lambda r: (r.streams, r.kind)):
        busiest = sorted(row.measured.redis_commands.items(), key=lambda item: -item[1][1])[:8]
        if busiest:
            print(f"Redis commands, {row.kind} at {row.streams}, per token (calls / µs): ", end="")
            print(", ".join(f"{name} {calls:.3f} / {us:.2f}" for name, (calls, us) in busiest))
    print("\nfits, Redis CPU = α·steps + β·tokens:")
    for name, got in fits.items():
        print(
            f"  {name}: α {got.per_step_us:.1f} µs per step, β {got.per_token_us:.3f} µs per token ({got.rows} loads)"
        )
    if any(got.per_step_us < 0 or got.per_token_us < 0 for got in fits.values()):
        print("  a negative cost: these loads did not separate the two (too few tokens for /proc's ticks, or noise)")
    print(
        f"\nmodel, workers of {model.worker_tokens_per_s:,.0f} tokens/s at {model.tokens_per_step:g} tokens per step:"
    )
    print(f"  one Redis: {model.one_redis_core_s_per_worker:.3f} core-s/s per worker, ", end="")
    print(f"{model.workers_per_redis_core:.1f} workers per Redis core")
    print(
        f"  {model.measured_primaries}-shard cluster: {model.primary_core_s_per_worker:.3f} core-s/s per worker ",
        end="",
    )
    print(f"on each primary, {model.workers_per_primary:.1f} workers before a primary's core is full")
    for how, shards in (
        ("a step costs each primary the same whatever the count", model.shards_if_steps_per_node),
        ("a step's cost on a primary follows its request shards", model.shards_if_steps_per_slot),
    ):
        print(f"  {model.fleet_workers} workers need {shards or f'more than {CLUSTER_SHARDS}'} primaries if {how}")
    return {
        "rows": [{"kind": r.kind, "streams": r.streams, **dataclasses.asdict(r.measured)} for r in rows],
        "fits": {name: dataclasses.asdict(got) for name, got in fits.items()},
        "model": dataclasses.asdict(model),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[16, 64], help="concurrent streams of each load")
    parser.add_argument("--tokens", type=int, default=512, help="tokens of each request")
    parser.add_argument("--prompts-per-stream", type=int, default=4, help="requests of a load per stream")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every load on each Redis setup")
    parser.add_argument("--worker-tokens-per-s", type=float, default=10_000.0, help="the model's worker rate")
    parser.add_argument("--tokens-per-step", type=float, default=64.0, help="the model's worker batch")
    parser.add_argument("--fleet-workers", type=int, default=100, help="the model's fleet size")
    parser.add_argument("--primaries", type=int, default=3, help="primaries of the cluster (a replica each)")
    parser.add_argument("--command-stats", action="store_true", help="Redis's commands per delivered token")
    parser.add_argument("--json", type=Path, default=None, help="also write rows, fits and model here")
    options = parser.parse_args()
    if len(set(options.streams)) < 2:
        parser.error("--streams needs two counts or more: the model splits Redis's cost per step and per token")
    if min(options.streams) < 1 or options.tokens < 1 or options.prompts_per_stream < 1 or options.rounds < 1:
        parser.error("--streams, --tokens, --prompts-per-stream and --rounds must be positive")
    if not 2 <= options.primaries <= CLUSTER_SHARDS:
        parser.error(f"--primaries must be 2 to {CLUSTER_SHARDS}")
    if options.worker_tokens_per_s <= 0 or options.tokens_per_step <= 0 or options.fleet_workers < 1:
        parser.error("--worker-tokens-per-s, --tokens-per-step and --fleet-workers must be positive")
    work = Path(tempfile.mkdtemp(prefix="metrale-bench-relay-capacity-"))
    print(f"logs: {work}", file=sys.stderr)
    result = report(measure(options, work), options)
    if options.json is not None:
        options.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
