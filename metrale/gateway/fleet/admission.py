"""Admission control: whether the fleet takes a new request now, or answers 429 with ``Retry-After``.

Two checks, fleet first (it only reads), then the tenant's (it charges):

1. **The fleet** (``FleetAdmission``), as soon as the request is parsed, before its prompt is
   rendered or tokenized (a refusal costs the gateway almost nothing, and comes at once even while
   it works on a burst): the request's backlog (``Dispatcher.backlog``: requests of its
   class and those served before it, untaken or on a worker and unfinished, read live from the
   streams, plus this gateway's admissions the read cannot show yet) against the live workers'
   slots and how fast they turn over (``SlotTurnover``, from heartbeats: measured from the workers'
   start, so the bound holds for a cold burst, planned on what recent requests asked for until
   requests have finished, ``requested_tokens.py``). A request that would wait
   longer than ``MET_MAX_QUEUE_WAIT_S`` for a slot, counting the time it already spent in this
   gateway (a loaded gateway reads a burst slowly), is refused, asked to retry when it would fit
   (``wait_estimate.py``) behind the refused requests told to come back before it
   (``retry_promises.py``: a burst's refusals return at the pace the fleet takes them); so is any
   request while more than ``MET_MAX_QUEUE`` are untaken. An interactive request counts only
   interactive requests (the scheduler preempts batch rows for it), so a big batch never refuses it;
   a batch-priority one counts both. Refusals are counted in ``met:metrics:gateway``
   (``queue_full_rejections``, shown by ``met top``). A batch runner's lines never come here: its
   window bounds them.
   While the fleet is full, ``load_shedding.py`` refuses requests before they are even parsed, on
   ``refusal_now``: the same judgement, counting what it knows without waiting (the requests that
   arrived before and are not judged yet, and a recent read of the streams).
2. **The tenant** (``TenantLimiter``), once the prompt's length is known: concurrency and tokens
   per minute from ``MET_API_KEYS``, counted in ``tenant_limit_rejections``.

``fleet_place`` holds a request's place in the fleet's count until it is on a stream (or fails
before); ``tenant_place`` holds its tenant's place for as long as it runs and gives its
``x-ratelimit-*`` headers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from redis.exceptions import RedisError

from metrale.gateway.fleet.arrivals import Arrivals
from metrale.gateway.fleet.dispatcher import Backlog, Dispatcher
from metrale.gateway.fleet.registry import ModelRegistry
from metrale.gateway.fleet.requested_tokens import RequestedTokens
from metrale.gateway.fleet.retry_promises import RetryPromises
from metrale.gateway.fleet.slot_turnover import FleetCapacity, SlotTurnover
from metrale.gateway.fleet.tenant_limiter import TenantLimiter
from metrale.gateway.fleet.wait_estimate import Verdict, estimate_wait, judge, retry_after
from metrale.shared.errors import QueueFull, TenantLimited
from metrale.shared.keys import QUEUE_FULL_FIELD, TENANT_LIMITED_FIELD, Keys
from metrale.shared.messages import GenerateRequest, Priority, WorkerHeartbeat
from metrale.shared.redis_connect import AsyncClient
from metrale.shared.settings import GatewaySettings

logger = logging.getLogger(__name__)

LAST_READ_MAX_AGE_S = 5.0
"""How old a read of the request streams may be for ``refusal_now`` to estimate the backlog from it."""
BEATS_MAX_AGE_S = 5.0
"""How old the cached heartbeats may be for ``refusal_now`` to judge on them (a fleet's slots and
their turnover change slowly; the route judges on fresh ones)."""


class FleetAdmission:
    """Refuses requests the fleet could not start within ``max_wait_s``, or past ``max_queue`` untaken."""

    def __init__(self, dispatcher: Dispatcher, registry: ModelRegistry, *, max_queue: int, max_wait_s: float) -> None:
        self._dispatcher = dispatcher
        self._registry = registry
        self._max_queue = max_queue
        self._max_wait_s = max_wait_s
        self._turnover = SlotTurnover()
        self._capacity_of: tuple[object, FleetCapacity] = (None, FleetCapacity(0, None))  # (heartbeats, theirs)
        self.arrivals = Arrivals()
        """Requests in this gateway not judged yet (``load_shedding.py`` counts them in)."""
        self.promises = RetryPromises()
        """When the requests refused here were told to come back (``refused`` records them)."""
        self.requested = RequestedTokens()
        """What the requests judged here asked for (``n × max_tokens``)."""

    async def admit(self, request_id: str, priority: Priority, created_at: float, tokens: int | None = None) -> None:
        """Take request ``request_id`` of ``priority``, which reached the gateway at ``created_at``
        (``time.time()``) asking for up to ``tokens`` (``n × max_tokens``; None: no limit), counted
        as admitted from now on; or raise ``QueueFull``."""
        self.requested.note(tokens)
        beats = await self._registry.live_workers()
        backlog = await self._dispatcher.backlog(priority)
        # Its time in this gateway from its arrival at the door, before its body was read, when counted.
        waited_s = max(time.time() - created_at, self.arrivals.waited_s())
        # No await from the read to ``unseen.admit``: the next request's check counts this one.
        verdict = self._verdict(self._capacity(beats), backlog, waited_s=waited_s)
        self.arrivals.judged()
        if not verdict.admit:
            raise self.refused(QueueFull(verdict.retry_after_s))
        self._dispatcher.unseen.admit(request_id, priority)

    def refused(self, refusal: QueueFull) -> QueueFull:
        """``refusal``, once it is sent: its request counts as ahead of later refusals until its
        ``Retry-After`` has passed (``retry_promises.py``)."""
        self.promises.promise(refusal.retry_after_s)
        return refusal

    def refusal_now(self) -> QueueFull | None:
        """The refusal a request arriving now would get, judged without waiting on Redis; None when
        it might be admitted. It would wait behind every request that arrived before it and is not
        judged yet (``arrivals``), plus the backlog estimated from the newest read of the streams (at
        most ``LAST_READ_MAX_AGE_S`` old: what it showed, less what the fleet's turnover has drained
        since, plus this gateway's admissions since). The fleet's capacity comes from heartbeats at
        most ``BEATS_MAX_AGE_S`` old, and its time in this gateway from the pace of recent judgements
        (``Arrivals.expected_delay_s``). Judged as an interactive request, which waits behind the
        fewest: whatever refuses it refuses a batch one too."""
        beats = self._registry.recent_live_workers(BEATS_MAX_AGE_S)
        if beats is None:
            return None
        capacity = self._capacity(beats)
        backlog = self._dispatcher.estimated_backlog(Priority.INTERACTIVE, capacity.drain_per_s, LAST_READ_MAX_AGE_S)
        in_system = self.arrivals.waiting + (backlog.in_system if backlog is not None else 0)
        untaken = self.arrivals.waiting + (backlog.untaken if backlog is not None else 0)
        # The route judges it again once it got there, counting the time it spent in the gateway; that
        # time is counted here already, so that the requests at the bound's margin are refused now.
        waited_s = self.arrivals.expected_delay_s()
        verdict = self._verdict(capacity, Backlog(Priority.INTERACTIVE, in_system, untaken), waited_s=waited_s)
        return None if verdict.admit else QueueFull(verdict.retry_after_s)

    def _capacity(self, beats: list[WorkerHeartbeat]) -> FleetCapacity:
        """The fleet's capacity from ``beats``, computed once per read of the heartbeats (the registry
        hands out the same list until it reads them again, once a second), for requests asking what
        the recent ones asked for."""
        if self._capacity_of[0] is not beats:
            self._capacity_of = (beats, self._turnover.capacity(beats))
        return self._capacity_of[1].asking(self.requested.mean())

    def _verdict(self, capacity: FleetCapacity, backlog: Backlog, *, waited_s: float) -> Verdict:
        estimate = estimate_wait(backlog.in_system, capacity)
        if judge(estimate, self._max_wait_s, waited_s=waited_s).admit and backlog.untaken <= self._max_queue:
            return Verdict(True)
        # Told to come back when it would fit behind the refused requests told to come back before it.
        later = estimate_wait(backlog.in_system + self.promises.outstanding(), capacity)
        return Verdict(False, retry_after(later.wait_s - self._max_wait_s if later.wait_s is not None else 0.0))


class Admission:
    """Both checks, and the counters of their refusals."""

    def __init__(
        self,
        client: AsyncClient,
        keys: Keys,
        settings: GatewaySettings,
        *,
        dispatcher: Dispatcher,
        registry: ModelRegistry,
    ) -> None:
        self._client = client
        self._keys = keys
        self._dispatcher = dispatcher
        self.fleet = FleetAdmission(
            dispatcher, registry, max_queue=settings.max_queue, max_wait_s=settings.max_queue_wait_s
        )
        self.tenants = TenantLimiter(client, keys, settings.tenant_limits)
        self._unwritten: Counter[str] = Counter()  # refusals counted here, not yet in Redis
        self._writing_counts: asyncio.Task[None] | None = None

    @asynccontextmanager
    async def fleet_place(
        self, request_id: str, priority: Priority, created_at: float, tokens: int | None = None
    ) -> AsyncIterator[None]:
        """Admit the request, asking for up to ``tokens`` (``n × max_tokens``; None: no limit), to the
        fleet for the block (429 ``QueueFull`` if not): it counts in this gateway's backlog until it
        is on a stream, or until the block ends without submitting it."""
        try:
            await self.fleet.admit(request_id, priority, created_at, tokens)
        except QueueFull:
            self._count(QUEUE_FULL_FIELD)
            raise
        try:
            yield
        finally:
            self._dispatcher.unseen.withdraw(request_id)  # if it never reached the stream

    @asynccontextmanager
    async def tenant_place(self, request: GenerateRequest) -> AsyncIterator[dict[str, str]]:
        """Hold ``request``'s place among its tenant's for the block (429 ``TenantLimited`` if there
        is none), yielding the ``x-ratelimit-*`` headers of its response; the place is given back when
        the block ends, however it ends (finished, failed, the client gone)."""
        try:
            headers = await self.tenants.acquire(request.tenant, request.request_id, _token_cost(request))
        except TenantLimited:
            self._count(TENANT_LIMITED_FIELD)
            raise
        try:
            yield headers
        finally:
            # Shielded: a client that left cancels this task, and the place must still be given back.
            await asyncio.shield(self.tenants.release(request.tenant, request.request_id))

    async def tenant_check(self, tenant: str, tokens: int) -> None:
        """Refuse (429 ``TenantLimited``) a request of ``tenant`` that asks for at least ``tokens`` when
        the tenant is already at a limit, before any work on it; ``tenant_place`` judges it again, with
        its whole cost, once it is prepared."""
        try:
            await self.tenants.check(tenant, tokens)
        except TenantLimited:
            self._count(TENANT_LIMITED_FIELD)
            raise

    def count_fleet_refusal(self, refusal: QueueFull) -> None:
        """Count ``refusal``, sent by the fleet's bound outside ``fleet_place`` (``load_shedding.py``)."""
        self.fleet.refused(refusal)
        self._count(QUEUE_FULL_FIELD)

    async def close(self) -> None:
        """Stop renewing tenant leases; write the refusals not counted yet."""
        await self.tenants.close()
        if self._writing_counts is not None:
            await self._writing_counts

    def _count(self, field: str) -> None:
        """Count one refusal in ``met:metrics:gateway``: the refusals of a burst go in one write, made
        once the tasks ready now have run (a refusal is not held up by a round trip to Redis)."""
        self._unwritten[field] += 1
        if self._writing_counts is None:
            self._writing_counts = asyncio.create_task(self._write_counts())

    async def _write_counts(self) -> None:
        try:
            while self._unwritten:
                counts, self._unwritten = self._unwritten, Counter()
                async with self._client.pipeline(transaction=False) as pipe:
                    for field, count in counts.items():
                        pipe.hincrby(self._keys.gateway_counters(), field, count)
                    await pipe.execute()
        except (RedisError, OSError) as error:
            logger.warning("could not count %d refusals: %s", sum(self._unwritten.values()), error)
        finally:
            self._writing_counts = None


def _token_cost(request: GenerateRequest) -> int:
    """What a request is charged against a tokens-per-minute limit: its prompt and all it may produce."""
    return len(request.prompt_token_ids) + request.n * request.max_tokens
