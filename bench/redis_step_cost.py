"""Redis CPU per token of one worker step's writes, by how the step's events are laid out (issue #34).

    python bench/redis_step_cost.py [--streams 64] [--steps 3000] [--payload 60]

A private ``redis-server`` (``bench.fleet.private_redis``) and one subscriber draining every channel in a
thread; each step is one ``MULTI`` of ``--streams`` one-token events of ``--payload`` bytes, in each
layout below. Redis's CPU (``/proc``, user + system) over the steps, per token:

- ``per event``: a ``PUBLISH`` per event on its request's channel and an ``RPUSH`` per request (the
  fleet before issue #34);
- ``grouped``: one ``PUBLISH`` of the step's events on the gateway's reply channel, an ``RPUSH`` per
  request (``GenerateRequest.reply_to``);
- ``step log``: one ``PUBLISH`` and one ``XADD`` of the step's events to a capped per-worker stream (no
  per-request write: a design in which a request's record is its compacted list plus that log's tail);
- ``step log, compacted every 32 steps``: the same, and per step the 1/32 of the requests whose 32
  events are moved to their lists (an ``RPUSH`` and an ``HSET`` each);
- ``grouped, each record appended every N steps``: one ``PUBLISH`` of the step's events, and per step the
  1/N of the requests whose N events are appended to their record at once (a worker that kept each
  request's events back for N steps before writing its record, publishing every step);
- ``PING``: one ``PING`` in a ``MULTI`` — the round trip's own cost, the floor of any layout.
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fleet import private_redis, process_cpu_s

Layout = Callable[[redis.client.Pipeline, int], None]


def layouts(streams: int, payload: bytes) -> dict[str, Layout]:
    channels = [f"met:out:req-{n}" for n in range(streams)]
    lists = [f"met:run:req-{n}:events" for n in range(streams)]
    group = payload * streams
    compact_every = 32
    per_step = max(1, streams // compact_every)

    def per_event(pipe: redis.client.Pipeline, _: int) -> None:
        for channel in channels:
            pipe.publish(channel, payload)
        for key in lists:
            pipe.rpush(key, payload)

    def grouped(pipe: redis.client.Pipeline, _: int) -> None:
        pipe.publish("met:relay:gateway-1", group)
        for key in lists:
            pipe.rpush(key, payload)

    def step_log(pipe: redis.client.Pipeline, _: int) -> None:
        pipe.publish("met:relay:gateway-1", group)
        pipe.xadd("met:steps:worker-1", {"events": group}, maxlen=4 * compact_every, approximate=True)

    def compacted(pipe: redis.client.Pipeline, step: int) -> None:
        step_log(pipe, step)
        for n in range(per_step):
            request = (step * per_step + n) % streams
            pipe.rpush(lists[request], *([payload] * compact_every))
            pipe.hset(f"met:run:req-{request}", "log_after", str(step))

    def appended_every(steps: int) -> Layout:
        share = max(1, streams // steps)

        def layout(pipe: redis.client.Pipeline, step: int) -> None:
            pipe.publish("met:relay:gateway-1", group)
            for n in range(share):
                pipe.rpush(lists[(step * share + n) % streams], *([payload] * steps))

        return layout

    def ping(pipe: redis.client.Pipeline, _: int) -> None:
        pipe.ping()

    return {
        "per event": per_event,
        "grouped": grouped,
        "step log": step_log,
        f"step log, compacted every {compact_every} steps": compacted,
        "grouped, each record appended every 8 steps": appended_every(8),
        "grouped, each record appended every 16 steps": appended_every(16),
        "PING": ping,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--payload", type=int, default=60, help="bytes of one encoded event")
    args = parser.parse_args()
    with private_redis() as server:
        client = redis.Redis.from_url(server.url)
        pid = int(client.info("server")["process_id"])
        listener = redis.Redis.from_url(server.url).pubsub()
        listener.psubscribe("met:*")
        stop = threading.Event()

        def drain() -> None:
            while not stop.is_set():
                listener.get_message(timeout=0.05)

        thread = threading.Thread(target=drain, daemon=True)
        thread.start()
        print(f"| layout | Redis CPU µs per token ({args.streams} streams, one token per event) |")
        print("|---|---:|")
        for name, layout in layouts(args.streams, b"x" * args.payload).items():
            client.flushdb()
            before = process_cpu_s(pid)
            for step in range(args.steps):
                with client.pipeline(transaction=True) as pipe:
                    layout(pipe, step)
                    pipe.execute()
            used = process_cpu_s(pid) - before
            print(f"| {name} | {1e6 * used / (args.steps * args.streams):.2f} |")
        stop.set()
        thread.join(5)
        listener.close()
        client.close()


if __name__ == "__main__":
    main()
