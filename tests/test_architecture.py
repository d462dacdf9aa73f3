"""The architecture page and the import contracts name every top-level package of
``smetric/``: a package added without its place in the layers fails here."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "smetric"


def top_level() -> dict[str, str]:
    """Each importable top-level package or module, by name, as the page writes it."""
    names = {p.name: f"`{p.name}/`" for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    for module in PACKAGE.glob("*.py"):
        if module.stem != "__init__":
            names[module.stem] = f"`{module.name}`"
    return names


def test_the_architecture_page_describes_every_top_level_package() -> None:
    page = (ROOT / "docs" / "concepts" / "architecture.md").read_text()
    names = top_level()
    assert {"core", "serve", "sim", "gateway", "demo"} <= set(names)
    missing = sorted(name for name, written in names.items() if f"| {written} |" not in page)
    assert not missing, f"docs/concepts/architecture.md has no row for {missing}"


def test_every_top_level_package_has_a_layer() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["type"] == "layers")["layers"]
    layered = {name.strip() for layer in layers for name in layer.split("|")}
    assert layered == {f"smetric.{name}" for name in top_level()}
