"""``/v1/batches``: create a batch from an uploaded file, retrieve, list and cancel — per tenant.

Creating stores the batch (``validating``) and queues its RQ job; a batch runner does the rest.
Cancelling marks it ``cancelling``; a job no runner is running (queued, failed, gone, or whose runner
died) is taken off the queue and the batch is ``cancelled`` at once, otherwise its runner stops its
lines and finishes it.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import anyio
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from metrale.gateway.api.files import page
from metrale.gateway.batches.batch_store import BatchStore
from metrale.gateway.batches.objects import BATCH_ENDPOINTS, Batch, BatchStatus
from metrale.gateway.edge.body import parse_body
from metrale.gateway.metadata import check_metadata
from metrale.gateway.state import Gateway, gateway_of
from metrale.shared.errors import BadRequest, MetraleError, NotFound

router = APIRouter()

COMPLETION_WINDOWS = {"24h": 24 * 3600}
"""The completion windows a batch may ask for (OpenAI's only one)."""
MAX_LIST = 100


class BatchesUnavailable(MetraleError):
    """This gateway cannot queue batch jobs (no file store, or no Redis client for RQ)."""

    status = 503
    code = "batches_unavailable"


class CreateBatchRequest(BaseModel):
    """``POST /v1/batches``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


def _tenant(request: Request) -> tuple[Gateway, str]:
    gateway = gateway_of(request)
    return gateway, gateway.auth.tenant_for(request.headers.get("authorization"))


@router.post("/v1/batches")
async def create_batch(request: Request) -> Batch:
    """Create a batch and queue it."""
    gateway, tenant = _tenant(request)
    body = await parse_body(request, CreateBatchRequest)
    if gateway.files is None or gateway.batch_jobs is None:
        raise BatchesUnavailable("This gateway cannot run batches (no file store or job queue).")
    _check(body)
    try:
        input_file = await gateway.files.get(tenant, body.input_file_id)
    except NotFound:
        raise BadRequest(f"No such file: {body.input_file_id!r}.", param="input_file_id") from None
    if input_file.purpose != "batch":
        raise BadRequest("The input file must have been uploaded with purpose 'batch'.", param="input_file_id")
    now = int(time.time())
    batch = Batch(
        id=f"batch_{uuid.uuid4().hex[:24]}",
        endpoint=body.endpoint,
        input_file_id=body.input_file_id,
        completion_window=body.completion_window,
        status=BatchStatus.VALIDATING,
        created_at=now,
        expires_at=now + COMPLETION_WINDOWS[body.completion_window],
        metadata=body.metadata,
    )
    await gateway.batches.create(tenant, batch)
    await anyio.to_thread.run_sync(gateway.batch_jobs.enqueue, tenant, batch.id)
    return batch


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, request: Request) -> Batch:
    """One batch."""
    gateway, tenant = _tenant(request)
    return await gateway.batches.get(tenant, batch_id)


@router.get("/v1/batches")
async def list_batches(request: Request, after: str | None = None, limit: int = 20) -> dict[str, Any]:
    """The tenant's batches, newest first (``after`` is the last id of the previous page)."""
    gateway, tenant = _tenant(request)
    if not 1 <= limit <= MAX_LIST:
        raise BadRequest(f"limit must be in [1, {MAX_LIST}]", param="limit")
    found = await gateway.batches.list(tenant, after=after, limit=limit + 1)
    return page([batch.model_dump(mode="json") for batch in found[:limit]], has_more=len(found) > limit)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request) -> Batch:
    """Cancel a batch: queued and running lines stop, finished ones are kept in its output."""
    gateway, tenant = _tenant(request)
    store = gateway.batches
    moved = await store.move(
        tenant, batch_id, BatchStatus.CANCELLING, allowed_from={BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS}
    )
    if moved is None:
        current = await store.get(tenant, batch_id)
        if current.status in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
            return current
        raise BadRequest(f"A batch that is {current.status.value} cannot be cancelled.", param="batch_id")
    jobs = gateway.batch_jobs
    if jobs is not None and await anyio.to_thread.run_sync(jobs.cancel_unless_running, batch_id):
        return await _cancelled_unrun(store, tenant, batch_id)
    return moved


async def _cancelled_unrun(store: BatchStore, tenant: str, batch_id: str) -> Batch:
    """A batch no runner is running (never started, or its job failed, vanished or lost its runner):
    cancelled here, or it would wait for ever; lines it kept are not written out."""
    done = await store.move(tenant, batch_id, BatchStatus.CANCELLED, allowed_from={BatchStatus.CANCELLING})
    return done if done is not None else await store.get(tenant, batch_id)


def _check(body: CreateBatchRequest) -> None:
    if body.endpoint not in BATCH_ENDPOINTS:
        raise BadRequest(f"endpoint must be one of {list(BATCH_ENDPOINTS)}, got {body.endpoint!r}", param="endpoint")
    if body.completion_window not in COMPLETION_WINDOWS:
        windows = list(COMPLETION_WINDOWS)
        raise BadRequest(f"completion_window must be one of {windows}", param="completion_window")
    check_metadata(body.metadata)
