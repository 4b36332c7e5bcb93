"""The parts of one gateway process, built once by ``create_app`` and shared by every route."""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio
from fastapi import Request

from metrale.gateway.auth import ApiKeyAuth
from metrale.gateway.batches.file_store import FileStore
from metrale.gateway.fleet.dispatcher import Dispatcher
from metrale.gateway.fleet.registry import ModelRegistry
from metrale.gateway.fleet.session_store import SessionStore
from metrale.gateway.metrics import GatewayMetrics
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
    metrics: GatewayMetrics
    auth: ApiKeyAuth
    sessions: SessionStore
    files: FileStore | None

    @classmethod
    def build(cls, settings: GatewaySettings, client: redis.asyncio.Redis) -> Gateway:
        keys = settings.keys
        return cls(
            settings=settings,
            client=client,
            relay=TokenRelay(client, keys),
            registry=ModelRegistry(client, keys),
            dispatcher=Dispatcher(client, keys, max_queue=settings.max_queue),
            metrics=GatewayMetrics(),
            auth=ApiKeyAuth(settings.api_keys),
            sessions=SessionStore(client, keys),
            files=_file_store(settings, client),
        )


def gateway_of(request: Request) -> Gateway:
    """The ``Gateway`` of the app serving ``request``."""
    gateway: Gateway = request.app.state.gateway
    return gateway


def _file_store(settings: GatewaySettings, client: redis.asyncio.Redis) -> FileStore | None:
    if settings.files_dir is None:
        return None
    limits = {"max_bytes": settings.max_file_bytes, "max_lines": settings.max_file_lines}
    return FileStore(client, settings.keys, settings.files_dir, **limits)
