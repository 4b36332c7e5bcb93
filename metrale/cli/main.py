"""The ``met`` command."""

from __future__ import annotations

import logging

import typer

from metrale.cli import model_cmd
from metrale.cli.generate_cmd import generate

app = typer.Typer(
    name="met",
    help="Metrale: serve hybrid recurrent LLMs (Kimi Linear: KDA + MLA) with exact recurrent state.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(model_cmd.app, name="model")
app.command("generate")(generate)


@app.callback()
def _main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log debug details.")) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
