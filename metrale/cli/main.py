"""The ``met`` command."""

from __future__ import annotations

import logging

import typer

from metrale.cli import fleet_cmd, model_cmd, worker_cmd
from metrale.cli.bench_cmd import bench
from metrale.cli.chat_cmd import chat
from metrale.cli.gateway_cmd import gateway
from metrale.cli.generate_cmd import generate
from metrale.cli.serve_cmd import serve

app = typer.Typer(
    name="met",
    help="Metrale: serve hybrid recurrent LLMs (Kimi Linear: KDA + MLA) with exact recurrent state.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(model_cmd.app, name="model")
app.add_typer(fleet_cmd.app, name="fleet")
app.command("generate")(generate)
app.command("gateway")(gateway)
app.command("worker")(worker_cmd.worker)
app.command("chat")(chat)
app.command("serve")(serve)
app.command("bench")(bench)


@app.callback()
def _main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log debug details.")) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
