"""``met batch``: OpenAI-style batches on a gateway — submit a JSONL file, follow it, cancel it,
download its answers."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from metrale.cli.errors import stderr

if TYPE_CHECKING:
    from metrale.cli.batch_client import Batch, BatchClient

# httpx (through batch_client) is imported inside the commands: ``met --help`` must not load it.

app = typer.Typer(
    help="Batches on a gateway: submit a JSONL file of requests, follow it, download the answers.",
    no_args_is_help=True,
)

DEFAULT_URL = "http://127.0.0.1:8000"
POLL_S = 0.5
"""How often ``--wait`` asks for the batch."""
UNWRAPPED_WIDTH = 200
"""``met batch list``'s width when its output is not a terminal: wide enough for a row on one line."""

Url = Annotated[str, typer.Option(help="Gateway base URL.")]
ApiKey = Annotated[str | None, typer.Option(envvar="MET_API_KEY", help="API key, if the gateway wants one.")]
BatchId = Annotated[str, typer.Argument(help="The batch's id (batch_...).")]
Wait = Annotated[bool, typer.Option("--wait", help="Show progress until the batch is final.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print the gateway's JSON instead.")]


@app.command()
def submit(
    file: Annotated[Path, typer.Argument(help='JSONL: one {"custom_id", "method": "POST", "url", "body"} per line.')],
    endpoint: Annotated[
        str | None,
        typer.Option(help="/v1/chat/completions or /v1/completions; default: the url of the file's first line."),
    ] = None,
    wait: Wait = False,
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
) -> None:
    """Upload FILE and start a batch of its lines; print the batch's id.

    Every line is checked before any runs: a bad line fails the whole batch, naming its line number.
    """
    from metrale.cli.batch_client import ENDPOINTS, endpoint_of

    with _client(url, api_key) as client:
        chosen = endpoint or endpoint_of(file) or ENDPOINTS[0]
        if chosen not in ENDPOINTS:
            raise typer.BadParameter(f"must be one of {', '.join(ENDPOINTS)}", param_hint="--endpoint")
        uploaded = client.upload(file)
        batch = client.create(uploaded["id"], chosen)
        typer.echo(batch["id"])
        _say(f"submitted {file} ({uploaded['bytes']} bytes) as {batch['id']} to {chosen}")
        if wait:
            _report(_follow(client, batch["id"]), url, final_exit=True)


@app.command()
def status(
    batch_id: BatchId, wait: Wait = False, as_json: AsJson = False, url: Url = DEFAULT_URL, api_key: ApiKey = None
) -> None:
    """Show a batch: its status and how many lines are answered (--wait: follow it to the end)."""
    with _client(url, api_key) as client:
        batch = _follow(client, batch_id) if wait else client.retrieve(batch_id)
        if as_json:
            typer.echo(json.dumps(batch, indent=2))
        else:
            _report(batch, url, final_exit=wait)


@app.command("list")
def list_batches(
    limit: Annotated[int, typer.Option(min=1, max=100, help="How many, newest first.")] = 20,
    as_json: AsJson = False,
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
) -> None:
    """List this API key's batches, newest first."""
    from rich.console import Console
    from rich.table import Table

    with _client(url, api_key) as client:
        batches = client.list(limit)
    if as_json:
        for batch in batches:
            typer.echo(json.dumps(batch))
        return
    # Ids and statuses whole on a narrow terminal (the other columns wrap); not on a terminal (a pipe,
    # a file), every row on one line.
    table = Table(box=None)
    table.add_column("id", no_wrap=True, min_width=max((len(batch["id"]) for batch in batches), default=2))
    table.add_column("status", no_wrap=True, min_width=max((len(batch["status"]) for batch in batches), default=6))
    for name in ("endpoint", "answered", "failed", "created"):
        table.add_column(name, overflow="fold")
    for batch in batches:
        counts = batch["request_counts"]
        answered = f"{counts['completed'] + counts['failed']}/{counts['total']}"
        table.add_row(
            batch["id"],
            batch["status"],
            batch["endpoint"],
            answered,
            str(counts["failed"]),
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(batch["created_at"])),
        )
    console = Console(highlight=False, width=None if sys.stdout.isatty() else UNWRAPPED_WIDTH)
    console.print(table if batches else "no batches")


@app.command()
def cancel(batch_id: BatchId, url: Url = DEFAULT_URL, api_key: ApiKey = None) -> None:
    """Cancel a batch: lines queued or running stop; lines already answered stay in its output."""
    with _client(url, api_key) as client:
        batch = client.cancel(batch_id)
    _say(f"{batch_id}: {batch['status']}")


@app.command()
def download(
    batch_id: BatchId,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write the answers here (default: standard output).")
    ] = None,
    errors: Annotated[Path | None, typer.Option(help="Write the lines that failed here.")] = None,
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
) -> None:
    """Download a final batch's answers, one line per request in input order (--errors: its failed lines)."""
    from metrale.cli.batch_client import TERMINAL_STATUSES, GatewayError

    with _client(url, api_key) as client:
        batch = client.retrieve(batch_id)
        if batch["status"] not in TERMINAL_STATUSES:
            raise GatewayError(f"{batch_id} is {batch['status']}: wait for it (met batch status {batch_id} --wait)")
        output_id, error_id = batch.get("output_file_id"), batch.get("error_file_id")
        if output_id is None and (errors is None or error_id is None):
            why = f"; {batch['request_counts']['failed']} failed lines: add --errors FILE" if error_id else ""
            raise GatewayError(f"{batch_id} ({batch['status']}) has no answered lines{why}")
        if output_id is not None:
            _save(client, output_id, output)
        if errors is not None:
            _save(client, error_id, errors)
        elif error_id is not None:
            _say(f"{batch['request_counts']['failed']} lines failed or never ran: --errors FILE saves them")


def _save(client: BatchClient, file_id: str | None, path: Path | None) -> None:
    """The file's bytes to ``path`` (nothing: an empty file), or to standard output."""
    if path is None:
        assert file_id is not None
        client.download(file_id, sys.stdout.buffer)
        sys.stdout.flush()
        return
    with path.open("wb") as out:
        written = client.download(file_id, out) if file_id is not None else 0
    _say(f"wrote {path} ({written} bytes)")


@contextmanager
def _client(url: str, api_key: str | None) -> Iterator[BatchClient]:
    """A client of the gateway; its errors (and unreadable local files) end the command with one line."""
    from rich.markup import escape

    from metrale.cli.batch_client import BatchClient, GatewayError

    try:
        with BatchClient(url, api_key) as client:
            yield client
    except (GatewayError, OSError) as error:
        stderr.print(f"[bold red]error:[/] {escape(str(error))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


def _follow(client: BatchClient, batch_id: str) -> Batch:
    """Poll the batch to its end under a progress bar (answered / total, ETA); Ctrl-C stops waiting."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        TimeElapsedColumn(),
    )
    try:
        with Progress(*columns, console=stderr) as progress:
            task = progress.add_task(batch_id, total=None)

            def show(batch: Batch) -> None:
                counts = batch["request_counts"]
                done, total = counts["completed"] + counts["failed"], counts["total"] or None
                progress.update(task, completed=done, total=total, description=f"{batch_id} {batch['status']}")

            return client.wait(batch_id, show, poll_s=POLL_S)
    except KeyboardInterrupt:
        _say(f"stopped waiting; the batch goes on (met batch status {batch_id} --wait)")
        raise typer.Exit(130) from None


def _report(batch: Batch, url: str, *, final_exit: bool) -> None:
    """Where the batch stands, and what to do next; with ``final_exit``, exit 1 unless it completed."""
    batch_id, status, counts = batch["id"], batch["status"], batch["request_counts"]
    answered = f"{counts['completed']} of {counts['total']} lines answered, {counts['failed']} failed"
    _say(f"{batch_id}: {status} ({answered})")
    if status == "failed":
        for error in _errors(batch):
            _say(f"  {error}")
    elif status in ("completed", "cancelled", "expired"):
        where = "" if url == DEFAULT_URL else f" --url {url}"
        extra = " --errors errors.jsonl" if batch.get("error_file_id") else ""
        if batch.get("output_file_id") or extra:
            _say(f"download: met batch download {batch_id}{where} --output output.jsonl{extra}")
    if final_exit and status != "completed":
        raise typer.Exit(1)


def _say(text: str) -> None:
    """A line for the person at the terminal (standard error, so standard output stays the data)."""
    stderr.print(text, highlight=False, soft_wrap=True, markup=False)


def _errors(batch: Batch) -> list[str]:
    """A failed batch's reasons, one per line: ``line 3: invalid_url: ...``."""
    listed: list[dict[str, Any]] = (batch.get("errors") or {}).get("data") or []
    return [
        f"{'line ' + str(e['line']) + ': ' if e.get('line') else ''}{e.get('code')}: {e.get('message')}" for e in listed
    ]
