"""Stored responses per tenant, on the gateway harness (one Redis, and a Redis Cluster): the quota on how
many a tenant keeps (refused before anything is generated, freed by deletes), and OpenAI's metadata
limits."""

from __future__ import annotations

import pytest

from metrale.shared.settings import StorageQuotas
from tests.gateway.harness import MODEL, gateway_harness

pytestmark = pytest.mark.anyio

KEYS = {"sk-a": "tenant-a", "sk-b": "tenant-b"}
A = {"Authorization": "Bearer sk-a"}
B = {"Authorization": "Bearer sk-b"}


def body(**extra: object) -> dict[str, object]:
    return {"model": MODEL, "input": "hello", "max_output_tokens": 8, **extra}


async def test_a_tenant_keeps_at_most_its_quota_of_stored_responses(any_redis_url: str) -> None:
    quotas = StorageQuotas(max_stored_responses=2)
    async with gateway_harness(api_keys=KEYS, redis_url=any_redis_url, quotas=quotas) as h:
        ids = [(await h.http.post("/v1/responses", headers=A, json=body())).json()["id"] for _ in range(2)]
        generated = len(h.worker.requests)
        refused = await h.http.post("/v1/responses", headers=A, json=body())
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "quota_exceeded" and error["param"] == "store"
        assert "MET_TENANT_MAX_STORED_RESPONSES=2" in error["message"]
        assert len(h.worker.requests) == generated  # refused before generating
        assert (await h.http.post("/v1/responses", headers=A, json=body(store=False))).status_code == 200
        assert (await h.http.post("/v1/responses", headers=B, json=body())).status_code == 200  # its own quota
        assert (await h.http.delete(f"/v1/responses/{ids[0]}", headers=A)).status_code == 200
        assert (await h.http.post("/v1/responses", headers=A, json=body())).status_code == 200


@pytest.mark.parametrize(
    ("metadata", "named"),
    [
        ({f"k{i}": "v" for i in range(17)}, "16"),
        ({"k" * 1000: "v"}, "64"),
        ({"k": "v" * 1_000_000}, "512"),
    ],
    ids=["17-pairs", "1000-char-key", "1MB-value"],
)
async def test_response_metadata_past_openais_limits_is_refused(metadata: dict[str, str], named: str) -> None:
    async with gateway_harness(api_keys=KEYS) as h:
        refused = await h.http.post("/v1/responses", headers=A, json=body(metadata=metadata))
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"].startswith("metadata") and named in refused.json()["error"]["message"]
        assert h.worker.requests == []
        limit = {f"k{i:02}" + "k" * 61: "v" * 512 for i in range(16)}
        kept = await h.http.post("/v1/responses", headers=A, json=body(metadata=limit))
        assert kept.status_code == 200 and kept.json()["metadata"] == limit
