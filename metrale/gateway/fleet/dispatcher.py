"""Putting requests on the fleet's request streams, and calling them back.

``submit`` writes the request's ``QUEUED`` record and its stream entry in one transaction (a worker
that takes the entry always finds the record). ``check_capacity`` refuses new work with a 429 while
more than ``max_queue`` entries that a request would wait behind are untaken: an interactive request
counts only the interactive stream (workers serve it first, so a big batch never makes it wait), a
batch-priority one both streams. A batch runner's own lines are never refused: its window bounds
them. Each refusal is counted in ``met:metrics:gateway`` (``QUEUE_FULL_FIELD``, fleet-wide, read by
``met top``). ``cancel`` broadcasts a ``CancelRequest``; whichever worker runs the request aborts it
within one engine step.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio
from redis.exceptions import ResponseError

from metrale.gateway.fleet.shared_read import SharedRead
from metrale.shared.codec import encode
from metrale.shared.errors import QueueFull
from metrale.shared.keys import QUEUE_FULL_FIELD, WORKER_GROUP, Keys
from metrale.shared.messages import CancelRequest, GenerateRequest, Priority
from metrale.shared.record import RunStatus, set_status
from metrale.shared.replication import NO_WAIT, Replication, ReplicaWaiter

STREAM_FIELD = "msg"
"""The field of a request stream entry that holds the encoded ``GenerateRequest``."""

RETRY_AFTER_S = 1.0
"""What a 429 asks the client to wait before retrying."""


@dataclass(frozen=True, slots=True)
class QueueDepth:
    """One request stream: ``length`` entries (XLEN), of which ``pending`` are taken by a worker but
    not yet acknowledged (XPENDING); the rest wait for a worker."""

    length: int
    pending: int

    @property
    def undelivered(self) -> int:
        """Entries no worker has taken yet."""
        return max(self.length - self.pending, 0)


class Dispatcher:
    """Submits and cancels requests on the fleet's Redis streams."""

    def __init__(
        self, client: redis.asyncio.Redis, keys: Keys, *, max_queue: int, replication: Replication = NO_WAIT
    ) -> None:
        self._client = client
        self._waiter = ReplicaWaiter(replication, keys.replication_mark())
        self._keys = keys
        self._max_queue = max_queue
        self._depths = SharedRead(self._read_queue_depths)

    async def queue_depths(self) -> dict[Priority, QueueDepth]:
        """The depth of each request stream (a stream no worker has opened yet counts as empty).

        Concurrent callers share one read (``SharedRead``)."""
        return await self._depths()

    async def _read_queue_depths(self) -> dict[Priority, QueueDepth]:
        priorities = list(Priority)
        async with self._client.pipeline(transaction=False) as pipe:
            for priority in priorities:
                stream = self._keys.request_stream(priority)
                pipe.xlen(stream)
                pipe.xpending(stream, WORKER_GROUP)
            replies = await pipe.execute(raise_on_error=False)
        depths: dict[Priority, QueueDepth] = {}
        for position, priority in enumerate(priorities):
            length, pending = replies[2 * position : 2 * position + 2]
            # XPENDING fails with NOGROUP until a worker has created the group; nothing is pending then.
            pending_count = 0 if isinstance(pending, ResponseError) else int(pending["pending"])
            depths[priority] = QueueDepth(int(length), pending_count)
        return depths

    async def check_capacity(self, priority: Priority) -> None:
        """Raise ``QueueFull`` when more than ``max_queue`` entries that a ``priority`` request would
        wait behind (its own stream and those served before it) are untaken."""
        depths = await self.queue_depths()
        ahead = list(Priority)[: list(Priority).index(Priority(priority)) + 1]
        waiting = sum(depths[served_first].undelivered for served_first in ahead)
        if waiting > self._max_queue:
            await self._client.hincrby(self._keys.gateway_counters(), QUEUE_FULL_FIELD, 1)
            raise QueueFull(RETRY_AFTER_S)

    async def submit(self, request: GenerateRequest) -> None:
        """Record ``request`` as queued and append it to its priority's stream, atomically.

        The caller subscribes the request's token channel first (``TokenRelay.open``). With replicas to
        wait for, returns once they hold both (or the primary that answers now does: ``replication.py``).
        """
        await self._write_submission(request)
        await self._waiter.confirm_async(
            self._client,
            missing=lambda: self._lacks_record(request.request_id),
            write=lambda: self._write_submission(request),
        )

    async def _write_submission(self, request: GenerateRequest) -> None:
        async with self._client.pipeline(transaction=True) as pipe:
            set_status(pipe, request.request_id, RunStatus.QUEUED, keys=self._keys)
            pipe.xadd(self._keys.request_stream(request.priority), {STREAM_FIELD: encode(request)})
            await pipe.execute()

    async def _lacks_record(self, request_id: str) -> bool:
        return not await self.has_record(request_id)

    async def has_record(self, request_id: str) -> bool:
        """Whether ``request_id`` was submitted already (its run record exists)."""
        return bool(await self._client.exists(self._keys.run_record(request_id)))

    async def cancel(self, request_id: str, reason: str) -> None:
        """Ask whichever worker runs ``request_id`` to abort it."""
        await self._client.publish(self._keys.cancel_channel(), encode(CancelRequest(request_id, reason)))
