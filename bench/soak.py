"""Soak: a fleet under mixed load for a long time, with workers killed and Redis restarted under it.

    python bench/soak.py [--minutes 20] [--kill-every-s 120] [--seed 0] [--json]
                         [--workers 3] [--concurrency 6] [--batch-lines 24] [--warmup-s 120]

A private ``redis-server`` (append-only file on, ``appendfsync everysec``), a ``met gateway``, a ``met
batch-runner`` and ``--workers`` ``met worker`` processes of the random-weight tiny model
(``bench/soak_fleet.py``). For ``--minutes``: interactive streamed chat completions at
``--concurrency`` and batches of ``--batch-lines`` chat lines one after another (``bench/soak_load.py``);
every ``--kill-every-s`` a random worker gets ``kill -9`` and is started again at once, as ``met fleet
up`` would; once, mid-run, Redis gets ``kill -9`` and is started again on the same port and AOF.

Then the load stops, what runs finishes, the fleet idles ``--settle-s``, and the report says:

- requests by outcome (whole output / clear error / lost) for interactive requests, batch lines and
  batches; answers to a repeated body that differ (seeded or greedy: there must be none); batch
  lines missing from, or twice in, their batch's files;
- the RSS of every process, sampled every ``--sample-every-s``, as a least-squares slope (MiB/min) over
  the samples after ``--warmup-s`` from that process's start (a restarted worker is a new series);
- the fleet's Redis keys before the load and after the settle, by family, those without TTL, and
  leaks (``bench/soak_measure.py`` ``classify_keys``).

``--json`` also carries every RSS sample (``rss_samples_mib``: seconds since the process started, MiB).

Not a test: it takes its minutes, and on a shared machine its rates mean little. Exit status 1 when
a request was lost, answers differed, a process crashed or a key leaked.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, cast

import redis
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.soak_fleet import API_KEY, AofRedis, SoakFleet
from bench.soak_load import LOSSES, Batches, Interactive, Ledger, chat_pool
from bench.soak_measure import MIB, KeyScan, RssSampler, RssSummary, scan_keys, summarize
from metrale.worker.model.builtin import RANDOM_MODEL_NAME, random_model_dir

CLIENT_TIMEOUT_S = 180.0
"""No interactive request may take longer (the gateway's own deadline, ``MET_REQUEST_TIMEOUT_S``, is 120)."""
BATCH_DEADLINE_S = 900.0
IDLE_WAIT_S = 180.0
REDIS_DOWN_S = 2.0


def settings(work: Path, model_dir: Path) -> dict[str, str]:
    return {
        "MET_MODEL_DIR": str(model_dir),
        "MET_FILES_DIR": str(work / "files"),
        "MET_CACHE_DIR": str(work / "cache"),
        "MET_DRAIN_HANDOFF": "true",
        "MET_DECODE_CHECKPOINT_INTERVAL": "16",
        "MET_REQUEST_TIMEOUT_S": "120",
        "MET_LOG_LEVEL": "WARNING",
    }


async def chaos(fleet: SoakFleet, args: argparse.Namespace, seconds: float) -> None:
    """Kill a random worker every ``--kill-every-s`` and restart Redis once, mid-run, for ``seconds``."""
    rng = random.Random(args.seed)
    start = time.monotonic()
    next_kill = args.kill_every_s
    redis_at = (seconds / 2 // args.kill_every_s) * args.kill_every_s + args.kill_every_s / 2
    while (elapsed := time.monotonic() - start) < seconds:
        if elapsed >= next_kill:
            await asyncio.to_thread(fleet.kill_worker, f"worker-{rng.randrange(1, args.workers + 1)}")
            next_kill += args.kill_every_s
        if redis_at is not None and elapsed >= redis_at:
            await asyncio.to_thread(fleet.restart_redis, REDIS_DOWN_S)
            redis_at = None
        await asyncio.to_thread(fleet.check_members)
        await asyncio.sleep(1.0)


async def drive(fleet: SoakFleet, args: argparse.Namespace, ledger: Ledger) -> float:
    """The load and the chaos for ``--minutes``; then the load stops and what is in flight ends.
    Returns the seconds the load ran, including that end."""
    stop = asyncio.Event()
    pool = chat_pool(RANDOM_MODEL_NAME, 48, args.seed)
    interactive = Interactive(fleet.base_url, API_KEY, pool, ledger, CLIENT_TIMEOUT_S)
    batch_pool = chat_pool(RANDOM_MODEL_NAME, args.batch_lines, args.seed + 1)
    batches = Batches(fleet.base_url, API_KEY, batch_pool, ledger, BATCH_DEADLINE_S)
    started = fleet.started_at = time.monotonic()
    load = [
        asyncio.create_task(interactive.run(args.concurrency, stop, args.seed)),
        asyncio.create_task(batches.run(stop)),
    ]
    await chaos(fleet, args, args.minutes * 60)
    stop.set()
    fleet.note("load stops; waiting for what is in flight")
    await asyncio.gather(*load)
    fleet.note("load ended")
    return time.monotonic() - started


def wait_idle(fleet: SoakFleet, settle_s: float) -> None:
    """Until every worker beats and no request runs (at most ``IDLE_WAIT_S``), then ``settle_s`` more."""
    fleet.wait_workers_beating()
    client = redis.Redis.from_url(fleet.redis.url)
    deadline = time.monotonic() + IDLE_WAIT_S
    while client.zcard(fleet.keys.running_index()) and time.monotonic() < deadline:
        time.sleep(1)
    client.close()
    time.sleep(settle_s)


def run(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="metrale-soak-"))
    model_dir = random_model_dir(work / "cache")
    fleet = SoakFleet(AofRedis(work / "redis", work), model_dir, work, args.workers, settings(work, model_dir))
    console.print(f"logs and data in {work}; starting the fleet", style="dim")
    ledger = Ledger()
    sampler = RssSampler(fleet.pids, args.sample_every_s)
    try:
        fleet.start()
        client = redis.Redis.from_url(fleet.redis.url)
        before = scan_keys(client, fleet.keys)
        memory = {"before": int(client.info("memory")["used_memory"])}
        sampler.start()
        console.print(f"fleet ready; {args.minutes:g} min of load", style="dim")
        load_s = asyncio.run(drive(fleet, args, ledger))
        wait_idle(fleet, args.settle_s)
        fleet.check_members()
        sampler.sample()
        after = scan_keys(client, fleet.keys)
        memory["after"] = int(client.info("memory")["used_memory"])
        counters = cast(dict[bytes, bytes], client.hgetall(fleet.keys.failover_counters()))
        failover = {name.decode(): int(value) for name, value in counters.items()}
        client.close()
    finally:
        sampler.stop()
        fleet.stop()
    summaries = [s for s in (summarize(x, args.warmup_s, args.min_samples) for x in sampler.series) if s]
    result = report(args, fleet, ledger, load_s, summaries, before, after, work)
    result["redis_used_memory_mib"] = {moment: round(n / 2**20, 2) for moment, n in memory.items()}
    result["failover_counters"] = failover
    result["rss_samples_mib"] = {
        f"{x.name}/{x.pid}": [[round(t), round(y / MIB, 1)] for t, y in x.samples] for x in sampler.series
    }
    return result


def report(
    args: argparse.Namespace,
    fleet: SoakFleet,
    ledger: Ledger,
    load_s: float,
    rss: list[RssSummary],
    before: KeyScan,
    after: KeyScan,
    work: Path,
) -> dict[str, Any]:
    by_kind: dict[str, Counter[str]] = {}
    for outcome in ledger.outcomes:
        by_kind.setdefault(outcome.kind, Counter())[outcome.outcome] += 1
    errors = Counter(
        f"{o.kind} {o.status or ''} {o.message[:120]}".strip() for o in ledger.outcomes if o.outcome != "ok"
    )
    ok_latency = [o.seconds for o in ledger.outcomes if o.kind == "interactive" and o.outcome == "ok"]
    unanswered = {kind: ledger.sent.get(kind, 0) - sum(by_kind.get(kind, Counter()).values()) for kind in ledger.sent}
    lost = sum(c[loss] for c in by_kind.values() for loss in LOSSES) + len(ledger.missing) + len(ledger.duplicates)
    lost += sum(max(n, 0) for n in unanswered.values())
    kills = sum(event.what.startswith("kill -9 worker") for event in fleet.events)
    slopes = [s.slope_mib_per_min for s in rss if s.slope_mib_per_min is not None]
    return {
        "command": " ".join(sys.argv),
        "cpus": os.cpu_count(),
        "minutes": args.minutes,
        "load_s": round(load_s, 1),
        "seed": args.seed,
        "workers": args.workers,
        "concurrency": args.concurrency,
        "worker_kills": kills,
        "redis_restarts": fleet.redis.starts - 1,
        "crashes": fleet.crashes,
        "sent": ledger.sent,
        "outcomes": {kind: dict(counter) for kind, counter in sorted(by_kind.items())},
        "unanswered": unanswered,
        "lost": lost,
        "missing_lines": ledger.missing[:20],
        "duplicate_lines": ledger.duplicates[:20],
        "mismatched_answers": len(ledger.mismatches),
        "mismatch_examples": ledger.mismatches[:5],
        "errors": dict(errors.most_common(12)),
        "batch_poll_errors": ledger.poll_errors,
        "interactive_latency_s": _percentiles(ok_latency),
        "rss": [dataclasses.asdict(s) for s in rss],
        "max_abs_rss_slope_mib_per_min": max((abs(s) for s in slopes), default=None),
        "keys_before": dataclasses.asdict(before),
        "keys_after": dataclasses.asdict(after),
        "leaked_keys": len(after.leaks),
        "events": [f"{e.at_s:7.1f}s {e.what}" for e in fleet.events],
        "logs": str(work),
    }


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {
        "p50": round(statistics.median(ordered), 3),
        "p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3),
        "max": round(ordered[-1], 3),
    }


def print_summary(result: dict[str, Any], console: Console) -> None:
    for line in result["events"]:
        console.print(line, style="dim", markup=False, highlight=False)
    requests = Table(title=f"requests over {result['load_s']:.0f} s ({result['worker_kills']} worker kills, "
                     f"{result['redis_restarts']} Redis restart, {result['crashes']} crashes)")  # fmt: skip
    for column in ("kind", "sent", "ok (whole output)", "clear error", "lost"):
        requests.add_column(column, justify="left" if column == "kind" else "right")
    for kind, counts in result["outcomes"].items():
        lost = sum(counts.get(loss, 0) for loss in LOSSES) + max(result["unanswered"].get(kind, 0), 0)
        requests.add_row(
            kind, str(result["sent"].get(kind, 0)), str(counts.get("ok", 0)), str(counts.get("error", 0)), str(lost)
        )
    console.print(requests)
    console.print(
        f"lost: {result['lost']} (missing lines {len(result['missing_lines'])}, duplicated lines "
        f"{len(result['duplicate_lines'])}); answers differing from the first to the same body: "
        f"{result['mismatched_answers']}; interactive latency {result['interactive_latency_s']}"
    )
    console.print(f"the fleet's failover counters: {result['failover_counters']}", markup=False, highlight=False)
    for error, count in result["errors"].items():
        console.print(f"  {count:5d} × {error}", markup=False, highlight=False)
    rss = Table(title=f"RSS (MiB), slope after the warm-up ({result['rss_warmup_s']:g} s from each start)")
    for column in ("process", "pid", "lived s", "first", "last", "peak", "samples", "slope MiB/min"):
        rss.add_column(column, justify="left" if column == "process" else "right")
    for s in result["rss"]:
        slope = "-" if s["slope_mib_per_min"] is None else f"{s['slope_mib_per_min']:+.3f}"
        rss.add_row(s["name"], str(s["pid"]), f"{s['lived_s']:.0f}", f"{s['first_mib']:.1f}", f"{s['last_mib']:.1f}",
                    f"{s['peak_mib']:.1f}", str(s["samples_after_warmup"]), slope)  # fmt: skip
    console.print(rss)
    keys = Table(title="Redis keys by family: before the load / after the settle (without TTL)")
    for column in ("family", "before", "after", "after, no TTL"):
        keys.add_column(column, justify="left" if column == "family" else "right")
    before, after = result["keys_before"], result["keys_after"]
    for family in sorted(set(before["families"]) | set(after["families"])):
        keys.add_row(family, str(before["families"].get(family, 0)), str(after["families"].get(family, 0)),
                     str(after["without_ttl"].get(family, 0)))  # fmt: skip
    console.print(keys)
    memory = result["redis_used_memory_mib"]
    console.print(f"Redis used_memory: {memory['before']} MiB before the load, {memory['after']} MiB after the settle")
    console.print(f"leaked keys: {result['leaked_keys']}")
    for leak in after["leaks"][:20]:
        console.print(f"  {leak}", markup=False, highlight=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--kill-every-s", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="the result as JSON on stdout (tables: stderr)")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=6, help="interactive streams at once")
    parser.add_argument("--batch-lines", type=int, default=24)
    parser.add_argument("--warmup-s", type=float, default=120.0, help="RSS samples ignored after each start")
    parser.add_argument("--min-samples", type=int, default=12, help="fewest samples after the warm-up for a slope")
    parser.add_argument("--sample-every-s", type=float, default=5.0)
    parser.add_argument("--settle-s", type=float, default=30.0)
    args = parser.parse_args()
    console = Console(width=160, stderr=args.json)
    result = run(args, console)
    result["rss_warmup_s"] = args.warmup_s
    print_summary(result, console)
    if args.json:
        print(json.dumps(result, indent=2))
    failed = result["lost"] or result["mismatched_answers"] or result["crashes"] or result["leaked_keys"]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
