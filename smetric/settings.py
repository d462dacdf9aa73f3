"""The configuration reference, generated from the settings' one declaration.

Every simulation setting is a dataclass field declared with ``core.settings.setting``:
its default, help and bounds. ``reference_markdown`` renders those declarations, so the
reference cannot drift from what a YAML file or a flag is checked against.
"""

from __future__ import annotations

from typing import Any

from smetric.core.settings import settings_of
from smetric.metrics.slo import SLOConfig
from smetric.sim.config import ClusterConfig, SimConfig, WorkloadConfig


def _cell(value: Any) -> str:
    return "none" if value is None else f"`{value}`"


def _rows(cls: type) -> list[str]:
    rows = ["| key | default | range | meaning |", "|---|---|---|---|"]
    for f, meta in settings_of(cls):
        bounds = meta.range() if meta.bounded else ""
        if meta.choices:
            bounds = ", ".join(f"`{c}`" for c in meta.choices)
        rows.append(f"| `{f.name}` | {_cell(f.default)} | {bounds} | {meta.help} |")
    return rows


def reference_markdown() -> str:
    """The keys of a simulation YAML file (``smetric simulate --config``), section by
    section, with each key's default, range and meaning."""
    out = ["## Simulation settings", "", "### Top level", "", *_rows(SimConfig)]
    for section, cls in (("cluster", ClusterConfig), ("workload", WorkloadConfig)):
        out += ["", f"### `{section}:`", "", *_rows(cls)]
    out += ["", "### `slo:`", "", *_rows(SLOConfig)]
    return "\n".join(out) + "\n"
