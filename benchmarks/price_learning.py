"""How fast the price learner converges, and what it learns of simulated engines.

1. Engines that follow the learner's cost model exactly (``smetric.testing.prices``),
   with every starting constant off by 2x either way, over several seeds: after how many
   completed requests each estimate is within 10 % of the truth for good.
2. The simulator: a small H20 cluster with a full global tier, in the configured world
   and in worlds the policy is not told about; the constants learned from its requests
   beside those the performance model implies (``model/calibrate.py``), and what they
   price a 30 k-token prefill and a 30 k-token fetch at.

    python benchmarks/price_learning.py [--requests 3000] [--seeds 3] [--instances 4]
"""

from __future__ import annotations

import argparse
import itertools

from smetric.core.policies import make_policy
from smetric.core.policies.prices import LEARNABLE, PriceLearner
from smetric.core.policies.smetric_cost import SMetricCost
from smetric.sim.config import SimConfig
from smetric.sim.policy import cluster_rates
from smetric.sim.run import simulate
from smetric.testing.prices import H20_PRICES, model_engines, requests_to_converge
from smetric.trace.load import load_trace

WORLDS = {
    "configured": {},
    "prefill 1.25x slower": {"prefill_slowdown": 1.25},
    "tier at 1/8 bandwidth": {"tier_bandwidth_scale": 1 / 8},
}


def convergence(requests: int, seeds: int) -> None:
    print(f"## Requests until within 10 % for good ({requests} requests, seeds 0..{seeds - 1})\n")
    print("| start | " + " | ".join(LEARNABLE) + " |")
    print("|---" * (len(LEARNABLE) + 1) + "|")
    for factor in (2.0, 0.5):
        per_seed = []
        for seed in range(seeds):
            learner = PriceLearner({k: v * factor for k, v in H20_PRICES.items()})
            refits = (
                (learner.observed, values)
                for done in itertools.islice(model_engines(H20_PRICES, seed), requests)
                if (values := learner.on_complete(done)) is not None
            )
            per_seed.append(requests_to_converge(refits, H20_PRICES))
        cells = []
        for name in LEARNABLE:
            counts = [c for s in per_seed if (c := s[name]) is not None]
            converged = len(counts) == len(per_seed)
            cells.append(f"{min(counts)}-{max(counts)}" if converged else "never")
        print(f"| {factor:g}x | " + " | ".join(cells) + " |")


def simulated(instances: int) -> None:
    trace = load_trace("sample:weka")
    base = (
        SimConfig()
        .override("cluster", instances=instances, global_capacity="full")
        .override("workload", session_rate=0.0125 * instances, duration_s=1200.0)
    )
    priced = make_policy("smetric_cost", cluster_rates(base.cluster))
    assert isinstance(priced, SMetricCost)
    print(f"\n## Learned in the simulator ({instances} H20s, full tier, 20 min, seed 0)\n")
    print("| world | requests | prefill_tps | attn_tokens | fetch_tps | kv_read_s | "
          "30 k prefill s | 30 k fetch s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| model's constants | - | {priced.prefill_tps:,.0f} | {priced.attn_tokens:,.0f} "
        f"| {priced.fetch_tps:,.0f} | {priced.kv_read_s:.2g} | "
        f"{priced.prefill_s(30_000):.2f} | {30_000 / priced.fetch_tps:.2f} |"
    )
    for name, world in WORLDS.items():
        summary = simulate(trace, base.override("cluster", **world), "smetric_cost").summary
        got = summary["learned_params"]
        priced = SMetricCost(**got)
        print(
            f"| {name} | {summary['learned_from']} | {got['prefill_tps']:,.0f} | "
            f"{got['attn_tokens']:,.0f} | {got['fetch_tps']:,.0f} | {got['kv_read_s']:.2g} | "
            f"{priced.prefill_s(30_000):.2f} | {30_000 / priced.fetch_tps:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--instances", type=int, default=4)
    args = parser.parse_args()
    convergence(args.requests, args.seeds)
    simulated(args.instances)


if __name__ == "__main__":
    main()
