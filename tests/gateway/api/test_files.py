"""``/v1/files``: upload, list, retrieve, download, delete — per tenant, within the limits, on one
Redis and on a Redis Cluster."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from metrale.gateway.batches import file_store
from metrale.shared.settings import StorageQuotas
from tests.gateway.harness import gateway_harness

pytestmark = pytest.mark.anyio

KEYS = {"sk-a": "tenant-a", "sk-b": "tenant-b"}
A = {"Authorization": "Bearer sk-a"}
B = {"Authorization": "Bearer sk-b"}
LINES = b'{"custom_id": "1"}\n{"custom_id": "2"}\n'


def _upload(content: bytes = LINES, purpose: str = "batch", name: str = "in.jsonl") -> dict[str, object]:
    return {"files": {"file": (name, content, "application/jsonl")}, "data": {"purpose": purpose}}


async def test_upload_list_retrieve_download_delete(any_redis_url: str, tmp_path: Path) -> None:
    async with gateway_harness(api_keys=KEYS, files_dir=tmp_path, redis_url=any_redis_url) as h:
        created = await h.http.post("/v1/files", headers=A, **_upload())  # type: ignore[arg-type]
        assert created.status_code == 200, created.text
        body = created.json()
        assert body["object"] == "file" and body["purpose"] == "batch" and body["filename"] == "in.jsonl"
        assert body["bytes"] == len(LINES) and body["id"].startswith("file-")
        file_id = body["id"]
        assert (tmp_path / "tenant-a" / file_id).read_bytes() == LINES

        assert (await h.http.get(f"/v1/files/{file_id}", headers=A)).json() == body
        content = await h.http.get(f"/v1/files/{file_id}/content", headers=A)
        assert content.content == LINES
        listed = (await h.http.get("/v1/files", headers=A)).json()
        assert [f["id"] for f in listed["data"]] == [file_id] and listed["has_more"] is False

        deleted = await h.http.delete(f"/v1/files/{file_id}", headers=A)
        assert deleted.json() == {"id": file_id, "object": "file", "deleted": True}
        assert (await h.http.get(f"/v1/files/{file_id}", headers=A)).status_code == 404
        assert not (tmp_path / "tenant-a" / file_id).exists()
        assert (await h.http.get("/v1/files", headers=A)).json()["data"] == []


async def test_another_tenants_file_is_not_found(tmp_path: Path) -> None:
    async with gateway_harness(api_keys=KEYS, files_dir=tmp_path) as h:
        file_id = (await h.http.post("/v1/files", headers=A, **_upload())).json()["id"]  # type: ignore[arg-type]
        for method, path in [("GET", ""), ("GET", "/content"), ("DELETE", "")]:
            answer = await h.http.request(method, f"/v1/files/{file_id}{path}", headers=B)
            assert answer.status_code == 404, (method, path)
            assert answer.json()["error"]["code"] == "not_found"
        assert (await h.http.get("/v1/files", headers=B)).json()["data"] == []
        assert (await h.http.get(f"/v1/files/{file_id}", headers=A)).status_code == 200


async def test_list_is_newest_first_and_pages_with_after(tmp_path: Path) -> None:
    async with gateway_harness(api_keys=KEYS, files_dir=tmp_path) as h:
        ids = [(await h.http.post("/v1/files", headers=A, **_upload())).json()["id"] for _ in range(3)]  # type: ignore[arg-type]
        first = (await h.http.get("/v1/files", headers=A, params={"limit": 2})).json()
        assert [f["id"] for f in first["data"]] == ids[::-1][:2] and first["has_more"] is True
        rest = (await h.http.get("/v1/files", headers=A, params={"limit": 2, "after": first["last_id"]})).json()
        assert [f["id"] for f in rest["data"]] == [ids[0]] and rest["has_more"] is False


async def test_limits_on_bytes_and_lines_leave_nothing_behind(tmp_path: Path) -> None:
    async with gateway_harness(api_keys=KEYS, files_dir=tmp_path, max_file_bytes=100, max_file_lines=2) as h:
        too_big = await h.http.post("/v1/files", headers=A, **_upload(b"x" * 101))  # type: ignore[arg-type]
        assert too_big.status_code == 413, too_big.text
        too_long = await h.http.post("/v1/files", headers=A, **_upload(b"{}\n{}\n{}"))  # type: ignore[arg-type]
        assert too_long.status_code == 400 and "3 lines" in too_long.json()["error"]["message"]
        assert list((tmp_path / "tenant-a").iterdir()) == []
        assert (await h.http.post("/v1/files", headers=A, **_upload(b"{}\n{}"))).status_code == 200  # type: ignore[arg-type]


async def test_a_purpose_other_than_batch_is_refused(tmp_path: Path) -> None:
    async with gateway_harness(api_keys=KEYS, files_dir=tmp_path) as h:
        answer = await h.http.post("/v1/files", headers=A, **_upload(purpose="fine-tune"))  # type: ignore[arg-type]
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "purpose"
        missing = await h.http.post("/v1/files", headers=A, data={"purpose": "batch"})
        assert missing.status_code == 400


async def test_without_a_file_store_the_files_api_is_503() -> None:
    async with gateway_harness(api_keys=KEYS) as h:
        assert (await h.http.get("/v1/files", headers=A)).status_code == 503


async def test_files_need_a_key(tmp_path: Path) -> None:
    async with gateway_harness(api_keys=KEYS, files_dir=tmp_path) as h:
        assert (await h.http.get("/v1/files")).status_code == 401


async def test_an_upload_may_be_larger_than_the_json_body_limit(tmp_path: Path) -> None:
    content = (b"x" * 999 + b"\n") * 9_500  # 9.5 MB: over the 8 MiB limit of JSON bodies
    async with gateway_harness(api_keys=KEYS, files_dir=tmp_path) as h:
        answer = await h.http.post("/v1/files", headers=A, **_upload(content))  # type: ignore[arg-type]
        assert answer.status_code == 200, answer.text
        assert answer.json()["bytes"] == len(content)


def _expiring(seconds: object, anchor: object = "created_at") -> dict[str, object]:
    upload = _upload()
    upload["data"] = {"purpose": "batch", "expires_after[anchor]": anchor, "expires_after[seconds]": seconds}
    return upload


async def test_per_tenant_quotas_on_file_count_and_bytes(any_redis_url: str, tmp_path: Path) -> None:
    quotas = StorageQuotas(max_files=3, max_file_bytes=3 * len(LINES) + 10)
    async with gateway_harness(api_keys=KEYS, files_dir=tmp_path, redis_url=any_redis_url, quotas=quotas) as h:
        ids = [(await h.http.post("/v1/files", headers=A, **_upload())).json()["id"] for _ in range(3)]  # type: ignore[arg-type]
        fourth = await h.http.post("/v1/files", headers=A, **_upload(b"{}"))  # type: ignore[arg-type]
        assert fourth.status_code == 400
        assert fourth.json()["error"]["code"] == "quota_exceeded"
        assert "MET_TENANT_MAX_FILES=3" in fourth.json()["error"]["message"]
        assert (await h.http.post("/v1/files", headers=B, **_upload())).status_code == 200  # another tenant's own
        await h.http.delete(f"/v1/files/{ids[0]}", headers=A)
        too_big = await h.http.post("/v1/files", headers=A, **_upload(LINES + b"x" * 11))  # type: ignore[arg-type]
        assert too_big.status_code == 400
        assert f"MET_TENANT_MAX_FILE_BYTES={quotas.max_file_bytes}" in too_big.json()["error"]["message"]
        assert len(list((tmp_path / "tenant-a").iterdir())) == 2  # nothing of the refused uploads left
        assert (await h.http.post("/v1/files", headers=A, **_upload(LINES + b"x" * 10))).status_code == 200  # type: ignore[arg-type]


async def test_expires_after_sets_expires_at_and_batch_uploads_default_to_30_days(tmp_path: Path) -> None:
    async with gateway_harness(api_keys=KEYS, files_dir=tmp_path) as h:
        default = (await h.http.post("/v1/files", headers=A, **_upload())).json()  # type: ignore[arg-type]
        assert default["expires_at"] == default["created_at"] + 30 * 24 * 3600
        hour = (await h.http.post("/v1/files", headers=A, **_expiring("3600"))).json()  # type: ignore[arg-type]
        assert hour["expires_at"] == hour["created_at"] + 3600
        assert 3590 <= await h.redis.ttl(h.keys.file("tenant-a", hour["id"])) <= 3600  # the metadata expires itself
        for seconds, anchor, param in [
            ("3599", "created_at", "expires_after[seconds]"),
            ("2592001", "created_at", "expires_after[seconds]"),
            ("soon", "created_at", "expires_after[seconds]"),
            ("3600", "last_active_at", "expires_after[anchor]"),
        ]:
            refused = await h.http.post("/v1/files", headers=A, **_expiring(seconds, anchor))  # type: ignore[arg-type]
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param, (seconds, anchor)
        unknown = _upload()
        unknown["data"] = {"purpose": "batch", "metadata[team]": "x"}
        refused = await h.http.post("/v1/files", headers=A, **unknown)  # type: ignore[arg-type]
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "metadata[team]"


async def test_an_expired_file_is_gone_bytes_and_all(
    any_redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with gateway_harness(api_keys=KEYS, files_dir=tmp_path, redis_url=any_redis_url) as h:
        file_id = (await h.http.post("/v1/files", headers=A, **_expiring("3600"))).json()["id"]  # type: ignore[arg-type]
        kept = (await h.http.post("/v1/files", headers=A, **_upload())).json()["id"]  # type: ignore[arg-type]
        later = time.time() + 3601
        monkeypatch.setattr(file_store.time, "time", lambda: later)
        assert (await h.http.get(f"/v1/files/{file_id}", headers=A)).status_code == 404
        assert [f["id"] for f in (await h.http.get("/v1/files", headers=A)).json()["data"]] == [kept]
        assert not (tmp_path / "tenant-a" / file_id).exists()  # the listing swept it off the disk
        assert await h.redis.hkeys(h.keys.file_sizes("tenant-a")) == [kept.encode()]
        assert await h.redis.zcard(h.keys.file_expiry()) == 1  # the kept one's 30 days
