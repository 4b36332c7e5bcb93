"""Put a worker together: engine, Redis transport, checkpoint tiers, counters."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import cast

import redis

from metrale.shared.redis_connect import SyncClient
from metrale.shared.settings import WorkerSettings
from metrale.worker.checkpoints.counters_sink import RedisCounterSink
from metrale.worker.checkpoints.manager import CheckpointManager
from metrale.worker.checkpoints.sessions import RedisSessions
from metrale.worker.checkpoints.store import DirectoryTier, MemoryTier, RedisTier, Tier, TieredStore
from metrale.worker.checkpoints.writer import CheckpointWriter
from metrale.worker.engine.factory import EngineLimits, LoadedModel, build_engine
from metrale.worker.engine.speculation import SpeculativeConfig
from metrale.worker.fleet.announcement import model_announcement
from metrale.worker.fleet.broker.redis_transport import BUSY_POLL_S, RedisTransport
from metrale.worker.fleet.failover_counters import HashCounterSink
from metrale.worker.fleet.service import Worker
from metrale.worker.fleet.step_probe import full_step_s
from metrale.worker.model.precision import DtypeChoice, dtype_name

CHECKPOINT_MEMORY_BYTES = 512 << 20
"""Host memory for the worker's checkpoint LRU."""


def checkpoint_manager(
    loaded: LoadedModel, client: SyncClient, settings: WorkerSettings, fingerprint: str
) -> CheckpointManager:
    """Checkpoints in host memory, then Redis (the fleet's), then ``MET_CHECKPOINT_DIR`` if set."""
    client = _keyed(client)
    tiers: list[Tier] = [MemoryTier(CHECKPOINT_MEMORY_BYTES), RedisTier(client, ttl_s=settings.checkpoint_ttl_s)]
    if settings.checkpoint_dir is not None:
        tiers.append(DirectoryTier(settings.checkpoint_dir))
    dtype = dtype_name(loaded.executor.model.weight_dtype)  # a state is only exact for the dtype it was made in
    return CheckpointManager(
        TieredStore(tiers),
        RedisSessions(client, settings.keys, ttl_s=settings.checkpoint_ttl_s),
        fingerprint=fingerprint,
        dtype=dtype,
        keys=settings.keys,
        grid=loaded.engine.config.checkpoint_grid or 0,
    )


def build_worker(
    settings: WorkerSettings,
    client: SyncClient,
    *,
    directory: Path,
    served_name: str,
    worker_id: str,
    limits: EngineLimits | None = None,
    device: str = "cpu",
    dtype: DtypeChoice = None,
    checkpoints: bool = True,
    compile_decode: bool = False,
    speculation: SpeculativeConfig | None = None,
) -> Worker:
    """A worker serving the model in ``directory`` as ``served_name`` from the Redis behind ``client``;
    ``dtype`` is the weight dtype (None: the config's); its full-batch step is timed before it is
    returned (``step_probe.py``); ``checkpoints=False`` turns state checkpoints off
    (every prompt is prefilled from position 0, and a request that loses its worker is prefilled again
    from position 0 elsewhere); ``compile_decode`` and ``speculation`` (None: off): see ``build_engine``."""
    interval = settings.decode_checkpoint_interval if checkpoints and settings.decode_checkpoint_interval else None
    limits = dataclasses.replace(limits or EngineLimits(), decode_checkpoint_interval=interval)
    loaded = build_engine(
        directory,
        limits,
        device=device,
        dtype=dtype,
        kernels=settings.kernels,
        compile_decode=compile_decode,
        speculation=speculation,
    )
    announcement = model_announcement(loaded, served_name)
    transport = RedisTransport(
        client,
        worker_id=worker_id,
        keys=settings.keys,
        heartbeat_ttl_s=settings.heartbeat_ttl_s,
        replication=settings.replication,
        poll_every_s=BUSY_POLL_S,
    )
    writer = None
    if checkpoints:
        writer = CheckpointWriter(checkpoint_manager(loaded, client, settings, announcement.fingerprint))
    return Worker(
        loaded.engine,
        transport,
        settings,
        worker_id=worker_id,
        model=announcement,
        checkpoints=writer,
        counter_sink=RedisCounterSink(_keyed(client), settings.keys),
        failover_sink=HashCounterSink(_keyed(client), settings.keys.failover_counters()),
        speculation_sink=HashCounterSink(_keyed(client), settings.keys.speculation_counters()),
        device=device,
        full_step_s=full_step_s(loaded.engine),
    )


def _keyed(client: SyncClient) -> redis.Redis:
    """``client`` for the checkpoint tiers and counter sinks, typed as one Redis: every command and
    transaction they send touches one key, which a Redis Cluster's client routes as one Redis runs it."""
    return cast(redis.Redis, client)
