"""The errors a user can act on, by kind.

Anything raised as a ``SmetricError`` is a statement about the user's input (a flag, a
file, a setting, a trace, a request) that the message alone explains, so the command line
prints it as one line and exits with code 2. Every other exception is a bug, however
ordinary its type (a ``ValueError`` from numpy is not the user's fault): the command line
says so and keeps the traceback for ``--debug``. The classes also derive from
``ValueError``: they report bad values, and callers written against ``ValueError`` keep
catching them.
"""

from __future__ import annotations

from pathlib import Path


class SmetricError(Exception):
    """A failure the user can fix, told in a message that needs no traceback."""


class UserError(SmetricError, ValueError):
    """Bad input: a flag, a file, a folder or a request that cannot be used as given."""


class ConfigError(UserError):
    """A setting out of its bounds, an unknown key, or settings that contradict each other."""


class TraceError(UserError):
    """A trace that cannot be read, located: which file, which line, what is wrong."""

    def __init__(self, path: Path | str, message: str, line: int | None = None) -> None:
        self.path = str(path)
        self.line = line
        self.reason = message
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {message}")
