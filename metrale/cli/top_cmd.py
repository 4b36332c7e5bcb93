"""``met top``: the operator's live view of the fleet, read from Redis alone."""

from __future__ import annotations

from typing import Annotated

import typer

from metrale.cli.errors import user_errors

# Textual, redis and the queries are imported inside the command: ``met --help`` must not load them.

PLAIN_WIDTH = 160
"""How wide ``--once`` prints when its output is not a terminal (CI logs, pipes)."""


def top(
    redis_url: Annotated[
        str | None,
        typer.Option(
            "--redis",
            help="Redis URL (one Redis, Sentinel or a Redis Cluster); default: MET_REDIS_URL.",
            show_default=False,
        ),
    ] = None,
    jobs_redis_url: Annotated[
        str | None,
        typer.Option(
            "--jobs-redis",
            help="Redis of the RQ job queue, when not --redis (a Redis Cluster's fleet keeps it apart); "
            "default: MET_JOBS_REDIS_URL.",
            show_default=False,
        ),
    ] = None,
    namespace: Annotated[
        str | None, typer.Option(help="Key namespace; default: MET_NAMESPACE, else 'met'.", show_default=False)
    ] = None,
    interval: Annotated[float, typer.Option(help="Seconds between refreshes.")] = 1.0,
    once: Annotated[bool, typer.Option("--once", help="Print every panel once as plain tables and exit.")] = False,
    filter_text: Annotated[
        str, typer.Option("--filter", help="Show only the requests whose model or tenant contains this.")
    ] = "",
    max_requests: Annotated[int, typer.Option(help="Most requests in flight read per refresh.")] = 2000,
) -> None:
    """Watch the fleet live: workers, queues, requests in flight, checkpoints and failover, batches.

    Keys: p pause, s sort the requests, / or f filter them by model or tenant, Enter on a worker for its
    detail, d drain a worker (it hands back what it runs and exits), ? help, q quit.
    """
    import time

    import redis
    from rich.console import Console

    from metrale.shared.keys import Keys
    from metrale.shared.redis_connect import connect_sync, sync_client
    from metrale.shared.redis_url import parse_redis_url
    from metrale.shared.settings import check_jobs_redis_url, load_settings
    from metrale.top.source import RedisSource

    with user_errors(ValueError):
        settings = load_settings()
        url = redis_url or settings.redis_url
        if url is None:
            raise ValueError("no Redis to watch: pass --redis URL or set MET_REDIS_URL")
        if interval <= 0 or max_requests < 1:
            raise ValueError("--interval must be > 0 and --max-requests >= 1")
        target = parse_redis_url(url)
        keys = Keys.for_redis(target, namespace or settings.namespace)
        jobs_url = jobs_redis_url or settings.jobs_redis_url
        check_jobs_redis_url(jobs_url)
        jobs = sync_client(jobs_url, socket_timeout=5, socket_connect_timeout=5) if jobs_url is not None else None
    # The cluster client reads the slot map as it is made: no node answering is a user error here.
    with user_errors(ValueError, redis.RedisError, redis.exceptions.RedisClusterException):
        client = connect_sync(target, socket_timeout=5, socket_connect_timeout=5)
    label = f"{target.display()} · {keys.namespace}"  # no password on screen
    source = RedisSource(client, keys, max_requests=max_requests, jobs=jobs)
    with user_errors(redis.RedisError):
        if once:
            from metrale.top.plain import render

            console = Console()
            if not console.is_terminal:
                console = Console(width=PLAIN_WIDTH)
            render(source.read(time.time(), None), console, label=label, text=filter_text)
            return
        from metrale.top.app import TopApp

        app = TopApp(source, interval=interval, label=label)
        app.filter_text = filter_text
        app.run()
