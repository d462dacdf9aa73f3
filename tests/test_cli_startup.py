"""The command line starts fast: its help imports no command, and each command's summary in
that help is the command's own."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest
import typer.main

import smetric.cli
from smetric.cli import app
from smetric.cli.app import COMMANDS, command
from smetric.cli.help import prose

# What takes the time: the data frames, the plots, the HTTP stack, the simulator and router.
HEAVY = (
    "aiohttp",
    "matplotlib",
    "numpy",
    "polars",
    "smetric.serve",
    "smetric.sim",
    "smetric.engine",
    "smetric.report.figures",
)


@pytest.mark.subprocess
def test_the_help_imports_no_command() -> None:
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "smetric", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    # -X importtime names every module imported on stderr, one per line: "... | name".
    imported = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if "|" in line}
    assert "smetric.cli.app" in imported
    assert not {m for m in imported if m.startswith(HEAVY)}
    assert not {m for m in imported if m.startswith("smetric.cli.") and m.split(".")[2] in COMMANDS}
    for name in COMMANDS:
        assert name in done.stdout


def test_every_command_is_listed_with_its_own_summary() -> None:
    for found in pkgutil.iter_modules(smetric.cli.__path__):
        __import__(f"smetric.cli.{found.name}")
    registered = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    assert set(registered) == set(COMMANDS)
    for name, (module, summary) in COMMANDS.items():
        loaded = command(name)
        assert loaded.callback is None or loaded.callback.__module__ == f"smetric.cli.{module}"
        assert (loaded.help or "").split("\n\n")[0] == prose(summary), name
