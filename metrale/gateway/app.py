"""The gateway's FastAPI application: ``create_app(settings, redis=None)``.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``/v1/responses``, ``/v1/files``, ``/v1/batches``,
``GET /v1/models``, ``GET /health``, ``GET /ready``, ``GET /metrics``. The app's lifespan starts the
token relay (the process's one pub/sub connection) and the watch over the workers' heartbeats, and
stops them; a Redis client the app created itself is closed with it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from redis import Redis as SyncRedis
from redis.asyncio import Redis

from metrale.gateway.api import batches, chat, completions, files, probes, responses, sessions, tokenize
from metrale.gateway.edge.access_log import AccessLog, written_by_a_thread
from metrale.gateway.edge.body import BodySizeLimit
from metrale.gateway.edge.disconnects import DisconnectCancels
from metrale.gateway.edge.load_shedding import GatewayApp
from metrale.gateway.errors import install_error_handlers
from metrale.gateway.metrics import ResponseCounter
from metrale.gateway.openapi import describe_api
from metrale.gateway.state import Gateway
from metrale.gateway.warm_start import warm_start
from metrale.shared.redis_connect import connect_async, is_cluster, sync_client, warm_pool
from metrale.shared.settings import GatewaySettings

logger = logging.getLogger(__name__)

GENERATION_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/responses": "responses"}
MULTIPART_OVERHEAD_BYTES = 64 * 1024
"""Room for the multipart framing and the other fields of an upload, beyond the file's own bytes."""
REDIS_CONNECTIONS = 1024
"""Connections the gateway may open to Redis; every request in flight can hold one at a time (redis-py's
default, 100, refuses the 101st concurrent stream with "Too many connections")."""
WARM_REDIS_CONNECTIONS = 128
"""Connections a server's gateway opens at start, before a burst needs them (``warm_pool``)."""


def connect_redis(url: str) -> Redis:
    """An asyncio client of ``url`` (any ``MET_REDIS_URL`` form) that retries commands through short
    outages and follows a sentinel failover or a Redis Cluster's slots (``redis_connect.py``; a
    cluster's client has the same calls, and the gateway keeps each transaction in one slot there)."""
    return connect_async(url, max_connections=REDIS_CONNECTIONS)  # type: ignore[return-value]


def create_app(
    settings: GatewaySettings,
    redis: Redis | None = None,
    job_client: SyncRedis | None = None,
    *,
    precheck_at_start: bool = False,
) -> FastAPI:
    """The gateway app for ``settings``, talking to ``redis`` (or to ``settings.redis_url``).

    Batch jobs are queued through ``job_client`` (synchronous, for RQ), made from ``settings.jobs_url``
    when the app makes its own client; an app given ``redis`` without one, or on a Redis Cluster without
    ``MET_JOBS_REDIS_URL``, cannot create batches. With
    ``precheck_at_start`` (the servers) the large-body pre-check process starts with the app, else on the
    first large body (``body_precheck.py``)."""
    if redis is None and settings.redis_url is None:
        raise ValueError("the gateway needs a Redis: pass a client or set redis_url")
    owns_client = redis is None
    client = redis if redis is not None else connect_redis(str(settings.redis_url))
    if owns_client and job_client is None and settings.jobs_url is not None:
        job_client = sync_client(settings.jobs_url)  # RQ's Redis: never a cluster (settings.py)
    gateway = Gateway.build(settings, client, job_client)
    if not gateway.auth.required:
        logger.warning("MET_API_KEYS is not set: the gateway accepts requests without an API key")

    access_log = AccessLog()

    @asynccontextmanager
    async def lifespan(started: FastAPI) -> AsyncIterator[None]:
        await gateway.relay.start()
        warm = owns_client and not is_cluster(client)  # a cluster's pools are per node, opened as used
        if warm and (opened := await warm_pool(client, WARM_REDIS_CONNECTIONS)) < WARM_REDIS_CONNECTIONS:
            logger.warning("opened %d of %d Redis connections at start", opened, WARM_REDIS_CONNECTIONS)
        if precheck_at_start:
            gateway.precheck.start()
        off_loop_threads = warm_start(started)
        watch = asyncio.create_task(gateway.registry.watch(), name="fleet heartbeats")
        reports = asyncio.create_task(access_log.report(), name="429s in the access log")
        # What exists now lives as long as the app: kept out of the collector's full passes, which
        # otherwise walk all of it (a 125 ms pause measured in the middle of a burst).
        gc.collect()
        gc.freeze()
        try:
            with written_by_a_thread():  # a line's write lets go of the interpreter lock: not on the loop
                yield
        finally:
            watch.cancel()
            await access_log.stop(reports)
            await gateway.admission.close()
            await gateway.relay.close()
            gateway.precheck.close()
            off_loop_threads.shutdown(wait=False)
            if owns_client:
                await client.aclose()
                if job_client is not None:
                    job_client.close()

    app = GatewayApp(
        gateway=gateway,
        endpoints=GENERATION_ENDPOINTS,
        access_log=access_log,
        title="Metrale gateway",
        lifespan=lifespan,
    )
    app.state.gateway = gateway
    for module in (chat, completions, responses, files, batches, probes, sessions, tokenize):
        app.include_router(module.router)
    describe_api(app)
    install_error_handlers(app)
    upload_limit = settings.max_file_bytes + MULTIPART_OVERHEAD_BYTES
    app.add_middleware(BodySizeLimit, path_limits={"/v1/files": upload_limit})
    app.add_middleware(DisconnectCancels, paths=GENERATION_ENDPOINTS)  # inside the counter: it counts the 499
    app.add_middleware(ResponseCounter, metrics=gateway.metrics, endpoints=GENERATION_ENDPOINTS)
    return app
