"""``met batch-runner``: run batch jobs (``POST /v1/batches``) from the fleet's RQ queue."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import typer


def batch_runner(
    redis: Annotated[
        str | None, typer.Option("--redis", help="Redis URL, e.g. redis://127.0.0.1:6379/0 (default: MET_REDIS_URL).")
    ] = None,
    jobs_redis: Annotated[
        str | None,
        typer.Option(
            "--jobs-redis",
            help="Redis of the RQ job queue, plain or Sentinel (default: MET_JOBS_REDIS_URL, else --redis); "
            "needed when --redis is a Redis Cluster, which RQ cannot use.",
        ),
    ] = None,
) -> None:
    """Take batch jobs from the queue and run them through the fleet, at batch priority.

    Uploaded files live in MET_FILES_DIR, which every gateway and batch runner must share. A runner
    that dies mid-batch is replaced by any other (or its restart), which continues the batch. On a
    Redis Cluster the job queue lives on a Redis of its own (--jobs-redis / MET_JOBS_REDIS_URL), the same
    for every gateway and batch runner.
    """
    from metrale.batch.job import run_runner
    from metrale.cli.errors import user_errors
    from metrale.shared.settings import load_settings

    with user_errors(ValueError):  # a bad MET_* setting (MET_REDIS_URL among them) is a one-line error
        settings = load_settings().batch_runner()
    redis_url = redis or settings.gateway.redis_url
    if redis_url is None:
        raise typer.BadParameter("no Redis to talk to: pass --redis URL or set MET_REDIS_URL", param_hint="--redis")
    with user_errors(ValueError):
        jobs_redis_url = jobs_redis or settings.gateway.jobs_redis_url
        gateway = dataclasses.replace(settings.gateway, redis_url=redis_url, jobs_redis_url=jobs_redis_url)
        settings = dataclasses.replace(settings, gateway=gateway)
    run_runner(settings)
