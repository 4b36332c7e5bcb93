"""How ``--help`` reads: prose that wraps to the terminal, and switches without a type.

Typer's rich help keeps a docstring's line breaks and then wraps each line to the terminal, so text
written at 110 columns breaks raggedly on an 80-column terminal. ``reflow_help`` joins the lines of each
paragraph before typer reads them; blank lines, list items (``-``, ``*``, ``1.``) and lines indented as code
keep their breaks.

Typer also prints a type column for every option, ``<bool>`` for switches too, which reads as if the
switch took a value. Switches (``--json``, ``--chat/--no-chat``, ``--help``) take none, so their column
is left empty; every other option keeps its type (``<int>``, ``<path>``).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import typer
import typer.core

_KEEPS_ITS_BREAK = re.compile(r"^( {4}|\t|[-*] |\d+\. )")
"""A line that starts a list item or is indented as code (4 spaces): it begins a line of its own in
the help. A list item's continuation (indented less) joins its item."""

_display_type_rich = typer.core.TyperOption.display_type_rich


def _switch_has_no_type(self: typer.core.TyperOption, ctx: typer.core._click.Context) -> str | None:
    if self.is_flag or self.count:
        return None
    return _display_type_rich(self, ctx)


def show_switches_without_type() -> None:
    """Install the rule above (once per process; ``metrale.cli.main`` does it)."""
    typer.core.TyperOption.display_type_rich = _switch_has_no_type  # type: ignore[method-assign]


def reflowed(text: str) -> str:
    """``text`` (a docstring) with each paragraph's lines joined by spaces, except before a list item
    or a line indented as code; paragraphs stay separated by a blank line."""
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(_reflowed_paragraph(paragraph) for paragraph in paragraphs)


def _reflowed_paragraph(paragraph: str) -> str:
    lines: list[str] = []
    for line in paragraph.splitlines():
        if lines and not _KEEPS_ITS_BREAK.match(line):
            lines[-1] = f"{lines[-1]} {line.strip()}"
        else:
            lines.append(line)
    return "\n".join(lines)


def reflow_help(app: typer.Typer) -> None:
    """Reflow the help of ``app``, its commands and its sub-apps, all the way down (before typer builds
    the click commands from them: once, at import)."""
    if isinstance(app.info.help, str):
        app.info.help = reflowed(app.info.help)
    for command in app.registered_commands:
        command.help = _reflowed_help(command.help, command.callback)
    for group in app.registered_groups:
        if group.typer_instance is not None:
            reflow_help(group.typer_instance)
        if isinstance(group.help, str):
            group.help = reflowed(group.help)
    callback = app.registered_callback
    if callback is not None:
        callback.help = _reflowed_help(callback.help, callback.callback)


def _reflowed_help(given: object, callback: Callable[..., Any] | None) -> Any:
    """A command's help reflowed: the help it was given, else its function's docstring (what typer
    shows without one); anything else (typer's unset default) as it is."""
    if isinstance(given, str):
        return reflowed(given)
    if callback is not None and callback.__doc__:
        return reflowed(callback.__doc__)
    return given
