"""One batch, run to its end: validate every line, expand them into requests on the batch stream with
at most ``window`` in flight, keep each finished line in Redis as it finishes, write the files.

``BatchRun.run`` may be called again for the same batch at any point — a runner killed mid-batch is
replaced by another — and continues: lines already kept are not run again, lines still running are
followed by their request ids (``line_request.py``). Every ``poll_s`` it looks for a cancel and for
the end of the completion window; either stops every line still queued or running at once (the
cancels reach the workers through the cancel channel) and keeps what finished.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterator

from metrale.batch.input_lines import BatchLine, read_lines
from metrale.batch.line_request import prepare_line, run_line
from metrale.batch.output import write_outputs
from metrale.gateway.batches.objects import Batch, BatchError, BatchStatus
from metrale.gateway.state import Gateway
from metrale.shared.errors import MetraleError, NotFound

logger = logging.getLogger(__name__)

MAX_REPORTED_ERRORS = 1000
"""The most validation errors a failed batch lists."""


class UnreadableInput(Exception):
    """The batch's input file is gone or cannot be read: the batch fails at once, never retried."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.error = BatchError(code=code, message=message, param="input_file_id")


class BatchRun:
    """Runs one batch of one tenant on ``gateway`` (its stores, registry, relay and dispatcher)."""

    def __init__(
        self,
        gateway: Gateway,
        tenant: str,
        batch_id: str,
        *,
        window: int,
        renew_lease: Callable[[], Awaitable[None]] | None = None,
        poll_s: float = 0.2,
        lease_every_s: float = 1.0,
    ) -> None:
        assert gateway.files is not None, "a batch runner needs the file store"
        self._gateway, self._files, self._store = gateway, gateway.files, gateway.batches
        self._tenant, self._batch_id = tenant, batch_id
        self._window, self._poll_s = window, poll_s
        self._renew_lease, self._lease_every_s = renew_lease, lease_every_s
        self._lease_at = 0.0
        self._stopping = False
        self._taken_over = False

    async def run(self) -> BatchStatus:
        """Take the batch from wherever it stands to a final status; return that status."""
        batch = await self._store.get(self._tenant, self._batch_id)
        if batch.status.is_terminal:
            return batch.status
        try:
            lines, errors = await self._read_input(batch)
        except UnreadableInput as error:
            logger.warning("batch %s: %s", batch.id, error.error.message)
            return await self._end([error.error])
        self._taken_over = batch.status is not BatchStatus.VALIDATING  # an earlier runner may have started lines
        if batch.status is BatchStatus.VALIDATING:
            errors += await self._check_bodies(batch, lines)
            if errors:
                return await self._fail(errors)
            moved = await self._move(BatchStatus.IN_PROGRESS, {BatchStatus.VALIDATING}, total=str(len(lines)))
            batch = moved or await self._store.get(self._tenant, self._batch_id)
        stopped_by = await self._expand(batch, lines) if batch.status is BatchStatus.IN_PROGRESS else batch.status
        return await self._finish(batch, lines, stopped_by)

    async def _read_input(self, batch: Batch) -> tuple[list[BatchLine], list[BatchError]]:
        """The input's lines and their structural errors; raises ``UnreadableInput``."""
        file_id = batch.input_file_id
        try:
            await self._files.get(self._tenant, file_id)
            return await asyncio.to_thread(read_lines, self._files.path(self._tenant, file_id), batch.endpoint)
        except (NotFound, FileNotFoundError):
            why = f"The input file {file_id!r} no longer exists (deleted or expired)."
            raise UnreadableInput("input_file_missing", why) from None
        except OSError as error:
            why = f"The input file {file_id!r} cannot be read: {error.strerror or error}."
            raise UnreadableInput("input_file_unreadable", why) from None

    async def _end(self, errors: list[BatchError]) -> BatchStatus:
        """End a batch that cannot run: ``cancelled`` if a cancel came, else ``failed`` with ``errors``."""
        ended = await self._store.end_unrun(self._tenant, self._batch_id, errors)
        return ended if ended is not None else BatchStatus.FAILED

    async def _check_bodies(self, batch: Batch, lines: list[BatchLine]) -> list[BatchError]:
        """Each body as its endpoint would check it (schema, model, prompt, sampling values)."""
        errors = []
        for line in lines:
            try:
                await prepare_line(self._gateway, self._tenant, batch, line)
            except MetraleError as error:
                errors.append(BatchError(code=error.code, message=error.message, param=error.param, line=line.number))
            await self._keep_lease()
        return errors

    async def _fail(self, errors: list[BatchError]) -> BatchStatus:
        ordered = sorted(errors, key=lambda error: error.line or 0)[:MAX_REPORTED_ERRORS]
        return await self._end(ordered)

    async def _expand(self, batch: Batch, lines: list[BatchLine]) -> BatchStatus | None:
        """Run every line not yet kept, ``window`` at a time; the status that stopped it early, if any."""
        kept = await self._recount()
        todo = iter([line for line in lines if line.custom_id not in kept])
        workers = [asyncio.create_task(self._drain(batch, todo)) for _ in range(self._window)]
        try:
            while not all(worker.done() for worker in workers):
                await asyncio.wait(workers, timeout=self._poll_s)
                for worker in workers:
                    if worker.done() and worker.exception() is not None:
                        raise worker.exception()  # type: ignore[misc]
                stop = await self._stop_reason(batch)
                if stop is not None:
                    logger.info("batch %s: %s, stopping its lines", batch.id, stop.value)
                    return stop
                await self._keep_lease()
            return None
        finally:
            self._stopping = True  # no line starts after this, even in a worker that missed its cancel
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    async def _drain(self, batch: Batch, todo: Iterator[BatchLine]) -> None:
        for line in todo:
            if self._stopping:
                return
            text, ok = await run_line(self._gateway, self._tenant, batch, line, attach=self._taken_over)
            await self._store.add_result(self._tenant, batch.id, line.custom_id, text, ok=ok)

    async def _recount(self) -> set[str]:
        """The lines already kept, and the counts made to match them (a runner may have died between
        keeping a line and counting it)."""
        kept = await self._store.results(self._tenant, self._batch_id)
        await self._store.update(self._tenant, self._batch_id, _counts(kept))
        return set(kept)

    async def _stop_reason(self, batch: Batch) -> BatchStatus | None:
        status = await self._store.status(self._tenant, batch.id)
        if status is BatchStatus.CANCELLING:
            return status
        if batch.expires_at is not None and time.time() >= batch.expires_at:
            return BatchStatus.EXPIRED
        return None

    async def _finish(self, batch: Batch, lines: list[BatchLine], stopped_by: BatchStatus | None) -> BatchStatus:
        """Write the output and error files and move to the final status."""
        if stopped_by is None and await self._move(BatchStatus.FINALIZING, {BatchStatus.IN_PROGRESS}) is None:
            stopped_by = await self._store.status(self._tenant, batch.id)  # cancelled just now
        if stopped_by is BatchStatus.CANCELLING:
            allowed, final = {BatchStatus.CANCELLING}, BatchStatus.CANCELLED
        elif stopped_by is BatchStatus.EXPIRED:
            allowed, final = {BatchStatus.IN_PROGRESS}, BatchStatus.EXPIRED
        else:  # finished, or a runner died while finalizing: (re)write the files
            allowed, final = {BatchStatus.FINALIZING}, BatchStatus.COMPLETED
        kept = await self._store.results(self._tenant, batch.id)
        file_ids = await write_outputs(self._files, self._tenant, batch, lines, kept, unanswered=final)
        # the counts are made from the lines in the files: a line task cancelled between keeping its
        # line and counting it (a cancel, the window's end) must not leave them disagreeing
        await self._move(final, allowed, **file_ids, **_counts(kept))
        logger.info("batch %s: %s (%d of %d lines answered)", batch.id, final.value, len(kept), len(lines))
        return final

    async def _move(self, to: BatchStatus, allowed: set[BatchStatus], **fields: str) -> Batch | None:
        return await self._store.move(self._tenant, self._batch_id, to, allowed_from=allowed, fields=fields)

    async def _keep_lease(self) -> None:
        """Tell RQ this runner is alive (at most every ``lease_every_s``)."""
        if self._renew_lease is None:
            return
        now = time.monotonic()
        if now - getattr(self, "_lease_at", 0.0) >= self._lease_every_s:
            self._lease_at = now
            try:
                await self._renew_lease()
            except Exception as error:  # RQ reruns the job if the lease lapses; the lines are not lost
                logger.warning("batch %s: could not renew the job's lease: %s", self._batch_id, error)


def _counts(kept: dict[str, str]) -> dict[str, str]:
    """``completed`` and ``failed`` as the kept lines make them."""
    completed = sum(1 for text in kept.values() if json.loads(text)["response"]["status_code"] == 200)
    return {"completed": str(completed), "failed": str(len(kept) - completed)}
