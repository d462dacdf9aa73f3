"""What ``smetric reproduce`` runs: a named preset (``quick``, ``full``) or a YAML file.

A preset is data: the base simulation configuration (as ``smetric simulate -c`` reads it)
and the sizes of the evaluation: global tiers with the first load their knee searches
probe, seeds, the search's precision, the offered loads of the rate sweep and the values
of the sensitivity sweeps. A YAML file of the same shape shrinks or grows any of it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from smetric.core.errors import ConfigError
from smetric.sim.config import SimConfig, from_dict, parse_global_capacity

PRESETS = ("quick", "full", "large")
# The tier every load is measured against (Figs. 14, 15, 17 and 25 use the full tier).
REFERENCE_TIER = "full"
KEYS = ("config", "tiers", "seeds", "precision", "load_multiples", "overloads", "hit_ratios")
# ``ceiling: true`` searches every policy's knee once more with a free global tier: the
# knee table's ceiling.
OPTIONAL_KEYS = ("ceiling",)


@dataclass(frozen=True)
class Preset:
    name: str
    config: SimConfig
    # Global tier -> first load probed by its knee searches (sessions/s).
    tiers: dict[str, float]
    seeds: int
    precision: float
    # The rate sweep's offered loads, as multiples of the load unit (``reproduce``).
    load_multiples: tuple[float, ...]
    overloads: tuple[float, ...]
    hit_ratios: tuple[float, ...]
    ceiling: bool = False

    def describe(self) -> str:
        c, w = self.config.cluster, self.config.workload
        return (
            f"{c.instances} x {c.hardware} · {c.model} · closed-loop runs of "
            f"{w.duration_s / 60:g} min ({self.config.warmup_s / 60:g} min warm-up) · "
            f"{self.seeds} seed{'s' if self.seeds > 1 else ''} · knee precision "
            f"{self.precision:g}x · {self.config.window_s:g} s load windows"
        )


def load_preset(spec: str) -> Preset:
    """``quick``, ``full``, or the path of a YAML file shaped like them."""
    data, where, name = read_preset(spec, PRESETS)
    return _parse(data, where, name)


def read_preset(spec: str, names: Sequence[str]) -> tuple[Any, str, str]:
    """A preset's YAML data, where it came from (for error messages) and its name: one of
    the packaged ``names``, or the path of a YAML file. A file whose top level has
    ``extends: BASE`` (a packaged name, or a path relative to the file) is that base with
    the file's values laid over it, so a variant states only what it changes."""
    return _read(spec, names, ())


def _read(spec: str, names: Sequence[str], seen: tuple[str, ...]) -> tuple[Any, str, str]:
    if spec in names:
        text = resources.files("smetric.eval").joinpath(f"presets/{spec}.yaml").read_text()
        where = f"preset {spec}"
    else:
        path = Path(spec)
        if not path.is_file():
            raise ConfigError(f"--preset {spec!r}: use {' or '.join(names)}, or a YAML file")
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read: {exc}") from exc
        where = str(path)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not YAML: {exc}") from exc
    name = Path(spec).stem
    if not isinstance(data, dict) or "extends" not in data:
        return data, where, name
    base_spec = data.pop("extends")
    if not isinstance(base_spec, str) or not base_spec:
        raise ConfigError(f"{where}: extends must name a preset ({', '.join(names)}) or a file")
    if base_spec not in names:
        if spec in names:
            # A packaged preset has no folder of its own to resolve a path against.
            raise ConfigError(f"{where}: extends {base_spec}: not a preset ({', '.join(names)})")
        base_spec = str(Path(spec).parent / base_spec)
    if base_spec not in names and not Path(base_spec).is_file():
        raise ConfigError(
            f"{where}: extends {base_spec}: no such preset ({', '.join(names)}) or file"
        )
    chain = (*seen, _identity(spec, names))
    if _identity(base_spec, names) in chain:
        raise ConfigError(f"{where}: extends loops back to {base_spec}")
    base, base_where, _ = _read(base_spec, names, chain)
    if not isinstance(base, dict):
        raise ConfigError(f"{where}: extends {base_where}, whose top level is not a mapping")
    return _overlay(base, data), where, name


def _identity(spec: str, names: Sequence[str]) -> str:
    return spec if spec in names else str(Path(spec).resolve())


def _overlay(base: dict, override: dict) -> dict:
    """``base`` with ``override`` laid over it: mappings merge key by key, any other value
    replaces the base's, and a null removes the key (a trace or tier the variant drops)."""
    merged = dict(base)
    for key, value in override.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _overlay(merged[key], value)
        else:
            merged[key] = value
    return merged


def check_keys(data: Any, where: str, keys: Sequence[str], optional: Sequence[str] = ()) -> dict:
    """``data`` as a mapping with exactly ``keys``, and maybe some of ``optional``: a
    preset file is checked whole before any of it is read, so a misspelt key is named
    rather than silently defaulted."""
    known = [*keys, *optional]
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the top level must map keys to values ({', '.join(known)})")
    for key in data:
        if key not in known:
            takes = ", ".join(known)
            raise ConfigError(f"{where}: unknown key {key!r}; the top level takes {takes}")
    for key in keys:
        if key not in data:
            raise ConfigError(f"{where}: {key} is required")
    return data


def _parse(data: Any, where: str, name: str) -> Preset:
    data = check_keys(data, where, KEYS, OPTIONAL_KEYS)
    tiers = data["tiers"]
    if not isinstance(tiers, dict) or REFERENCE_TIER not in tiers:
        raise ConfigError(f"{where}: tiers must map global tiers to loads and include 'full'")
    for tier in tiers:
        parse_global_capacity(str(tier))
    return Preset(
        name=name,
        config=from_dict(data["config"] or {}, f"{where}: config"),
        tiers={str(t): positive(v, f"{where}: tiers.{t}") for t, v in tiers.items()},
        seeds=int(positive(data["seeds"], f"{where}: seeds")),
        precision=positive(data["precision"], f"{where}: precision"),
        load_multiples=_values(data["load_multiples"], f"{where}: load_multiples"),
        overloads=_values(data["overloads"], f"{where}: overloads"),
        hit_ratios=_values(data["hit_ratios"], f"{where}: hit_ratios", zero=True),
        ceiling=flag(data.get("ceiling", False), f"{where}: ceiling"),
    )


def flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    return value


def positive(value: Any, where: str, zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if value < 0 or (value == 0 and not zero):
        raise ConfigError(f"{where}: expected a {'non-negative' if zero else 'positive'} number")
    return float(value)


def _values(values: Any, where: str, zero: bool = False) -> tuple[float, ...]:
    if not isinstance(values, list) or not values:
        raise ConfigError(f"{where}: expected a non-empty list of numbers")
    return tuple(positive(v, where, zero) for v in values)
