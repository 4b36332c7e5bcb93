"""Workers of the tiny model sharing one fakeredis server, any of which can be killed mid-request
(it stops talking to Redis at once and for good, as after ``kill -9``)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import fakeredis
import pytest

from metrale.shared.codec import encode
from metrale.shared.keys import Keys
from metrale.shared.messages import GenerateRequest, ModelAnnouncement, TokenEvent, WorkerHeartbeat
from metrale.shared.record import RunRecord, RunStatus, read_record, set_status
from metrale.shared.settings import WorkerSettings
from metrale.worker.checkpoints.writer import CheckpointWriter
from metrale.worker.engine.factory import EngineLimits, LoadedModel, build_engine
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.fleet.announcement import model_announcement
from metrale.worker.fleet.assembly import checkpoint_manager
from metrale.worker.fleet.broker.redis_transport import RedisTransport
from metrale.worker.fleet.service import Worker
from metrale.worker.fleet.transport import FinishedRequest, Received, StartedRequest
from tests.worker.worker_helpers import worker_settings

MODEL = "tiny"
HEARTBEAT_TTL_S = 1
DECODE_INTERVAL = 4
LIMITS = EngineLimits(max_seqs=4, max_batch_tokens=64, num_blocks=64, checkpoint_grid=32)
WAIT_S = 60.0

Result = TypeVar("Result")


class Killed(BaseException):
    """Raised by a killed worker's transport: no ``except Exception`` in the worker may catch it."""


class KillableTransport(RedisTransport):
    """A Redis transport that dies, with nothing more written or read, once ``kill_when`` says so after
    a publish was sent; ``published`` keeps the events that went out."""

    def __init__(self, *args: Any, kill_when: Callable[[KillableTransport], bool], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kill_when = kill_when
        self.published: list[TokenEvent] = []
        self.dead = False

    def receive(self, max_new: int, block_ms: int, *, max_interactive: int | None = None) -> list[Received]:
        return self._alive(super().receive)(max_new, block_ms, max_interactive=max_interactive)

    def cancellations(self) -> list[str]:
        return self._alive(super().cancellations)()

    def begin(self, started: Sequence[StartedRequest]) -> None:
        self._alive(super().begin)(started)

    def start_publish(self, events: Sequence[TokenEvent], finished: Sequence[FinishedRequest]) -> Callable[[], None]:
        written = self._alive(super().start_publish)(events, finished)
        self.published += events
        self.dead = self.kill_when(self)
        return lambda: self._alive(written)()

    def hand_back(self, request_ids: Sequence[str]) -> None:
        self._alive(super().hand_back)(request_ids)

    def heartbeat(self, stats: WorkerHeartbeat) -> None:
        self._alive(super().heartbeat)(stats)

    def announce(self, model: ModelAnnouncement) -> None:
        self._alive(super().announce)(model)

    def close(self) -> None:
        self._alive(super().close)()

    def _alive(self, method: Callable[..., Result]) -> Callable[..., Result]:
        if self.dead:
            raise Killed
        return method


@dataclass
class RunningWorker:
    worker: Worker
    thread: threading.Thread
    stop: threading.Event

    def join(self, timeout_s: float = WAIT_S) -> None:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the worker did not exit"


class Fleet:
    """Workers over one fakeredis server, each with its own engine and memory tier, sharing Redis."""

    def __init__(self, model_dir: Path, keys: Keys, **settings: Any) -> None:
        self.server = fakeredis.FakeServer()
        self.client = fakeredis.FakeRedis(server=self.server)
        self.keys = keys
        self.model_dir = model_dir
        base = worker_settings(heartbeat_ttl_s=HEARTBEAT_TTL_S)
        fields = {"namespace": keys.namespace, "decode_checkpoint_interval": DECODE_INTERVAL, **settings}
        self.settings: WorkerSettings = replace(base, **fields)

    def start(self, worker_id: str, kill_when: Callable[[KillableTransport], bool] | None = None) -> RunningWorker:
        loaded = self._engine()
        announcement = model_announcement(loaded, MODEL)
        client = fakeredis.FakeRedis(server=self.server)
        transport = KillableTransport(
            client,
            worker_id=worker_id,
            keys=self.keys,
            heartbeat_ttl_s=HEARTBEAT_TTL_S,
            kill_when=kill_when or (lambda _: False),
        )
        manager = checkpoint_manager(loaded, client, self.settings, announcement.fingerprint)
        worker = Worker(
            loaded.engine,
            transport,
            self.settings,
            worker_id=worker_id,
            model=announcement,
            checkpoints=CheckpointWriter(manager),
        )
        stop = threading.Event()
        thread = threading.Thread(target=_run_until_killed, args=(worker, stop), daemon=True)
        thread.start()
        return RunningWorker(worker, thread, stop)

    def submit(self, message: GenerateRequest) -> None:
        with self.client.pipeline(transaction=True) as pipe:
            set_status(pipe, message.request_id, RunStatus.QUEUED, keys=self.keys)
            pipe.xadd(self.keys.request_stream(message.priority), {"msg": encode(message)})
            pipe.execute()

    def record(self, request_id: str) -> RunRecord | None:
        return read_record(self.client, request_id, keys=self.keys)

    def finished_record(self, request_id: str, timeout_s: float = WAIT_S) -> RunRecord:
        wait_for(lambda: (r := self.record(request_id)) is not None and r.status is RunStatus.FINISHED, timeout_s)
        record = self.record(request_id)
        assert record is not None
        return record

    def raw_event_count(self, request_id: str) -> int:
        """Entries in the record's event list, duplicates included."""
        return int(self.client.llen(self.keys.run_events(request_id)))

    def reference(self, message: GenerateRequest, seed: int) -> list[int]:
        """The tokens of ``message`` run alone and undisturbed with ``seed``."""
        params = SamplingParams(
            max_tokens=message.max_tokens, temperature=message.temperature, seed=seed, ignore_eos=message.ignore_eos
        )
        (result,) = self._engine().engine.generate([message.prompt_token_ids], params)
        return result.completions[0].token_ids

    def _engine(self) -> LoadedModel:
        interval = self.settings.decode_checkpoint_interval or None
        return build_engine(self.model_dir, replace(LIMITS, decode_checkpoint_interval=interval))


def _run_until_killed(worker: Worker, stop: threading.Event) -> None:
    with contextlib.suppress(Killed):
        worker.run(stop)


def wait_for(condition: Callable[[], bool], timeout_s: float = WAIT_S, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)
