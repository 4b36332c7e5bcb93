"""``met model``: create the built-in tiny model, inspect any KimiLinear checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from metrale.cli.errors import user_errors

if TYPE_CHECKING:
    from rich.table import Table

    from metrale.worker.model.inspect import ModelSummary

# The model modules (and torch) are imported inside the commands: ``met --help`` must not load them.
app = typer.Typer(help="Create and inspect models.", no_args_is_help=True)
console = Console()


@app.command("init-tiny")
def init_tiny(
    directory: Annotated[Path, typer.Argument(help="Folder to write the model into (created if missing).")],
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
) -> None:
    """Write the built-in tiny KimiLinear model (HF layout: config, safetensors, tokenizer) to DIRECTORY.

    Random weights, deterministic: the same seed writes the same bytes. At least one KDA, one MLA and
    one MoE layer; small enough for a CPU; loadable by transformers.
    """
    from metrale.worker.model.tiny import write_tiny_model

    with user_errors():
        write_tiny_model(directory, seed=seed)
    console.print(f"wrote the tiny model to [bold]{directory}[/]")


@app.command("inspect")
def inspect(
    directory: Annotated[Path, typer.Argument(help="An HF model folder (config.json + safetensors).")],
    dtype: Annotated[str | None, typer.Option(help="State dtype to size for (default: the config's).")] = None,
) -> None:
    """Print the architecture, parameter counts and state bytes per sequence and per token."""
    from metrale.worker.model.config import ModelConfig
    from metrale.worker.model.inspect import summarize
    from metrale.worker.model.precision import parse_dtype

    with user_errors():
        config = ModelConfig.from_pretrained(directory)
        summary = summarize(directory, config, parse_dtype(dtype or config.dtype))
    console.print(_table(summary))


def _table(summary: ModelSummary) -> Table:
    from rich.table import Table

    table = Table(title=str(summary.directory), show_header=False, title_justify="left")
    for name, value in summary.rows():
        table.add_row(name, value)
    return table
