"""Admission control through the HTTP API: the fleet's wait bound (fakeredis: it only reads and
counts) and the tenants' limits (a real Redis, one and a Redis Cluster: they run a script)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from typing import Any

import pytest

from metrale.gateway.state import Gateway
from metrale.shared.codec import encode
from metrale.shared.messages import GenerateRequest, Priority, WorkerHeartbeat
from metrale.shared.settings import TenantLimits
from tests.gateway.api.test_probes import sample
from tests.gateway.fake_worker import FakeWorkerScript
from tests.gateway.harness import MAX_MODEL_LEN, MODEL, Harness, counted, gateway_harness
from tests.redis_kinds import HarnessRedis

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
KEY = {"Authorization": "Bearer sk-a"}


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **extra}


async def beat(h: Harness, *, slots: int, finished: int, slot_ms: int, full_step_s: float = 0.0) -> None:
    """Replace the fake worker's heartbeat: ``slots`` slots, all busy, the slot-time counters and its
    loop's full step (its probe: the same)."""
    now = time.time()
    counters = [("request_slot_ms", slot_ms), ("requests_finished", finished)]
    heartbeat = WorkerHeartbeat(
        h.worker.worker_id,
        MODEL,
        slots,
        0,
        0,
        slots,
        0.0,
        0,
        64,
        now,
        now,
        total_slots=slots,
        counters=counters,
        probe_step_s=full_step_s,
        full_step_s=full_step_s,
    )
    await h.redis.hset(h.keys.worker(h.worker.worker_id), "msg", encode(heartbeat))


async def test_a_burst_is_admitted_up_to_the_wait_bound_and_the_rest_refused_at_once() -> None:
    # 2 slots, a request holds one 4 s: a slot frees every 2 s, planned as every 2.4 s (HOLD_HEADROOM).
    # The 12th request has 10 ahead (24 s), the 13th 11 (26.4 s); the bound of 25.5 s leaves the 12th
    # 1.5 s for the time it spends in the gateway and refuses the 13th even if it spent none there.
    # The deadline (3 s) comes after all 30 are judged: none that was taken has left the queue before.
    async with gateway_harness(worker_running=False, max_queue_wait_s=25.5, request_timeout_s=3.0) as h:
        await beat(h, slots=2, finished=10, slot_ms=40_000)
        began = time.monotonic()
        responses = await asyncio.gather(*(h.http.post(CHAT, json=chat()) for _ in range(30)))
        refusals_counted = await counted(h, "queue_full_rejections", 18)
    statuses = [response.status_code for response in responses]
    assert statuses.count(504) == 12, statuses  # admitted; no worker runs, so they end at their deadline
    assert statuses.count(429) == 18 and refusals_counted
    refused = [response for response in responses if response.status_code == 429]
    # The first refused would be the 13th, waiting 26.4 s: 0.9 s over the bound. Each refused after it
    # waits behind those told to come back before it, a slot's 2.4 s later each: 0.9 + 2.4 k s over.
    retry_after = sorted(int(response.headers["Retry-After"]) for response in refused)
    assert retry_after == [math.ceil(0.9 + 2.4 * k) for k in range(18)], retry_after
    assert refused[0].json()["error"]["code"] == "rate_limit_exceeded"
    assert time.monotonic() - began < 10


async def test_a_cold_burst_is_bounded_by_the_workers_full_step_and_what_it_asks() -> None:
    # Nothing finished yet; 2 slots at 0.25 s a full step make 8 tokens a second, and each request asks
    # for 8: one leaves a slot every second, planned as 1.2 s. The i-th request (from 0) has i - 1
    # ahead: 1.2 (i - 1) s <= 5.5 s admits the first six (the sixth with 0.7 s spare for the gateway).
    async with gateway_harness(worker_running=False, max_queue_wait_s=5.5, request_timeout_s=3.0) as h:
        await beat(h, slots=2, finished=0, slot_ms=0, full_step_s=0.25)
        responses = await asyncio.gather(*(h.http.post(CHAT, json=chat()) for _ in range(12)))
    statuses = [response.status_code for response in responses]
    assert statuses.count(504) == 6 and statuses.count(429) == 6, statuses
    assert all(response.headers["Retry-After"] for response in responses if response.status_code == 429)


async def test_a_big_batch_never_refuses_an_interactive_request(harness_redis: HarnessRedis) -> None:
    # On fakeredis, then on a cluster: the batch requests wait in every shard's stream, and all count.
    async with gateway_harness(
        worker_running=False, max_queue_wait_s=5.0, request_timeout_s=0.3, redis_url=harness_redis.url
    ) as h:
        await beat(h, slots=2, finished=10, slot_ms=10_000)
        for n in range(100):
            await h.redis.xadd(h.keys.request_stream(Priority.BATCH, n % h.keys.shards), {"msg": b"waiting"})
        interactive = await h.http.post(CHAT, json=chat())
        batch = await h.http.post(CHAT, json=chat(priority="batch"))
    assert interactive.status_code == 504  # taken (then no worker ran it)
    assert batch.status_code == 429  # behind 100 batch requests: 49.5 s, planned as 59.4 s
    assert batch.headers["Retry-After"] == "55"


async def test_until_a_request_finished_only_max_queue_bounds_the_queue() -> None:
    async with gateway_harness(worker_running=False, max_queue=3, max_queue_wait_s=1.0, request_timeout_s=0.5) as h:
        await beat(h, slots=1, finished=0, slot_ms=0)
        responses = await asyncio.gather(*(h.http.post(CHAT, json=chat()) for _ in range(6)))
    assert sorted(response.status_code for response in responses) == [429, 429, 504, 504, 504, 504]


@pytest.mark.redis
async def test_tenant_concurrency_limit_with_ratelimit_headers(any_redis_url: str) -> None:
    script = FakeWorkerScript(lambda request, index: list(range(10, 18)), step_s=0.05)
    limits = {"acme": TenantLimits(max_concurrent=1, tokens_per_min=10_000)}
    async with gateway_harness(script, api_keys={"sk-a": "acme"}, tenant_limits=limits, redis_url=any_redis_url) as h:
        first = asyncio.create_task(h.http.post(CHAT, headers=KEY, json=chat(max_tokens=8)))
        await in_flight(h, 1)
        refused = await h.http.post(CHAT, headers=KEY, json=chat())
        answered = await first
        streamed = await h.http.post(CHAT, headers=KEY, json=chat(stream=True))
        refusal_counted = await counted(h, "tenant_limit_rejections", 1)
        left = await h.redis.zcard(h.keys.tenant_in_flight("acme"))
    assert refused.status_code == 429 and refusal_counted
    assert refused.json()["error"]["type"] == "requests"
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert refused.headers["Retry-After"] == "1"
    assert refused.headers["x-ratelimit-limit-requests"] == "1"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    for response in (answered, streamed):
        assert response.status_code == 200
        assert response.headers["x-ratelimit-limit-requests"] == "1"
        assert response.headers["x-ratelimit-remaining-requests"] == "0"  # itself
        assert response.headers["x-ratelimit-limit-tokens"] == "10000"
        assert int(response.headers["x-ratelimit-remaining-tokens"]) < 10_000
        assert response.headers["x-ratelimit-reset-tokens"].endswith("s")
    assert left == 0  # both given back


@pytest.mark.redis
async def test_a_tenant_at_its_limit_is_refused_before_its_prompt_is_prepared(any_redis_url: str) -> None:
    """The held request's twin is a prompt far over the context: rendered first, it was a 400; judged
    first, the tenant's 429 comes before any work on it."""
    script = FakeWorkerScript(lambda request, index: list(range(10, 18)), step_s=0.05)
    limits = {"acme": TenantLimits(max_concurrent=1)}
    async with gateway_harness(script, api_keys={"sk-a": "acme"}, tenant_limits=limits, redis_url=any_redis_url) as h:
        held = asyncio.create_task(h.http.post(CHAT, headers=KEY, json=chat(max_tokens=8)))
        await in_flight(h, 1)
        too_long = chat(messages=[{"role": "user", "content": "word " * (4 * MAX_MODEL_LEN)}])
        refused = await h.http.post(CHAT, headers=KEY, json=too_long)
        assert (await held).status_code == 200
        alone = await h.http.post(CHAT, headers=KEY, json=too_long)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["type"] == "requests"
    assert alone.status_code == 400  # the same body, its tenant free: its own error


@pytest.mark.redis
async def test_tokens_per_minute_count_prompt_and_requested_tokens(any_redis_url: str) -> None:
    limits = {"acme": TenantLimits(tokens_per_min=100)}
    async with gateway_harness(api_keys={"sk-a": "acme"}, tenant_limits=limits, redis_url=any_redis_url) as h:
        first = await h.http.post(CHAT, headers=KEY, json=chat(max_tokens=40))
        prompt_tokens = first.json()["usage"]["prompt_tokens"]
        too_many = await h.http.post(CHAT, headers=KEY, json=chat(max_tokens=100 - (prompt_tokens + 40)))
    assert first.headers["x-ratelimit-remaining-tokens"] == str(100 - prompt_tokens - 40)
    assert too_many.status_code == 429
    assert too_many.json()["error"]["type"] == "tokens"
    assert int(too_many.headers["Retry-After"]) >= 1
    assert too_many.headers["x-ratelimit-remaining-tokens"] == str(100 - prompt_tokens - 40)


@pytest.mark.redis
async def test_a_cancelled_request_gives_its_tenant_place_back(any_redis_url: str) -> None:
    """What a client that disconnects does to the task serving it."""
    limits = {"acme": TenantLimits(max_concurrent=1)}
    async with gateway_harness(api_keys={"sk-a": "acme"}, tenant_limits=limits, redis_url=any_redis_url) as h:
        gateway: Gateway = h.app.state.gateway
        request = GenerateRequest("chatcmpl-gone", MODEL, "acme", [1, 2, 3], 8)
        entered = asyncio.Event()

        async def serve() -> None:
            async with gateway.admission.tenant_place(request):
                entered.set()
                await asyncio.sleep(60)

        task = asyncio.create_task(serve())
        await entered.wait()
        assert await h.redis.zcard(h.keys.tenant_in_flight("acme")) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await in_flight(h, 0)


async def in_flight(h: Harness, count: int) -> None:
    async with asyncio.timeout(5):
        while await h.redis.zcard(h.keys.tenant_in_flight("acme")) != count:
            await asyncio.sleep(0.01)


async def test_while_the_fleet_is_full_a_request_is_refused_before_its_body_is_read() -> None:
    """Load shedding: once a recent read shows the fleet full, a new request gets its 429 on arrival,
    before it is parsed (so even an unparseable one); one without a valid key still gets its 401, and
    other routes are untouched."""
    keys = {"sk-a": "acme"}
    async with gateway_harness(worker_running=False, max_queue_wait_s=5.0, api_keys=keys) as h:
        await beat(h, slots=2, finished=10, slot_ms=10_000)
        for _ in range(20):
            await h.redis.xadd(h.keys.request_stream(Priority.INTERACTIVE), {"msg": b"waiting"})
        judged_by_route = await h.http.post(CHAT, headers=KEY, json=chat())  # reads the streams
        shed = await h.http.post(CHAT, headers={**KEY, "Content-Type": "application/json"}, content=b"{not json")
        unauthorized = await h.http.post(CHAT, content=b"{not json")
        models = await h.http.get("/v1/models", headers=KEY)
        refusals_counted = await counted(h, "queue_full_rejections", 2)
        metrics = (await h.http.get("/metrics")).text
    assert judged_by_route.status_code == 429
    assert shed.status_code == 429  # the route would have answered 422
    assert shed.headers["Retry-After"] == judged_by_route.headers["Retry-After"] == "7"  # waits 11.4 s of 5
    assert shed.json()["error"]["code"] == "rate_limit_exceeded"
    assert unauthorized.status_code == 401
    assert models.status_code == 200
    assert refusals_counted
    assert sample(metrics, "metrale_requests_total", '{endpoint="chat",status="429"}') == 2


async def test_without_a_recent_read_only_requests_not_yet_judged_count_ahead() -> None:
    """The arrivals a burst's later requests wait behind: requests in the gateway not judged yet.
    With nothing in the fleet and nothing read, a request is refused on arrival only once enough
    of them are ahead of it."""
    async with gateway_harness(worker_running=False, max_queue_wait_s=5.0) as h:
        await beat(h, slots=2, finished=10, slot_ms=10_000)  # a slot frees every 0.5 s, planned 0.6 s
        gateway: Gateway = h.app.state.gateway
        await gateway.registry.live_workers()
        fleet = gateway.admission.fleet
        assert fleet.refusal_now() is None
        with contextlib.ExitStack() as arrived:
            for _ in range(9):  # 2 start at once, 7 wait up to 4.2 s; the 10th would wait 4.8 s
                arrived.enter_context(fleet.arrivals.arrived())
            assert fleet.refusal_now() is None
            arrived.enter_context(fleet.arrivals.arrived())  # the 11th would wait 5.4 s
            refusal = fleet.refusal_now()
            assert refusal is not None and refusal.retry_after_s == 1
        assert fleet.arrivals.waiting == 0
        assert fleet.refusal_now() is None


async def test_a_full_fleet_still_answers_a_continuation_of_an_unknown_response_404() -> None:
    """A request that can never succeed is told so, not told to come back: the previous response is
    looked up before the fleet judges the request (a cheap read; the prompt is rendered after)."""
    async with gateway_harness(worker_running=False, max_queue_wait_s=5.0, api_keys={"sk-a": "acme"}) as h:
        await beat(h, slots=2, finished=10, slot_ms=10_000)
        for _ in range(20):
            await h.redis.xadd(h.keys.request_stream(Priority.INTERACTIVE), {"msg": b"waiting"})
        unknown = {"model": MODEL, "input": "Hi", "previous_response_id": "resp-unknown"}
        continued = await h.http.post("/v1/responses", headers=KEY, json=unknown)
        fresh = await h.http.post("/v1/responses", headers=KEY, json={"model": MODEL, "input": "Hi"})
    assert continued.status_code == 404, continued.text
    assert continued.json()["error"]["param"] == "previous_response_id"
    assert fresh.status_code == 429  # the same fleet refuses a request that could run
