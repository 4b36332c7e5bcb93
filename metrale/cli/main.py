"""The ``met`` command.

Every command module imports only typer and the standard library at the top, and the rest (torch, the
engine, the gateway, httpx) inside its command, so ``met --help`` and ``met COMMAND --help`` stay fast.
"""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from metrale.cli import batch_cmd, fleet_cmd, model_cmd, worker_cmd
from metrale.cli.batch_runner_cmd import batch_runner
from metrale.cli.bench_cmd import bench
from metrale.cli.chat_cmd import chat
from metrale.cli.gateway_cmd import gateway
from metrale.cli.generate_cmd import generate
from metrale.cli.help_format import reflow_help, show_switches_without_type
from metrale.cli.serve_cmd import serve
from metrale.cli.top_cmd import top

INTERACTIVE_COMMANDS = frozenset({"chat", "bench", "generate", "top"})
"""Commands whose output is for a person to read: no log lines in it unless --verbose."""

show_switches_without_type()
app = typer.Typer(
    name="met",
    help="Metrale: serve hybrid recurrent LLMs (Kimi Linear: KDA + MLA) with exact recurrent state.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.command("serve")(serve)
app.command("chat")(chat)
app.command("generate")(generate)
app.command("gateway")(gateway)
app.command("worker")(worker_cmd.worker)
app.command("batch-runner")(batch_runner)
app.add_typer(batch_cmd.app, name="batch")
app.add_typer(fleet_cmd.app, name="fleet")
app.command("bench")(bench)
app.command("top")(top)
app.add_typer(model_cmd.app, name="model")


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"met {version('metrale')}")
        raise typer.Exit()


@app.callback()
def _main(
    ctx: typer.Context,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show log lines, with debug details.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    configure_logging(verbose=verbose, interactive=ctx.invoked_subcommand in INTERACTIVE_COMMANDS)


reflow_help(app)


def configure_logging(*, verbose: bool, interactive: bool) -> None:
    """Servers log Metrale's own INFO lines and libraries' warnings; interactive commands only
    warnings; ``--verbose`` shows everything down to Metrale's debug lines and libraries' INFO."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(logging.INFO if verbose else logging.WARNING)
    own = logging.DEBUG if verbose else logging.WARNING if interactive else logging.INFO
    logging.getLogger("metrale").setLevel(own)
