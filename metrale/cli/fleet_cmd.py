"""``met fleet up``: a local fleet without Docker — a gateway and N worker processes on one Redis."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from metrale.cli.options import (
    CompileOption,
    DtypeOption,
    ReasoningParserOption,
    SpeculativeConfigOption,
    ToolCallParserOption,
)

app = typer.Typer(help="Run a local fleet: a gateway and several workers.", no_args_is_help=True)
console = Console(stderr=True, highlight=False)

POLL_S = 0.25
STOP_GRACE_S = 10.0
"""How long processes get, beyond the drain timeout, to exit after SIGTERM before they are killed."""


class _StopSignal(Exception):
    """SIGTERM or SIGHUP reached ``met fleet up``: stop the fleet as on Ctrl-C."""


@app.command()
def up(
    workers: Annotated[int, typer.Option(min=1, help="Worker processes to start.")] = 2,
    redis_url: Annotated[
        str | None, typer.Option("--redis", help="Redis URL (default: MET_REDIS_URL, else an embedded one).")
    ] = None,
    host: Annotated[str, typer.Option(help="Interface the gateway listens on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Gateway port.")] = 8000,
    model: Annotated[Path | None, typer.Option(help="HF model folder; default: the built-in tiny model.")] = None,
    max_seqs: Annotated[int, typer.Option(help="Sequences each worker runs concurrently.")] = 64,
    dtype: DtypeOption = "auto",
    compile_decode: CompileOption = False,
    speculative_config: SpeculativeConfigOption = None,
    tool_call_parser: ToolCallParserOption = None,
    reasoning_parser: ReasoningParserOption = None,
    split_cpus: Annotated[
        bool,
        typer.Option(
            help="Give each worker its own share of this machine's CPUs (met worker --cpus), one torch "
            "thread per CPU; --no-split-cpus lets every worker use every CPU.",
        ),
    ] = True,
) -> None:
    """Start a gateway and WORKERS worker processes against one Redis; Ctrl-C stops them all.

    Each worker runs on its own share of the CPUs (--split-cpus): workers whose torch threads all
    spread over every CPU wait on each other's threads at every operator (on two CPUs, two such workers
    made 7x fewer tokens per second than two on a CPU each). With more workers than CPUs, each gets one
    CPU, shared round-robin.

    A member that dies (a crash, a kill -9) is restarted with backoff; one that exits with status 0
    (a worker stopped by hand with SIGTERM, which hands its streams to the others since
    MET_DRAIN_HANDOFF=true unless set) stays stopped. Ctrl-C, SIGTERM and SIGHUP stop every member,
    and no member outlives this process.
    """
    from metrale.cli.embedded_redis import redis_or_embedded
    from metrale.cli.errors import user_errors
    from metrale.cli.supervisor import GaveUp, Supervisor
    from metrale.shared.settings import load_settings

    with user_errors(ValueError):  # a bad MET_* setting is refused here, not by each member in turn
        settings = load_settings()
        given = redis_url or settings.redis_url
    _stop_on_signals()
    url, embedded = redis_or_embedded(given)
    environment = {"MET_DRAIN_HANDOFF": "true", **os.environ, "MET_REDIS_URL": url}
    supervisor = Supervisor(environment, log=lambda line: console.print(f"[yellow]fleet:[/] {line}"))
    try:
        worker_args = ["--max-seqs", str(max_seqs), "--dtype", dtype]
        worker_args += ["--model", str(model)] if model is not None else []
        worker_args += ["--compile"] if compile_decode else []
        worker_args += ["--speculative-config", speculative_config] if speculative_config is not None else []
        shares = worker_cpus(workers, sorted(os.sched_getaffinity(0))) if split_cpus else [None] * workers
        for i, share in enumerate(shares, start=1):
            cpus = ["--cpus", share] if share is not None else []
            supervisor.start(f"worker-{i}", [*met_command(), "worker", *worker_args, *cpus])
        gateway_args = ["--host", host, "--port", str(port)]
        gateway_args += ["--tool-call-parser", tool_call_parser] if tool_call_parser is not None else []
        gateway_args += ["--reasoning-parser", reasoning_parser] if reasoning_parser is not None else []
        supervisor.start("gateway", [*met_command(), "gateway", *gateway_args])
        redis_note = f"embedded Redis ({embedded.kind}) at {url}" if embedded is not None else url
        console.print(f"[bold]Metrale fleet[/]: gateway at http://{host}:{port}, {workers} workers, {redis_note}")
        console.print("Ctrl-C stops the fleet")
        while True:
            time.sleep(POLL_S)
            supervisor.poll()
    except (KeyboardInterrupt, _StopSignal):
        console.print("stopping the fleet")
    except GaveUp as failure:
        console.print(f"[red]error:[/] {failure}; stopping the fleet")
        raise typer.Exit(1) from None
    finally:
        _ignore_stop_signals()
        supervisor.stop(settings.drain_timeout_s + STOP_GRACE_S)
        if embedded is not None:
            embedded.close()


def _stop_on_signals() -> None:
    def stop(signum: int, _frame: object) -> None:
        raise _StopSignal(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)


def _ignore_stop_signals() -> None:
    """While stopping, a second SIGTERM / SIGHUP / Ctrl-C must not cut the members' drain short."""
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)


def worker_cpus(workers: int, cpus: Sequence[int]) -> list[str]:
    """Each worker's ``--cpus``: ``cpus`` split into ``workers`` contiguous, disjoint runs as even as can
    be (the first ones one CPU longer); with more workers than CPUs, one CPU each, round-robin."""
    if workers > len(cpus):
        return [str(cpus[i % len(cpus)]) for i in range(workers)]
    size, longer = divmod(len(cpus), workers)
    shares, start = [], 0
    for i in range(workers):
        end = start + size + (i < longer)
        shares.append(",".join(str(cpu) for cpu in cpus[start:end]))
        start = end
    return shares


def met_command() -> list[str]:
    """How to run ``met`` from here: the entry point beside this interpreter, else on the PATH."""
    beside = Path(sys.executable).with_name("met")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("met")
    if found is None:
        raise typer.BadParameter("cannot find the 'met' command to start the fleet's processes")
    return [found]
