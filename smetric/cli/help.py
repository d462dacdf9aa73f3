"""Help text as prose: docstrings and option help reflowed before rich renders them.

Docstrings are wrapped at the source's width, and typer keeps their single line breaks,
so ``--help`` at 80 columns wrapped raggedly. Every paragraph becomes one line here
(bullet items stay one line each) and the terminal wraps it. Help text is plain text:
brackets such as ``[default: ...]`` are escaped so rich shows them instead of reading
them as markup.

Option names stay whole at any width: rich narrows a table too wide for the terminal by
shrinking its widest columns first, the help text down to the width of the option names
and then both together, which cut ``--max-prompt-tokens`` to ``--max-prompt-toke…`` at
80 columns. In the tables of ``--help`` only the last column (the help text) may wrap,
and an option's names share one column, one a line (``--engine, -e``; an alias or a
flag's ``--no-`` form on the line below), rather than four, most of them empty, so the
help keeps its room.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from rich.columns import Columns
from rich.markup import escape
from rich.table import Table
from rich.text import Text
from typer.core import TyperGroup


def prose(text: str | None) -> str | None:
    """``text`` with each paragraph on one line, bullets one line each, markup escaped."""
    if not text:
        return text
    paragraphs = []
    for block in inspect.cleandoc(text).split("\n\n"):
        lines: list[str] = []
        for line in block.splitlines():
            stripped = line.strip()
            if not lines or stripped.startswith(("- ", "* ")):
                lines.append(stripped)
            else:
                lines[-1] += " " + stripped
        paragraphs.append("\n".join(lines))
    return escape("\n\n".join(paragraphs))


# An option's row in typer's help: [required mark,] long names, short names, the long
# and short names of a flag's negation, its type, its help.
_OPTION_ROW = 6


class WholeNamesTable(Table):
    """A table whose columns never wrap or cut, but the last (which folds a word too
    long for it); an option row's names in one column."""

    def add_row(self, *renderables: Any, **kwargs: Any) -> None:
        if len(renderables) >= _OPTION_ROW and all(
            isinstance(cell, Text) for cell in renderables[-_OPTION_ROW:-2]
        ):
            *mark, long, short, no_long, no_short, kind, text = renderables
            # One name a line, the short one beside the first: ``--engine, -e``.
            longs = [n for n in long.split(",") if n.plain]
            shorts = [n for n in (short, no_short) if n.plain]
            negations = [n for n in no_long.split(",") if n.plain]
            first = Text(", ").join([*longs[:1], *shorts])
            names = Text("\n").join([first, *longs[1:], *negations])
            parts = text.renderables if isinstance(text, Columns) else []
            texts = [part for part in parts if isinstance(part, Text)]
            if parts and len(texts) == len(parts):
                # One text, so a long word (a default) folds rather than being cut.
                text = Text(" ").join(texts)
            renderables = (*mark, names, kind, text)
        super().add_row(*renderables, **kwargs)
        for column in self.columns[:-1]:
            column.no_wrap = True
        self.columns[-1].overflow = "fold"


def whole_names(format_help: Callable[..., None]) -> Callable[..., None]:
    """``format_help`` rendering its tables as ``WholeNamesTable``s. typer's renderer
    is imported here, when help is asked for, not when the CLI starts."""

    @functools.wraps(format_help)
    def formatted(*args: Any, **kwargs: Any) -> None:
        from typer import rich_utils

        rich_utils.Table = WholeNamesTable  # type: ignore[misc]
        format_help(*args, **kwargs)

    return formatted


def reflow(command: Any) -> None:
    """Rewrite the help of a click ``command``, its parameters and its subcommands, and
    keep the option names in its help whole."""
    command.format_help = whole_names(command.format_help)
    command.help = prose(command.help)
    command.short_help = prose(command.short_help)
    for param in command.params:
        if hasattr(param, "help"):
            param.help = prose(param.help)
    for sub in getattr(command, "commands", {}).values():
        reflow(sub)


class ProseGroup(TyperGroup):
    """The ``smetric`` group: every command's help reflowed when the CLI is built."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for sub in self.commands.values():
            reflow(sub)
        self.help = prose(self.help)
        self.format_help = whole_names(self.format_help)  # type: ignore[method-assign]
