"""Help text as prose: docstrings and option help reflowed before rich renders them.

Docstrings are wrapped at the source's width, and typer keeps their single line breaks,
so ``--help`` at 80 columns wrapped raggedly. Every paragraph becomes one line here
(bullet items stay one line each) and the terminal wraps it. Help text is plain text:
brackets such as ``[default: ...]`` are escaped so rich shows them instead of reading
them as markup.
"""

from __future__ import annotations

import inspect
from typing import Any

from rich.markup import escape
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


def reflow(command: Any) -> None:
    """Rewrite the help of a click ``command``, its parameters and its subcommands."""
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
