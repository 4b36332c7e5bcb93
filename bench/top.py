"""What one ``met top`` refresh costs: every panel's query against a real Redis holding a fake fleet.

    python bench/top.py [--redis redis://127.0.0.1:6379/15] [--workers 100] [--requests 2000]

Writes a fleet of ``--workers`` heartbeats and ``--requests`` requests in flight (spread over the
workers, ``--tokens`` events each in their records), a few waiting, counters and batches, under a
namespace of its own, then times ``read_snapshot`` (each refresh given the one before, as the app
does, with a third of the heartbeats rewritten between refreshes as live workers beating every third
of a 10 s TTL would) and prints the median, 90th percentile and worst, and the Redis commands one refresh sends.
The namespace is deleted at the end.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis

from metrale.shared.keys import Keys
from metrale.top.queries.snapshot import read_snapshot
from tests.top.fake_fleet import FakeFleet, request


def build(fleet: FakeFleet, workers: int, requests: int, tokens: int) -> None:
    now = fleet.now
    for w in range(workers):
        fleet.worker(f"worker-{w:03d}", running=requests // workers, free_slots=64, total_slots=96)
        mine = [
            request(f"req-{w:03d}-{i:04d}", now, age_s=60.0, tenant=f"tenant-{i % 7}")
            for i in range(w, requests, workers)
        ]
        fleet.take(f"worker-{w:03d}", mine, tokens=tokens, taken_ago_s=50.0)
    for i in range(20):
        fleet.submit(request(f"wait-{i:02d}", now, age_s=5.0 - i * 0.1))
    fleet.counters(checkpoints={"lookups": 1000, "hits": 800, "miss:none": 200}, failover={"resumed_requests": 4})
    for b in range(5):
        fleet.batch(f"tenant-{b}", f"batch_{b}", total=1000, completed=100 * b, failed=b, running_s=60.0)


def commands_per_refresh(client: redis.Redis, keys: Keys, now: float) -> int:
    before = int(client.info("stats")["total_commands_processed"])
    read_snapshot(client, keys, now)
    return int(client.info("stats")["total_commands_processed"]) - before - 1  # the INFO itself


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/15")
    parser.add_argument("--workers", type=int, default=100)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=20)
    parser.add_argument("--refreshes", type=int, default=50)
    args = parser.parse_args()

    client = redis.Redis.from_url(args.redis)
    keys = Keys(f"bench-top-{uuid.uuid4().hex[:8]}")
    now = time.time()
    try:
        started = time.perf_counter()
        build(FakeFleet(client, keys, now), args.workers, args.requests, args.tokens)
        print(f"fleet written in {time.perf_counter() - started:.1f} s")
        previous = read_snapshot(client, keys, now)
        assert len(previous.fleet.workers) == args.workers and len(previous.requests.rows) == args.requests
        timings = []
        fleet = FakeFleet(client, keys, now)
        for i in range(args.refreshes):
            for w in range(i % 3, args.workers, 3):  # a third beat again between refreshes, as live ones do
                fleet.worker(f"worker-{w:03d}", running=args.requests // args.workers, tokens_per_s=10.0 + i)
            began = time.perf_counter()
            previous = read_snapshot(client, keys, now + i + 1, previous=previous)
            timings.append((time.perf_counter() - began) * 1000)
        timings.sort()
        p90 = timings[int(len(timings) * 0.9) - 1]
        print(
            f"{args.workers} workers, {args.requests} requests in flight: one refresh "
            f"median {statistics.median(timings):.1f} ms, p90 {p90:.1f} ms, worst {timings[-1]:.1f} ms "
            f"({args.refreshes} refreshes; {commands_per_refresh(client, keys, now)} Redis commands each)"
        )
    finally:
        doomed = list(client.scan_iter(match=f"{keys.namespace}:*", count=1000))
        for start in range(0, len(doomed), 500):
            client.delete(*doomed[start : start + 500])
        client.close()


if __name__ == "__main__":
    main()
