"""What a subscriber pays per message: plain pub/sub on one Redis against sharded pub/sub on a Redis
Cluster, both through redis-py's asyncio clients (issue #34: the gateway relay's receive path).

First every message is published (``--messages`` payloads of ``--payload`` bytes round robin over
``--channels`` channels, pipelined ``PUBLISH`` / ``SPUBLISH``, ``--batch`` per round trip, each to the node
owning its channel); they wait in the subscriber's buffers. Then one asyncio subscriber reads them all
(``PubSub.get_message`` / ``ClusterPubSub.get_sharded_message``). Reported per mode: messages per second
read, the subscriber thread's CPU µs per message (``time.thread_time``), and the publish rate. Starts its
own ``redis-server`` and 3 + 3 node cluster (``tests/failover/cluster.py``).

    .venv/bin/python -m bench.cluster_pubsub [--messages 50000] [--channels 64]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from metrale.shared.redis_connect import async_client, async_cluster_client, sync_client, sync_cluster_client
from metrale.worker.fleet.broker.cluster_router import SlotRouter
from tests.failover.cluster import ClusterGroup
from tests.failover.processes import RedisServer


def publish(client: Any, command: str, channels: list[str], options: argparse.Namespace) -> float:
    """Send every message, ``--batch`` per pipelined round trip to the node owning each channel's slot
    (as a worker's hand-packed transactions would go, not through redis-py's cluster pipeline); seconds."""
    payload = b"x" * options.payload
    nodes = {channel: SlotRouter(client).primary_for(channel) for channel in channels} if command == "SPUBLISH" else {}
    began = time.perf_counter()
    for start in range(0, options.messages, options.batch):
        by_node: dict[int, tuple[Any, list[str]]] = {}
        for index in range(start, min(start + options.batch, options.messages)):
            channel = channels[index % len(channels)]
            node = nodes.get(channel, client)
            by_node.setdefault(id(node), (node, []))[1].append(channel)
        for node, targets in by_node.values():
            with node.pipeline(transaction=False) as pipe:
                for channel in targets:
                    pipe.execute_command(command, channel, payload)
                pipe.execute()
    return time.perf_counter() - began


async def receive(pubsub: Any, sharded: bool, messages: int, timeout_s: float) -> tuple[int, float, float]:
    """Messages received, wall seconds, subscriber-thread CPU seconds (from the first message)."""
    read = pubsub.get_sharded_message if sharded else pubsub.get_message
    received, began_wall, began_cpu = 0, 0.0, 0.0
    deadline = time.monotonic() + timeout_s
    while received < messages and time.monotonic() < deadline:
        message = await read(ignore_subscribe_messages=True, timeout=1.0)
        if message is None:
            continue
        if received == 0:
            began_wall, began_cpu = time.perf_counter(), time.thread_time()
        received += 1
    return received, time.perf_counter() - began_wall, time.thread_time() - began_cpu


async def run_mode(url: str, sharded: bool, options: argparse.Namespace) -> dict[str, float]:
    channels = [f"met:bench:out:{{c{index}}}" for index in range(options.channels)]
    subscriber = async_cluster_client(url) if sharded else async_client(url)
    publisher = sync_cluster_client(url) if sharded else sync_client(url)
    pubsub = subscriber.pubsub()
    if sharded:
        await pubsub.ssubscribe(*channels)
    else:
        await pubsub.subscribe(*channels)
    for _ in range(len(channels)):  # the confirmations
        await (pubsub.get_sharded_message(timeout=2.0) if sharded else pubsub.get_message(timeout=2.0))
    command = "SPUBLISH" if sharded else "PUBLISH"
    published_s = await asyncio.to_thread(publish, publisher, command, channels, options)  # all sent, unread
    received, wall, cpu = await receive(pubsub, sharded, options.messages, timeout_s=120)
    await pubsub.aclose()
    await subscriber.aclose()
    publisher.close()
    return {
        "received": received,
        "msg_per_s": received / wall,
        "cpu_us_per_msg": 1e6 * cpu / received,
        "published_per_s": options.messages / published_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=50000)
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--payload", type=int, default=200, help="bytes per message (a step's group of events)")
    parser.add_argument("--batch", type=int, default=64, help="publishes per pipelined round trip")
    parser.add_argument("--repeats", type=int, default=2)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        single = RedisServer(Path(directory) / "single")
        (Path(directory) / "single").mkdir()
        cluster = ClusterGroup(Path(directory))
        try:
            single.start()
            cluster.start()
            for repeat in range(options.repeats):
                for name, url, sharded in (
                    ("single PUBLISH", single.url, False),
                    ("cluster SPUBLISH", cluster.url, True),
                ):
                    result = asyncio.run(run_mode(url, sharded, options))
                    print(f"run {repeat + 1} {name:17} " + "  ".join(f"{k} {v:,.1f}" for k, v in result.items()))
        finally:
            single.stop()
            cluster.stop()


if __name__ == "__main__":
    main()
