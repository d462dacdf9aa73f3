"""SMetric against least-load and cache-aware routing, in front of two real vLLM engines.

    python benchmarks/real_vllm_policies.py [--duration 120] [--rate 0.1] [--token-scale 30]
        [--policies smetric_cost,smetric,least_load,cache_aware] [--json OUT.json]

Needs vLLM's CPU build and its model (``scripts/real_engines/setup_vllm.sh``); without them
this prints why and exits 0. For each policy, two fresh vLLM instances (one core each, so no
policy inherits another's warm caches) start on loopback with prefix caching and KV events,
``smetric serve --policy P`` routes on their KV events with the model's own tokenizer, and
``smetric replay``'s ``Replayer`` drives the same closed-loop Claude Code sessions from the
embedded sample (prompts scaled down ``--token-scale`` times to fit the 135M model's window
and a CPU's speed). Reported per policy, from vLLM's own ``/metrics`` deltas: completed
requests/s, p50/p90 end-to-end latency, prefix-cache hit ratio and imbalance (max over mean
requests per engine); from the replayer: TTFT p50/p90, and how often the router's predicted
hit (``x-smetric-predicted-hit-tokens``) equalled the cached tokens vLLM reported; for a
policy that learns its prices (``smetric_cost``), what its router learned of the engines.
``--json`` writes those figures per policy, the input of ``benchmarks/real_vllm_twin.py``
(the simulator run as this setup, beside them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from router_overhead import processes
from router_vs_sglang import Outcome, measure, report, routes_chat

from smetric.replay import Replayer, ReplayOptions
from smetric.testing.engines import (
    BLOCK_SIZE,
    VLLMInstall,
    find_vllm,
    start_engines,
    vllm_instances,
)
from smetric.trace.load import DEFAULT_SAMPLE, load_trace
from smetric.trace.schema import Trace

POLICIES = "smetric_cost,smetric,least_load,cache_aware"


async def run_one(
    policy: str, args: argparse.Namespace, trace: Trace, install: VLLMInstall, scratch: Path
) -> tuple[Outcome, Replayer]:
    servers = vllm_instances(install, scratch)
    try:
        await asyncio.to_thread(start_engines, servers)
        config = scratch / f"engines-{policy}.yaml"
        config.write_text("engines:\n" + "".join(s.engines_yaml_entry() for s in servers))
        with processes() as procs:
            command = ["serve", "--config", str(config), "--policy", policy]
            command += ["--block-size", str(BLOCK_SIZE), "--tokenizer", f"hf:{install.model}"]
            router, _ = procs.start_smetric([*command, "--scrape-interval", "1"])
            await routes_chat(router, timeout_s=120)
            options = ReplayOptions(
                url=router,
                rate=args.rate,
                duration_s=args.duration,
                token_scale=args.token_scale,
                seed=args.seed,
            )
            measured = await measure(policy, router, [s.url for s in servers], trace, options)
            LEARNED[policy] = await learned_prices(router)
            return measured
    finally:
        for server in servers:
            server.stop()


# What each policy's router learned of the engines by the end of its run (empty for a
# policy that learns nothing): smetric_learned_price{constant} from its /metrics.
LEARNED: dict[str, dict[str, float]] = {}


async def learned_prices(router: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as client, client.get(router + "/metrics") as reply:
        text = await reply.text()
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name == "smetric_learned_price":
            for sample in family.samples:
                out[sample.labels["constant"]] = sample.value
    return out


def percentile(values: list[float], q: float) -> float:
    return float(np.quantile(values, q)) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=120.0)
    parser.add_argument("--rate", type=float, default=0.1, help="session starts per second")
    parser.add_argument("--token-scale", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default=POLICIES, help="comma-separated policy specs")
    parser.add_argument("--json", type=Path, help="also write the figures per policy here")
    args = parser.parse_args()
    install = find_vllm()
    if install is None:
        print("vLLM is not installed: run scripts/real_engines/setup_vllm.sh first; skipping.")
        return
    t0 = time.perf_counter()
    trace = load_trace(DEFAULT_SAMPLE)
    runs = []
    with tempfile.TemporaryDirectory(prefix="smetric-vllm-") as scratch:
        for policy in args.policies.split(","):
            runs.append(asyncio.run(run_one(policy, args, trace, install, Path(scratch))))
    report(
        [outcome for outcome, _ in runs],
        f"2 vLLM CPU instances (SmolLM2-135M, one core each), {DEFAULT_SAMPLE} sessions at "
        f"{args.rate}/s for {args.duration:.0f} s, tokens / {args.token_scale:g}, seed {args.seed}",
    )
    print(f"{'policy':<20}{'TTFT p50 s':>11}{'TTFT p90 s':>11}{'predicted == cached':>21}")
    figures = {}
    for outcome, replayer in runs:
        done = [r for r in replayer.records.values() if r.finished_s is not None]
        ttft = [r.first_token_s - r.arrival_s for r in done if r.first_token_s is not None]
        exact = [r.predicted_hit_tokens == r.cached_tokens for r in done]
        print(
            f"{outcome.router:<20}{percentile(ttft, 0.5):>11.2f}{percentile(ttft, 0.9):>11.2f}"
            f"{sum(exact):>14} of {len(exact):<5}"
        )
        figures[outcome.router] = {
            "completed": len(outcome.latencies),
            "failed": outcome.failed,
            "rps": outcome.rps,
            "latency_p50_s": percentile(outcome.latencies, 0.5),
            "latency_p90_s": percentile(outcome.latencies, 0.9),
            "ttft_p50_s": percentile(ttft, 0.5),
            "ttft_p90_s": percentile(ttft, 0.9),
            "hit_ratio": outcome.hit_ratio,
            "imbalance": outcome.imbalance,
            # Per finished request: session, turn, prompt tokens, cached tokens.
            "requests": [[r.session_id, r.turn, r.prompt_tokens, r.cached_tokens] for r in done],
        }
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    for policy, values in LEARNED.items():
        if values:
            learned = ", ".join(f"{k}={v:.3g}" for k, v in sorted(values.items()))
            print(f"{policy} learned: {learned}")
    print(f"total time {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
