"""How ``--help`` shows options: a switch (``--json``, ``--chat/--no-chat``, ``--help``) shows no type.

Typer's rich help prints a type column for every option, ``<bool>`` for switches too, which reads as
if the switch took a value. Switches take none, so their column is left empty; every other option
keeps its type (``<int>``, ``<path>``).
"""

from __future__ import annotations

import typer.core

_display_type_rich = typer.core.TyperOption.display_type_rich


def _switch_has_no_type(self: typer.core.TyperOption, ctx: typer.core._click.Context) -> str | None:
    if self.is_flag or self.count:
        return None
    return _display_type_rich(self, ctx)


def show_switches_without_type() -> None:
    """Install the rule above (once per process; ``metrale.cli.main`` does it)."""
    typer.core.TyperOption.display_type_rich = _switch_has_no_type  # type: ignore[method-assign]
