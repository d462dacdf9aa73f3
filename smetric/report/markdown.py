"""Markdown tables, for results pages and ``validation.md``."""

from __future__ import annotations

from collections.abc import Sequence


def markdown_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured table; ``|`` inside a cell is escaped so it cannot split it."""

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(head), "|---" * len(head) + "|", *map(line, rows)]) + "\n"
