"""The tenant limiter against a real Redis (one, and a Redis Cluster): two limiters stand for two gateways
sharing it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from metrale.gateway.fleet.tenant_limiter import TenantLimiter, TokenWindow, duration
from metrale.shared.errors import TenantRequestsLimited, TenantTokensLimited
from metrale.shared.keys import Keys
from metrale.shared.redis_connect import AsyncClient, connect_async
from metrale.shared.settings import TenantLimits

pytestmark = [pytest.mark.anyio, pytest.mark.redis]


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def client(any_redis_url: str) -> AsyncIterator[AsyncClient]:
    connection = connect_async(any_redis_url)
    yield connection
    await connection.aclose()


@pytest.fixture
def keys(any_redis_url: str) -> Keys:
    return Keys.for_redis(any_redis_url, f"met-test-{uuid.uuid4().hex[:12]}")


async def test_concurrency_is_shared_by_gateways_and_given_back(client: AsyncClient, keys: Keys) -> None:
    limits = {"acme": TenantLimits(max_concurrent=2)}
    one, two = TenantLimiter(client, keys, limits), TenantLimiter(client, keys, limits)
    first = await one.acquire("acme", "r1", 10)
    assert first == {
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "1",
        "x-ratelimit-reset-requests": "0ms",
    }
    await two.acquire("acme", "r2", 10)
    with pytest.raises(TenantRequestsLimited) as refused:
        await one.acquire("acme", "r3", 10)
    assert refused.value.status == 429 and refused.value.code == "rate_limit_exceeded"
    assert refused.value.headers() == {
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "1s",
        "Retry-After": "1",
    }
    assert await one.acquire("beta", "r4", 10) == {}  # another tenant, unlimited
    await two.release("acme", "r2")
    await one.acquire("acme", "r5", 10)
    await one.release("acme", "never-acquired")  # harmless
    await one.close()
    await two.close()


async def test_a_check_judges_without_counting_or_charging(client: AsyncClient, keys: Keys) -> None:
    limits = {"acme": TenantLimits(max_concurrent=1, tokens_per_min=100)}
    limiter = TenantLimiter(client, keys, limits, clock=Clock(600.0))
    for _ in range(3):
        await limiter.check("acme", 60)  # neither a place nor tokens are taken
    await limiter.acquire("acme", "r1", 60)
    with pytest.raises(TenantRequestsLimited):
        await limiter.check("acme", 1)
    await limiter.release("acme", "r1")
    await limiter.check("acme", 40)
    with pytest.raises(TenantTokensLimited):
        await limiter.check("acme", 41)
    await limiter.acquire("acme", "r2", 40)  # what the checks asked was never charged
    await limiter.close()


async def test_a_dead_gateways_requests_stop_counting_after_their_lease(client: AsyncClient, keys: Keys) -> None:
    limits = {"acme": TenantLimits(max_concurrent=1)}
    dead = TenantLimiter(client, keys, limits, lease_s=0.6)
    await dead.acquire("acme", "r1", 1)
    await dead.close()  # it stops renewing, as a gateway that died does, and never releases
    alive = TenantLimiter(client, keys, limits, lease_s=0.6)
    with pytest.raises(TenantRequestsLimited):
        await alive.acquire("acme", "r2", 1)
    await asyncio.sleep(0.8)
    await alive.acquire("acme", "r2", 1)
    await alive.close()


async def test_a_live_gateway_renews_its_leases(client: AsyncClient, keys: Keys) -> None:
    limits = {"acme": TenantLimits(max_concurrent=1)}
    holder = TenantLimiter(client, keys, limits, lease_s=0.6)
    other = TenantLimiter(client, keys, limits, lease_s=0.6)
    await holder.acquire("acme", "long", 1)
    await asyncio.sleep(1.5)  # more than twice the lease: renewed every 0.2 s
    with pytest.raises(TenantRequestsLimited):
        await other.acquire("acme", "r2", 1)
    await holder.release("acme", "long")
    await other.acquire("acme", "r2", 1)
    await holder.close()
    await other.close()


async def test_tokens_per_minute_slide_across_the_minute(client: AsyncClient, keys: Keys) -> None:
    clock = Clock(6_000_000.0 + 30)  # half-way through a minute
    limiter = TenantLimiter(client, keys, {"acme": TenantLimits(tokens_per_min=1000)}, clock=clock)
    headers = await limiter.acquire("acme", "r1", 600)
    assert headers["x-ratelimit-limit-tokens"] == "1000"
    assert headers["x-ratelimit-remaining-tokens"] == "400"
    assert headers["x-ratelimit-reset-tokens"] == "1m30s"  # the rest of this minute, then all of the next
    with pytest.raises(TenantTokensLimited) as refused:
        await limiter.acquire("acme", "r2", 500)
    assert refused.value.error_type == "tokens"
    # 600 + 500 > 1000 until the 600 decay to 500: 1/6 of the next minute, 40 s from now.
    assert refused.value.headers()["Retry-After"] == "40"
    assert refused.value.headers()["x-ratelimit-remaining-tokens"] == "400"
    clock.now += 40.5
    await limiter.acquire("acme", "r2", 500)  # 600 * (1 - 10.5/60) + 500 = 995
    with pytest.raises(TenantTokensLimited):
        await limiter.acquire("acme", "r3", 10)
    await limiter.close()


async def test_a_request_larger_than_the_limit_is_refused(client: AsyncClient, keys: Keys) -> None:
    limiter = TenantLimiter(client, keys, {"acme": TenantLimits(max_concurrent=5, tokens_per_min=100)})
    with pytest.raises(TenantTokensLimited, match="requested 101"):
        await limiter.acquire("acme", "r1", 101)
    # Refused on tokens, it holds no place in flight.
    assert await client.zcard(keys.tenant_in_flight("acme")) == 0
    await limiter.close()


@pytest.mark.parametrize(
    ("window", "cost", "limit", "seconds"),
    [
        pytest.param(TokenWindow(0, 0, 10), 50, 100, 0.0, id="empty"),
        pytest.param(TokenWindow(0, 80, 30), 50, 100, 30 + 60 * (1 - 50 / 80), id="this-minute-must-decay"),
        pytest.param(TokenWindow(90, 0, 0), 50, 100, 60 * (1 - 50 / 90), id="last-minute-decays"),
        pytest.param(TokenWindow(90, 20, 6), 50, 100, 60 * (1 - 30 / 90) - 6, id="both"),
        pytest.param(TokenWindow(0, 0, 0), 101, 100, 60.0, id="never-fits"),
    ],
)
def test_seconds_until_room(window: TokenWindow, cost: int, limit: int, seconds: float) -> None:
    assert window.seconds_until_room(cost, limit) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("seconds", "text"), [(0, "0ms"), (0.25, "250ms"), (1.0, "1s"), (59.6, "1m0s"), (90, "1m30s"), (125.2, "2m5s")]
)
def test_duration_as_openai_writes_it(seconds: float, text: str) -> None:
    assert duration(seconds) == text
