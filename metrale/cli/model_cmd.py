"""``met model``: create the built-in tiny model, inspect any served model's checkpoint (or just its config)."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from metrale.cli.errors import user_errors
from metrale.cli.options import DtypeOption

if TYPE_CHECKING:
    from rich.table import Table

# The model modules (and torch) are imported inside the commands: ``met --help`` must not load them.
app = typer.Typer(help="Create and inspect models.", no_args_is_help=True)
console = Console()


class Layout(StrEnum):
    """The files ``init-tiny`` writes."""

    default = "default"
    release = "release"


class TinyFamily(StrEnum):
    """The families ``init-tiny`` writes."""

    kimi_linear = "kimi_linear"
    qwen3_5 = "qwen3_5"
    qwen3_5_moe = "qwen3_5_moe"
    qwen3_next = "qwen3_next"


@app.command("init-tiny")
def init_tiny(
    directory: Annotated[Path, typer.Argument(help="Folder to write the model into (created if missing).")],
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
    layout: Annotated[
        Layout,
        typer.Option(
            help="default: config, one fp32 model.safetensors, tokenizer.json. release: the files of the "
            "Kimi-Linear-48B-A3B-Instruct release (its config keys and tensor names, bf16 shards with an "
            "index, tiktoken.model, Kimi chat template)."
        ),
    ] = Layout.default,
    family: Annotated[
        TinyFamily,
        typer.Option(
            help="kimi_linear: KDA + MLA + MoE. qwen3_5: the Qwen3.5 dense release's layout (Gated DeltaNet + "
            "gated attention, bf16 shards under model.language_model, ChatML tokenizer, Qwen3.5 chat template). "
            "qwen3_5_moe: the same with the MoE release's experts (fused, top-k) and gated shared expert. "
            "qwen3_next: the Qwen3-Next release's flat layout (fused in_proj_qkvz / in_proj_ba, experts one "
            "tensor each, ChatML with Hermes tools). The Qwen families are always release-shaped."
        ),
    ] = TinyFamily.kimi_linear,
) -> None:
    """Write a tiny random-weight model (HF layout) of a served family to DIRECTORY.

    Random weights, deterministic: the same seed writes the same bytes. Small enough for a CPU; loadable
    by transformers. Kimi Linear: at least one KDA, one MLA and one MoE layer.
    """
    with user_errors():
        if family is not TinyFamily.kimi_linear:
            if layout is not Layout.default:
                raise typer.BadParameter(f"--layout is for kimi_linear; a {family} model is always release-shaped")
            if family is TinyFamily.qwen3_next:
                from metrale.worker.model.families.qwen3_next_tiny import write_tiny_qwen3_next

                write_tiny_qwen3_next(directory, seed=seed)
            else:
                from metrale.worker.model.families.qwen3_5_tiny import write_tiny_qwen3_5

                write_tiny_qwen3_5(directory, seed=seed, moe=family is TinyFamily.qwen3_5_moe)
            console.print(f"wrote the tiny {family} model (release layout) to [bold]{directory}[/]")
            return
        if layout is Layout.release:
            from metrale.worker.model.release_layout import write_release_model

            write_release_model(directory, seed=seed)
        else:
            from metrale.worker.model.tiny import write_tiny_model

            write_tiny_model(directory, seed=seed)
    suffix = " (release layout)" if layout is Layout.release else ""
    console.print(f"wrote the tiny model{suffix} to [bold]{directory}[/]")


@app.command("inspect")
def inspect(
    directory: Annotated[Path, typer.Argument(help="An HF model folder; config.json is all it needs.")],
    dtype: DtypeOption = "auto",
    memory: Annotated[
        str | None, typer.Option(help="Size for this much memory: 141GB, 141GiB, 80G (SI unless 'i').")
    ] = None,
    context: Annotated[
        str | None,
        typer.Option(help="Tokens per sequence: 32k, 128K, 1M (k = 1024); default: the model's context."),
    ] = None,
) -> None:
    """Print the architecture, parameters (total and active per token), weight bytes, state bytes per
    sequence and per token; with --memory, how many sequences of --context tokens fit beside the weights.

    Everything comes from config.json, so a folder holding only the config will do; weights, when the
    folder has them, are checked to be all there (their headers are read, not their data).
    """
    from metrale.cli.units import parse_bytes, parse_tokens
    from metrale.worker.model.inspect import capacity_rows, summarize_directory
    from metrale.worker.model.loader import has_weights, stored_shapes

    with user_errors(ValueError):
        summary = summarize_directory(directory, dtype)
        if has_weights(directory):
            stored_shapes(directory)  # a missing shard or a corrupt header is refused, naming the file
        rows = summary.rows()
        if memory is not None or context is not None:
            tokens = parse_tokens(context) if context is not None else summary.context
            rows.append(("state of one sequence", f"{summary.state.total(tokens):,} bytes at {tokens:,} tokens"))
            if memory is not None:
                rows += capacity_rows(summary.capacity(parse_bytes(memory), tokens))
    console.print(_table(str(directory), rows))


def _table(title: str, rows: list[tuple[str, str]]) -> Table:
    from rich.table import Table

    table = Table(title=title, show_header=False, title_justify="left")
    for name, value in rows:
        table.add_row(name, value)
    return table
