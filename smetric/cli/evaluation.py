"""What the preset-driven evaluations (``smetric reproduce``, ``smetric grid``) share: an
open list of policies in, checked before any run, and the command line their reports
name as their source."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer

from smetric.core.errors import UserError
from smetric.core.policies import make_policy, split_policies

PolicyListOpt = Annotated[
    str,
    typer.Option(
        "--policies",
        "-p",
        help="Comma-separated policies; each of the SMetric family (smetric, smetric_*) is "
        "compared with the best of the rest.",
    ),
]


def preset_option(names: Sequence[str], note: str = "") -> Any:
    """``--preset``: one of the packaged ``names``, or a YAML file shaped like the first."""
    return typer.Option(
        "--preset",
        help=f"{', '.join(names)}{note}, or a YAML file of the same shape "
        f"(smetric/eval/presets/{names[0]}.yaml) to shrink or grow it; a file that starts "
        "with 'extends: NAME' gives only what it changes.",
    )


def page_option(report: str) -> Any:
    """``--page``: where to write the result as a stamped docs page as well."""
    return typer.Option(
        "--page",
        help=f"Also write {report} as a results page at this path (docs/results/*.md), "
        "stamped with the commit, date, machine and command that produced it.",
    )


def check_page(page: Path | None) -> None:
    """A results page's folder must exist: checked before a long run, not after."""
    if page is not None and not page.parent.is_dir():
        raise UserError(f"--page {page}: folder {page.parent} does not exist")


def checked_policies(text: str) -> tuple[str, ...]:
    """The policy specs in ``text``; a typo fails here, with the valid names, rather than
    minutes into the runs."""
    specs = split_policies(text)
    if not specs:
        raise UserError("--policies: name at least one policy")
    for spec in specs:
        make_policy(spec)
    return specs


def report_command(command: str, words: Sequence[str], policies: str, default: str) -> str:
    """The command line that regenerates a report: its words, and the policies only where
    they are not the command's default, so the default run's report names the short form."""
    extra = ["-p", policies] if policies != default else []
    return shlex.join(["smetric", command, *words, *extra])
