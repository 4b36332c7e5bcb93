"""Putting requests on the fleet's request streams, and calling them back.

``submit`` writes the request's ``QUEUED`` record and its stream entry in one transaction (a worker
that takes the entry always finds the record). ``backlog`` is what a new request would wait behind,
read live from the streams plus what this gateway admitted that the read cannot show yet
(``unseen_admissions.py``); admission control (``admission.py``) judges it. ``cancel`` broadcasts a
``CancelRequest``; whichever worker runs the request aborts it within one engine step.

On a Redis Cluster (``Keys.shards`` > 1) a request goes to the stream of its own shard, whose hash tag its
record shares, so the submit stays one transaction in one slot; a priority's depth sums its shards' streams
(one pipelined read, one round trip per node), and cancellations go by ``SPUBLISH`` (sharded pub/sub).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio
import redis.asyncio.cluster
from redis.exceptions import ResponseError

from metrale.gateway.fleet.reads_between_writes import ReadsBetweenWrites
from metrale.gateway.fleet.shared_read import SharedRead
from metrale.gateway.fleet.unseen_admissions import UnseenAdmissions
from metrale.shared.codec import encode
from metrale.shared.keys import WORKER_GROUP, Keys
from metrale.shared.messages import CancelRequest, GenerateRequest, Priority
from metrale.shared.record import RunStatus, set_status
from metrale.shared.replication import NO_WAIT, Replication, ReplicaWaiter

STREAM_FIELD = "msg"
"""The field of a request stream entry that holds the encoded ``GenerateRequest``."""


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


@dataclass(frozen=True, slots=True)
class Backlog:
    """What a request of ``priority`` would wait behind or beside: ``in_system`` requests of its class
    and those served before it, not finished (untaken, waiting on a worker, or running), of which
    ``untaken`` no worker has taken yet. Both include this gateway's admissions not yet visible."""

    priority: Priority
    in_system: int
    untaken: int


def served_first(priority: Priority) -> list[Priority]:
    """The classes a ``priority`` request waits behind: its own and every class served before it
    (workers read the interactive stream first; the scheduler preempts batch rows for interactive)."""
    order = list(Priority)
    return order[: order.index(Priority(priority)) + 1]


@dataclass(frozen=True, slots=True)
class _DepthRead:
    """One read of the request streams: when it began (``time.monotonic()``) and what it found."""

    began: float
    depths: dict[Priority, QueueDepth]


class Dispatcher:
    """Submits and cancels requests on the fleet's Redis streams."""

    def __init__(
        self,
        client: redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster,
        keys: Keys,
        *,
        replication: Replication = NO_WAIT,
    ) -> None:
        self._client: redis.asyncio.Redis = client  # type: ignore[assignment]  # a cluster's has the same calls
        self._sharded_pubsub = isinstance(client, redis.asyncio.cluster.RedisCluster)
        if self._sharded_pubsub and replication.replicas > 0:
            raise ValueError("MET_REDIS_WAIT_REPLICAS is not served on a Redis Cluster: leave it 0")
        self._waiter = ReplicaWaiter(replication, keys.replication_mark())
        self._keys = keys
        self._depths = SharedRead(self._read_queue_depths)
        self._newest_read: _DepthRead | None = None
        self._reads_between_writes = ReadsBetweenWrites()
        self.unseen = UnseenAdmissions()
        """This gateway's admitted requests a stream read may not show yet."""

    async def queue_depths(self) -> dict[Priority, QueueDepth]:
        """The depth of each request stream (a stream no worker has opened yet counts as empty).

        Concurrent callers share one read (``SharedRead``)."""
        return (await self._depths())[1]

    async def backlog(self, priority: Priority) -> Backlog:
        """The live backlog a new ``priority`` request faces. Nothing awaits after the read, so a
        caller that admits on the answer (``unseen.admit``) without awaiting in between is counted by
        the next caller."""
        began, depths = await self._depths()
        return self._backlog_from(priority, began, depths)

    def _backlog_from(
        self, priority: Priority, began: float, depths: dict[Priority, QueueDepth], *, drained: float = 0.0
    ) -> Backlog:
        unseen = self.unseen.unseen_by(began)
        classes = served_first(priority)
        read_in_system = sum(depths[c].length for c in classes)
        read_untaken = sum(depths[c].undelivered for c in classes)
        own = sum(unseen[c] for c in classes)
        # What the read showed less what left it since (not below nothing), and this gateway's own since.
        in_system = max(0, round(read_in_system - drained)) + own
        untaken = max(0, round(read_untaken - drained)) + own
        return Backlog(Priority(priority), in_system, untaken)

    def estimated_backlog(self, priority: Priority, drain_per_s: float | None, max_age_s: float) -> Backlog | None:
        """``backlog`` now, estimated without waiting from the newest read (None: none, or older than
        ``max_age_s``): what it showed, less ``drain_per_s`` requests per second since it began (requests
        leave their slots at that rate while the fleet is busy; None: none assumed to have left), plus
        this gateway's admissions it cannot show."""
        newest = self._newest_read
        if newest is None:
            return None
        age_s = time.monotonic() - newest.began
        if age_s > max_age_s:
            return None
        drained = (drain_per_s or 0.0) * age_s
        return self._backlog_from(priority, newest.began, newest.depths, drained=drained)

    async def _read_queue_depths(self) -> tuple[float, dict[Priority, QueueDepth]]:
        priorities = list(Priority)
        async with self._reads_between_writes.reading():
            began = time.monotonic()
            async with self._client.pipeline(transaction=False) as pipe:
                for priority in priorities:
                    for stream in self._keys.request_streams(priority):
                        pipe.xlen(stream)
                        pipe.xpending(stream, WORKER_GROUP)
                replies = iter(await pipe.execute(raise_on_error=False))
        depths: dict[Priority, QueueDepth] = {}
        for priority in priorities:
            length = pending_count = 0
            for _ in range(self._keys.shards):
                shard_length, pending = next(replies), next(replies)
                length += int(shard_length)
                # XPENDING fails with NOGROUP until a worker has created the group; nothing is pending then.
                pending_count += 0 if isinstance(pending, ResponseError) else int(pending["pending"])
            depths[priority] = QueueDepth(length, pending_count)
        if self._newest_read is None or self._newest_read.began < began:
            self._newest_read = _DepthRead(began, depths)
        return began, depths

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
        async with self._reads_between_writes.writing():
            async with self._client.pipeline(transaction=True) as pipe:
                set_status(pipe, request.request_id, RunStatus.QUEUED, keys=self._keys)
                shard = self._keys.shard_of(request.request_id)
                pipe.xadd(self._keys.request_stream(request.priority, shard), {STREAM_FIELD: encode(request)})
                await pipe.execute()
            self.unseen.submitted(request.request_id)  # before any read can begin

    async def _lacks_record(self, request_id: str) -> bool:
        return not await self.has_record(request_id)

    async def has_record(self, request_id: str) -> bool:
        """Whether ``request_id`` was submitted already (its run record exists)."""
        return bool(await self._client.exists(self._keys.run_record(request_id)))

    async def cancel(self, request_id: str, reason: str) -> None:
        """Ask whichever worker runs ``request_id`` to abort it."""
        message = encode(CancelRequest(request_id, reason))
        if self._sharded_pubsub:
            await self._client.spublish(self._keys.cancel_channel(), message)
        else:
            await self._client.publish(self._keys.cancel_channel(), message)
