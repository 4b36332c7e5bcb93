"""The RQ job of a background response (``background: true``): prepare it again from its stored body,
run it on the fleet, and keep its events and object in Redis (``BackgroundStore``) as they come.

The job, not the gateway, follows the response, so a gateway restart does not touch it; a worker's
death is the fleet's failover (another worker resumes the request, and the relay follows it). A job
whose batch runner died is run again by RQ (``Retry``): it follows the request it had submitted
(``attach``) rather than submitting it twice, reads the text its predecessor's events already cover
into a fresh turn without appending them again (``read_chars``; item ids are made from the response id,
so the turn is the one it had), and appends from there with the next ``sequence_number``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import redis

from metrale.gateway.api.prepare.intake import intake_for
from metrale.gateway.api.prepare.sampling import RequestContext
from metrale.gateway.api.responses import PreparedResponse, prepare_response, previous_response, start_generation_of
from metrale.gateway.responses.background_store import BackgroundJob, BackgroundStatus
from metrale.gateway.responses.bodies import ResponseCreateRequest
from metrale.gateway.responses.output import OutputEvent
from metrale.gateway.state import Gateway
from metrale.shared.errors import MetraleError

logger = logging.getLogger(__name__)

OBJECT_EVERY_S = 0.25
"""How often, at most, the stored object is brought up to the output so far while events come."""
MAX_EVENTS_PER_APPEND = 64
LEASE_EVERY_S = 1.0


class BackgroundRun:
    """Runs (or continues) one background response of one tenant on ``gateway``."""

    def __init__(self, gateway: Gateway, tenant: str, response_id: str) -> None:
        self._gateway, self._store = gateway, gateway.background
        self._tenant, self._response_id = tenant, response_id

    async def run(self) -> str:
        """Take the response to a terminal status (or leave it to a cancel); the status it is in after."""
        job = await self._store.job(self._tenant, self._response_id)
        if job is None or job.status.is_terminal:
            return job.status.value if job is not None else "gone"
        try:
            prepared = await self._prepare(job)
            if job.status is BackgroundStatus.QUEUED:
                opening = prepared.turn.body("in_progress", [])
                event = OutputEvent("response.in_progress", {"response": opening})
                if not await self._store.start(self._tenant, self._response_id, opening, event):
                    return await self._status()  # cancelled while queued
            await self._generate(prepared, job.read_chars)
        except MetraleError as error:
            logger.info("background response %s failed: %s", self._response_id, error.message)
            await self._store.fail(self._tenant, self._response_id, error.code, error.message)
        return await self._status()

    async def _prepare(self, job: BackgroundJob) -> PreparedResponse:
        """The request and turn, made from the stored body as ``create`` made them."""
        body = ResponseCreateRequest.model_validate_json(job.request_json)
        context = RequestContext(
            request_id=self._response_id,
            tenant=self._tenant,
            session_id=None,
            deadline=job.deadline,
            created_at=job.created_at,
        )
        intake = await intake_for(self._gateway, body, context)
        return await prepare_response(intake, await previous_response(intake))

    async def _generate(self, prepared: PreparedResponse, read_chars: int) -> None:
        """Run the request, appending the turn's events for the text past ``read_chars``; end the
        response with its last events. Stops without a word once the response is no longer in progress."""
        submission, turn = prepared
        store, tenant, response_id = self._store, self._tenant, self._response_id
        read, pending, object_at = 0, list[OutputEvent](), 0.0
        async with start_generation_of(self._gateway, submission, attach=True) as generation:
            while (delta := await generation.next_delta()) is not None:
                text = delta.text
                if read < read_chars:  # covered by the events a run before this one stored
                    covered = text[: read_chars - read]
                    turn.read(covered)
                    read, text = read + len(covered), text[len(covered) :]
                if text:
                    pending += turn.read(text)
                    read += len(text)
                if not pending or (generation.has_ready_event and len(pending) < MAX_EVENTS_PER_APPEND):
                    continue
                body = None
                if time.monotonic() - object_at >= OBJECT_EVERY_S:
                    body, object_at = turn.body("in_progress", turn.output.items), time.monotonic()
                if not await store.append(tenant, response_id, pending, read_chars=read, body=body):
                    return  # cancelled: leaving the block cancels the request on its worker
                pending = []
            reply = generation.choices[0]
            closing = pending + turn.end(reply)
        stored = await turn.sealed(reply, generation.usage)
        final = OutputEvent(f"response.{stored.body['status']}", {"response": stored.body})
        await store.finish(tenant, stored, [*closing, final])

    async def _status(self) -> str:
        status = await self._store.status(self._tenant, self._response_id)
        return status.value if status is not None else "gone"


async def run_with_lease(run: BackgroundRun, renew_lease: Callable[[], Awaitable[None]]) -> str:
    """``run.run()``, telling RQ every ``LEASE_EVERY_S`` that its runner is alive."""

    async def keep() -> None:
        while True:
            await asyncio.sleep(LEASE_EVERY_S)
            try:
                await renew_lease()
            except Exception as error:  # RQ reruns the job if the lease lapses; the rerun continues it
                logger.warning("could not renew a background response's lease: %s", error)

    keeper = asyncio.create_task(keep())
    try:
        return await run.run()
    finally:
        keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeper


async def fail_response(gateway: Gateway, tenant: str, response_id: str, message: str) -> None:
    """End a background response whose job will not run again as ``failed`` (if it had not ended)."""
    await gateway.background.fail(tenant, response_id, "server_error", message)


def run_background_response(tenant: str, response_id: str) -> str:
    """The RQ job of one background response: run (or continue) it; the status it ends in."""
    from rq import get_current_job

    from metrale.batch.job import current_worker

    worker = current_worker()
    job = get_current_job()
    assert job is not None
    loop = worker.loop

    async def run() -> str:
        gateway = await loop.gateway()
        return await run_with_lease(
            BackgroundRun(gateway, tenant, response_id), lambda: asyncio.to_thread(worker.renew_lease, job)
        )

    try:
        return loop.run(run())
    except (redis.ConnectionError, redis.TimeoutError):
        raise  # Redis is away: RQ runs the job again, and the run continues where this one stopped
    except Exception as error:  # anything else would fail the same way again: end the response now
        logger.exception("background response %s: the runner failed", response_id)
        message = f"The response's runner failed: {type(error).__name__}: {error}"

        async def failed() -> None:
            await fail_response(await loop.gateway(), tenant, response_id, message)

        loop.run(failed())
        return BackgroundStatus.FAILED.value
