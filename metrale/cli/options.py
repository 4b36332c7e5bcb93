"""Options that several commands share, declared once so they read and behave the same everywhere."""

from __future__ import annotations

from typing import Annotated

import typer

DtypeOption = Annotated[
    str,
    typer.Option(
        help="Weight dtype: auto (the config's), float32, bfloat16 or float16. KDA states stay fp32.",
    ),
]
"""``--dtype``; the value is checked where the model is loaded (``precision.weight_dtype``), so a bad
one is a one-line error like any other bad model input."""

CompileOption = Annotated[
    bool,
    typer.Option(
        "--compile/--no-compile",
        help="Decode steps of up to 8 sequences through a torch.compile'd graph (CPU; faster one-stream "
        "decode, ~45 s of compiling per batch-size bucket at start, seconds once cached).",
    ),
]
"""``--compile``: ``build_engine(compile_decode=True)`` (``model.decode_graph``)."""

ToolCallParserOption = Annotated[
    str | None,
    typer.Option(
        "--tool-call-parser",
        help="Tool-call format of the model's output: kimi_k2 or hermes (default: from its chat template).",
    ),
]
"""``--tool-call-parser``; checked by ``GatewaySettings`` (an unknown name is a one-line error)."""
