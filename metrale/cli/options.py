"""Options that several commands share, declared once so they read and behave the same everywhere."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from metrale.worker.engine.speculation import SpeculativeConfig

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

StreamIntervalOption = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="Send each stream's tokens every this many steps (its first token at once), all streams' in "
        "one write, as vLLM's --stream-interval: above 1, Redis, gateways and clients do less work per "
        "token, and streams arrive that many tokens at a time. Default: MET_STREAM_INTERVAL, else 1.",
        show_default=False,
    ),
]
"""``--stream-interval``: ``WorkerSettings.stream_interval`` (None: the setting's)."""

ToolCallParserOption = Annotated[
    str | None,
    typer.Option(
        "--tool-call-parser",
        help="Tool-call format of the model's output: kimi_k2, hermes or qwen3_coder (default: from its chat "
        "template).",
    ),
]
"""``--tool-call-parser``; checked by ``GatewaySettings`` (an unknown name is a one-line error)."""

ReasoningParserOption = Annotated[
    str | None,
    typer.Option(
        "--reasoning-parser",
        help="Split <think>...</think> from answers into reasoning_content: qwen3 or deepseek_r1 (default: when "
        "the model's chat template writes think blocks).",
    ),
]
"""``--reasoning-parser``; checked by ``GatewaySettings`` (an unknown name is a one-line error)."""


def checked_speculative_config(text: str | None) -> str | None:
    """``--speculative-config``'s value, once ``SpeculativeConfig.from_json`` takes it: bad JSON, an unknown
    key or a bad value is a usage error (exit 2) in ``SpeculativeConfig``'s words."""
    if text is None:
        return None
    from metrale.worker.engine.speculation import SpeculativeConfig

    try:
        config = SpeculativeConfig.from_json(text)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    if config.model is not None and not (Path(config.model) / "config.json").is_file():
        raise typer.BadParameter(f"the draft model {config.model} is not a model folder (no config.json in it)")
    return text


SpeculativeConfigOption = Annotated[
    str | None,
    typer.Option(
        "--speculative-config",
        help='Speculative decoding, as vLLM takes it: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 1}\' (prompt lookup), or \'{"model": DIR, '
        '"num_speculative_tokens": 4}\' (a draft model with the same tokenizer). Tokens stay exactly those '
        "without it. Off by default.",
        callback=checked_speculative_config,
        show_default=False,
    ),
]
"""``--speculative-config``: checked as it is parsed; the command builds its ``SpeculativeConfig`` with
``speculation_of``."""


def speculation_of(text: str | None) -> SpeculativeConfig | None:
    """The ``SpeculativeConfig`` a checked ``--speculative-config`` value names; None: speculation off."""
    from metrale.worker.engine.speculation import SpeculativeConfig

    return SpeculativeConfig.from_json(text) if text is not None else None
