"""What ``smetric grid`` runs: a shipped preset (grid-quick, grid-16, robustness,
robustness-32) or a YAML file of their shape.

A grid preset is data: per trace a base simulation configuration (as ``smetric simulate
-c`` reads it) and, per global tier, the first load its knee searches probe, and per KV
room a factor on those loads (a GPU with more KV room and compute peaks at a higher load,
by how much depends on the trace); the fetch modes; the KV rooms (hardware and KV dtype);
seeds, the search's step and precision, and the looser SLO the same runs are scored again under.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from smetric.core.errors import ConfigError
from smetric.eval.preset import check_keys, flag, positive, read_preset
from smetric.metrics.slo import SLOConfig
from smetric.sim.config import (
    PERTURBATIONS,
    SimConfig,
    check_kv_load,
    from_dict,
    parse_global_capacity,
)

GRID_PRESETS = ("grid-quick", "grid-16", "robustness", "robustness-32")
KEYS = ("traces", "kv_loads", "hardware", "seeds", "grow", "precision", "loose_slo")
# ``worlds``: name -> perturbations of the simulated engines that the policies are not
# told about (``ClusterConfig``'s ``PERTURBATIONS``), every cell run in each; without it,
# the configured world alone.
# ``ceiling``: true adds a free-tier cell per group, the knee tables' ceiling.
# ``tier_ceilings``: true adds each bounded tier's free twin (its own capacity, transfers
# costing nothing), an estimate of the most any router could reach with that tier.
# ``title``: the heading of the results page ``--page`` writes.
OPTIONAL_KEYS = ("worlds", "ceiling", "tier_ceilings", "title")
CONFIGURED = "configured"


@dataclass(frozen=True)
class GridTrace:
    config: SimConfig
    # Global tier -> first load probed (sessions/s closed loop, speed-up open loop).
    tiers: dict[str, float]
    # KV room -> factor on those first loads (1 where not given).
    scale: dict[str, float]


@dataclass(frozen=True)
class KvRoom:
    hardware: str
    kv_dtype: str


@dataclass(frozen=True)
class GridPreset:
    name: str
    traces: dict[str, GridTrace]
    kv_loads: tuple[str, ...]
    hardware: dict[str, KvRoom]
    seeds: int
    # The search's first steps away from its start: near a knee, 2x overshoots into
    # overload, where runs are slow and say little.
    grow: float
    precision: float
    loose_slo: SLOConfig
    worlds: dict[str, dict[str, float]] = field(default_factory=lambda: {CONFIGURED: {}})
    ceiling: bool = False
    tier_ceilings: bool = False
    title: str | None = None

    @property
    def page_title(self) -> str:
        if self.title:
            return self.title
        if len(self.worlds) > 1:
            return "Robustness: the lead in worlds the policies are not told about"
        return "The policy grid"


def load_grid_preset(spec: str) -> GridPreset:
    """A shipped preset (``GRID_PRESETS``), or the path of a YAML file shaped like one."""
    raw, where, name = read_preset(spec, GRID_PRESETS)
    data = check_keys(raw, where, KEYS, OPTIONAL_KEYS)
    kv_loads = data["kv_loads"]
    if not isinstance(kv_loads, list) or not kv_loads:
        raise ConfigError(f"{where}: kv_loads must be a non-empty list of sync, async")
    loose = _mapping(data["loose_slo"], f"{where}: loose_slo")
    try:
        loose_slo = SLOConfig(
            **{k: positive(v, f"{where}: loose_slo.{k}") for k, v in loose.items()}
        )
    except TypeError as exc:
        raise ConfigError(f"{where}: loose_slo: {exc}") from exc
    hardware = {
        str(h): _room(v, f"{where}: hardware.{h}")
        for h, v in _mapping(data["hardware"], f"{where}: hardware").items()
    }
    return GridPreset(
        name=name,
        traces={
            str(t): _trace(v, f"{where}: traces.{t}", hardware)
            for t, v in _mapping(data["traces"], f"{where}: traces").items()
        },
        kv_loads=tuple(check_kv_load(str(m)) for m in kv_loads),
        hardware=hardware,
        seeds=int(positive(data["seeds"], f"{where}: seeds")),
        grow=positive(data["grow"], f"{where}: grow"),
        precision=positive(data["precision"], f"{where}: precision"),
        loose_slo=loose_slo,
        worlds=_worlds(data.get("worlds"), f"{where}: worlds"),
        ceiling=flag(data.get("ceiling", False), f"{where}: ceiling"),
        tier_ceilings=flag(data.get("tier_ceilings", False), f"{where}: tier_ceilings"),
        title=_title(data.get("title"), f"{where}: title"),
    )


def _title(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}: expected a non-empty heading")
    return value.strip()


def _worlds(value: Any, where: str) -> dict[str, dict[str, float]]:
    if value is None:
        return {CONFIGURED: {}}
    worlds = {}
    for name, factors in _mapping(value, where).items():
        factors = factors or {}
        if not isinstance(factors, dict):
            raise ConfigError(f"{where}.{name}: expected a mapping of perturbations")
        unknown = sorted(set(factors) - set(PERTURBATIONS))
        if unknown:
            raise ConfigError(
                f"{where}.{name}: unknown perturbations {unknown}; known: {list(PERTURBATIONS)}"
            )
        worlds[str(name)] = {k: positive(v, f"{where}.{name}.{k}") for k, v in factors.items()}
    return worlds


def _mapping(value: Any, where: str) -> dict:
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"{where}: expected a non-empty mapping")
    return value


def _trace(value: Any, where: str, hardware: dict[str, KvRoom]) -> GridTrace:
    data = _mapping(value, where)
    if not {"config", "tiers"} <= set(data) <= {"config", "tiers", "scale"}:
        raise ConfigError(f"{where}: expected the keys config, tiers and (optional) scale")
    tiers = _mapping(data["tiers"], f"{where}.tiers")
    for tier in tiers:
        parse_global_capacity(str(tier))
    scale = data.get("scale") or {}
    if not isinstance(scale, dict):
        raise ConfigError(f"{where}.scale: expected a mapping of hardware to factors")
    unknown = sorted(set(map(str, scale)) - set(hardware))
    if unknown:
        raise ConfigError(f"{where}.scale: {unknown} not among hardware {sorted(hardware)}")
    return GridTrace(
        config=from_dict(data["config"] or {}, f"{where}.config"),
        tiers={str(t): positive(v, f"{where}.tiers.{t}") for t, v in tiers.items()},
        scale={h: positive(scale.get(h, 1), f"{where}.scale.{h}") for h in hardware},
    )


def _room(value: Any, where: str) -> KvRoom:
    data = _mapping(value, where)
    if set(data) != {"hardware", "kv_dtype"}:
        raise ConfigError(f"{where}: expected the keys hardware and kv_dtype")
    return KvRoom(str(data["hardware"]), str(data["kv_dtype"]))
