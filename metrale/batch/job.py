"""The batch runner process: an RQ worker on the batch queue, and the job it runs for each batch.

``BatchWorker`` is RQ's ``SimpleWorker`` (jobs run in its own thread, so a ``kill -9`` takes the job
with it and nothing is left running behind a dead runner) with a short lease: a job's entry in RQ's
started registry expires ``lease_s`` after its last renewal, the job renews it every second while it
runs, and every idle runner cleans the registries every ``lease_s`` — so the job of a dead runner is
found abandoned and re-enqueued (RQ's ``Retry``) within a few leases, and the next runner continues it.
It also runs inside ``met serve`` in a thread (no signal handlers there).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import redis
from rq import Queue, SimpleWorker
from rq.job import Job
from rq.timeouts import BaseDeathPenalty

from metrale.batch.background_response import fail_response
from metrale.batch.runner import BatchRun
from metrale.batch.runner_loop import RunnerLoop
from metrale.gateway.batches.job_queue import JOB_FUNCTION, RESPONSE_JOB_FUNCTION, RUNS_PER_JOB
from metrale.gateway.batches.objects import BatchError, BatchStatus
from metrale.shared.redis_connect import sync_client
from metrale.shared.settings import BatchRunnerSettings

logger = logging.getLogger(__name__)

_running = threading.local()
"""The ``BatchWorker`` of this thread while it performs a job (RQ calls job functions by path)."""


class NoDeathPenalty(BaseDeathPenalty):
    """No RQ timeout: a batch ends with its completion window (and SIGALRM cannot be used off the main thread)."""

    def setup_death_penalty(self) -> None:
        return None

    def cancel_death_penalty(self) -> None:
        return None


COMMAND_POLL_S = 1.0
"""How long RQ's command listener waits for a message per poll: the most a runner's stop waits for it."""


class BatchWorker(SimpleWorker):
    """An RQ worker for batch jobs and background responses' jobs (those first), with the lease
    described above."""

    death_penalty_class = NoDeathPenalty

    def __init__(self, settings: BatchRunnerSettings, connection: redis.Redis, **kwargs: Any) -> None:
        keys = settings.gateway.keys
        queues = [Queue(name, connection=connection) for name in (keys.response_queue(), keys.batch_queue())]
        lease = settings.lease_s
        super().__init__(queues, connection=connection, worker_ttl=15 + max(lease // 2, 1), **kwargs)
        self.maintenance_interval = lease
        self.settings = settings
        self.loop = RunnerLoop(settings)
        self.push_exc_handler(self._end_when_no_runs_left)

    def get_heartbeat_ttl(self, job: Job) -> int:
        return self.settings.lease_s

    def subscribe(self) -> None:
        """RQ's listener for its commands (stop a job, shut down), polling every ``COMMAND_POLL_S``: RQ's
        own 60 s poll made every stop of a runner wait up to a minute (redis-py's ``stop`` joins the
        listener thread, which waits out its poll when the unsubscribe lands before the subscribe)."""
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(  # type: ignore[assignment]  # RQ declares it None
            sleep_time=COMMAND_POLL_S, daemon=True, exception_handler=self._pubsub_exception_handler
        )

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is threading.main_thread():
            super()._install_signal_handlers()

    def execute_job(self, job: Job, queue: Queue) -> None:
        with _performing(self):
            super().execute_job(job, queue)

    def _end_when_no_runs_left(self, job: Job, exc_type: type[BaseException], *_: Any) -> bool:
        """RQ's exception handler, called when a job raised or its runner was found dead: once RQ will not
        run it again, its batch ends (``failed``, or ``cancelled`` if a cancel came) rather than wait."""
        if job.retries_left or job.func_name not in (JOB_FUNCTION, RESPONSE_JOB_FUNCTION):
            return True
        if job.func_name == RESPONSE_JOB_FUNCTION:
            self._fail_response(job, exc_type)
            return True
        tenant, batch_id = job.args
        message = f"The batch's job failed {RUNS_PER_JOB + 1} times, the last with {exc_type.__name__}."
        try:
            self.loop.run(_end(self.loop, tenant, batch_id, "batch_runner_failed", message))
        except Exception:  # RQ's maintenance must go on; a cancel still ends the batch (the job has failed)
            logger.exception("batch %s: could not end it after its job failed", batch_id)
        return True

    def _fail_response(self, job: Job, exc_type: type[BaseException]) -> None:
        tenant, response_id = job.args
        message = f"The response's job failed {RUNS_PER_JOB + 1} times, the last with {exc_type.__name__}."

        async def failed() -> None:
            await fail_response(await self.loop.gateway(), tenant, response_id, message)

        try:
            self.loop.run(failed())
        except Exception:  # RQ's maintenance must go on
            logger.exception("background response %s: could not end it after its job failed", response_id)

    def clean_registries(self) -> None:
        """RQ's registry maintenance (every ``lease_s``), and expired files' removal with it."""
        super().clean_registries()
        try:
            self.loop.run(_sweep_files(self.loop))
        except Exception:  # the next maintenance tries again; the gateway sweeps too
            logger.exception("could not remove expired files")

    def renew_lease(self, job: Job) -> None:
        """Push the job's expiry in the started registry ``lease_s`` ahead (and the worker's heartbeat)."""
        self.maintain_heartbeats(job)


@contextmanager
def _performing(worker: BatchWorker) -> Iterator[None]:
    _running.worker = worker
    try:
        yield
    finally:
        _running.worker = None


def current_worker() -> BatchWorker:
    """The ``BatchWorker`` performing a job in this thread."""
    worker: BatchWorker | None = getattr(_running, "worker", None)
    if worker is None:
        raise RuntimeError("batch jobs run on a BatchWorker (met batch-runner)")
    return worker


def run_batch_job(tenant: str, batch_id: str) -> str:
    """The RQ job of one batch: run it (or continue it) to a final status, which it returns."""
    from rq import get_current_job

    worker = current_worker()
    job = get_current_job()
    assert job is not None
    loop = worker.loop
    try:
        return loop.run(_run(worker, tenant, batch_id, lambda: worker.renew_lease(job)))
    except (redis.ConnectionError, redis.TimeoutError):
        raise  # Redis is away: RQ runs the job again (its Retry), and the run continues where this one stopped
    except Exception as error:  # anything else would fail the same way again: end the batch now
        logger.exception("batch %s: the runner failed", batch_id)
        message = f"The batch runner failed: {type(error).__name__}: {error}"
        return loop.run(_end(loop, tenant, batch_id, "batch_runner_failed", message)).value


async def _end(loop: RunnerLoop, tenant: str, batch_id: str, code: str, message: str) -> BatchStatus:
    """End a batch that will not run again (``BatchStore.end_unrun``)."""
    gateway = await loop.gateway()
    ended = await gateway.batches.end_unrun(tenant, batch_id, [BatchError(code=code, message=message)])
    return ended if ended is not None else BatchStatus.FAILED


async def _sweep_files(loop: RunnerLoop) -> None:
    files = (await loop.gateway()).files
    while files is not None and await files.sweep_expired() > 0:
        pass


async def _run(worker: BatchWorker, tenant: str, batch_id: str, renew: Callable[[], None]) -> str:
    gateway = await worker.loop.gateway()
    window = worker.settings.window
    run = BatchRun(gateway, tenant, batch_id, window=window, renew_lease=lambda: asyncio.to_thread(renew))
    return (await run.run()).value


def run_runner(settings: BatchRunnerSettings, stop: threading.Event | None = None) -> None:
    """Work the batch queue until stopped (SIGINT/SIGTERM in the main thread, else ``stop``)."""
    jobs_url = settings.gateway.jobs_url  # RQ's Redis (never a cluster: settings.py)
    if jobs_url is None:
        raise ValueError("the batch runner needs a Redis: set MET_REDIS_URL (and MET_JOBS_REDIS_URL on a cluster)")
    connection = sync_client(jobs_url)
    worker = BatchWorker(settings, connection)
    if stop is not None:
        threading.Thread(target=_stop_when_set, args=(worker, stop), daemon=True, name="batch-runner-stop").start()
    logger.info("batch runner %s working queue %s", worker.name, settings.gateway.keys.batch_queue())
    # RQ logs every job and every registry sweep (each 10 s) at INFO: only its warnings, unless debugging.
    try:
        worker.work(logging_level="DEBUG" if logger.isEnabledFor(logging.DEBUG) else "WARNING")
    finally:
        worker.loop.close()


def _stop_when_set(worker: BatchWorker, stop: threading.Event) -> None:
    stop.wait()
    worker._stop_requested = True
