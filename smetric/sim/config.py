"""What a simulation run is: cluster, workload, SLOs and policies, as data.

The flags of ``smetric simulate`` and a YAML file map onto the same dataclasses, and a run
writes its resolved configuration next to its results, so any number can be reproduced
with ``smetric simulate --config RESULT/config.yaml``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import msgspec
import yaml

from smetric.core.policies import POLICY_NAMES
from smetric.core.policies.decode import make_decode_policy
from smetric.metrics.slo import SLOConfig
from smetric.metrics.summary import WINDOW_S


@dataclass(frozen=True)
class ClusterConfig:
    instances: int = 32
    model: str = "Qwen3-Coder-30B-A3B"
    hardware: str = "H20"
    gpus_per_instance: int = 1
    # None: the model preset's own (fp8 for Qwen3-235B-A22B-FP8, else bf16).
    weight_dtype: str | None = None
    kv_dtype: str = "bf16"
    gpu_memory_utilization: float = 0.9
    # None: GPU memory x utilisation - weights - activations, over KV bytes per token.
    kv_capacity_tokens: int | None = None
    # None: the model's context, capped at what one instance's KV pool can hold.
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # "none", "full" (never evicts) or a multiple of the cluster's total local capacity.
    global_capacity: str = "full"
    # Links to the global tier (kv.Route). The paper's testbed: servers of 8 H20 GPUs with
    # 200 Gbps RDMA NICs (about 21.7 GB/s effective each, as measured for such NICs); the
    # paper does not say how many NICs a server has, so the default is Mooncake's reference
    # setup of four (87 GB/s per server, Mooncake README). The GPUs of a server share its NICs;
    # each GPU also has its own PCIe Gen5 x16 lane to host memory (~50 GB/s measured).
    gpus_per_server: int = 8
    nics_per_server: int = 4
    nic_gb_s: float = 21.7
    pcie_gb_s: float = 50.0
    # What the connector reaches end to end on top of those links (presets/tiers.toml):
    # "line-rate" (the paper's testbed), "lmcache-cpu", "mooncake-rdma", "mooncake-tcp".
    global_medium: str = "line-rate"
    # How an admitted request reads the global tier: "sync" loads before the forward pass
    # and stretches that step (LMCache's default), "async" holds the request, not the batch.
    kv_load: str = "sync"
    # PD disaggregation (the paper's Figure 4c, sim/pd.py): prefill_instances > 0 replaces
    # ``instances`` by that many prefill-only instances (they alone read the global tier)
    # and decode_instances that decode with the KV pulled from them over the links. No
    # decode instances is the paper's prefill-only evaluation: decode is not modelled and a
    # session's next turn comes assumed_tpot_s per output token after its prefill.
    prefill_instances: int = 0
    decode_instances: int = 0
    decode_policy: str = "least_kv"
    assumed_tpot_s: float = 0.03
    # Perturbations of the simulated world that the policies are not told about (their
    # hardware constants come from the nominal cluster, ``nominal``): every global-tier
    # link's rate scaled, every engine's compute-bound prefill work slowed, every
    # instance's KV room scaled.
    tier_bandwidth_scale: float = 1.0
    prefill_slowdown: float = 1.0
    kv_room_scale: float = 1.0


PERTURBATIONS = ("tier_bandwidth_scale", "prefill_slowdown", "kv_room_scale")


def nominal(cluster: ClusterConfig) -> ClusterConfig:
    """The cluster as its operator believes it to be: no perturbation."""
    unperturbed: dict[str, Any] = dict.fromkeys(PERTURBATIONS, 1.0)
    return dataclasses.replace(cluster, **unperturbed)


def check_perturbations(cluster: ClusterConfig) -> None:
    for name in PERTURBATIONS:
        if not getattr(cluster, name) > 0:
            raise ValueError(f"{name} must be positive, got {getattr(cluster, name)}")


@dataclass(frozen=True)
class WorkloadConfig:
    trace: str = "sample:weka"
    format: str | None = None
    # Closed-loop sessions composed from the trace: start rate and how long starts go on.
    session_rate: float = 0.25
    duration_s: float = 600.0
    arrival: str = "poisson"
    # Traces with a clock may instead be replayed open loop at their recorded arrivals,
    # scaled by keeping a seeded fraction of their sessions (the paper's method) or by speed.
    open_loop: bool = False
    sample: float = 1.0
    speed: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class SimConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    slo: SLOConfig = field(default_factory=SLOConfig)
    policies: tuple[str, ...] = POLICY_NAMES
    # Width of the windows in which load imbalance is measured.
    window_s: float = WINDOW_S
    # Requests arriving before this are left out of throughput and latency (metrics.py).
    warmup_s: float = 0.0

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


def _section(cls: type, data: Any, where: str) -> Any:
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; known: {sorted(known)}")
    try:
        return msgspec.convert(data, cls, strict=False)
    except msgspec.ValidationError as exc:
        raise ValueError(f"{where}: {exc}") from exc


def from_dict(data: dict[str, Any], where: str = "config") -> SimConfig:
    known = {f.name for f in fields(SimConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: unknown sections {unknown}; known: {sorted(known)}")
    policies = data.get("policies", SimConfig().policies)
    if isinstance(policies, str):
        policies = [p.strip() for p in policies.split(",") if p.strip()]
    return SimConfig(
        cluster=_section(ClusterConfig, data.get("cluster"), f"{where}: cluster"),
        workload=_section(WorkloadConfig, data.get("workload"), f"{where}: workload"),
        slo=_section(SLOConfig, data.get("slo"), f"{where}: slo"),
        policies=tuple(policies),
        window_s=float(data.get("window_s", SimConfig().window_s)),
        warmup_s=float(data.get("warmup_s", SimConfig().warmup_s)),
    )


def load_yaml(path: Path) -> SimConfig:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: cannot read YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return from_dict(data, str(path))


def dump_yaml(config: SimConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))


KV_LOAD_MODES = ("sync", "async")


def check_disaggregation(cluster: ClusterConfig) -> None:
    """Decode instances need prefill instances to feed them, and a known decode rule."""
    if cluster.prefill_instances < 0 or cluster.decode_instances < 0:
        raise ValueError("prefill and decode instance counts must not be negative")
    if cluster.decode_instances and not cluster.prefill_instances:
        raise ValueError("decode instances need prefill instances (--prefill-instances N)")
    make_decode_policy(cluster.decode_policy)


def check_kv_load(mode: str) -> str:
    if mode not in KV_LOAD_MODES:
        raise ValueError(f"kv_load {mode!r}: use one of {', '.join(KV_LOAD_MODES)}")
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
    except ValueError as exc:
        raise ValueError(
            f"global capacity {text!r}: use none, full, or a ratio to local capacity like 1.6x"
        ) from exc
    if ratio < 0:
        raise ValueError(f"global capacity {text!r} must not be negative")
    return ratio
