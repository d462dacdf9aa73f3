"""The simulator run as benchmarks/real_vllm_policies.py's setup, beside what it measured.

    python benchmarks/real_vllm_twin.py [--measured MEASURED.json] [--token-scale 30]
        [--config benchmarks/real_vllm_twin.yaml] [--tokenizer hf:DIR | bytes]
        [--write-trace TRACE.parquet]

The cluster is ``benchmarks/real_vllm_twin.yaml``: two instances of SmolLM2-135M on the
``CPU-core`` preset (fitted by ``benchmarks/vllm_cpu_calibration.py``), the engines' KV
pool, batch limits and context, no global tier. The workload is the embedded sample as the
benchmark's replayer sends it (``smetric.replay.replayed_trace``: prompts scaled down
``--token-scale`` times and tokenised with the model's own tokenizer and chat template,
outputs scaled as ``max_tokens`` is), closed loop at the benchmark's rate, duration and
seed, so the simulator draws the same sessions the benchmark did. Printed per policy, in
the benchmark's terms: completed requests/s, p50/p90 end-to-end latency and TTFT, prefix
hit ratio, imbalance (max over mean requests per engine); with ``--measured`` (the
benchmark's ``--json``) the measured figures beside them and both rankings. The tokenizer
defaults to the installed vLLM model's; without it, ``--tokenizer bytes`` (byte counts,
about 3.4 times the model's tokens: give a larger ``--token-scale``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from smetric.replay import replayed_trace
from smetric.serve.tokenizers import make_tokenizer
from smetric.sim.config import SimConfig, load_yaml
from smetric.sim.run import simulate
from smetric.testing.engines import BLOCK_SIZE, find_vllm
from smetric.trace.load import DEFAULT_SAMPLE, load_trace, write_parquet
from smetric.trace.schema import Trace

CONFIG = Path(__file__).with_suffix(".yaml")
# Columns of the comparison: (figure, heading, better when higher).
FIGURES = (
    ("hit_ratio", "hit ratio", True),
    ("rps", "req/s", True),
    ("latency_p50_s", "p50 s", False),
    ("latency_p90_s", "p90 s", False),
    ("ttft_p50_s", "TTFT p50", False),
    ("ttft_p90_s", "TTFT p90", False),
    ("imbalance", "imbalance", False),
)


def twin_trace(tokenizer: str, token_scale: float, config: SimConfig) -> Trace:
    """The sample as the benchmark's replayer sends it to engines of ``config``."""
    encoder, template = make_tokenizer(tokenizer)
    limit = config.cluster.max_model_len or 2048
    return replayed_trace(
        load_trace(DEFAULT_SAMPLE), token_scale, encoder, template, BLOCK_SIZE, limit
    )


def quantile(values: np.ndarray, q: float) -> float:
    return float(np.quantile(values, q)) if len(values) else float("nan")


def figures(table: pl.DataFrame, horizon_s: float, instances: int) -> dict[str, Any]:
    """One run's requests in the benchmark's terms (``real_vllm_policies.py --json``)."""
    done = table.filter(pl.col("completed"))
    latency = (done["finished_s"] - done["arrival_s"]).to_numpy()
    ttft = done["ttft_s"].to_numpy()
    admitted = table.filter(pl.col("instance") >= 0)
    prompt = int(admitted["prompt_tokens"].sum())
    served = np.bincount(done["instance"].to_numpy(), minlength=instances)
    return {
        "completed": done.height,
        "failed": int(table["rejected"].sum()),
        "rps": done.height / horizon_s,
        "latency_p50_s": quantile(latency, 0.5),
        "latency_p90_s": quantile(latency, 0.9),
        "ttft_p50_s": quantile(ttft, 0.5),
        "ttft_p90_s": quantile(ttft, 0.9),
        "hit_ratio": int(admitted["local_hit_tokens"].sum()) / prompt if prompt else 0.0,
        "imbalance": float(served.max() / served.mean()) if served.any() else float("nan"),
    }


def simulated(trace: Trace, config: SimConfig) -> dict[str, dict[str, Any]]:
    """The benchmark's figures for each policy of ``config``, simulated, with the same
    per-request list the benchmark writes (session, turn, prompt and cached tokens)."""
    out = {}
    for policy in config.policies:
        result = simulate(trace, config, policy)
        horizon = result.summary.horizon_s
        out[policy] = figures(result.requests, horizon, config.cluster.instances)
        done = result.requests.filter(pl.col("completed"))
        columns = ("session_id", "turn", "prompt_tokens", "local_hit_tokens")
        out[policy]["requests"] = [list(row) for row in done.select(columns).rows()]
    return out


def matched(sim: list[list], measured: list[list]) -> tuple[int, float, float, float]:
    """Requests finished in both runs, keyed by session copy and turn (where the key is
    unique in both): how many, the mean relative gap of their prompt tokens, and their
    hit ratio simulated and measured. Timing apart, this checks the derived workload and
    the cache: the same requests, the same history, the same hits?"""

    def unique(rows: list[list]) -> dict[tuple[str, int], tuple[int, int]]:
        seen: dict[tuple[str, int], list[tuple[int, int]]] = {}
        for session, turn, prompt, hit in rows:
            seen.setdefault((session, turn), []).append((prompt, hit))
        return {key: values[0] for key, values in seen.items() if len(values) == 1}

    ours, theirs = unique(sim), unique(measured)
    keys = sorted(ours.keys() & theirs.keys())
    if not keys:
        return 0, float("nan"), float("nan"), float("nan")
    gap = np.mean([abs(ours[k][0] - theirs[k][0]) / theirs[k][0] for k in keys])
    hit = sum(ours[k][1] for k in keys) / sum(ours[k][0] for k in keys)
    real = sum(theirs[k][1] for k in keys) / sum(theirs[k][0] for k in keys)
    return len(keys), float(gap), hit, real


def ranking(runs: dict[str, dict[str, Any]], figure: str, higher: bool) -> list[str]:
    """Policies best first by ``figure``."""
    return sorted(runs, key=lambda p: runs[p][figure], reverse=higher)


def report(sim: dict[str, dict[str, Any]], measured: dict[str, dict[str, Any]]) -> None:
    head = f"{'policy':<14}{'':<10}" + "".join(f"{h:>11}" for _, h, _ in FIGURES)
    print(head + f"{'completed':>11}")
    for policy, values in sim.items():
        rows = [("simulated", values)]
        if policy in measured:
            rows.append(("measured", measured[policy]))
        for i, (label, row) in enumerate(rows):
            cells = "".join(f"{row[f]:>11.3f}" for f, _, _ in FIGURES)
            print(f"{policy if i == 0 else '':<14}{label:<10}{cells}{row['completed']:>11}")
    shared = {p: v for p, v in measured.items() if p in sim}
    for figure, heading, higher in FIGURES[:4]:
        line = f"ranking by {heading}: simulated {' > '.join(ranking(sim, figure, higher))}"
        if shared:
            ours = {p: sim[p] for p in shared}
            line += f"; simulated (measured policies) {' > '.join(ranking(ours, figure, higher))}"
            line += f"; measured {' > '.join(ranking(shared, figure, higher))}"
        print(line)
    if shared:
        gaps = [abs(sim[p]["hit_ratio"] - shared[p]["hit_ratio"]) * 100 for p in shared]
        print(f"hit ratio: largest gap {max(gaps):.1f} points")
    for policy, row in shared.items():
        if "requests" not in row:
            continue
        n, gap, hit, real = matched(sim[policy]["requests"], row["requests"])
        print(
            f"{policy}: {n} requests finished in both; prompt tokens differ by {gap:.1%} on "
            f"average; their hit ratio simulated {hit:.3f}, measured {real:.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--measured", type=Path, help="real_vllm_policies.py --json output")
    parser.add_argument("--token-scale", type=float, default=30.0)
    parser.add_argument("--tokenizer", help="hf:DIR or bytes; default: the vLLM model's")
    parser.add_argument("--write-trace", type=Path, help="save the derived trace (parquet)")
    args = parser.parse_args()
    tokenizer = args.tokenizer
    if tokenizer is None:
        install = find_vllm()
        if install is None:
            print("vLLM's model is not installed (scripts/real_engines/setup_vllm.sh); give")
            print("--tokenizer bytes with a larger --token-scale to run on byte counts.")
            return
        tokenizer = f"hf:{install.model}"
    t0 = time.perf_counter()
    config = load_yaml(args.config)
    trace = twin_trace(tokenizer, args.token_scale, config)
    if args.write_trace:
        write_parquet(trace, args.write_trace)
    sim = simulated(trace, config)
    measured = json.loads(args.measured.read_text()) if args.measured else {}
    workload = config.workload
    print(
        f"{config.cluster.instances} x {config.cluster.model} on {config.cluster.hardware}, "
        f"{DEFAULT_SAMPLE} sessions at {workload.session_rate}/s for {workload.duration_s:g} s, "
        f"tokens / {args.token_scale:g} ({tokenizer.split('/')[-1]}), seed {workload.seed}"
    )
    report(sim, measured)
    print(f"total time {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
