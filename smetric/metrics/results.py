"""What runs produce, typed: the one schema the simulator, ``replay`` and the evaluations
write and the reports read (docs/concepts/metrics.md). A run's summary first, then what
the experiments built on runs produce: knee searches, sweeps, plans, grids, ``reproduce``.

A run's summary is a tree of frozen records, each a section of ``summary.json``: fields
are named as the file's keys (``Reuse.global_`` is the file's ``"global"``), so a record
and its JSON convert both ways without a mapping table, and mypy checks every reader
against the fields the simulator writes. Counts are ``int`` in one run and may be
``float`` in a mean over seeds (``sim.seeds``), so they are typed ``int | float``.

Sections a run may lack are ``None`` and left out of the file (a replay measures no
global-tier bytes; a policy that learns nothing has no learned parameters), so files
stay the shape they always had. Files carry no version field: every file written so far
is ``SCHEMA_VERSION`` 1, and a file that does not match it fails with a message naming
the version this code reads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

from smetric.core.errors import UserError
from smetric.core.records import JsonRecord

SCHEMA_VERSION = JsonRecord.schema_version

Number = int | float


class Record(JsonRecord, frozen=True, omit_defaults=True):
    """A record of the results; sections a run lacks are left out of the file."""


Quantile = Literal["p50", "p90", "p99"]
QUANTILES: tuple[Quantile, ...] = ("p50", "p90", "p99")


class Percentiles(Record, frozen=True):
    """The 50th, 90th and 99th percentiles of a latency; None each over no requests."""

    p50: float | None
    p90: float | None
    p99: float | None

    def of(self, q: Quantile) -> float | None:
        return {"p50": self.p50, "p90": self.p90, "p99": self.p99}[q]


class RequestCounts(Record, frozen=True):
    """What happened to the run's requests (the completed ones after the warm-up)."""

    issued: Number
    completed: Number
    met_slo: Number
    rejected: Number
    unfinished: Number
    preemptions: Number


class Reuse(Record, frozen=True):
    """Shares of the admitted requests' prompt tokens: hit in the instance's own cache,
    fetched from the global tier, or computed."""

    prompt_tokens: Number
    local: float
    global_: float = msgspec.field(name="global")
    miss: float


class Imbalance(Record, frozen=True):
    """Max over mean load per window, over the busy windows after the warm-up; NaN each
    when no window had load."""

    mean: float
    p50: float
    p90: float
    max: float
    series: list[float]


Way = Literal["session", "agent", "turn"]
WAYS: tuple[Way, ...] = ("session", "agent", "turn")


class Stickiness(Record, frozen=True):
    """Share of follow-ups served where a reference request was (``metrics.summary``'s
    ``stickiness`` says which); None where there were none or they were not recorded."""

    session: float | None
    agent: float | None
    turn: float | None

    def of(self, way: Way) -> float | None:
        return {"session": self.session, "agent": self.agent, "turn": self.turn}[way]


class LinkUse(Record, frozen=True):
    """Mean and busiest share of a set of links' capacity used over the run."""

    mean: float | None
    max: float | None


class NicUse(Record, frozen=True):
    prefill: LinkUse
    decode: LinkUse


class PDSummary(Record, frozen=True):
    """PD disaggregation's figures: the prefill stage scored on its own, and the KV
    transfers. The fields from ``decode_instances`` on are the simulator's alone (a
    replay does not see the links)."""

    mode: Literal["full", "prefill-only"]
    prefill_instances: Number
    prefill_tps_within_slo: float
    prefill_ttft_s: Percentiles
    end_to_end_tps_within_slo: float | None
    transfer_tokens: Number
    transfers: Number
    requests_per_decoder: list[Number]
    decode_instances: Number | None = None
    # None where the run only prefills; unset (left out) where nobody decides it.
    decode_policy: str | msgspec.UnsetType | None = msgspec.UNSET
    transfer_bytes: Number | None = None
    nic_utilisation: NicUse | None = None


class RunSummary(Record, frozen=True):
    """One run's results: the paper's metrics over its horizon (``metrics.summary``),
    PD's where the cluster is disaggregated, and what only the simulator sees."""

    horizon_s: float
    warmup_s: float
    window_s: float
    requests: RequestCounts
    tps_within_slo: float
    tps: float
    slo_attainment: float
    ttft_s: Percentiles
    tpot_s: Percentiles
    reuse: Reuse
    imbalance: Imbalance
    # Mean in-flight load per instance (rows) and window (columns).
    load_heatmap: list[list[float]]
    stickiness: Stickiness
    # Admitted requests per routing branch the policy took.
    branches: dict[str, int | float]
    pd: PDSummary | None = None
    global_tier_bytes: Number | None = None
    # Per instance, the share of the horizon it was busy.
    busy_fraction: list[float] | None = None
    learned_params: dict[str, float] | None = None
    learned_from: Number | None = None


class SweepRun(Record, frozen=True):
    """One cell of a rate sweep: its summary (the mean over seeds, with several), and the
    seeds' TPS within SLO and its spread."""

    rate: float
    global_: str = msgspec.field(name="global")
    policy: str
    summary: RunSummary
    seeds_tps: list[float] | None = None
    stdev: float | None = None


class BestRate(Record, frozen=True):
    """A policy's best TPS within SLO over a sweep's rates, and the rate it was at."""

    tps: float
    rate: float
    stdev: float | None = None


class SweepResult(Record, frozen=True):
    """``smetric sweep``'s result (``sweep.json``): rates x global tiers x policies."""

    rates: list[float]
    provisionings: list[str]
    policies: list[str]
    runs: list[SweepRun]
    # Per global tier and policy.
    max_tps: dict[str, dict[str, BestRate]]
    # With several seeds, how many.
    seeds: int | None = None


class PlanPoint(Record, frozen=True):
    """One instance count's figures for one policy and global tier: at the trace's own
    load (means over seeds), and at the count's knee."""

    instances: int
    tps_within_slo: float
    slo_attainment: float
    knee_load: float
    knee_tps_within_slo: float
    serves: bool


class Plan(Record, frozen=True):
    """A policy's plan: the fewest instances (and the global tier) that serve the trace."""

    instances: int
    gpus: int
    global_: str = msgspec.field(name="global")
    # None: an unbounded tier, which never evicts.
    global_bytes: int | None
    tps_within_slo: float
    slo_attainment: float
    knee_load: float
    # None without a price per GPU-hour.
    cost_per_million_tokens: float | None


class PlanResult(Record, frozen=True):
    """``smetric plan``'s result (``plan.json``)."""

    trace_load: float
    load_unit: str
    attainment: float
    seeds: list[int]
    # The least and most instances searched.
    instances_searched: list[int]
    price_per_gpu_hour: float | None
    policies: list[str]
    globals: list[str]
    # None for a policy that no count searched serves.
    plans: dict[str, Plan | None]
    # The policy needing the fewest instances, if any serves.
    choice: str | None
    # Per policy and global tier, every instance count probed.
    curves: dict[str, dict[str, list[PlanPoint]]]
    runs_simulated: int | None = None


# A grid cell's knees under the default SLO, or the same runs scored under the looser one.
Which = Literal["knees", "loose"]


class GridCell(Record, frozen=True):
    """One cell of ``smetric grid``: every policy's knee under the default SLO and under
    the looser one (the same runs scored again)."""

    trace: str
    tier: str
    kv_load: str
    hardware: str
    world: str
    knees: dict[str, Knee]
    loose: dict[str, Knee]

    def of(self, which: Which) -> dict[str, Knee]:
        return self.knees if which == "knees" else self.loose


class GridResult(Record, frozen=True):
    """``smetric grid``'s result (``grid.json``)."""

    preset: str
    policies: list[str]
    # Name -> the perturbations of the simulated engines the policies are not told of.
    worlds: dict[str, dict[str, float]]
    seeds: int
    precision: float
    # The default and the looser SLO, as ``SLOConfig``'s fields.
    slo: dict[str, float]
    loose_slo: dict[str, float]
    cells: list[GridCell]


def write_summaries(path: Path, meta: Mapping[str, Any], runs: Mapping[str, RunSummary]) -> None:
    """``summary.json``: ``meta`` (what produced the runs) with each run's summary under
    ``policies``, placed where ``meta`` has a ``policies`` key, else last."""
    data = dict(meta) | {"policies": {name: run.to_builtins() for name, run in runs.items()}}
    path.write_text(json.dumps(data, indent=1))


def read_summaries(path: Path) -> dict[str, RunSummary]:
    """Each run's summary in a ``summary.json``; ``UserError`` naming the file when it is
    missing, unreadable or not results of this schema version."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise UserError(
            f"{path.parent}: no summary.json (not a `smetric simulate` or `replay` result)"
        ) from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: cannot read: {exc}") from exc
    runs = data.get("policies") if isinstance(data, dict) else None
    if not isinstance(runs, dict) or not runs:
        raise UserError(f"{path}: no 'policies' with run summaries")
    try:
        return {name: RunSummary.from_builtins(run) for name, run in runs.items()}
    except ValueError as exc:
        raise UserError(f"{path}: {exc}") from exc


class Knee(Record, frozen=True):
    """A policy's knee: the offered load at which its TPS within SLO peaked, the mean
    and spread over seeds there, each seed's value, and every probed load's mean."""

    load: float
    mean: float
    stdev: float
    seeds: tuple[float, ...]
    probes: dict[float, float]


class KneeCell(Record, frozen=True):
    """One cell of a knee search (a global tier and a KV load): every policy's knee and
    the best baseline at its best setting."""

    global_: str = msgspec.field(name="global")
    kv_load: str
    knees: dict[str, Knee]
    best_baseline: str | None


class KneeSummary(Record, frozen=True):
    """``smetric knee``'s result (``knee.json``), also the shape of ``reproduce``'s knees."""

    policies: list[str]
    cells: list[KneeCell]
    # The seeds each probe ran over and the search's settings, where a search wrote them.
    seeds: int | None = None
    settings: dict[str, float] | None = None


class HitSplit(Record, frozen=True):
    """Shares of prompt tokens by where their KV came from, a mean over seeds."""

    local: float
    global_: float = msgspec.field(name="global")
    miss: float


class MeanPoint(Record, frozen=True):
    """One configuration's TPS within SLO over seeds (mean and spread) and hit split."""

    tps_within_slo: float
    stdev: float
    reuse: HitSplit


class Point(MeanPoint, frozen=True):
    """A configuration's runs as the figures and the paper's table read them: means over
    seeds (latencies and stickiness over the seeds that measured them)."""

    slo_attainment: float
    ttft_s: Percentiles
    tpot_s: Percentiles
    # Mean max / mean in-flight load per window after the warm-up.
    imbalance: float | None
    stickiness: Stickiness


class KneePoint(Point, frozen=True):
    """A policy at its knee on one global tier: the knee and its runs' point."""

    knee: Knee


class Tier(Record, frozen=True):
    best_baseline: str | None
    policies: dict[str, KneePoint]


class Ceiling(Record, frozen=True):
    """Every policy's knee with a free global tier, and the best of them."""

    best: str
    knees: dict[str, Knee]


class LoadUnit(Record, frozen=True):
    """The rate that 1.0x load means: the best baseline's full-tier knee is ``paper_load``."""

    rate: float
    reference_policy: str
    reference_knee: float
    paper_load: float


class RateSweep(Record, frozen=True):
    multiples: list[float]
    rates: list[float]
    # Per policy, one point per rate.
    policies: dict[str, list[MeanPoint]]


class AtLoad(Record, frozen=True):
    rate: float
    policies: dict[str, Point]


class Guard(Record, frozen=True):
    """Per-window imbalance of one policy: over time (first seed) and pooled over seeds."""

    window_s: float
    warmup_s: float
    # None where the cluster was idle.
    over_time: list[float | None]
    windows: list[float]
    # p50, p75, p90 and p99 over the pooled windows.
    percentiles: dict[str, float | None]
    mean: float | None
    tps_within_slo: float


class SensitivityPoint(MeanPoint, frozen=True):
    # None for infinity (JSON has none); ``label`` is the value as written ("inf").
    value: float | None
    label: str
    policy: str


class ReproduceResult(Record, frozen=True):
    """``smetric reproduce``'s result (``reproduce.json``): every figure's data."""

    preset: str
    setup: str
    trace: str
    # The base configuration, as ``SimConfig.to_dict`` writes it.
    config: dict[str, Any]
    seeds: int
    policies: list[str]
    tiers: dict[str, Tier]
    ceiling: Ceiling | None
    load_unit: LoadUnit
    rate_sweep: RateSweep
    at_paper_load: AtLoad
    # By policy spec: ``smetric`` and the same without its overload guard.
    guard: dict[str, Guard]
    # By parameter (``overload``, ``hit_ratio``), one point per value.
    sensitivity: dict[str, list[SensitivityPoint]]
