"""Files: bytes in a directory every gateway and batch runner shares, metadata in Redis.

A file's bytes live at ``{files_dir}/{tenant}/{file_id}``; its metadata in the hash
``met:file:{tenant}:{id}`` and its id in the tenant's index ``met:files:{tenant}`` (scored by
creation time), its size in ``met:files:{tenant}:bytes`` (what the tenant's quota counts). A file that
expires has an ``EXPIREAT`` on its metadata and a member in ``met:files-expiring`` (fleet-wide: written
beside the tenant's transaction, not in it); ``sweep_expired`` (each upload and listing, and the batch
runner's maintenance) takes expired files out of the indexes and removes their bytes, so nothing stays on
disk for ever. Bytes are written to a hidden ``.part`` file
first and renamed into place before the metadata is written, so a file that is listed is always whole.
Every lookup goes through the tenant: another tenant's id is simply not found.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import BinaryIO, Protocol, cast

import anyio

from metrale.gateway.batches.objects import FileObject, text_of
from metrale.shared.errors import BadRequest, NotFound, PayloadTooLarge, QuotaExceeded
from metrale.shared.keys import Keys, check_segment
from metrale.shared.redis_connect import AsyncClient
from metrale.shared.settings import StorageQuotas

CHUNK_BYTES = 1024 * 1024
"""How much of an upload is read and written at a time."""


class AsyncReadable(Protocol):
    """What an upload is read from (Starlette's ``UploadFile``)."""

    async def read(self, size: int = -1) -> bytes: ...


def new_file_id() -> str:
    """A fresh file id, ``file-`` and 24 hex digits (OpenAI's shape)."""
    return f"file-{uuid.uuid4().hex[:24]}"


class FileStore:
    """The fleet's files, seen by one tenant at a time."""

    def __init__(
        self,
        client: AsyncClient,
        keys: Keys,
        root: Path,
        *,
        max_bytes: int,
        max_lines: int,
        quotas: StorageQuotas | None = None,
    ) -> None:
        self._client = client
        self._keys = keys
        self.root = root
        self._max_bytes = max_bytes
        self._max_lines = max_lines
        self._quotas = quotas if quotas is not None else StorageQuotas()

    def path(self, tenant: str, file_id: str) -> Path:
        """Where the bytes of ``file_id`` live (whether or not it exists)."""
        return self.root / check_segment(tenant, "tenant") / check_segment(file_id, "file id")

    async def upload(
        self, tenant: str, source: AsyncReadable, *, filename: str, purpose: str, expires_after_s: int | None = None
    ) -> FileObject:
        """Store ``source`` chunk by chunk (never whole in memory); refuse it past the size or line limit,
        or the tenant's quota. With ``expires_after_s`` it expires that long after its creation."""
        await self.sweep_expired()
        room = await self._room(tenant)
        file_id = new_file_id()
        with self._part_file(tenant, file_id) as (part, out):
            size, lines, last = 0, 0, b"\n"
            while chunk := await source.read(CHUNK_BYTES):
                size, lines, last = size + len(chunk), lines + chunk.count(b"\n"), chunk[-1:]
                if size > self._max_bytes:
                    raise PayloadTooLarge(f"The file is larger than {self._max_bytes} bytes.", param="file")
                if room is not None and size > room:
                    quota = self._quotas.max_file_bytes
                    raise QuotaExceeded(
                        f"The tenant's files would take more than MET_TENANT_MAX_FILE_BYTES={quota} bytes "
                        f"({quota - room} in use): delete files first.",
                        param="file",
                    )
                await anyio.to_thread.run_sync(out.write, chunk)
            lines += last != b"\n"
            if lines > self._max_lines:
                raise BadRequest(f"The file has {lines} lines; the limit is {self._max_lines}.", param="file")
            if size == 0:
                raise BadRequest("The file is empty.", param="file")
        return await self._register(tenant, file_id, part, filename=filename, purpose=purpose, ttl_s=expires_after_s)

    async def create(
        self,
        tenant: str,
        write: Callable[[BinaryIO], None],
        *,
        filename: str,
        purpose: str,
        expires_after_s: int | None = None,
    ) -> FileObject:
        """A new file whose bytes ``write`` produces (called in a thread), e.g. a batch's output: it counts
        towards the tenant's quota but is never refused by it."""
        file_id = new_file_id()
        with self._part_file(tenant, file_id) as (part, out):
            await anyio.to_thread.run_sync(write, out)
        return await self._register(tenant, file_id, part, filename=filename, purpose=purpose, ttl_s=expires_after_s)

    async def get(self, tenant: str, file_id: str) -> FileObject:
        """The file's object; raises ``NotFound`` if this tenant has no such file (or it expired)."""
        stored = await self._client.hget(self._keys.file(tenant, _file_id(file_id)), "object")
        found = FileObject.model_validate_json(stored) if stored is not None else None
        if found is None or (found.expires_at is not None and found.expires_at <= time.time()):
            raise NotFound(f"No such file: {file_id!r}.", param="file_id")
        return found

    async def sweep_expired(self, *, limit: int = 100) -> int:
        """Forget up to ``limit`` expired files of any tenant and remove their bytes; how many. (Their
        metadata also expires by itself in Redis: this takes them out of the indexes and off the disk.)"""
        expiry = self._keys.file_expiry()
        members = cast(list[bytes], await self._client.zrangebyscore(expiry, "-inf", time.time(), start=0, num=limit))
        for member in map(text_of, members):
            tenant, _, file_id = member.partition(":")
            await self._forget(tenant, file_id)
        return len(members)

    async def _room(self, tenant: str) -> int | None:
        """Bytes the tenant may still upload (None: unlimited); 400 if it has as many files as allowed."""
        sizes = await self._client.hvals(self._keys.file_sizes(tenant))
        max_files, max_bytes = self._quotas.max_files, self._quotas.max_file_bytes
        if max_files and len(sizes) >= max_files:
            raise QuotaExceeded(
                f"The tenant has {len(sizes)} files, as many as MET_TENANT_MAX_FILES={max_files} allows: "
                "delete files first.",
                param="file",
            )
        return max(0, max_bytes - sum(int(size) for size in sizes)) if max_bytes else None

    async def list(self, tenant: str, *, purpose: str | None, limit: int, after: str | None) -> list[FileObject]:
        """The tenant's files, newest first, after the file ``after`` (a cursor), at most ``limit``."""
        await self.sweep_expired()
        raw_ids = cast(list[bytes], await self._client.zrevrange(self._keys.file_index(tenant), 0, -1))
        ids = [text_of(raw) for raw in raw_ids]
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        files: list[FileObject] = []
        for file_id in ids:
            with contextlib.suppress(NotFound):
                found = await self.get(tenant, file_id)
                if purpose is None or found.purpose == purpose:
                    files.append(found)
            if len(files) >= limit:
                break
        return files

    async def read_chunks(self, tenant: str, file_id: str) -> AsyncIterator[bytes]:
        """The file's bytes, chunk by chunk."""
        await self.get(tenant, file_id)
        async with await anyio.open_file(self.path(tenant, file_id), "rb") as source:
            while chunk := await source.read(CHUNK_BYTES):
                yield chunk

    async def delete(self, tenant: str, file_id: str) -> None:
        """Forget the file and remove its bytes; raises ``NotFound`` if there is none."""
        await self.get(tenant, file_id)
        await self._forget(tenant, file_id)

    async def _forget(self, tenant: str, file_id: str) -> None:
        async with self._client.pipeline(transaction=True) as pipe:  # the tenant's keys: one slot
            pipe.delete(self._keys.file(tenant, file_id))
            pipe.zrem(self._keys.file_index(tenant), file_id)
            pipe.hdel(self._keys.file_sizes(tenant), file_id)
            await pipe.execute()
        # The fleet-wide expiry set is not the tenant's (another slot on a cluster): out of it after the
        # file is forgotten, so a member left behind only makes a later sweep forget it again.
        await self._client.zrem(self._keys.file_expiry(), f"{tenant}:{file_id}")
        with contextlib.suppress(FileNotFoundError):
            await anyio.to_thread.run_sync(self.path(tenant, file_id).unlink)

    @contextlib.contextmanager
    def _part_file(self, tenant: str, file_id: str) -> Iterator[tuple[Path, BinaryIO]]:
        """A hidden file to write into; removed if the block fails."""
        part = self.path(tenant, file_id).with_name(f".{file_id}.part")
        part.parent.mkdir(parents=True, exist_ok=True)
        try:
            with part.open("wb") as out:
                yield part, out
        except BaseException:
            part.unlink(missing_ok=True)
            raise

    async def _register(
        self, tenant: str, file_id: str, part: Path, *, filename: str, purpose: str, ttl_s: int | None
    ) -> FileObject:
        os.replace(part, self.path(tenant, file_id))
        created = time.time()
        now = int(created)
        expires_at = now + ttl_s if ttl_s else None
        stored = FileObject(
            id=file_id, bytes=self.path(tenant, file_id).stat().st_size, created_at=now, filename=filename,
            purpose=purpose, expires_at=expires_at,
        )  # fmt: skip
        key = self._keys.file(tenant, file_id)
        if expires_at is not None:
            # Into the fleet-wide expiry set (another slot on a cluster) before the tenant's transaction, so
            # an expiring file is always swept; a member whose file never got stored is swept harmlessly.
            await self._client.zadd(self._keys.file_expiry(), {f"{tenant}:{file_id}": expires_at})
        async with self._client.pipeline(transaction=True) as pipe:  # the tenant's keys: one slot
            pipe.hset(key, mapping={"object": stored.model_dump_json()})
            pipe.zadd(self._keys.file_index(tenant), {file_id: created})
            pipe.hset(self._keys.file_sizes(tenant), file_id, str(stored.bytes))
            if expires_at is not None:
                pipe.expireat(key, expires_at)
            await pipe.execute()
        return stored


def _file_id(file_id: str) -> str:
    """``file_id`` if it can name a key, else ``NotFound`` (it names no file)."""
    try:
        return check_segment(file_id, "file id")
    except ValueError:
        raise NotFound(f"No such file: {file_id!r}.", param="file_id") from None
