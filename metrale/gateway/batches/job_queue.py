"""The RQ queue batch jobs wait in: one job per batch, run by a batch runner (``metrale/batch/``).

RQ speaks synchronous redis-py, so this facade takes a sync client; the gateway calls it in a thread.
A job whose runner died is run again by RQ (``Retry``: a runner's maintenance finds the job's lease
expired and re-enqueues it), and the new run continues where the old one stopped.
"""

from __future__ import annotations

import re

import redis
from rq import Queue, Retry
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry

from metrale.shared.keys import Keys

JOB_FUNCTION = "metrale.batch.job.run_batch_job"
"""What a batch job calls, by import path (the gateway never imports the runner)."""
RESPONSE_JOB_FUNCTION = "metrale.batch.background_response.run_background_response"
"""What a background response's job calls (on the responses queue, which batch runners take first)."""
RUNS_PER_JOB = 20
"""How often a batch job may be started again after its runner died or it failed."""
RESULT_TTL_S = 7 * 24 * 3600


class BatchJobQueue:
    """Enqueues and cancels batch jobs."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self._client = client
        self._keys = keys
        self.queue = Queue(keys.batch_queue(), connection=client)
        self.response_queue = Queue(keys.response_queue(), connection=client)

    def job_id(self, batch_id: str) -> str:
        """The RQ job id of a batch or background response (RQ's job keys are not namespaced, so the
        id carries the namespace)."""
        namespace = re.sub(r"[^A-Za-z0-9_-]", "_", self._keys.namespace)  # what RQ allows in an id
        return f"{namespace}--{batch_id}"

    def enqueue(self, tenant: str, batch_id: str) -> str:
        """Queue the batch's job; return its id."""
        job = self.queue.enqueue(
            JOB_FUNCTION,
            tenant,
            batch_id,
            job_id=self.job_id(batch_id),
            retry=Retry(max=RUNS_PER_JOB),
            job_timeout=-1,  # the batch's own completion window bounds it
            result_ttl=RESULT_TTL_S,
            failure_ttl=RESULT_TTL_S,
        )
        return str(job.id)

    def enqueue_response(self, tenant: str, response_id: str) -> str:
        """Queue a background response's job; return its id. Run again like a batch's if its runner dies."""
        job = self.response_queue.enqueue(
            RESPONSE_JOB_FUNCTION,
            tenant,
            response_id,
            job_id=self.job_id(response_id),
            retry=Retry(max=RUNS_PER_JOB),
            job_timeout=-1,  # the response's deadline bounds it
            result_ttl=RESULT_TTL_S,
            failure_ttl=RESULT_TTL_S,
        )
        return str(job.id)

    def cancel_unless_running(self, batch_id: str) -> bool:
        """Make sure no runner will take the batch's job unless one is running it now; whether none is.

        A queued, scheduled or deferred job is cancelled; a job that is gone, failed, finished or
        stopped has no runner either; a started job whose lease expired lost its runner (RQ's
        maintenance reruns it, and the rerun finds its batch ended)."""
        try:
            job = Job.fetch(self.job_id(batch_id), connection=self._client)
        except NoSuchJobError:
            return True
        status = job.get_status()
        if status in (JobStatus.QUEUED, JobStatus.SCHEDULED, JobStatus.DEFERRED):
            job.cancel()
            return True
        if status is JobStatus.STARTED:
            return job.id in StartedJobRegistry(queue=self.queue).get_expired_job_ids()
        return True
