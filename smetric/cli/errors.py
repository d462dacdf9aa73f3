"""How a command ends when something goes wrong: the user's mistake, or a bug.

A ``SmetricError`` says what the user gave that cannot be used, so it is one line and exit
code 2. Anything else is a bug, whatever its type: a ``ValueError`` from numpy deep in a
run is not bad input. It is named as a bug in two lines with exit code 1, and ``--debug``
(or ``SMETRIC_DEBUG=1``) lets the traceback through instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.console import Console
from rich.markup import escape
from typer.exceptions import TyperException

from smetric.core.errors import SmetricError

err_console = Console(stderr=True)

# The command line's own ways out (usage errors, exit codes) pass through untouched.
_CLI_EXITS = (typer.Exit, typer.Abort, TyperException)


class Debug:
    """Whether the running command was given ``--debug``; set by the app's callback."""

    on = False


@contextmanager
def user_errors() -> Iterator[None]:
    """Bad input ends with one located line and exit code 2; a bug says it is one."""
    try:
        yield
    except _CLI_EXITS:
        raise
    except SmetricError as exc:
        raise _bad_input(exc) from exc
    except Exception as exc:
        if Debug.on:
            raise
        err_console.print(
            f"[bold red]internal error:[/] {escape(type(exc).__name__)}: {escape(str(exc))}",
            soft_wrap=True,
        )
        err_console.print("this is a bug in SMetric; rerun with --debug for the traceback")
        raise typer.Exit(1) from exc


def _bad_input(exc: Exception) -> typer.Exit:
    # Escaped: a message that names a TOML table or a list ("[hardware]", "['x']") would
    # otherwise be read as markup and lose it.
    # One line however long, so that a script can read it.
    err_console.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
    return typer.Exit(2)
