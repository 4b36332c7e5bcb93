"""``met fleet up``: a local fleet without Docker — a gateway and N worker processes on one Redis."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from metrale.cli.embedded_redis import redis_or_embedded
from metrale.shared.settings import load_settings

app = typer.Typer(help="Run a local fleet: a gateway and several workers.", no_args_is_help=True)
console = Console(stderr=True, highlight=False)

POLL_S = 0.5
STOP_GRACE_S = 10.0
"""How long processes get, beyond the drain timeout, to exit after SIGTERM before they are killed."""


@dataclass
class _Member:
    name: str
    process: subprocess.Popen[bytes]


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
) -> None:
    """Start a gateway and WORKERS worker processes against one Redis; Ctrl-C stops them all.

    Workers hand their requests back on stop (MET_DRAIN_HANDOFF=true unless set), so stopping one
    of them by hand (SIGTERM) moves its streams to the others. A member that exits is reported, not
    restarted.
    """
    settings = load_settings()
    url, embedded = redis_or_embedded(redis_url or settings.redis_url)
    environment = {"MET_DRAIN_HANDOFF": "true", **os.environ, "MET_REDIS_URL": url}
    members: list[_Member] = []
    try:
        worker_args = ["--max-seqs", str(max_seqs), *(["--model", str(model)] if model is not None else [])]
        members += [_start(f"worker-{i}", ["worker", *worker_args], environment) for i in range(1, workers + 1)]
        members.append(_start("gateway", ["gateway", "--host", host, "--port", str(port)], environment))
        redis_note = f"embedded Redis ({embedded.kind}) at {url}" if embedded is not None else url
        console.print(f"[bold]Metrale fleet[/]: gateway at http://{host}:{port}, {workers} workers, {redis_note}")
        console.print("Ctrl-C stops the fleet")
        _supervise(members)
    except KeyboardInterrupt:
        console.print("stopping the fleet")
    finally:
        _stop(members, settings.drain_timeout_s + STOP_GRACE_S)
        if embedded is not None:
            embedded.close()


def met_command() -> list[str]:
    """How to run ``met`` from here: the entry point beside this interpreter, else on the PATH."""
    beside = Path(sys.executable).with_name("met")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("met")
    if found is None:
        raise typer.BadParameter("cannot find the 'met' command to start the fleet's processes")
    return [found]


def _start(name: str, args: list[str], environment: dict[str, str]) -> _Member:
    # Their own session: the terminal's Ctrl-C reaches only this process, which stops them in order.
    process = subprocess.Popen([*met_command(), *args], env=environment, start_new_session=True)
    return _Member(name, process)


def _supervise(members: list[_Member]) -> None:
    """Wait for Ctrl-C; report members that exit; give up when the gateway or every worker is gone."""
    reported: set[str] = set()
    while True:
        time.sleep(POLL_S)
        for member in members:
            code = member.process.poll()
            if code is not None and member.name not in reported:
                reported.add(member.name)
                console.print(f"[yellow]{member.name}[/] (pid {member.process.pid}) exited with status {code}")
        alive = {member.name for member in members if member.process.poll() is None}
        if "gateway" not in alive or alive == {"gateway"}:
            console.print("[red]the fleet cannot serve any more[/]; stopping")
            raise typer.Exit(1)


def _stop(members: list[_Member], timeout_s: float) -> None:
    """SIGTERM every member (workers drain), wait up to ``timeout_s``, then kill what is left."""
    for member in members:
        if member.process.poll() is None:
            member.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for member in members:
        try:
            member.process.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            console.print(f"[yellow]{member.name}[/] did not stop in time; killing it")
            member.process.kill()
            member.process.wait()
