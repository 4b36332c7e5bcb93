"""``met worker``: serve one model to the fleet from a Redis queue until SIGTERM."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from metrale.cli.errors import user_errors
from metrale.cli.options import (
    CompileOption,
    DtypeOption,
    SpeculativeConfigOption,
    StreamIntervalOption,
    speculation_of,
)

if TYPE_CHECKING:
    from metrale.shared.settings import WorkerSettings

# The worker and torch are imported inside the command: ``met --help`` must not load them.

logger = logging.getLogger(__name__)


class Device(StrEnum):
    CPU = "cpu"
    CUDA = "cuda"


def worker(
    redis_url: Annotated[
        str | None, typer.Option("--redis", help="Redis URL; default: MET_REDIS_URL.", show_default=False)
    ] = None,
    model: Annotated[
        Path | None, typer.Option(help="HF model folder; default: MET_MODEL_DIR, else the built-in tiny model.")
    ] = None,
    name: Annotated[str | None, typer.Option(help="Worker id; default: host-pid-random.")] = None,
    device: Annotated[Device, typer.Option(help="Where the model runs.")] = Device.CPU,
    dtype: DtypeOption = "auto",
    compile_decode: CompileOption = False,
    speculative_config: SpeculativeConfigOption = None,
    max_seqs: Annotated[int, typer.Option(help="Sequences run concurrently.")] = 64,
    max_batch_tokens: Annotated[int, typer.Option(help="Most tokens in one step.")] = 2048,
    num_blocks: Annotated[int, typer.Option(help="MLA KV-cache blocks.")] = 4096,
    served_model_name: Annotated[
        str | None, typer.Option(help="Name clients ask for; default: the model folder's name.")
    ] = None,
    checkpoints: Annotated[
        bool, typer.Option(help="Resume prompts from exact state checkpoints (memory, Redis, MET_CHECKPOINT_DIR).")
    ] = True,
    stream_interval: StreamIntervalOption = None,
    cpus: Annotated[
        str | None,
        typer.Option(
            help="Run on these CPUs only, e.g. 0-3,8 (Linux); keep gateways and Redis on others. Default: every "
            "CPU. Torch runs one thread per CPU, fewer under a cgroup CPU quota (docker --cpus), unless "
            "OMP_NUM_THREADS is set.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Serve a model to the gateways: take requests from Redis, stream tokens back.

    SIGTERM (or Ctrl-C) stops taking requests, finishes those running (up to MET_DRAIN_TIMEOUT_S) or,
    with MET_DRAIN_HANDOFF=true, checkpoints them and hands them back to the queue at once, withdraws
    the worker's heartbeat and exits 0.
    """
    from metrale.worker.cpu_affinity import parse_cpu_list, pin, usable_cpus

    if cpus is not None:  # before torch starts its threads: they inherit the process's CPUs
        with user_errors(ValueError):
            pin(parse_cpu_list(cpus))

    from redis.exceptions import RedisClusterException

    from metrale.shared.keys import check_segment
    from metrale.shared.settings import load_settings
    from metrale.worker.engine.factory import EngineLimits
    from metrale.worker.fleet.assembly import build_worker
    from metrale.worker.fleet.broker.redis_transport import redis_client
    from metrale.worker.fleet.service import default_worker_id

    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(usable_cpus())

    # A cluster's client reads the slot map as it is made: no node answering is a start-up error.
    with user_errors(ValueError, RedisClusterException):
        settings = load_settings().worker()
        url = redis_url or settings.redis_url
        if url is None:
            raise ValueError("no Redis to serve from: pass --redis URL or set MET_REDIS_URL")
        settings = dataclasses.replace(settings, redis_url=url)  # its key space follows the Redis served
        if stream_interval is not None:
            settings = dataclasses.replace(settings, stream_interval=stream_interval)
        worker_id = check_segment(name or default_worker_id(), "worker name")
        directory, served_name = model_to_serve(settings, model, served_model_name)
        limits = EngineLimits(max_seqs=max_seqs, max_batch_tokens=max_batch_tokens, num_blocks=num_blocks)
        service = build_worker(
            settings,
            redis_client(url),
            directory=directory,
            served_name=served_name,
            worker_id=worker_id,
            limits=limits,
            device=device.value,
            dtype=dtype,
            compile_decode=compile_decode,
            speculation=speculation_of(speculative_config),
            checkpoints=checkpoints,
        )
    stop = threading.Event()
    _stop_on_signals(stop)
    service.run(stop)


def model_to_serve(settings: WorkerSettings, model: Path | None, served_name: str | None) -> tuple[Path, str]:
    """The model folder and the name it is served under (checked to fit a Redis key): ``model``, else
    ``MET_MODEL_DIR``, else the built-in model."""
    from metrale.shared.keys import check_segment
    from metrale.worker.model.builtin import BUILTIN_MODEL_NAME, builtin_model_dir

    directory = model or settings.model_dir
    if directory is None:
        directory, default_name = builtin_model_dir(), BUILTIN_MODEL_NAME
    else:
        default_name = directory.resolve().name
    return directory, check_segment(served_name or default_name, "served model name")


def _stop_on_signals(stop: threading.Event) -> None:
    """First SIGTERM / SIGINT: drain and exit 0. A second one: exit at once (status 1)."""

    def request_stop(signum: int, _frame: object) -> None:
        if stop.is_set():
            raise SystemExit(1)
        logger.info("received %s: draining", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
