"""``/v1/files``: upload (multipart, ``purpose=batch``), list, retrieve, download and delete files.

Every route acts for the tenant of the request's API key; another tenant's file is a 404.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.datastructures import UploadFile
from starlette.responses import StreamingResponse

from metrale.gateway.batches.file_store import FileStore
from metrale.gateway.batches.objects import FileObject
from metrale.gateway.state import gateway_of
from metrale.shared.errors import BadRequest, Conflict, MetraleError

router = APIRouter()

UPLOAD_PURPOSES = ("batch",)
"""What an uploaded file may be for."""
MAX_LIST = 10_000
UPLOAD_FIELDS = frozenset({"file", "purpose", "expires_after[anchor]", "expires_after[seconds]"})
EXPIRES_AFTER_S = (3600, 30 * 24 * 3600)
"""The bounds OpenAI sets on ``expires_after[seconds]``: an hour to 30 days."""


class FilesUnavailable(MetraleError):
    """This gateway was started without a file store."""

    status = 503
    code = "files_unavailable"


def _files(request: Request) -> tuple[FileStore, str]:
    gateway = gateway_of(request)
    tenant = gateway.auth.tenant_for(request.headers.get("authorization"))
    if gateway.files is None:
        raise FilesUnavailable("This gateway has no file store (MET_FILES_DIR).")
    return gateway.files, tenant


@router.post("/v1/files")
async def upload_file(request: Request) -> FileObject:
    """Upload a file (``multipart/form-data`` with ``file``, ``purpose`` and, optionally,
    ``expires_after[anchor]=created_at`` and ``expires_after[seconds]``)."""
    store, tenant = _files(request)
    async with request.form(max_files=1, max_fields=8) as form:
        unknown = sorted(set(form.keys()) - UPLOAD_FIELDS)
        if unknown:
            raise BadRequest(f"Unknown upload field {unknown[0]!r}: send {sorted(UPLOAD_FIELDS)}.", param=unknown[0])
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise BadRequest("Send the file as the multipart field 'file'.", param="file")
        if purpose not in UPLOAD_PURPOSES:
            raise BadRequest(f"purpose must be one of {list(UPLOAD_PURPOSES)}, got {purpose!r}", param="purpose")
        ttl_s = _expires_after(form.get("expires_after[anchor]"), form.get("expires_after[seconds]"))
        if ttl_s is None:
            ttl_s = gateway_of(request).settings.quotas.batch_file_ttl_s or None
        filename = upload.filename or "upload.jsonl"
        return await store.upload(tenant, upload, filename=filename, purpose=purpose, expires_after_s=ttl_s)


def _expires_after(anchor: object, seconds: object) -> int | None:
    """The seconds of OpenAI's ``expires_after`` (anchored at ``created_at``), or None if not sent."""
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise BadRequest(f"expires_after[anchor] must be 'created_at', got {anchor!r}", param="expires_after[anchor]")
    low, high = EXPIRES_AFTER_S
    if not isinstance(seconds, str) or not seconds.isdigit() or not low <= int(seconds) <= high:
        raise BadRequest(
            f"expires_after[seconds] must be a whole number in [{low}, {high}], got {seconds!r}",
            param="expires_after[seconds]",
        )
    return int(seconds)


@router.get("/v1/files")
async def list_files(
    request: Request, purpose: str | None = None, limit: int = MAX_LIST, after: str | None = None
) -> dict[str, Any]:
    """The tenant's files, newest first (``after`` is the last id of the previous page)."""
    store, tenant = _files(request)
    if not 1 <= limit <= MAX_LIST:
        raise BadRequest(f"limit must be in [1, {MAX_LIST}]", param="limit")
    found = await store.list(tenant, purpose=purpose, limit=limit + 1, after=after)
    return page([file.model_dump(mode="json") for file in found[:limit]], has_more=len(found) > limit)


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, request: Request) -> FileObject:
    """One file's object."""
    store, tenant = _files(request)
    return await store.get(tenant, file_id)


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request) -> StreamingResponse:
    """The file's bytes."""
    store, tenant = _files(request)
    await store.get(tenant, file_id)  # a 404 before the response starts
    return StreamingResponse(store.read_chunks(tenant, file_id), media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request) -> dict[str, Any]:
    """Delete a file: its object and its bytes; 409 while an unfinished batch reads it."""
    store, tenant = _files(request)
    await store.get(tenant, file_id)
    reader = await gateway_of(request).batches.unfinished_reading(tenant, file_id)
    if reader is not None:
        raise Conflict(
            f"The file {file_id!r} is the input of batch {reader!r}, which has not finished: cancel the batch or "
            "wait for it to end before deleting the file.",
            param="file_id",
        )
    await store.delete(tenant, file_id)
    return {"id": file_id, "object": "file", "deleted": True}


def page(data: list[dict[str, Any]], *, has_more: bool) -> dict[str, Any]:
    """An OpenAI list page."""
    first = data[0]["id"] if data else None
    last = data[-1]["id"] if data else None
    return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": has_more}
