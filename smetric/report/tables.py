"""Tables that never cut a number: one model, printed for people or for scripts.

A command builds its tables once, as formatted cells for people and raw values for
scripts, and ``emit`` prints them in the format asked for:

- ``table``: rich tables at the console's width (80 columns when piped). A table too wide
  for it is folded: its columns are split into groups that fit, each printed with the
  row labels again; where even one column does not fit beside the labels, each row is
  printed as a block of ``header: value`` lines. Cells are never truncated or wrapped.
- ``markdown``: GitHub-flavoured tables, every column.
- ``csv``: the first (main) table, raw values, one header row of keys.
- ``json``: every table as a list of rows of raw values, keyed by table name.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table as RichTable
from rich.text import Text

from smetric.core.errors import UserError
from smetric.report.markdown import markdown_table

FORMATS = ("table", "json", "csv", "markdown")
HIGHLIGHT = "bold green"


@dataclass(frozen=True)
class Column:
    """``header`` may hold a line break: two header lines in a rich table, one elsewhere.
    A ``wrap`` column holds prose, which may wrap between words; numbers never do."""

    header: str
    align: Literal["left", "right"] = "right"
    wrap: bool = False

    @property
    def flat(self) -> str:
        """The header on one line (a word broken with a hyphen joined again)."""
        return " ".join(self.header.split()).replace("- ", "")


@dataclass(frozen=True)
class Table:
    """``rows`` of formatted cells (the first column labels the row), ``values`` one
    mapping of raw values per row, ``bold`` the (row, column) cells to highlight."""

    name: str
    title: str
    columns: tuple[Column, ...]
    rows: tuple[tuple[str, ...], ...]
    values: tuple[Mapping[str, Any], ...]
    bold: frozenset[tuple[int, int]] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        assert all(len(r) == len(self.columns) for r in self.rows), self.name
        assert len(self.rows) == len(self.values), self.name


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
    return fmt


def emit(tables: Sequence[Table], fmt: str, console: Console) -> None:
    """Print ``tables`` on ``console`` as ``fmt`` (one of ``FORMATS``)."""
    check_format(fmt)
    tables = [t for t in tables if t.rows]
    if fmt == "json":
        document = {t.name: [dict(v) for v in t.values] for t in tables}
        console.out(json.dumps(document, indent=1, default=str), highlight=False)
    elif fmt == "csv":
        console.out(to_csv(tables[0]) if tables else "", end="", highlight=False)
    elif fmt == "markdown":
        console.out("\n".join(to_markdown(t) for t in tables), end="", highlight=False)
    else:
        for t in tables:
            print_table(t, console)


def to_csv(table: Table) -> str:
    out = io.StringIO()
    keys = list(dict.fromkeys(k for v in table.values for k in v))
    writer = csv.DictWriter(out, keys, lineterminator="\n")
    writer.writeheader()
    for value in table.values:
        writer.writerow({k: "" if value.get(k) is None else value.get(k) for k in keys})
    return out.getvalue()


def to_markdown(table: Table) -> str:
    rows = [
        [f"**{cell}**" if (i, j) in table.bold else cell for j, cell in enumerate(row)]
        for i, row in enumerate(table.rows)
    ]
    return f"### {table.title}\n\n" + markdown_table([c.flat for c in table.columns], rows) + "\n"


def print_table(table: Table, console: Console) -> None:
    """The table at the console's width: whole, folded into column groups, or as blocks."""
    width = console.width
    groups = column_groups(table, console, width)
    if groups is None:
        _print_blocks(table, console)
        return
    if table.title:
        console.print(Text(table.title, style="bold"))
    for group in groups:
        console.print(_rich(table, group))


def column_groups(table: Table, console: Console, width: int) -> list[list[int]] | None:
    """The data columns in groups that each fit ``width`` beside the label column, in
    order; None when some column does not fit even alone."""
    groups: list[list[int]] = []
    current: list[int] = []
    for j in range(1, len(table.columns)):
        if _fits(table, [*current, j], console, width):
            current.append(j)
        elif current and _fits(table, [j], console, width):
            groups.append(current)
            current = [j]
        else:
            return None
    return [*groups, current] if current or not groups else groups


def _fits(table: Table, group: list[int], console: Console, width: int) -> bool:
    """Whether the label column and ``group`` fit ``width`` with every unwrapped cell
    whole and every wrapped one at least its longest word wide (measured by rich with
    those column widths fixed, and without a width limit, which would clamp it)."""
    unbounded = console.options.update_width(1 << 20)
    fixed = {j: _needed(table, j) for j in [0, *group]}
    return Measurement.get(console, unbounded, _rich(table, group, fixed)).maximum <= width


def _needed(table: Table, j: int) -> int:
    column = table.columns[j]
    texts = [row[j] for row in table.rows]
    if column.wrap:
        texts = [word for text in texts for word in text.split()]
    return max(cell_len(t) for t in [*texts, *column.header.splitlines()])


def _rich(table: Table, group: list[int], widths: dict[int, int] | None = None) -> RichTable:
    out = RichTable(
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        pad_edge=False,
    )
    shown = [0, *group]
    for j in shown:
        column = table.columns[j]
        out.add_column(
            column.header,
            justify=column.align,
            no_wrap=not column.wrap,
            overflow="fold",
            min_width=(widths or {}).get(j),
            max_width=(widths or {}).get(j),
        )
    for i, row in enumerate(table.rows):
        out.add_row(*(Text(row[j], style=HIGHLIGHT if (i, j) in table.bold else "") for j in shown))
    return out


def _print_blocks(table: Table, console: Console) -> None:
    """One block per row: its label, then a ``header: value`` line per column."""
    if table.title:
        console.print(Text(table.title, style="bold"))
    headers = [c.flat for c in table.columns]
    pad = max(len(h) for h in headers[1:]) if len(headers) > 1 else 0
    for i, row in enumerate(table.rows):
        console.print(Text(row[0], style="bold"))
        for j in range(1, len(row)):
            line = Text(f"  {headers[j]:<{pad}}  ")
            line.append(row[j], style=HIGHLIGHT if (i, j) in table.bold else "")
            console.print(line)
    console.print()
