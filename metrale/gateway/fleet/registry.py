"""Which models the fleet serves right now, and the tokenizer of each.

A model is *live* when at least one unexpired worker heartbeat (``met:worker:{wid}``) names it; it is
*known* when a worker has announced it (``met:model:{name}``, no TTL). ``resolve`` tells the two
apart: unknown is a 404, known without a live worker a 503. Heartbeats are found through the worker
index (``met:workers``, written in each heartbeat's transaction), never by ``SCAN``: two round trips to
the one node holding the control keys on a Redis Cluster, however many workers. They are read every
``liveness_cache_s`` while ``watch`` runs (the gateway runs it), and on demand when older; an
announcement is re-read at most every ``announcement_refresh_s``, and a tokenizer is built once per
announced fingerprint (in a thread: a large ``tokenizer.json`` takes a while to parse). Requests that
resolve a model together share one read (``SharedRead`` per name), and ``watch`` resolves every live
model ahead of its requests: a cold burst finds its tokenizer built, not 200 reads and builds at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from redis.exceptions import RedisError

from metrale.gateway.fleet.shared_read import SharedRead
from metrale.shared.codec import decode
from metrale.shared.errors import ModelNotFound, NoWorker
from metrale.shared.keys import Keys
from metrale.shared.messages import ModelAnnouncement, WorkerHeartbeat
from metrale.shared.redis_connect import AsyncClient
from metrale.text.tokenizer import Tokenizer, TokenizerError

logger = logging.getLogger(__name__)

MESSAGE_FIELD = "msg"
"""The hash field holding the encoded message in heartbeat and announcement hashes."""


@dataclass(frozen=True, slots=True)
class ServedModel:
    """A model a live worker serves: what its worker announced, and the tokenizer built from it."""

    announcement: ModelAnnouncement
    tokenizer: Tokenizer

    @property
    def name(self) -> str:
        return self.announcement.model

    @property
    def max_model_len(self) -> int:
        return self.announcement.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.announcement.vocab_size

    @property
    def stop_ids(self) -> frozenset[int]:
        """Ids that end a choice unless ``ignore_eos``: the announced EOS ids and the tokenizer's."""
        return frozenset(self.announcement.eos_token_ids) | self.tokenizer.eos_token_ids


@dataclass(frozen=True, slots=True)
class _Cached:
    model: ServedModel
    read_at: float


class ModelRegistry:
    """Live workers and announced models, read from Redis and cached briefly."""

    def __init__(
        self,
        client: AsyncClient,
        keys: Keys,
        *,
        liveness_cache_s: float = 1.0,
        announcement_refresh_s: float = 10.0,
    ) -> None:
        self._client = client
        self._keys = keys
        self._liveness_cache_s = liveness_cache_s
        self._announcement_refresh_s = announcement_refresh_s
        self._heartbeats: tuple[float, list[WorkerHeartbeat]] | None = None
        self._models: dict[str, _Cached] = {}
        self._tokenizers: dict[str, Tokenizer] = {}  # fingerprint -> tokenizer
        self._scan_heartbeats = SharedRead(self._read_heartbeats)
        self._model_reads: dict[str, SharedRead[ServedModel]] = {}
        self._ahead_failed_at: dict[str, float] = {}  # live name -> when ``watch`` last failed to resolve it

    async def live_workers(self) -> list[WorkerHeartbeat]:
        """The heartbeat of every indexed worker whose heartbeat key has not expired."""
        cached = self.recent_live_workers(self._liveness_cache_s)
        if cached is not None:
            return cached
        return await self._scan_heartbeats()  # requests that find the cache expired together scan once

    async def watch(self) -> None:
        """Keep ``live_workers`` fresh (a scan every ``liveness_cache_s``) until cancelled, so that
        what the fleet looks like is known without waiting when a burst arrives (``load_shedding.py``);
        a failed scan is logged and tried again next time."""
        while True:
            try:
                await self._scan_heartbeats()
                await self._resolve_live_models()
            except (RedisError, OSError) as error:
                logger.warning("could not read the workers' heartbeats: %s", error)
            await asyncio.sleep(self._liveness_cache_s)

    async def _resolve_live_models(self) -> None:
        """Resolve each live model whose cached resolution is missing or due, so its tokenizer is
        ready before its requests arrive; a model that cannot be resolved now is left to them."""
        now = time.monotonic()
        for name in await self.live_model_names():
            cached = self._models.get(name)
            due = cached is None or now - cached.read_at >= self._announcement_refresh_s
            if due and now - self._ahead_failed_at.get(name, -math.inf) >= self._announcement_refresh_s:
                try:
                    await self.resolve(name)
                except (ModelNotFound, NoWorker) as error:  # tried again after announcement_refresh_s
                    self._ahead_failed_at[name] = now
                    logger.debug("model %r not resolved ahead of its requests: %s", name, error)

    def recent_live_workers(self, max_age_s: float) -> list[WorkerHeartbeat] | None:
        """The cached ``live_workers`` if read less than ``max_age_s`` ago, else None (never waits)."""
        if self._heartbeats is not None and time.monotonic() - self._heartbeats[0] < max_age_s:
            return self._heartbeats[1]
        return None

    async def _read_heartbeats(self) -> list[WorkerHeartbeat]:
        now = time.monotonic()
        indexed = cast(list[bytes], await self._client.zrange(self._keys.worker_index(), 0, -1))
        async with self._client.pipeline(transaction=False) as pipe:
            for worker_id in indexed:
                pipe.hget(self._keys.worker(worker_id.decode()), MESSAGE_FIELD)
            payloads = await pipe.execute()
        heartbeats = [beat for beat in map(_decode_heartbeat, payloads) if beat is not None]
        self._heartbeats = (now, heartbeats)
        return heartbeats

    async def live_model_names(self) -> list[str]:
        """Names of the models at least one live worker serves, sorted."""
        return sorted({beat.model for beat in await self.live_workers()})

    async def resolve(self, name: str) -> ServedModel:
        """The live model ``name``; raises ``ModelNotFound`` (never announced) or ``NoWorker``."""
        live = name in await self.live_model_names()
        cached = self._models.get(name)
        if cached is not None and live and time.monotonic() - cached.read_at < self._announcement_refresh_s:
            return cached.model
        if not live:  # any name a client sends: not kept
            return await self._read_model(name)
        read = self._model_reads.get(name)  # live names only: as many as the fleet serves
        if read is None:
            read = self._model_reads[name] = SharedRead(lambda: self._read_model(name))
        return await read()

    async def _read_model(self, name: str) -> ServedModel:
        """Read ``name``'s announcement, check it is live, build (or reuse) its tokenizer and cache both."""
        live = name in await self.live_model_names()
        announcement = await self._read_announcement(name)
        if announcement is None:
            raise ModelNotFound(name)
        if not live:  # the cached scan may predate a worker that has just come up: look again before a 503
            live = name in {beat.model for beat in await self._scan_heartbeats()}
        if not live:
            raise NoWorker(f"No live worker serves the model {name!r} right now; retry later.")
        served = ServedModel(announcement, await self._tokenizer_for(announcement))
        self._models[name] = _Cached(served, time.monotonic())
        return served

    async def _read_announcement(self, name: str) -> ModelAnnouncement | None:
        try:
            key = self._keys.model(name)
        except ValueError:  # not a name any worker could have announced
            return None
        payload = await self._client.hget(key, MESSAGE_FIELD)
        if payload is None:
            return None
        announcement = decode(cast(bytes, payload))  # the client does not decode responses
        if not isinstance(announcement, ModelAnnouncement):
            logger.error("the announcement of model %r cannot be read: %s", name, announcement)
            return None
        return announcement

    async def _tokenizer_for(self, announcement: ModelAnnouncement) -> Tokenizer:
        tokenizer = self._tokenizers.get(announcement.fingerprint)
        if tokenizer is None:
            try:
                tokenizer = await asyncio.to_thread(build_tokenizer, announcement)
            except TokenizerError as error:
                logger.error("model %r: the announced tokenizer cannot be loaded: %s", announcement.model, error)
                message = f"The model {announcement.model!r} announced a tokenizer that cannot be loaded."
                raise NoWorker(message) from error
            self._tokenizers[announcement.fingerprint] = tokenizer
            logger.info("model %r: tokenizer built for fingerprint %s", announcement.model, announcement.fingerprint)
        return tokenizer


def build_tokenizer(announcement: ModelAnnouncement) -> Tokenizer:
    """The tokenizer a worker announced, loaded exactly as ``Tokenizer.from_dir`` loads a model folder.

    The announced texts are written to a private temporary folder so that the gateway and the worker
    share one loading path (special tokens, BOS/EOS flags, chat template); the announced EOS ids are
    added to the tokenizer's own.
    """
    with tempfile.TemporaryDirectory(prefix="met-tokenizer-") as folder:
        directory = Path(folder)
        (directory / "tokenizer.json").write_text(announcement.tokenizer_json, encoding="utf-8")
        (directory / "tokenizer_config.json").write_text(announcement.tokenizer_config_json, encoding="utf-8")
        (directory / "config.json").write_text(json.dumps({"eos_token_id": announcement.eos_token_ids}))
        tokenizer = Tokenizer.from_dir(directory)
    _ = tokenizer.max_chars_per_token  # read from the whole vocabulary once, here, not on the loop by a request
    return tokenizer


def _decode_heartbeat(payload: bytes | None) -> WorkerHeartbeat | None:
    if payload is None:  # a lost worker (indexed, its heartbeat expired) or one withdrawn meanwhile
        return None
    heartbeat = decode(payload)
    if not isinstance(heartbeat, WorkerHeartbeat):
        logger.warning("ignoring a worker heartbeat that cannot be read: %s", heartbeat)
        return None
    return heartbeat
