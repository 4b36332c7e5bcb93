"""The parts of one gateway process, built once by ``create_app`` and shared by every route."""

from __future__ import annotations

from dataclasses import dataclass, field

import redis
import redis.asyncio
from fastapi import Request

from metrale.gateway.batches.batch_store import BatchStore
from metrale.gateway.batches.file_store import FileStore
from metrale.gateway.batches.job_queue import BatchJobQueue
from metrale.gateway.edge.auth import ApiKeyAuth
from metrale.gateway.edge.body_precheck import BodyPrecheck
from metrale.gateway.fleet.admission import Admission
from metrale.gateway.fleet.dispatcher import Dispatcher
from metrale.gateway.fleet.registry import ModelRegistry
from metrale.gateway.fleet.session_store import SessionStore
from metrale.gateway.metrics import GatewayMetrics
from metrale.gateway.responses.background_store import BackgroundStore
from metrale.gateway.responses.store import ResponseStore
from metrale.gateway.streams.relay import TokenRelay
from metrale.shared.settings import GatewaySettings


@dataclass(frozen=True, slots=True)
class Gateway:
    """Settings, the Redis client, and the components built on it."""

    settings: GatewaySettings
    client: redis.asyncio.Redis
    relay: TokenRelay
    registry: ModelRegistry
    dispatcher: Dispatcher
    admission: Admission
    metrics: GatewayMetrics
    auth: ApiKeyAuth
    sessions: SessionStore
    responses: ResponseStore
    background: BackgroundStore
    """Background responses: status, object and events (in ``responses``' hashes)."""
    files: FileStore | None
    batches: BatchStore
    batch_jobs: BatchJobQueue | None
    """``None`` without a synchronous client for RQ: then batches cannot be created."""
    precheck: BodyPrecheck = field(default_factory=BodyPrecheck)
    """Where large bodies are judged before they are parsed (``body_precheck.py``)."""

    @classmethod
    def build(
        cls, settings: GatewaySettings, client: redis.asyncio.Redis, job_client: redis.Redis | None = None
    ) -> Gateway:
        """The parts on ``client``; ``job_client`` (sync, same Redis) is the one RQ uses."""
        keys = settings.keys
        registry = ModelRegistry(client, keys)
        dispatcher = Dispatcher(client, keys, replication=settings.replication)
        return cls(
            settings=settings,
            client=client,
            relay=TokenRelay(client, keys),
            registry=registry,
            dispatcher=dispatcher,
            admission=Admission(client, keys, settings, dispatcher=dispatcher, registry=registry),
            metrics=GatewayMetrics(),
            auth=ApiKeyAuth(settings.api_keys),
            sessions=SessionStore(client, keys),
            responses=ResponseStore(
                client, keys, ttl_s=settings.response_ttl_s, max_stored=settings.quotas.max_stored_responses
            ),
            background=BackgroundStore(client, keys, ttl_s=settings.response_ttl_s),
            files=_file_store(settings, client),
            batches=BatchStore(client, keys),
            batch_jobs=BatchJobQueue(job_client, keys) if job_client is not None else None,
        )


def gateway_of(request: Request) -> Gateway:
    """The ``Gateway`` of the app serving ``request``."""
    gateway: Gateway = request.app.state.gateway
    return gateway


def _file_store(settings: GatewaySettings, client: redis.asyncio.Redis) -> FileStore | None:
    if settings.files_dir is None:
        return None
    limits = {"max_bytes": settings.max_file_bytes, "max_lines": settings.max_file_lines}
    return FileStore(client, settings.keys, settings.files_dir, **limits, quotas=settings.quotas)
