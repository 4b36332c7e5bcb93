"""Fleet benchmark: throughput with 1, 2, 4, 8 worker processes, and the gap a client's stream sees
when its worker dies (SIGKILL) or stops (SIGTERM, handing its requests back).

Workers run a fixed-cost fake model (``FixedCostModel``: every forward sleeps ``--forward-ms``, for
up to ``--max-seqs`` sequences at once, like one GPU step), so throughput measures the fleet — Redis,
transport, scheduling — not the model: the ideal is N × max_seqs × 1000 / forward_ms tokens/s.
Requests go straight to the request streams (no gateway); the gaps are measured on a pattern
subscription to every token channel, the events a gateway relays.

    python -m bench.failover [--workers 1,2,4,8] [--forward-ms 20] [--max-seqs 32] [--ttl 2]
    python -m bench.failover worker --redis URL --namespace NS --name NAME ...   (started by the above)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import redis
import torch
from rich.console import Console
from rich.table import Table

from bench.relay_worker import relay_announcement
from metrale.cli.embedded_redis import start_embedded_redis
from metrale.shared.codec import decode, encode
from metrale.shared.keys import Keys
from metrale.shared.messages import GenerateRequest, TokenEvent, TokenEventGroup
from metrale.shared.record import RunStatus, read_record, set_status
from metrale.shared.settings import KernelBackend, WorkerSettings
from metrale.text.builtin_tokenizer import BUILTIN_VOCAB_SIZE
from metrale.worker.checkpoints.manager import CheckpointManager
from metrale.worker.checkpoints.sessions import RedisSessions
from metrale.worker.checkpoints.store import MemoryTier, RedisTier, TieredStore
from metrale.worker.checkpoints.writer import CheckpointWriter
from metrale.worker.engine.engine import Engine
from metrale.worker.fleet.broker.redis_transport import RedisTransport, redis_client
from metrale.worker.fleet.failover_counters import HashCounterSink
from metrale.worker.fleet.service import Worker
from metrale.worker.model.interface import ForwardChunk, SequenceState
from metrale.worker.scheduler.config import SchedulerConfig

MODEL = "fixed-cost"
BLOCK_SIZE = 16
MAX_MODEL_LEN = 2048
console = Console()


class FixedCostModel:
    """A ``StatefulModel`` whose forward costs ``forward_s`` whatever it holds; its state (a hash of
    the tokens consumed) cannot be rewound, and its logits are a fixed function of that state."""

    def __init__(self, num_slots: int, num_blocks: int, forward_s: float) -> None:
        self.num_slots, self.num_blocks, self.block_size = num_slots, num_blocks, BLOCK_SIZE
        self.vocab_size = BUILTIN_VOCAB_SIZE
        self._forward_s = forward_s
        self._digests = [b""] * num_slots
        self._table = torch.randn(4096, self.vocab_size, generator=torch.Generator().manual_seed(0))

    def forward(self, chunks: Sequence[ForwardChunk]) -> torch.Tensor:
        time.sleep(self._forward_s)
        rows = []
        for chunk in chunks:
            seed = b"" if chunk.start == 0 else self._digests[chunk.slot]
            digest = hashlib.blake2b(seed + bytes(str(list(chunk.token_ids)), "ascii"), digest_size=8).digest()
            self._digests[chunk.slot] = digest
            rows.append(self._table[int.from_bytes(digest, "little") % len(self._table)])
        return torch.stack(rows)

    def export_state(self, slot: int, block_ids: Sequence[int], length: int) -> SequenceState:
        return {"digest": torch.tensor(list(self._digests[slot]), dtype=torch.uint8)}

    def import_state(self, state: SequenceState, slot: int, block_ids: Sequence[int]) -> None:
        self._digests[slot] = bytes(state["digest"].tolist())

    def state_nbytes(self, length: int) -> int:
        return 8


def serve(args: argparse.Namespace) -> None:
    """One worker process over the fake model, until SIGTERM (handing its requests back)."""
    keys = Keys(args.namespace)
    settings = WorkerSettings(
        redis_url=args.redis, model_dir=None,
        checkpoint_dir=None, kernels=KernelBackend.TORCH, heartbeat_ttl_s=args.ttl, namespace=args.namespace,
        drain_handoff=True, decode_checkpoint_interval=args.decode_interval,
    )  # fmt: skip
    blocks = args.max_seqs * (MAX_MODEL_LEN // BLOCK_SIZE)
    config = SchedulerConfig(
        max_batch_tokens=max(1024, args.max_seqs), max_seqs=args.max_seqs, num_slots=args.max_seqs,
        num_blocks=blocks, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
    )  # fmt: skip
    model = FixedCostModel(args.max_seqs, blocks, args.forward_ms / 1000)
    engine = Engine(model, config, decode_checkpoint_interval=args.decode_interval)
    client = redis_client(args.redis)
    store = TieredStore([MemoryTier(64 << 20), RedisTier(client)])
    manager = CheckpointManager(store, RedisSessions(client, keys), fingerprint=MODEL, dtype="uint8", keys=keys)
    transport = RedisTransport(client, worker_id=args.name, keys=keys, heartbeat_ttl_s=args.ttl)
    worker = Worker(
        engine, transport, settings, worker_id=args.name, model=relay_announcement(MODEL),
        checkpoints=CheckpointWriter(manager), failover_sink=HashCounterSink(client, keys.failover_counters()),
    )  # fmt: skip
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    worker.run(stop)


@dataclass
class Bench:
    """The orchestrator's options and its Redis."""

    url: str
    forward_ms: float
    max_seqs: int
    ttl: int
    decode_interval: int

    def start_workers(self, keys: Keys, count: int) -> dict[str, subprocess.Popen[bytes]]:
        workers = {}
        for i in range(count):
            name = f"bench-worker-{i}"
            command = [sys.executable, "-m", "bench.failover", "worker", "--redis", self.url, "--namespace"]
            command += [keys.namespace, "--name", name, "--forward-ms", str(self.forward_ms)]
            command += ["--max-seqs", str(self.max_seqs), "--ttl", str(self.ttl)]
            command += ["--decode-interval", str(self.decode_interval)]
            environment = {**os.environ, "OMP_NUM_THREADS": "1"}
            workers[name] = subprocess.Popen(command, env=environment, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        while not all(client.exists(keys.worker(name)) for name in workers):
            time.sleep(0.05)
        return workers

    def submit(self, keys: Keys, count: int, max_tokens: int) -> list[str]:
        client = redis.Redis.from_url(self.url)
        ids = [f"bench-{uuid.uuid4().hex}" for _ in range(count)]
        with client.pipeline(transaction=False) as pipe:
            for i, request_id in enumerate(ids):
                prompt = [(i * 7 + k) % 500 + 5 for k in range(16)]
                request = GenerateRequest(request_id, MODEL, "bench", prompt, max_tokens=max_tokens, ignore_eos=True)
                set_status(pipe, request_id, RunStatus.QUEUED, keys=keys)
                pipe.xadd(keys.request_stream(request.priority), {"msg": encode(request)})
            pipe.execute()
        return ids

    def wait_finished(self, keys: Keys, ids: Sequence[str]) -> float:
        """Wait until every request finished; raise if one ended with an error. Polls only the requests not
        yet seen finished, so the poller's own load on Redis and the CPU shrinks as the run ends. Returns
        when (``time.monotonic()``) all were seen finished, before their records are read for errors."""
        client = redis.Redis.from_url(self.url)
        pending = list(ids)
        while pending:
            with client.pipeline(transaction=False) as pipe:
                for request_id in pending:
                    pipe.hget(keys.run_record(request_id), "status")
                statuses = pipe.execute()
            finished = RunStatus.FINISHED.value.encode()
            pending = [request_id for request_id, status in zip(pending, statuses, strict=True) if status != finished]
            if pending:
                time.sleep(0.05)
        finished_at = time.monotonic()
        errors = [r for r in (read_record(client, i, keys=keys) for i in ids) if r and r.error]
        if errors:
            raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0].error}")
        return finished_at

    def throughput(self, workers: int, waves: int, max_tokens: int) -> float:
        """Generated tokens per second with ``workers`` processes kept full for ``waves`` rounds."""
        keys = Keys(f"bench-{uuid.uuid4().hex[:8]}")
        processes = self.start_workers(keys, workers)
        try:
            started = time.monotonic()
            ids = self.submit(keys, workers * self.max_seqs * waves, max_tokens)
            finished_at = self.wait_finished(keys, ids)  # the clock stops before the records are checked
            return len(ids) * max_tokens / (finished_at - started)
        finally:
            stop(processes.values())

    def failover_gaps(self, how: signal.Signals, requests: int, max_tokens: int) -> list[float]:
        """Seconds between a moved request's last event from its first worker and its next event,
        when the busiest of two workers gets ``how`` mid-run."""
        keys = Keys(f"bench-{uuid.uuid4().hex[:8]}")
        processes = self.start_workers(keys, 2)
        tap = Tap(self.url, keys)
        try:
            ids = self.submit(keys, requests, max_tokens)
            deadline = time.monotonic() + 120
            while tap.events_heard < requests * max_tokens // 4:
                if time.monotonic() > deadline:
                    raise RuntimeError("the workers stream nothing; are they failing?")
                time.sleep(0.01)
            busiest = tap.busiest_worker()
            processes[busiest].send_signal(how)
            self.wait_finished(keys, ids)
            return tap.gaps(busiest)
        finally:
            tap.close()
            stop(processes.values())


class Tap:
    """Arrival times of every token event under ``keys`` (on request or reply channels), by request:
    ``(time, worker)``."""

    def __init__(self, url: str, keys: Keys) -> None:
        self.arrivals: dict[str, list[tuple[float, str, bool]]] = defaultdict(list)
        self.events_heard = 0
        self._stop = threading.Event()
        self._pubsub = redis.Redis.from_url(url).pubsub()
        self._pubsub.psubscribe(keys.token_channel_pattern(), keys.reply_channel_pattern())
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def busiest_worker(self) -> str:
        running: dict[str, int] = defaultdict(int)
        for arrivals in list(self.arrivals.values()):
            _, worker, finished = arrivals[-1]
            running[worker] += not finished
        return max(running, key=lambda worker: running[worker])

    def gaps(self, lost: str) -> list[float]:
        gaps = []
        for arrivals in self.arrivals.values():
            moved = [i for i in range(1, len(arrivals)) if arrivals[i - 1][1] == lost and arrivals[i][1] != lost]
            gaps += [arrivals[i][0] - arrivals[i - 1][0] for i in moved]
        return gaps

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._pubsub.close()

    def _listen(self) -> None:
        while not self._stop.is_set():
            message = self._pubsub.get_message(timeout=0.1)
            if message is None or message["type"] != "pmessage":
                continue
            decoded = decode(message["data"])
            events = [decode(raw) for raw in decoded.events] if isinstance(decoded, TokenEventGroup) else [decoded]
            for event in events:
                if isinstance(event, TokenEvent):
                    self.arrivals[event.request_id].append((time.monotonic(), event.worker_id, event.finished))
                    self.events_heard += 1


def stop(processes: Iterable[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every process (workers hand their requests back), then wait; kill the slow ones."""
    processes = list(processes)
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def percentile(values: Sequence[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def report(bench: Bench, args: argparse.Namespace) -> None:
    ideal_per_worker = bench.max_seqs * 1000 / bench.forward_ms
    table = Table(title=f"throughput, {bench.forward_ms:g} ms per forward, {bench.max_seqs} sequences per worker")
    for column in ("workers", "tokens/s", "ideal", "x one worker", "goal (0.9 N)"):
        table.add_column(column, justify="right")
    single = None
    for count in args.workers:
        rate = bench.throughput(count, args.waves, args.max_tokens)
        single = single or rate
        table.add_row(
            str(count), f"{rate:,.0f}", f"{count * ideal_per_worker:,.0f}", f"{rate / single:.2f}", f"{0.9 * count:.1f}"
        )
    console.print(table)
    if args.failover_requests > 0:
        console.print(failover_table(bench, args))
    console.print(f"{os.cpu_count()} CPUs here; workers, Redis and this client share them.")


def failover_table(bench: Bench, args: argparse.Namespace) -> Table:
    """The gap a moved stream sees when the busiest of two workers is killed, or stopped and hands back."""
    gaps = Table(title=f"failover: gap in a moved stream (heartbeat TTL {bench.ttl} s, 2 workers)")
    for column in ("stopped by", "moved streams", "p50 s", "p99 s", "max s"):
        gaps.add_column(column, justify="right")
    for how in (signal.SIGKILL, signal.SIGTERM):
        measured = bench.failover_gaps(how, args.failover_requests, args.failover_tokens)
        if measured:
            row = [percentile(measured, 0.5), percentile(measured, 0.99), max(measured)]
            gaps.add_row(how.name, str(len(measured)), *(f"{value:.3f}" for value in row))
        else:
            gaps.add_row(how.name, "0", "-", "-", "-")
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", nargs="?", choices=["bench", "worker"], default="bench")
    parser.add_argument("--redis", help="Redis URL (default: a private redis-server)")
    parser.add_argument("--namespace", default="bench")
    parser.add_argument("--name", default="bench-worker")
    parser.add_argument("--workers", type=lambda text: [int(n) for n in text.split(",")], default=[1, 2, 4, 8])
    parser.add_argument("--forward-ms", type=float, default=20.0)
    parser.add_argument("--max-seqs", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--waves", type=int, default=3, help="full batches per worker in a throughput run")
    parser.add_argument("--ttl", type=int, default=2, help="heartbeat TTL (s)")
    parser.add_argument("--decode-interval", type=int, default=64)
    parser.add_argument("--failover-requests", type=int, default=32)
    parser.add_argument("--failover-tokens", type=int, default=200)
    args = parser.parse_args()
    if args.role == "worker":
        serve(args)
        return
    embedded = start_embedded_redis() if args.redis is None else None
    url = args.redis if embedded is None else embedded.url
    try:
        report(Bench(url, args.forward_ms, args.max_seqs, args.ttl, args.decode_interval), args)
    finally:
        if embedded is not None:
            embedded.close()


if __name__ == "__main__":
    main()
