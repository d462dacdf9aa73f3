"""What a simulation run is: cluster, workload, SLOs and policies, as data.

The flags of ``smetric simulate`` and a YAML file map onto the same dataclasses, and a run
writes its resolved configuration next to its results, so any number can be reproduced
with ``smetric simulate --config RESULT/config.yaml``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from smetric.core.errors import ConfigError
from smetric.core.policies import POLICY_NAMES, make_policy
from smetric.core.policies.decode import DECODE_POLICY_NAMES
from smetric.core.settings import check_settings, setting
from smetric.core.settings_load import load, read_yaml
from smetric.metrics.slo import SLOConfig
from smetric.metrics.summary import WINDOW_S
from smetric.model.perf import HARDWARE_NAMES, MEDIUM_NAMES, MODEL_NAMES, load_medium

KV_LOAD_MODES = ("sync", "async")


@dataclass(frozen=True)
class ClusterConfig:
    instances: int = setting(32, "Instances in the cluster.", ge=1)
    model: str = setting("Qwen3-Coder-30B-A3B", f"Model preset: {', '.join(MODEL_NAMES)}.")
    hardware: str = setting("H20", f"GPU preset: {', '.join(HARDWARE_NAMES)}.")
    gpus_per_instance: int = setting(1, "GPUs per instance (tensor parallel).", ge=1)
    # None: the model preset's own (fp8 for Qwen3-235B-A22B-FP8, else bf16).
    weight_dtype: str | None = setting(
        None, "Weight dtype (bf16, fp8, fp32); none: the model preset's own."
    )
    kv_dtype: str = setting("bf16", "KV-cache dtype (bf16, fp8, fp32).")
    gpu_memory_utilization: float = setting(
        0.9, "Share of GPU memory the engine may use.", gt=0, le=1.0
    )
    # None: GPU memory x utilisation - weights - activations, over KV bytes per token.
    kv_capacity_tokens: int | None = setting(
        None, "KV room per instance in tokens; none: from GPU memory.", ge=1
    )
    # None: the model's context, capped at what one instance's KV pool can hold.
    max_model_len: int | None = setting(
        None, "Maximum context; none: the model's, capped by one KV pool.", ge=1
    )
    max_num_seqs: int = setting(256, "Running sequences cap per instance.", ge=1)
    max_num_batched_tokens: int = setting(
        8192, "Token budget per engine step (chunked prefill).", ge=1
    )
    # "none", "full" (never evicts) or a multiple of the cluster's total local capacity.
    global_capacity: str = setting(
        "full", "Global KV tier: none, full, or a multiple of local capacity (1.6x)."
    )
    # Links to the global tier (kv.Route). The paper's testbed: servers of 8 H20 GPUs with
    # 200 Gbps RDMA NICs (about 21.7 GB/s effective each, as measured for such NICs); the
    # paper does not say how many NICs a server has, so the default is Mooncake's reference
    # setup of four (87 GB/s per server, Mooncake README). The GPUs of a server share its NICs;
    # each GPU also has its own PCIe Gen5 x16 lane to host memory (~50 GB/s measured).
    gpus_per_server: int = setting(8, "GPUs per server, sharing its NICs.", ge=1)
    nics_per_server: int = setting(
        4, "RDMA NICs per server, shared by its GPUs' global-tier traffic.", ge=1
    )
    nic_gb_s: float = setting(
        21.7, "Effective bandwidth of one RDMA NIC, GB/s (21.7: one 200 Gbps NIC).", gt=0
    )
    pcie_gb_s: float = setting(50.0, "Bandwidth of a GPU's PCIe lane to host memory, GB/s.", gt=0)
    # What the connector reaches end to end on top of those links (presets/tiers.toml):
    # "line-rate" (the paper's testbed), "lmcache-cpu", "mooncake-rdma", "mooncake-tcp".
    global_medium: str = setting(
        "line-rate",
        f"How the global tier moves KV end to end: {', '.join(MEDIUM_NAMES)} (line-rate: "
        "the paper's testbed; presets/tiers.toml); `smetric model` shows each one's cost.",
    )
    # How an admitted request reads the global tier: "sync" loads before the forward pass
    # and stretches that step (LMCache's default), "async" holds the request, not the batch.
    kv_load: str = setting(
        "sync",
        "Global-tier loads: sync (before the forward pass, stretching the step) or async "
        "(the request waits, the batch runs on).",
        choices=KV_LOAD_MODES,
    )
    # PD disaggregation (the paper's Figure 4c, sim/pd.py): prefill_instances > 0 replaces
    # ``instances`` by that many prefill-only instances (they alone read the global tier)
    # and decode_instances that decode with the KV pulled from them over the links. No
    # decode instances is the paper's prefill-only evaluation: decode is not modelled and a
    # session's next turn comes assumed_tpot_s per output token after its prefill.
    prefill_instances: int = setting(
        0,
        "PD disaggregation: prefill-only instances, routed by the policy on unprefilled "
        "tokens; replaces instances.",
        ge=0,
    )
    decode_instances: int = setting(
        0, "PD disaggregation: decode instances; 0: prefill-only evaluation.", ge=0
    )
    decode_policy: str = setting(
        "least_kv",
        "PD disaggregation: how the decode instance is chosen.",
        choices=DECODE_POLICY_NAMES,
    )
    assumed_tpot_s: float = setting(
        0.03, "Prefill-only evaluation: seconds per output token before the next turn.", ge=0
    )
    # Perturbations of the simulated world that the policies are not told about (their
    # hardware constants come from the nominal cluster, ``nominal``): every global-tier
    # link's rate scaled, every engine's compute-bound prefill work slowed, every
    # instance's KV room scaled.
    tier_bandwidth_scale: float = setting(
        1.0, "Every global-tier link's rate scaled (the policies are not told).", gt=0
    )
    prefill_slowdown: float = setting(
        1.0, "Every engine's compute-bound prefill slowed (the policies are not told).", gt=0
    )
    kv_room_scale: float = setting(
        1.0, "Every instance's KV room scaled (the policies are not told).", gt=0
    )


PERTURBATIONS = ("tier_bandwidth_scale", "prefill_slowdown", "kv_room_scale")


def nominal(cluster: ClusterConfig) -> ClusterConfig:
    """The cluster as its operator believes it to be: no perturbation."""
    unperturbed: dict[str, Any] = dict.fromkeys(PERTURBATIONS, 1.0)
    return dataclasses.replace(cluster, **unperturbed)


@dataclass(frozen=True)
class WorkloadConfig:
    trace: str = setting("sample:weka", "Trace: a path, or sample:NAME.")
    format: str | None = setting(None, "Trace format; none: from the file.")
    # Closed-loop sessions composed from the trace: start rate and how long starts go on.
    session_rate: float = setting(0.25, "Closed loop: sessions started per second.", gt=0)
    duration_s: float = setting(600.0, "Closed loop: seconds in which sessions start.", gt=0)
    arrival: str = setting("poisson", "Closed loop: how session starts arrive.")
    # Traces with a clock may instead be replayed open loop at their recorded arrivals,
    # scaled by keeping a seeded fraction of their sessions (the paper's method) or by speed.
    open_loop: bool = setting(False, "Replay the trace's recorded arrivals instead.")
    sample: float = setting(1.0, "Open loop: share of sessions kept.", gt=0, le=1.0)
    speed: float = setting(1.0, "Open loop: replay speed-up.", gt=0)
    seed: int = setting(0, "Seed of the workload.", ge=0)


@dataclass(frozen=True)
class SimConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    slo: SLOConfig = field(default_factory=SLOConfig)
    policies: tuple[str, ...] = POLICY_NAMES
    # Width of the windows in which load imbalance is measured.
    window_s: float = setting(
        WINDOW_S, "Width of the windows in which load imbalance is measured, seconds.", gt=0
    )
    # Requests arriving before this are left out of throughput and latency (metrics.py).
    warmup_s: float = setting(
        0.0, "Requests arriving before this are left out of the metrics, seconds.", ge=0
    )

    def override(self, section: str, **values: Any) -> SimConfig:
        """A copy with fields of one section changed; None values leave a field as is."""
        values = {k: v for k, v in values.items() if v is not None}
        if not values:
            return self
        updated = dataclasses.replace(getattr(self, section), **values)
        return dataclasses.replace(self, **{section: updated})

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["policies"] = list(self.policies)
        return data


def from_dict(data: dict[str, Any], where: str = "config") -> SimConfig:
    """The run a YAML file's mapping describes, read as every settings file is read
    (``core.settings_load``): an unknown key, a wrong type or a value out of bounds is a
    ValueError naming ``where``, the key and what it takes. ``policies`` may also be one
    comma-separated string, as on the command line."""
    policies = data.get("policies")
    if isinstance(policies, str):
        data = {**data, "policies": [p.strip() for p in policies.split(",") if p.strip()]}
    return load(SimConfig, data, where)


def check_config(config: SimConfig) -> SimConfig:
    """``config`` if every setting lies within its declared bounds, else a ValueError
    naming the key and the bounds: for configurations assembled in code (presets, sweeps'
    overrides), which no file or flag reader has checked."""
    check_settings(config)
    return config


SECTIONS = ("cluster", "workload", "slo")


def check_runnable(config: SimConfig) -> SimConfig:
    """``config`` if a run of it can start, else a ValueError saying what stops it: a
    setting out of bounds, a warm-up as long as the arrivals, an unknown policy, tier
    capacity, load mode, medium or decode rule. Checked before a trace is loaded, so a
    typo fails at once and names the valid values."""
    check_config(config)
    if config.warmup_s >= config.workload.duration_s:
        raise ConfigError(
            f"warmup_s {config.warmup_s:g} must be shorter than workload.duration_s "
            f"{config.workload.duration_s:g}"
        )
    for spec in config.policies:
        make_policy(spec)
    parse_global_capacity(config.cluster.global_capacity)
    load_medium(config.cluster.global_medium)
    check_disaggregation(config.cluster)
    return config


def load_yaml(path: Path) -> SimConfig:
    data = read_yaml(path) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must map keys to values")
    return from_dict(data, str(path))


def dump_yaml(config: SimConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))


def check_disaggregation(cluster: ClusterConfig) -> None:
    """Decode instances need prefill instances to feed them (the counts' bounds and the
    decode rule's names are checked where they are declared)."""
    if cluster.decode_instances and not cluster.prefill_instances:
        raise ConfigError("decode instances need prefill instances (--prefill-instances N)")


def check_kv_load(mode: str) -> str:
    if mode not in KV_LOAD_MODES:
        raise ConfigError(f"kv_load {mode!r}: use one of {', '.join(KV_LOAD_MODES)}")
    return mode


def parse_global_capacity(text: str) -> float | None:
    """'none' -> 0, 'full' -> None (never evicts), '1.6x' or '1.6' -> 1.6."""
    value = str(text).strip().lower()
    if value in ("none", "0", "0x"):
        return 0.0
    if value in ("full", "inf", "infinite"):
        return None
    try:
        ratio = float(value.removesuffix("x"))
    except ValueError:
        ratio = math.nan
    if not math.isfinite(ratio):  # "nanx" and "1e400x" read as floats, but as no capacity
        raise ConfigError(
            f"global capacity {text!r}: use none, full, or a ratio to local capacity like 1.6x"
        )
    if ratio < 0:
        raise ConfigError(f"global capacity {text!r} must not be negative")
    return ratio


def global_levels(text: str) -> list[str]:
    """'none,1x,full' -> the checked global-tier capacities."""
    levels = [g.strip() for g in text.split(",") if g.strip()]
    for level in levels:
        parse_global_capacity(level)
    return levels
