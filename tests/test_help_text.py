"""``--help`` reads as prose: paragraphs wrap at the terminal's width, not the source's."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import typer
from typer.testing import CliRunner

from smetric.cli import app
from smetric.cli.help import prose

runner = CliRunner()


def test_prose_joins_paragraph_lines_keeps_bullets_and_escapes_markup() -> None:
    text = """First line
    goes on.

    Second paragraph, wrapped
    at the source's width [default: 3].

    - one item
      continued
    - another
    """
    assert prose(text) == (
        "First line goes on.\n\n"
        "Second paragraph, wrapped at the source's width \\[default: 3].\n\n"
        "- one item continued\n- another"
    )


def help_at(width: int, *command: str) -> list[str]:
    result = runner.invoke(app, [*command, "--help"], env={**os.environ, "COLUMNS": str(width)})
    assert result.exit_code == 0, result.output
    return result.output.splitlines()


def test_sweep_help_wraps_its_paragraphs_at_80_columns_without_ragged_breaks() -> None:
    lines = help_at(80, "sweep")
    text = "\n".join(lines)
    # A docstring line break used to survive as "...in parallel processes or" / "on Ray".
    assert "processes or on Ray" in " ".join(line.strip() for line in lines)
    # Text in brackets is shown, not swallowed as rich markup.
    assert "[default:" in text
    description = lines[3 : lines.index(next(x for x in lines if x.startswith("╭")))]
    body = [line.rstrip() for line in description if line.strip()]
    # Wrapped by the terminal: every line but a paragraph's last fills most of the width.
    short = [line for line in body[:-1] if len(line) < 60]
    assert len(short) <= 2, body


def _commands(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every command's path under the ``smetric`` group, groups included."""
    yield path
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def _names(command: Any, path: tuple[str, ...]) -> list[str]:
    for name in path:
        command = command.commands[name]
    return [n for p in command.params for n in (*p.opts, *p.secondary_opts) if n.startswith("-")]


def test_every_option_name_is_whole_in_every_command_s_help_at_80_columns() -> None:
    root = typer.main.get_command(app)
    for path in _commands(root):
        text = "\n".join(help_at(80, *path))
        assert not re.search(r"-[\w-]*…", text), (path, text)
        for name in _names(root, path):
            assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), (path, name, text)
