"""What the simulation commands (simulate, sweep, knee, plan) share: the trace argument,
``--config``, ``--policies`` and one flag per simulation setting, and the configuration
they describe together.

Every key of a simulation YAML file is a flag of the same name (``cluster.instances`` is
``--instances``, ``workload.duration_s`` is ``--duration-s``), generated from the
setting's declaration; the short names below are kept beside it. A command that sweeps a
setting itself (``sweep --rates``) leaves that flag out, and says why in ``EXCLUDED``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from smetric.cli.settings_options import Given, SettingFlag, setting_flags
from smetric.core.policies import POLICY_NAMES, split_policies
from smetric.metrics.slo import SLOConfig
from smetric.sim.config import (
    SECTIONS,
    ClusterConfig,
    SimConfig,
    WorkloadConfig,
    check_runnable,
    load_yaml,
)

SourceArg = Annotated[
    str | None,
    typer.Argument(
        help="Trace (as for analyze) [default: the config's, else sample:weka].",
        show_default=False,
    ),
]
ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config", "-c", help="YAML file with cluster/workload/slo/policies; flags override it."
    ),
]
PoliciesOpt = Annotated[
    str | None,
    typer.Option(
        "--policies",
        "-p",
        help=f"Comma-separated policies (name or name:key=value,...) or 'all': "
        f"{', '.join(POLICY_NAMES)}.",
    ),
]
PlotsOpt = Annotated[
    bool,
    typer.Option(
        "--plots/--no-plots",
        help="Draw the figures; --no-plots writes only the numbers, sooner.",
    ),
]

# Flag names other than the key's own: short names kept beside the keys,
# a --on/--off pair, and --trace-format, since --format prints the tables.
NAMES = {
    "gpus_per_instance": ("--gpus-per-instance", "--gpus"),
    "gpu_memory_utilization": ("--gpu-memory-utilization", "--mem-util"),
    "kv_capacity_tokens": ("--kv-capacity-tokens", "--kv-tokens"),
    "max_num_batched_tokens": ("--max-num-batched-tokens", "--max-batched-tokens"),
    "global_capacity": ("--global-capacity", "--global"),
    "nic_gb_s": ("--nic-gb-s", "--nic-bandwidth"),
    "format": ("--trace-format",),
    "session_rate": ("--session-rate", "--rate"),
    "duration_s": ("--duration-s", "--duration"),
    "open_loop": ("--open-loop/--closed-loop",),
    "ttft_base_s": ("--ttft-base-s", "--ttft-base"),
    "ttft_per_token_s": ("--ttft-per-token-s", "--ttft-per-token"),
    "tpot_s": ("--tpot-s", "--tpot"),
    "warmup_s": ("--warmup-s", "--warmup"),
}

# Keys a YAML file may set that no generated flag sets, and what sets them instead.
NOT_FLAGS = {
    "workload.trace": "the SOURCE argument",
    "policies": "--policies, a list rather than a setting",
}
SIM_FLAGS: tuple[SettingFlag, ...] = tuple(
    flag
    for flags in (
        setting_flags(ClusterConfig, "cluster", panel="Cluster", names=NAMES),
        setting_flags(WorkloadConfig, "workload", panel="Workload", names=NAMES),
        setting_flags(SLOConfig, "slo", panel="SLO", names=NAMES),
        setting_flags(SimConfig, panel="Measurement", names=NAMES),
    )
    for flag in flags
    if flag.key not in NOT_FLAGS
)
# Per command, the keys it offers no flag for, and why: it sets them itself.
EXCLUDED: dict[str, dict[str, str]] = {
    "simulate": {},
    "sweep": {
        "workload.session_rate": "--rates gives the rates swept",
        "cluster.global_capacity": "--globals gives the tiers swept",
    },
    "knee": {
        "workload.session_rate": "the load searched, from --start",
        "workload.speed": "the load searched in open loop, from --start",
        "workload.seed": "--seeds runs seeds 0..N-1",
        "cluster.global_capacity": "--globals gives the tiers searched",
        "cluster.kv_load": "--kv-loads gives the load modes searched",
    },
    "plan": {
        "cluster.instances": "--min-instances/--max-instances give the counts searched",
        "cluster.global_capacity": "--globals gives the tiers tried",
        "workload.seed": "--seeds runs seeds 0..N-1",
    },
}


def sim_flags(command: str) -> tuple[SettingFlag, ...]:
    """The setting flags of one simulation command: every setting but those it sets itself."""
    return tuple(f for f in SIM_FLAGS if f.key not in EXCLUDED[command])


def command_config(
    given: Given, config_path: Path | None, source: str | None, policies: str | None
) -> SimConfig:
    """The configuration a command line describes: its ``--config`` file (or the
    defaults), the flags it gave over it, its trace and policies; checked before any
    trace is loaded."""
    config = load_yaml(config_path) if config_path else SimConfig()
    for section in SECTIONS:
        config = config.override(section, **given.section(section))
    config = dataclasses.replace(config, **given.section(""))
    if source is not None:
        config = config.override("workload", trace=source)
    if policies:
        names = POLICY_NAMES if policies == "all" else split_policies(policies)
        config = dataclasses.replace(config, policies=tuple(names))
    return check_runnable(config)
