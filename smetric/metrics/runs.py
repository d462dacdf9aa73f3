"""Result folders written by ``smetric simulate`` and ``smetric replay``, read back together.

Both write ``summary.json`` (its ``policies`` maps a run's name to the simulator's summary)
and one ``requests-NAME.parquet`` per run with the simulator's per-request columns, so a
simulated and a measured run can be compared figure for figure.
"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl

from smetric.core.errors import UserError


def safe_name(name: str, fallback: str) -> str:
    """``name`` made safe for a file or folder name."""
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name).strip("-") or fallback


def run_file_name(name: str) -> str:
    """The per-request table's file name for run ``name`` (a policy, or ``replay``)."""
    return f"requests-{safe_name(name, 'run')}.parquet"


def load_runs(folders: list[Path]) -> tuple[dict[str, dict], dict[str, pl.DataFrame]]:
    """Summaries and per-request tables of every run in ``folders``, in order.

    Runs are named by their policy alone when one folder is given, else ``FOLDER/policy``,
    so that two folders' ``smetric`` rows stay apart. Raises ``ValueError`` naming the
    folder when something is missing or not a result.
    """
    summaries: dict[str, dict] = {}
    tables: dict[str, pl.DataFrame] = {}
    for folder in folders:
        path = folder / "summary.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise UserError(
                f"{folder}: no summary.json (not a `smetric simulate` or `replay` result)"
            ) from exc
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UserError(f"{path}: cannot read: {exc}") from exc
        runs = data.get("policies") if isinstance(data, dict) else None
        if not isinstance(runs, dict) or not runs:
            raise UserError(f"{path}: no 'policies' with run summaries")
        for name, summary in runs.items():
            label = name if len(folders) == 1 else f"{folder.name}/{name}"
            if label in summaries:
                raise UserError(f"two runs are both named {label!r}; rename one folder")
            table_path = folder / run_file_name(name)
            try:
                tables[label] = pl.read_parquet(table_path)
            except (OSError, pl.exceptions.PolarsError) as exc:
                raise UserError(f"{table_path}: cannot read the run's requests: {exc}") from exc
            summaries[label] = summary
    return summaries, tables
