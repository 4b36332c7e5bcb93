"""``met bench``: load a gateway and report latency and throughput like ``vllm bench serve``."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from metrale.cli.errors import stderr

if TYPE_CHECKING:
    from rich.table import Table

# The load generator (and httpx) is imported inside the command: ``met --help`` must not load it.

console = Console()


def bench(
    url: Annotated[str, typer.Option(help="Gateway base URL.")] = "http://127.0.0.1:8000",
    model: Annotated[str | None, typer.Option(help="Model name; default: the first the gateway serves.")] = None,
    num_prompts: Annotated[int, typer.Option(help="Requests to send.")] = 64,
    input_len: Annotated[int, typer.Option(help="Prompt tokens per request.")] = 128,
    output_len: Annotated[int, typer.Option(help="Tokens generated per request.")] = 64,
    shared_prefix_len: Annotated[int, typer.Option(help="Leading prompt tokens shared by every request.")] = 0,
    concurrency: Annotated[int, typer.Option(help="Requests in flight (closed loop).")] = 32,
    request_rate: Annotated[
        float | None, typer.Option(help="Open loop: Poisson arrivals per second (overrides the closed loop).")
    ] = None,
    api_key: Annotated[str | None, typer.Option(envvar="MET_API_KEY", help="API key, if needed.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the random prompts.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Load a gateway with streamed completions and report latency and throughput.

    Sends NUM_PROMPTS requests and reports TTFT, TPOT, ITL, end-to-end latency (mean / median / p99) and
    request and token throughput; when the fleet speculates (met serve / worker --speculative-config),
    also the acceptance of its draft tokens during the run, from the gateway's /metrics (fleet-wide
    counters: other load on the fleet counts too; read a few seconds after the run, as workers report
    them with their heartbeats).
    """
    import asyncio

    from metrale.cli.loadgen import LoadSpec, run_load
    from metrale.cli.spec_decode_metrics import read_speculation_counts, speculation_during_run

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    name = model or _first_model(url, headers)
    spec = LoadSpec(
        model=name,
        num_prompts=num_prompts,
        input_len=input_len,
        output_len=output_len,
        shared_prefix_len=min(shared_prefix_len, input_len),
        concurrency=concurrency,
        request_rate=request_rate,
        seed=seed,
    )
    before = read_speculation_counts(url, headers)
    report = asyncio.run(run_load(url, spec, headers))
    if before is not None:
        report["spec_decode"] = speculation_during_run(url, headers, before, report["duration_s"])
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        console.print(_table(report))
    if report["failed"]:
        stderr.print(f"[yellow]{report['failed']} requests failed:[/] {report['errors']}")
        raise typer.Exit(1)


def _first_model(url: str, headers: dict[str, str]) -> str:
    import httpx

    try:
        models = httpx.get(f"{url}/v1/models", headers=headers, timeout=10).json()["data"]
        return str(models[0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        stderr.print(f"[bold red]error:[/] no model served at {url} ({exc})")
        raise typer.Exit(1) from None


def _table(report: dict[str, Any]) -> Table:
    from rich.table import Table

    table = Table(title="met bench", show_header=True)
    table.add_column("metric")
    table.add_column("mean", justify="right")
    table.add_column("median", justify="right")
    table.add_column("p99", justify="right")
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = report[name]
        table.add_row(f"{name.upper()} (ms)", f"{s['mean_ms']:.1f}", f"{s['median_ms']:.1f}", f"{s['p99_ms']:.1f}")
    table.add_row("requests/s", f"{report['request_throughput']:.2f}", "", "")
    table.add_row("output tokens/s", f"{report['output_token_throughput']:.1f}", "", "")
    table.add_row("total tokens/s", f"{report['total_token_throughput']:.1f}", "", "")
    table.add_row("completed / failed", f"{report['completed']} / {report['failed']}", "", "")
    drafted = report.get("spec_decode")
    if drafted is not None:
        table.add_row("draft acceptance (%)", f"{100 * drafted['acceptance_rate']:.1f}", "", "")
        table.add_row("acceptance length", f"{drafted['acceptance_length']:.2f}", "", "")
        table.add_row("drafts / draft tokens", f"{drafted['drafts']} / {drafted['draft_tokens']}", "", "")
        per_position = " ".join(f"{100 * rate:.0f}" for rate in drafted["per_position_acceptance_rate"])
        table.add_row("per-position acceptance (%)", per_position, "", "")
    return table
