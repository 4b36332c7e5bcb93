"""``met serve``: the whole fleet in one process — Redis (embedded unless given), a gateway, a worker."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from metrale.cli.options import (
    CompileOption,
    DtypeOption,
    ReasoningParserOption,
    SpeculativeConfigOption,
    StreamIntervalOption,
    ToolCallParserOption,
    speculation_of,
)

if TYPE_CHECKING:
    from metrale.cli.embedded_redis import EmbeddedRedis
    from metrale.shared.keys import Keys
    from metrale.shared.settings import BatchRunnerSettings
    from metrale.worker.fleet.service import Worker

# The gateway, the worker and torch are imported inside the command: ``met --help`` must not load them.
logger = logging.getLogger(__name__)
console = Console(stderr=True, highlight=False)


def serve(
    host: Annotated[str, typer.Option(help="Interface the gateway listens on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Gateway port.")] = 8000,
    model: Annotated[Path | None, typer.Option(help="HF model folder; default: the built-in tiny model.")] = None,
    redis_url: Annotated[
        str | None, typer.Option("--redis", help="Use this Redis (default: MET_REDIS_URL, else an embedded one).")
    ] = None,
    max_seqs: Annotated[int, typer.Option(help="Sequences the worker runs concurrently.")] = 64,
    batch_runner: Annotated[
        bool, typer.Option("--batch-runner/--no-batch-runner", help="Run batch jobs in this process too.")
    ] = True,
    dtype: DtypeOption = "auto",
    compile_decode: CompileOption = False,
    speculative_config: SpeculativeConfigOption = None,
    stream_interval: StreamIntervalOption = None,
    tool_call_parser: ToolCallParserOption = None,
    reasoning_parser: ReasoningParserOption = None,
    threads: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Torch threads of the worker. Default: OMP_NUM_THREADS if set, else every CPU but one (a cgroup CPU "
            "quota, docker --cpus, counts), which the gateway and Redis use.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Run a gateway, a worker and a batch runner in one process, on the built-in tiny model unless
    --model is given.

    Without --redis or MET_REDIS_URL a private Redis is started (redis-server if installed, else an
    in-process fakeredis). Files go to MET_FILES_DIR, else to a private folder removed on exit.
    Ctrl-C stops everything.

    The worker leaves one CPU to the gateway (--threads): torch's threads on every CPU wait at each
    operator for the one the gateway holds (two CPUs, one stream of the built-in model: 3.1 ms a token
    on one thread against 6.7 ms on two).
    """
    import dataclasses
    import shutil
    import tempfile

    import uvicorn

    from metrale.cli.embedded_redis import redis_or_embedded
    from metrale.cli.errors import user_errors
    from metrale.cli.worker_cmd import model_to_serve
    from metrale.gateway.app import create_app
    from metrale.gateway.edge.http_server import uvicorn_config
    from metrale.shared.redis_url import CLUSTER_NOT_SERVED, parse_redis_url
    from metrale.shared.settings import load_settings
    from metrale.worker.cpu_affinity import usable_cpus
    from metrale.worker.engine.factory import EngineLimits
    from metrale.worker.fleet.assembly import build_worker
    from metrale.worker.fleet.broker.redis_transport import redis_client
    from metrale.worker.fleet.service import default_worker_id

    settings = load_settings()
    with user_errors(ValueError):  # an unknown parser name is refused before the model loads
        dataclasses.replace(settings.gateway(), tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser)
    torch_threads = worker_threads(threads, os.environ, usable_cpus())
    if torch_threads is not None:
        import torch

        torch.set_num_threads(torch_threads)
    given = redis_url or settings.redis_url
    if given is not None and parse_redis_url(given).cluster:  # its batch runner's RQ cannot use a cluster
        raise typer.BadParameter(CLUSTER_NOT_SERVED, param_hint="--redis")
    url, embedded = redis_or_embedded(given)
    stop = threading.Event()
    worker_thread: threading.Thread | None = None
    private_files = Path(tempfile.mkdtemp(prefix="met-files-")) if settings.files_dir is None else None
    try:
        with user_errors(ValueError):
            worker_settings = dataclasses.replace(settings.worker(), redis_url=url)
            if stream_interval is not None:
                worker_settings = dataclasses.replace(worker_settings, stream_interval=stream_interval)
            builtin = model is None and worker_settings.model_dir is None
            directory, served = model_to_serve(worker_settings, model, None)
            worker = build_worker(
                worker_settings,
                redis_client(url),
                directory=directory,
                served_name=served,
                worker_id=default_worker_id(),
                limits=EngineLimits(max_seqs=max_seqs),
                dtype=dtype,
                compile_decode=compile_decode,
                speculation=speculation_of(speculative_config),
            )
            files_dir = private_files or settings.resolved_files_dir
            gateway_settings = dataclasses.replace(
                settings.gateway(),
                redis_url=url,
                files_dir=files_dir,
                tool_call_parser=tool_call_parser or settings.tool_call_parser,
                reasoning_parser=reasoning_parser or settings.reasoning_parser,
            )
            runner_settings = dataclasses.replace(settings.batch_runner(), gateway=gateway_settings)
        worker_thread = _start_worker(worker, stop, url, worker_settings.keys)
        if batch_runner:
            _start_batch_runner(runner_settings, stop)
        _announce(host, port, served, embedded, auth=gateway_settings.auth_required, builtin=builtin)
        config = uvicorn_config(
            create_app(gateway_settings, precheck_at_start=True), gateway_settings, host=host, port=port
        )
        # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal into whatever
        # handler was installed before it: make that one quiet, since the shutdown continues below.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        uvicorn.Server(config).run()
        console.print("stopping: the worker finishes what it runs")
    finally:
        stop.set()
        if worker_thread is not None:
            worker_thread.join(timeout=worker_settings.drain_timeout_s + 5)
        if embedded is not None:
            embedded.close()
        if private_files is not None:
            shutil.rmtree(private_files, ignore_errors=True)


def worker_threads(requested: int | None, environ: Mapping[str, str], cpus: int) -> int | None:
    """The torch threads ``met serve``'s worker runs: ``requested`` if given, else None (torch's own
    choice) when ``OMP_NUM_THREADS`` is set, else every one of ``cpus`` but one (at least one)."""
    if requested is not None:
        return requested
    if "OMP_NUM_THREADS" in environ:
        return None
    return max(1, cpus - 1)


def _start_batch_runner(settings: BatchRunnerSettings, stop: threading.Event) -> None:
    """Work the batch queue in a thread (it stops with the process)."""
    from metrale.batch.job import run_runner

    threading.Thread(target=run_runner, args=(settings, stop), name="batch-runner", daemon=True).start()


def _start_worker(worker: Worker, stop: threading.Event, url: str, keys: Keys) -> threading.Thread:
    """Run the worker in a thread; return once it has announced itself (so the gateway sees it)."""
    from metrale.worker.fleet.broker.redis_transport import redis_client

    thread = threading.Thread(target=worker.run, args=(stop,), name="worker", daemon=True)
    thread.start()
    client = redis_client(url)
    deadline = time.monotonic() + 60
    while not any(client.scan_iter(match=keys.worker_pattern(), count=100)):
        if not thread.is_alive() or time.monotonic() > deadline:
            raise typer.Exit(1)
        time.sleep(0.05)
    client.close()
    return thread


def _announce(host: str, port: int, model: str, embedded: EmbeddedRedis | None, *, auth: bool, builtin: bool) -> None:
    """Say where the gateway is and print a curl that works as printed (never a key itself)."""
    url = f"http://{host}:{port}"
    redis_note = f"embedded Redis ({embedded.kind}) at {embedded.url}" if embedded is not None else "external Redis"
    console.print(f"[bold]Metrale[/] serving [bold]{model}[/] at {url} ({redis_note})", soft_wrap=True)
    if embedded is not None:
        console.print(f"watch it: met top --redis {embedded.url}", soft_wrap=True, markup=False)
    if builtin:
        console.print(
            f"{model} is a toy model trained on Python's standard library: it answers with code-like text. "
            "Serve a real one with --model DIR.",
            soft_wrap=True,
        )
    if auth:
        console.print("API keys are required (MET_API_KEYS is set): export MET_API_KEY=<one of them> first, then")
    console.print("try:")
    auth_header = """-H "Authorization: Bearer $MET_API_KEY" """ if auth else ""
    body = {"model": model, "messages": [{"role": "user", "content": "def fibonacci(n):"}], "max_tokens": 64}
    console.print(
        f"  curl {url}/v1/chat/completions {auth_header}-H 'Content-Type: application/json' -d '{json.dumps(body)}'",
        soft_wrap=True,
        markup=False,
    )
