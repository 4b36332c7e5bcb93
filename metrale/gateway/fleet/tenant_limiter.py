"""Per-tenant limits, enforced across every gateway through Redis: requests in flight at once and
tokens per minute (``MET_API_KEYS`` ``key:tenant:max_concurrent:tokens_per_min``).

*In flight*: the sorted set ``met:tenant:{tenant}:inflight`` holds the tenant's request ids, each
scored by when its lease expires. Admitting drops expired leases, counts the rest and adds the new
one, in one script. The gateway that admitted a request renews its lease every ``lease_s / 3`` and
removes it when the request ends (finished, failed, or the client gone); a gateway that dies stops
renewing, and its requests stop counting ``lease_s`` later. Leases are scored by the gateways'
clocks, assumed within a few seconds of one another.

*Tokens per minute*: each request is charged its prompt tokens plus the output tokens it may
produce (``n * max_tokens``) when admitted — as OpenAI counts a request against a token limit —
and nothing is refunded. Charges go to one counter per minute; the tokens used are the current
minute's plus the previous minute's weighted by how much of it still lies within the last 60 s (a
sliding window, without a fixed window's double burst at the boundary).

A refusal is a 429 with ``Retry-After`` and the ``x-ratelimit-*`` headers OpenAI sends (requests
meaning concurrent requests here); an admitted request's response carries the same headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import redis.asyncio

from metrale.shared.errors import TenantRequestsLimited, TenantTokensLimited
from metrale.shared.keys import Keys
from metrale.shared.redis_connect import AsyncClient
from metrale.shared.settings import TenantLimits

logger = logging.getLogger(__name__)

LEASE_S = 30.0
"""How long a request counts against its tenant's concurrency after its gateway last renewed it."""
WINDOW_S = 60
REQUESTS_RETRY_AFTER_S = 1.0
"""When a tenant at its concurrency limit is asked to retry: one of its requests may end any time."""
TOKEN_KEY_TTL_S = 2 * WINDOW_S + 10

# KEYS: in-flight set, previous minute's tokens, this minute's tokens.
# ARGV: now, lease expiry, request id, max concurrent (0: none), tokens per minute (0: none), cost,
#       weight of the previous minute, 1 to count and charge an admitted request (0: only judge it).
# Returns {verdict (1 admitted, 0 too many in flight, -1 too many tokens), in flight, previous
# minute's tokens, this minute's tokens (after the charge)}.
_ACQUIRE = f"""
local in_flight = 0
local max_concurrent = tonumber(ARGV[4])
if max_concurrent > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
  in_flight = redis.call('ZCARD', KEYS[1])
end
local per_min = tonumber(ARGV[5])
local cost = tonumber(ARGV[6])
local previous = tonumber(redis.call('GET', KEYS[2]) or '0')
local current = tonumber(redis.call('GET', KEYS[3]) or '0')
if max_concurrent > 0 and in_flight >= max_concurrent then return {{0, in_flight, previous, current}} end
if per_min > 0 and previous * tonumber(ARGV[7]) + current + cost > per_min then
  return {{-1, in_flight, previous, current}}
end
if ARGV[8] == '0' then return {{1, in_flight, previous, current}} end
if max_concurrent > 0 then
  redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
  redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2]) - tonumber(ARGV[1])) + 1)
  in_flight = in_flight + 1
end
if per_min > 0 then
  current = redis.call('INCRBY', KEYS[3], cost)
  redis.call('EXPIRE', KEYS[3], {TOKEN_KEY_TTL_S})
end
return {{1, in_flight, previous, current}}
"""


@dataclass(frozen=True, slots=True)
class TokenWindow:
    """A tenant's token charges: ``previous`` and ``current`` minute, ``elapsed_s`` into the current."""

    previous: int
    current: int
    elapsed_s: float

    def used(self) -> float:
        """Tokens used in the sliding minute ending now."""
        return self.previous * (1 - self.elapsed_s / WINDOW_S) + self.current

    def seconds_until_room(self, cost: int, limit: int) -> float:
        """How long until ``cost`` more tokens fit under ``limit`` (nothing else charged meanwhile);
        ``WINDOW_S`` for a cost over the limit itself (it never fits)."""
        if cost > limit:
            return WINDOW_S
        room = limit - cost
        left_in_minute = WINDOW_S - self.elapsed_s
        if self.previous > 0 and room >= self.current:  # the previous minute's share decays enough
            return max(0.0, WINDOW_S * (1 - (room - self.current) / self.previous) - self.elapsed_s)
        if self.current <= room:
            return 0.0
        return left_in_minute + WINDOW_S * (1 - room / self.current)

    def seconds_until_reset(self) -> float:
        """How long until every charge has left the sliding window."""
        left_in_minute = WINDOW_S - self.elapsed_s
        if self.current > 0:
            return left_in_minute + WINDOW_S
        return left_in_minute if self.previous > 0 else 0.0


def duration(seconds: float) -> str:
    """``seconds`` as OpenAI writes its reset headers: ``250ms``, ``7s``, ``1m30s``."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    whole = round(seconds)
    minutes, rest = divmod(whole, 60)
    return f"{minutes}m{rest}s" if minutes else f"{rest}s"


class TenantLimiter:
    """Admits requests within their tenant's limits and keeps their in-flight leases."""

    def __init__(
        self,
        client: AsyncClient,
        keys: Keys,
        limits: Mapping[str, TenantLimits],
        *,
        lease_s: float = LEASE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._client = client
        self._keys = keys
        self._limits = dict(limits)
        self._lease_s = lease_s
        self._clock = clock
        self._acquire = client.register_script(_ACQUIRE)
        self._held: dict[str, str] = {}  # request id -> tenant, for leases this gateway renews
        self._renewer: asyncio.Task[None] | None = None

    def limits_of(self, tenant: str) -> TenantLimits:
        """``tenant``'s limits (unlimited when none are configured)."""
        return self._limits.get(tenant, TenantLimits())

    async def acquire(self, tenant: str, request_id: str, tokens: int) -> dict[str, str]:
        """Count ``request_id`` (charged ``tokens``) against ``tenant``'s limits and return the
        ``x-ratelimit-*`` headers for its response; raises ``TenantLimited`` (429) when over a limit."""
        return await self._judge(tenant, request_id, tokens, commit=True)

    async def check(self, tenant: str, tokens: int) -> None:
        """Raise what ``acquire`` would for a request charged ``tokens``, counting and charging nothing:
        a tenant already at a limit is refused before its request is prepared (rendered, tokenized)."""
        await self._judge(tenant, "", tokens, commit=False)

    async def _judge(self, tenant: str, request_id: str, tokens: int, *, commit: bool) -> dict[str, str]:
        limits = self.limits_of(tenant)
        if limits.unlimited:
            return {}
        now = self._clock()
        minute, elapsed = divmod(now, WINDOW_S)
        keys = [
            self._keys.tenant_in_flight(tenant),
            self._keys.tenant_tokens(tenant, int(minute) - 1),
            self._keys.tenant_tokens(tenant, int(minute)),
        ]
        args: list[Any] = [now, now + self._lease_s, request_id, limits.max_concurrent or 0]
        args += [limits.tokens_per_min or 0, tokens, 1 - elapsed / WINDOW_S, int(commit)]
        verdict, in_flight, previous, current = (int(value) for value in await self._acquire(keys=keys, args=args))
        window = TokenWindow(previous, current, elapsed)
        if verdict == 1:
            if commit and limits.max_concurrent is not None:
                self._held[request_id] = tenant
                self._start_renewing()
            return _headers(limits, in_flight, window, cost=0)
        headers = _headers(limits, in_flight, window, cost=tokens)
        if verdict == 0:
            message = f"Too many requests in flight for this tenant: the limit is {limits.max_concurrent}."
            raise TenantRequestsLimited(message, REQUESTS_RETRY_AFTER_S, headers)
        used = math.ceil(window.used())
        message = (
            f"Rate limit reached for tokens per minute: limit {limits.tokens_per_min}, used {used}, requested {tokens}."
        )
        raise TenantTokensLimited(message, window.seconds_until_room(tokens, limits.tokens_per_min or 0), headers)

    async def release(self, tenant: str, request_id: str) -> None:
        """``request_id`` ended: it no longer counts against ``tenant``'s concurrency. Safe to call for
        a request never acquired; a Redis failure leaves the lease to expire."""
        if self._held.pop(request_id, None) is None:
            return
        try:
            await self._client.zrem(self._keys.tenant_in_flight(tenant), request_id)
        except redis.RedisError as exc:
            logger.warning("could not release %s of tenant %s (its lease expires): %s", request_id, tenant, exc)

    async def renew(self) -> None:
        """Push the lease of every request this gateway holds ``lease_s`` ahead."""
        expiry = self._clock() + self._lease_s
        held = list(self._held.items())
        if not held:
            return
        async with self._client.pipeline(transaction=False) as pipe:
            for request_id, tenant in held:
                pipe.zadd(self._keys.tenant_in_flight(tenant), {request_id: expiry}, xx=True)
            await pipe.execute()

    async def close(self) -> None:
        """Stop renewing (the leases of requests still held then expire)."""
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
            self._renewer = None

    def _start_renewing(self) -> None:
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.get_running_loop().create_task(self._renew_forever())

    async def _renew_forever(self) -> None:
        while self._held:
            await asyncio.sleep(self._lease_s / 3)
            try:
                await self.renew()
            except redis.RedisError as exc:
                logger.warning("tenant leases not renewed: %s", exc)


def _headers(limits: TenantLimits, in_flight: int, window: TokenWindow, *, cost: int) -> dict[str, str]:
    """The ``x-ratelimit-*`` headers; ``cost`` > 0 for a refusal (the token reset is then when it fits)."""
    headers: dict[str, str] = {}
    if limits.max_concurrent is not None:
        remaining = max(0, limits.max_concurrent - in_flight)
        headers["x-ratelimit-limit-requests"] = str(limits.max_concurrent)
        headers["x-ratelimit-remaining-requests"] = str(remaining)
        headers["x-ratelimit-reset-requests"] = duration(0 if remaining else REQUESTS_RETRY_AFTER_S)
    if limits.tokens_per_min is not None:
        headers["x-ratelimit-limit-tokens"] = str(limits.tokens_per_min)
        headers["x-ratelimit-remaining-tokens"] = str(max(0, limits.tokens_per_min - math.ceil(window.used())))
        reset = window.seconds_until_room(cost, limits.tokens_per_min) if cost else window.seconds_until_reset()
        headers["x-ratelimit-reset-tokens"] = duration(reset)
    return headers
