"""One-line errors for the command line: known failures print ``error: …`` and exit non-zero, no traceback."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.console import Console

stderr = Console(stderr=True)


def user_error_types() -> tuple[type[Exception], ...]:
    """Failures caused by what the user gave us; anything else is a bug and keeps its traceback.

    Imported on demand: the model loader brings torch, which ``met --help`` must not pay for.
    """
    from metrale.text.chat_templates.render import ChatTemplateError
    from metrale.text.tokenizer_files import TokenizerError
    from metrale.worker.model.config import ModelConfigError
    from metrale.worker.model.loader import CheckpointError
    from metrale.worker.model.precision import UnsupportedDtypeError

    return (
        ModelConfigError,
        CheckpointError,
        UnsupportedDtypeError,
        TokenizerError,
        ChatTemplateError,
        FileNotFoundError,
        IsADirectoryError,
        NotADirectoryError,
        PermissionError,
    )


@contextmanager
def user_errors(*extra: type[Exception]) -> Iterator[None]:
    """Turn the known user errors raised inside into ``error: message`` and exit code 1."""
    try:
        yield
    except Exception as exc:
        if not isinstance(exc, (*user_error_types(), *extra)):
            raise
        stderr.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=1) from None
