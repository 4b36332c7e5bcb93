"""Endpoints about the gateway and its fleet: ``/health``, ``/ready``, ``/v1/models[/{id}]``, ``/metrics``."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError
from starlette.responses import JSONResponse, Response

from metrale.gateway.errors import RedisUnavailable, error_response
from metrale.gateway.response_bodies import ModelCard, ModelList
from metrale.gateway.state import Gateway, gateway_of
from metrale.shared.errors import ModelNotFound, NoWorker
from metrale.shared.messages import WorkerHeartbeat

router = APIRouter()


@router.get("/health")
async def health() -> dict[str, str]:
    """The process is up (says nothing about Redis or workers)."""
    return {"status": "ok"}


@router.get("/ready", response_model=None)
async def ready(request: Request) -> Response:
    """Ready to serve: Redis answers and at least one worker is live; else a 503."""
    gateway = gateway_of(request)
    try:
        await gateway.client.ping()
        workers = await gateway.registry.live_workers()
    except RedisError:
        return error_response(RedisUnavailable())
    if not workers:
        return error_response(NoWorker("No live worker yet."))
    return JSONResponse({"status": "ready", "workers": len(workers)})


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    """The models at least one live worker serves, in OpenAI's list format."""
    gateway = gateway_of(request)
    gateway.auth.tenant_for(request.headers.get("authorization"))
    workers = await gateway.registry.live_workers()
    cards = []
    for name in sorted({worker.model for worker in workers}):
        try:
            cards.append(await _model_card(gateway, name, workers))
        except (ModelNotFound, NoWorker):  # a worker that has not announced its model yet
            continue
    return ModelList(data=cards)


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> ModelCard:
    """One model a live worker serves (the client's ``models.retrieve``); 404 for any other name."""
    gateway = gateway_of(request)
    gateway.auth.tenant_for(request.headers.get("authorization"))
    workers = await gateway.registry.live_workers()
    try:
        return await _model_card(gateway, model_id, workers)
    except NoWorker:
        raise ModelNotFound(model_id) from None  # as in the list: a model without a live worker is not shown


async def _model_card(gateway: Gateway, name: str, workers: Sequence[WorkerHeartbeat]) -> ModelCard:
    """The card of ``name``; raises ``ModelNotFound`` / ``NoWorker`` when no live worker announced it."""
    served = await gateway.registry.resolve(name)
    started = [worker.started_at for worker in workers if worker.model == name]
    if not started:
        raise NoWorker(f"No live worker serves '{name}'.")
    return ModelCard(id=name, created=int(min(started)), max_model_len=served.max_model_len)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus metrics; the fleet gauges (queue depth, live workers) are read from Redis now."""
    gateway = gateway_of(request)
    try:
        depths = await gateway.dispatcher.queue_depths()
        workers = await gateway.registry.live_workers()
        gateway.metrics.checkpoints.update(await gateway.client.hgetall(gateway.settings.keys.checkpoint_counters()))
        gateway.metrics.failover.update(await gateway.client.hgetall(gateway.settings.keys.failover_counters()))
        speculation = await gateway.client.hgetall(gateway.settings.keys.speculation_counters())
        gateway.metrics.speculation.update(speculation)
    except RedisError:
        pass  # the counters and histograms are still worth scraping
    else:
        gateway.metrics.record_fleet(depths, len(workers))
    return Response(gateway.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
