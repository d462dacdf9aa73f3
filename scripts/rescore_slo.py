"""TPS within SLO of finished simulation runs under another SLO, without re-simulating.

The SLO only scores requests; it never changes what the simulator does. So a result folder
of ``smetric simulate`` (its ``config.yaml`` and per-request tables) can be scored again
under a looser or stricter SLO:

    python scripts/rescore_slo.py RESULT [RESULT ...] --ttft-base 2 --ttft-per-token 0.0005

prints, per folder and policy, TPS within SLO under the run's own SLO and under the new one.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import polars as pl

from smetric.metrics.runs import run_file_name
from smetric.metrics.slo import SLOConfig
from smetric.metrics.summary import summarize, with_latencies
from smetric.sim.config import load_yaml


def rescore(folder: Path, slo: SLOConfig) -> dict[str, tuple[float, float]]:
    """Per policy: (TPS within the run's SLO, TPS within ``slo``)."""
    config = load_yaml(folder / "config.yaml")
    horizon = config.workload.duration_s
    out = {}
    for policy in config.policies:
        table = pl.read_parquet(folder / run_file_name(policy))
        scores = []
        for level in (config.slo, slo):
            scored = with_latencies(table, level, horizon)
            summary = summarize(
                scored, level, horizon, config.cluster.instances, config.window_s, config.warmup_s
            )
            scores.append(summary.tps_within_slo)
        out[policy] = (scores[0], scores[1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--ttft-base", type=float, default=SLOConfig.ttft_base_s)
    parser.add_argument("--ttft-per-token", type=float, default=SLOConfig.ttft_per_token_s)
    parser.add_argument("--tpot", type=float, default=SLOConfig.tpot_s)
    args = parser.parse_args()
    slo = SLOConfig(args.ttft_base, args.ttft_per_token, args.tpot)
    for folder in args.folders:
        print(folder)
        for policy, (own, new) in rescore(folder, slo).items():
            print(f"  {policy:32s} {own:>12,.0f} {new:>12,.0f}")


if __name__ == "__main__":
    main()
