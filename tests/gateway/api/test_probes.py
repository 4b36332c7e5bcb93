from __future__ import annotations

import re

import pytest

from metrale.shared.keys import WORKER_GROUP
from metrale.shared.messages import Priority
from tests.gateway.harness import MAX_MODEL_LEN, MODEL, gateway_harness

pytestmark = pytest.mark.anyio


async def test_health_says_the_process_is_up_even_without_workers() -> None:
    async with gateway_harness(worker_running=False) as h:
        await h.worker.retire()
        response = await h.http.get("/health")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})


async def test_ready_with_a_live_worker() -> None:
    async with gateway_harness(worker_running=False) as h:
        response = await h.http.get("/ready")
    assert (response.status_code, response.json()) == (200, {"status": "ready", "workers": 1})


async def test_not_ready_without_a_live_worker() -> None:
    async with gateway_harness(worker_running=False) as h:
        await h.worker.retire()
        response = await h.http.get("/ready")
    assert response.status_code == 503
    assert response.json() == {
        "error": {
            "message": "No live worker yet.",
            "type": "server_error",
            "param": None,
            "code": "no_worker_available",
        }
    }


async def test_ready_is_503_when_redis_is_unreachable() -> None:
    async with gateway_harness(worker_running=False) as h:
        server = h.redis.connection_pool.connection_kwargs["server"]
        server.connected = False
        response = await h.http.get("/ready")
        server.connected = True
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "queue_unavailable"


async def test_models_lists_what_live_workers_serve() -> None:
    async with gateway_harness(worker_running=False) as h:
        response = await h.http.get("/v1/models")
    body = response.json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert (card["id"], card["object"], card["owned_by"], card["max_model_len"]) == (
        MODEL,
        "model",
        "metrale",
        MAX_MODEL_LEN,
    )


async def test_models_is_empty_without_live_workers() -> None:
    async with gateway_harness(worker_running=False) as h:
        await h.worker.retire()
        response = await h.http.get("/v1/models")
    assert response.json() == {"object": "list", "data": []}


async def test_retrieve_one_model_as_the_client_does() -> None:
    async with gateway_harness(worker_running=False) as h:
        listed = (await h.http.get("/v1/models")).json()["data"][0]
        response = await h.http.get(f"/v1/models/{MODEL}")
    assert response.status_code == 200
    assert response.json() == listed


async def test_retrieve_an_unknown_model_is_404_model_not_found() -> None:
    async with gateway_harness(worker_running=False) as h:
        response = await h.http.get("/v1/models/no-such-model")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


async def test_retrieve_a_model_without_a_live_worker_is_404_as_in_the_list() -> None:
    async with gateway_harness(worker_running=False) as h:
        await h.worker.retire()
        response = await h.http.get(f"/v1/models/{MODEL}")
    assert response.status_code == 404


async def test_retrieve_needs_a_key_when_keys_are_set() -> None:
    async with gateway_harness(worker_running=False, api_keys={"sk-a": "acme"}) as h:
        refused = await h.http.get(f"/v1/models/{MODEL}")
        allowed = await h.http.get(f"/v1/models/{MODEL}", headers={"Authorization": "Bearer sk-a"})
    assert (refused.status_code, allowed.status_code) == (401, 200)


def sample(exposition: str, name: str, labels: str = "") -> float:
    """The value of one sample in a Prometheus text exposition."""
    match = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", exposition, re.MULTILINE)
    assert match is not None, f"{name}{labels} not exposed"
    return float(match.group(1))


async def test_metrics_count_requests_tokens_and_latencies() -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}
    async with gateway_harness() as h:
        ok = await h.http.post("/v1/chat/completions", json=chat)
        await h.http.post("/v1/chat/completions", json={**chat, "model": "nope"})
        streamed = await h.http.post("/v1/chat/completions", json={**chat, "stream": True})
        text = (await h.http.get("/metrics")).text
    usage = ok.json()["usage"]
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    assert sample(text, "metrale_requests_total", '{endpoint="chat",status="200"}') == 2
    assert sample(text, "metrale_requests_total", '{endpoint="chat",status="404"}') == 1
    assert sample(text, "metrale_request_success_total", '{finished_reason="length"}') == 2
    assert sample(text, "metrale_prompt_tokens_total") == 2 * usage["prompt_tokens"]
    assert sample(text, "metrale_generation_tokens_total") == 2 * usage["completion_tokens"] == 10
    assert sample(text, "metrale_time_to_first_token_seconds_count") == 2
    # Only the stream's tokens arrive one by one: the whole answer hears its first and last events.
    assert sample(text, "metrale_inter_token_latency_seconds_count") == 4
    assert sample(text, "metrale_e2e_request_latency_seconds_count") == 2
    assert sample(text, "metrale_live_workers") == 1


async def test_metrics_report_queue_depth() -> None:
    async with gateway_harness(worker_running=False) as h:
        stream = h.keys.request_stream(Priority.BATCH)
        await h.redis.xgroup_create(stream, WORKER_GROUP, id="0", mkstream=True)
        for _ in range(3):
            await h.redis.xadd(stream, {"msg": b"queued"})
        await h.redis.xreadgroup(WORKER_GROUP, "w-1", {stream: ">"}, count=1)
        text = (await h.http.get("/metrics")).text
    assert sample(text, "metrale_queue_length", '{priority="batch"}') == 3
    assert sample(text, "metrale_queue_pending", '{priority="batch"}') == 1
    assert sample(text, "metrale_queue_length", '{priority="interactive"}') == 0
