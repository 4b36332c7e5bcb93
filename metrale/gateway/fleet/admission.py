"""Admission control: whether the fleet takes a new request now, or answers 429 with ``Retry-After``.

Two checks, fleet first (it only reads), then the tenant's (it charges):

1. **The fleet** (``FleetAdmission``): the request's backlog (``Dispatcher.backlog``: requests of its
   class and those served before it, untaken or on a worker and unfinished, read live from the
   streams, plus this gateway's admissions the read cannot show yet) against the live workers'
   slots and how fast they turn over (``SlotTurnover``, from heartbeats). A request that would wait
   longer than ``MET_MAX_QUEUE_WAIT_S`` for a slot, counting the time it already spent in this
   gateway (a loaded gateway reads a burst slowly), is refused, asked to retry when it would fit
   (``wait_estimate.py``); so is any request while more than ``MET_MAX_QUEUE`` are untaken. An
   interactive request counts only interactive requests (the scheduler preempts batch rows for it),
   so a big batch never refuses it; a batch-priority one counts both. Refusals are counted in
   ``met:metrics:gateway`` (``queue_full_rejections``, shown by ``met top``). A batch runner's lines
   never come here: its window bounds them.
2. **The tenant** (``TenantLimiter``): concurrency and tokens per minute from ``MET_API_KEYS``,
   counted in ``tenant_limit_rejections``.

``admitted`` holds a request's place for as long as it runs and gives its ``x-ratelimit-*``
headers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis.asyncio

from metrale.gateway.fleet.dispatcher import Dispatcher
from metrale.gateway.fleet.registry import ModelRegistry
from metrale.gateway.fleet.slot_turnover import SlotTurnover
from metrale.gateway.fleet.tenant_limiter import TenantLimiter
from metrale.gateway.fleet.wait_estimate import Verdict, estimate_wait, judge, retry_after
from metrale.shared.errors import QueueFull, TenantLimited
from metrale.shared.keys import QUEUE_FULL_FIELD, TENANT_LIMITED_FIELD, Keys
from metrale.shared.messages import GenerateRequest
from metrale.shared.settings import GatewaySettings


class FleetAdmission:
    """Refuses requests the fleet could not start within ``max_wait_s``, or past ``max_queue`` untaken."""

    def __init__(self, dispatcher: Dispatcher, registry: ModelRegistry, *, max_queue: int, max_wait_s: float) -> None:
        self._dispatcher = dispatcher
        self._registry = registry
        self._max_queue = max_queue
        self._max_wait_s = max_wait_s
        self._turnover = SlotTurnover()

    async def admit(self, request: GenerateRequest) -> None:
        """Take ``request`` (counted as admitted from now on) or raise ``QueueFull``."""
        beats = await self._registry.live_workers()
        backlog = await self._dispatcher.backlog(request.priority)
        # No await from the read to ``unseen.admit``: the next request's check counts this one.
        estimate = estimate_wait(backlog.in_system, self._turnover.capacity(beats))
        verdict = judge(estimate, self._max_wait_s, waited_s=time.time() - request.created_at)
        if verdict.admit and backlog.untaken > self._max_queue:
            over = estimate.wait_s - self._max_wait_s if estimate.wait_s is not None else 0.0
            verdict = Verdict(False, retry_after(over))
        if not verdict.admit:
            raise QueueFull(verdict.retry_after_s)
        self._dispatcher.unseen.admit(request.request_id, request.priority)


class Admission:
    """Both checks, and the counters of their refusals."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
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

    @asynccontextmanager
    async def admitted(self, request: GenerateRequest) -> AsyncIterator[dict[str, str]]:
        """Admit ``request`` for the block (429 ``QueueFull`` or ``TenantLimited`` if not), yielding
        the ``x-ratelimit-*`` headers of its response; its tenant's place is given back when the
        block ends, however it ends (finished, failed, the client gone)."""
        try:
            await self.fleet.admit(request)
        except QueueFull:
            await self._count(QUEUE_FULL_FIELD)
            raise
        try:
            headers = await self.tenants.acquire(request.tenant, request.request_id, _token_cost(request))
        except BaseException as error:
            self._dispatcher.unseen.withdraw(request.request_id)
            if isinstance(error, TenantLimited):
                await self._count(TENANT_LIMITED_FIELD)
            raise
        try:
            yield headers
        finally:
            self._dispatcher.unseen.withdraw(request.request_id)  # if it never reached the stream
            # Shielded: a client that left cancels this task, and the place must still be given back.
            await asyncio.shield(self.tenants.release(request.tenant, request.request_id))

    async def close(self) -> None:
        """Stop renewing tenant leases."""
        await self.tenants.close()

    async def _count(self, field: str) -> None:
        await self._client.hincrby(self._keys.gateway_counters(), field, 1)


def _token_cost(request: GenerateRequest) -> int:
    """What a request is charged against a tokens-per-minute limit: its prompt and all it may produce."""
    return len(request.prompt_token_ids) + request.n * request.max_tokens
