"""A fake worker for the relay benchmark: the fleet protocol without a model.

It speaks through the real worker's ``RedisTransport`` (requests taken with the consumer group, one
``MULTI`` pipeline per step publishing every event with its record append, finished requests
acknowledged), and announces the built-in tokenizer under ``--model``. Each step emits the next
``--tokens-per-event`` pre-made tokens of every running choice, with no pause between steps, so the
gateway and its clients set the pace; with ``--step-ms``, a step that publishes starts at least that long
after the one before (a model's step time: a batch of B running choices then makes B tokens a step). A
choice ends (``length``) at its ``max_tokens``; a cancel ends it at once (``abort``). SIGTERM stops it.

``--redis`` takes any ``MET_REDIS_URL`` form: on a Redis Cluster (``redis+cluster://``) the key space has
the fleet's request shards (``Keys.for_redis``) and the transport writes one transaction per shard.

With ``--stats FILE``, SIGUSR1 writes the worker's counters so far to ``FILE`` as JSON (``WorkerCounts``:
the steps that published something, their token events and tokens), for a bench to price Redis's work
per step.

    python -m bench.relay_worker --redis URL --namespace NS [--model NAME] [--tokens-per-event 1] [--stats FILE]
                                 [--step-ms 0]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from metrale.shared.keys import Keys
from metrale.shared.messages import FinishReason, GenerateRequest, ModelAnnouncement, TokenEvent, Usage, WorkerHeartbeat
from metrale.text.builtin_tokenizer import (
    BUILTIN_VOCAB_SIZE,
    STOP_TOKEN_IDS,
    build_builtin_tokenizer,
    builtin_tokenizer_config,
)
from metrale.worker.fleet.broker.redis_transport import BUSY_POLL_S, RedisTransport, redis_client
from metrale.worker.fleet.transport import FinishedRequest, Received

SCRIPT_TEXT = "The lighthouse keeper woke before dawn and climbed the stairs to the lamp. "
MAX_RUNNING = 1024
"""Requests served at once; more than any benchmark keeps in flight."""
HEARTBEAT_TTL_S = 10
IDLE_BLOCK_MS = 50


@dataclass(slots=True)
class WorkerCounts:
    """What a relay worker has published since it started."""

    steps: int = 0
    """Steps that published a token event or finished a request (one ``publish`` call each)."""
    events: int = 0
    tokens: int = 0

    def write(self, path: Path) -> None:
        """The counts to ``path`` as JSON, replacing it whole (a reader never sees half a file)."""
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(dataclasses.asdict(self)))
        os.replace(partial, path)


@dataclass(slots=True)
class _Running:
    """A request being answered: per choice, tokens sent and whether its final event went out."""

    request: GenerateRequest
    emitted: list[int]
    ended: list[bool]
    aborted: bool = False
    seq: int = 0

    @property
    def finished(self) -> bool:
        return all(self.ended)


def relay_announcement(model: str) -> ModelAnnouncement:
    """The built-in tokenizer, announced as ``model``."""
    return ModelAnnouncement(
        model=model,
        tokenizer_json=build_builtin_tokenizer().to_str(),
        tokenizer_config_json=json.dumps(builtin_tokenizer_config()),
        max_model_len=1 << 20,
        vocab_size=BUILTIN_VOCAB_SIZE,
        eos_token_ids=list(STOP_TOKEN_IDS),
        fingerprint="relay-" + "0" * 58,
    )


class ScriptedWorker:
    """Answers every choice with ``script`` (cycled), ``tokens_per_event`` tokens per step."""

    def __init__(
        self,
        transport: RedisTransport,
        worker_id: str,
        model: ModelAnnouncement,
        tokens_per_event: int,
        stats: Path | None = None,
        step_s: float = 0.0,
    ):
        self._transport = transport
        self._worker_id = worker_id
        self._model = model
        self._script = build_builtin_tokenizer().encode(SCRIPT_TEXT, add_special_tokens=False).ids
        self._tokens_per_event = tokens_per_event
        self._running: dict[str, _Running] = {}
        self._started_at = time.time()
        self._next_heartbeat = 0.0
        self.counts = WorkerCounts()
        self._stats = stats
        self._stats_due = False
        self._step_s = step_s
        self._next_step = 0.0  # monotonic time before which no step publishes (with ``step_s``)

    def ask_for_counts(self) -> None:
        """Have the loop write the counts to the stats file after its current step (a signal handler)."""
        self._stats_due = True

    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set, then withdraw the heartbeat."""
        self._transport.announce(self._model)
        try:
            while not stop.is_set():
                self._abort(self._transport.cancellations())
                room = MAX_RUNNING - len(self._running)
                self._admit(self._transport.receive(room, 0 if self._running else IDLE_BLOCK_MS))
                if self._running and self._step_s > 0:
                    self._pace()
                events, finished = self._step()
                self._transport.publish(events, finished)
                if events or finished:
                    self.counts.steps += 1
                    self.counts.events += len(events)
                    self.counts.tokens += sum(len(event.token_ids) for event in events)
                if self._stats_due and self._stats is not None:
                    self._stats_due = False
                    self.counts.write(self._stats)
                self._heartbeat_if_due()
        finally:
            self._transport.close()

    def _pace(self) -> None:
        """Wait out the rest of the step time since the last step that published."""
        now = time.monotonic()
        if now < self._next_step:
            time.sleep(self._next_step - now)
        self._next_step = max(now, self._next_step) + self._step_s

    def _admit(self, received: Sequence[Received]) -> None:
        for request in received:  # only new requests: no other worker serves this namespace to hand any back
            if isinstance(request, GenerateRequest):
                self._running[request.request_id] = _Running(request, [0] * request.n, [False] * request.n)

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if request_id in self._running:
                self._running[request_id].aborted = True  # the next step sends the final events

    def _step(self) -> tuple[list[TokenEvent], list[FinishedRequest]]:
        events: list[TokenEvent] = []
        finished: list[FinishedRequest] = []
        for request_id, running in list(self._running.items()):
            events += [self._next_event(running, i) for i in range(running.request.n) if not running.ended[i]]
            if running.finished:
                reason = FinishReason.ABORT if running.aborted else FinishReason.LENGTH
                finished.append(FinishedRequest(request_id, reason))
                del self._running[request_id]
        return events, finished

    def _next_event(self, running: _Running, index: int) -> TokenEvent:
        request, start = running.request, running.emitted[index]
        count = 0 if running.aborted else min(self._tokens_per_event, request.max_tokens - start)
        tokens = [self._script[(start + k + index) % len(self._script)] for k in range(count)]
        running.emitted[index] += count
        done = running.aborted or running.emitted[index] == request.max_tokens
        running.ended[index] = done
        event = TokenEvent(
            request_id=request.request_id,
            index=index,
            seq=running.seq,
            token_ids=tokens,
            worker_id=self._worker_id,
            finished=done,
            finish_reason=(FinishReason.ABORT if running.aborted else FinishReason.LENGTH) if done else None,
            usage=Usage(len(request.prompt_token_ids), running.emitted[index], 0) if done else None,
        )
        running.seq += 1
        return event

    def _heartbeat_if_due(self) -> None:
        now = time.monotonic()
        if now < self._next_heartbeat:
            return
        running = len(self._running)
        beat = WorkerHeartbeat(
            worker_id=self._worker_id,
            model=self._model.model,
            running=running,
            waiting=0,
            swapped=0,
            batch_size=running,
            tokens_per_s=0.0,
            free_slots=MAX_RUNNING - running,
            free_blocks=0,
            started_at=self._started_at,
            sent_at=time.time(),
        )
        self._transport.heartbeat(beat)
        self._next_heartbeat = now + HEARTBEAT_TTL_S / 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--model", default="relay-model")
    parser.add_argument("--worker-id", default="relay-worker")
    parser.add_argument("--tokens-per-event", type=int, default=1)
    parser.add_argument("--stats", type=Path, default=None, help="where SIGUSR1 writes the counts (JSON)")
    parser.add_argument("--step-ms", type=float, default=0.0, help="the least time from one step to the next")
    args = parser.parse_args()
    if args.tokens_per_event < 1:
        parser.error("--tokens-per-event must be at least 1")
    if args.step_ms < 0:
        parser.error("--step-ms must not be negative")
    keys = Keys.for_redis(args.redis, args.namespace)
    transport = RedisTransport(
        redis_client(args.redis),
        worker_id=args.worker_id,
        keys=keys,
        heartbeat_ttl_s=HEARTBEAT_TTL_S,
        poll_every_s=BUSY_POLL_S,
    )
    announcement = relay_announcement(args.model)
    worker = ScriptedWorker(
        transport, args.worker_id, announcement, args.tokens_per_event, args.stats, step_s=args.step_ms / 1000
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    if args.stats is not None:
        signal.signal(signal.SIGUSR1, lambda *_: worker.ask_for_counts())
    worker.run(stop)


if __name__ == "__main__":
    main()
