"""How fast one vLLM CPU instance of the real-engine benchmark prefills and decodes.

    python benchmarks/vllm_cpu_calibration.py [--repeats 3] [--json OUT.json] [--peak-tflops P]

The simulator's ``CPU-core`` hardware preset (``smetric/model/presets/hardware.toml``) is
fitted on what this prints, so that ``smetric simulate`` can stand in for
``benchmarks/real_vllm_policies.py``'s engines. It starts one instance exactly as that
benchmark does (``smetric.testing.engines.VLLMServer``: float32, eager, 32-token blocks,
prefix caching, pinned to core 0) and times, from vLLM's own ``/metrics`` (the engine's
``request_prefill_time`` and ``request_decode_time`` histograms, so HTTP and
tokenisation are left out):

- prefills of N fresh tokens (random token ids no other request shares, ``max_tokens`` 1),
  for several N: the per-token and quadratic (attention) cost;
- a prefill of N tokens behind C cached ones (the same C-token prefix sent first): what
  attention over cached context adds;
- decode steps with B sequences running at once (``ignore_eos``, prompts short enough to
  prefill in one step together), and one sequence at a long context: the per-step cost
  and what the batch and the KV read add.

It then fits ``t = a + b N + c N^2 / 2`` to the fresh prefills and prints the preset values
that make the step-time model reproduce these points (gemm and attention efficiency
against the core's nominal FP32 peak, per-step overhead), with the model's time beside
each measured one. Without vLLM installed it prints why and exits 0. The machine is shared
(2 cores, other jobs), so repeat counts are medians and the figures carry that noise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np

from smetric.model.perf import Corrections, StepTimeModel, load_hardware, load_model
from smetric.testing.engines import (
    MODEL_NAME,
    VLLMServer,
    find_vllm,
    metric,
    start_engines,
    vllm_instances,
)

PREFILL_TOKENS = (32, 128, 256, 512, 1024, 1536)
CONTEXT_CASES = ((1024, 256), (1536, 256))  # (cached tokens, new tokens)
DECODE_BATCHES = (1, 2, 4, 8)
DECODE_TOKENS = 48
# Token ids drawn from the ordinary vocabulary (SmolLM2's special tokens are the first few).
_LOW_ID, _HIGH_ID = 200, 49_000


@dataclass
class Point:
    kind: str
    prefill_tokens: int
    cached_tokens: int
    batch: int
    seconds: float


class Engine:
    """One started instance and the counters it exposes."""

    def __init__(self, server: VLLMServer, client: aiohttp.ClientSession) -> None:
        self.server = server
        self.client = client
        self.rng = np.random.default_rng(0)

    def fresh(self, n: int) -> list[int]:
        return self.rng.integers(_LOW_ID, _HIGH_ID, n).tolist()

    async def counters(self) -> dict[str, float]:
        async with self.client.get(self.server.url + "/metrics") as reply:
            text = await reply.text()
        names = (
            "vllm:request_prefill_time_seconds_sum",
            "vllm:request_decode_time_seconds_sum",
            "vllm:request_success_total",
            "vllm:generation_tokens_total",
            "vllm:prompt_tokens_cached_total",
        )
        return {name: metric(text, name) for name in names}

    async def complete(self, prompt: list[int], max_tokens: int) -> dict:
        body = {
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
        }
        async with self.client.post(self.server.url + "/v1/completions", json=body) as reply:
            reply.raise_for_status()
            return await reply.json()

    async def timed(self, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
        """Counter deltas over ``prompts`` sent at once."""
        before = await self.counters()
        await asyncio.gather(*(self.complete(p, max_tokens) for p in prompts))
        # The histograms are updated when a request finishes, before its reply is sent.
        after = await self.counters()
        return {k: after[k] - before[k] for k in after}


async def measure(engine: Engine, repeats: int) -> list[Point]:
    points: list[Point] = []
    await engine.timed([engine.fresh(64)], 4)  # warm-up: first-call allocations
    for n in PREFILL_TOKENS:
        times = []
        for _ in range(repeats):
            delta = await engine.timed([engine.fresh(n)], 1)
            times.append(delta["vllm:request_prefill_time_seconds_sum"])
        points.append(Point("prefill", n, 0, 1, statistics.median(times)))
        print(f"prefill {n:>5} fresh tokens: {points[-1].seconds:.3f} s", flush=True)
    for cached, n in CONTEXT_CASES:
        times = []
        for _ in range(repeats):
            prefix = engine.fresh(cached)
            await engine.timed([prefix], 1)
            delta = await engine.timed([prefix + engine.fresh(n)], 1)
            hit = delta["vllm:prompt_tokens_cached_total"]
            if hit < cached - 32:
                raise RuntimeError(f"expected about {cached} cached tokens, vLLM reports {hit}")
            times.append(delta["vllm:request_prefill_time_seconds_sum"])
        points.append(Point("prefill", n, cached, 1, statistics.median(times)))
        print(f"prefill {n:>5} tokens after {cached} cached: {points[-1].seconds:.3f} s")
    for context in (64, 1024):
        # One sequence only at the long context: B of them would not prefill in one
        # 2,048-token step, and a later one's prefill would stretch the others' decode.
        for batch in DECODE_BATCHES if context == 64 else (1,):
            steps = []
            for _ in range(repeats):
                delta = await engine.timed(
                    [engine.fresh(context) for _ in range(batch)], DECODE_TOKENS
                )
                # A request's decode time spans its tokens after the first, all in
                # steps shared by the batch: the mean over requests is one step's time.
                per_request = delta["vllm:request_decode_time_seconds_sum"] / batch
                steps.append(per_request / (DECODE_TOKENS - 1))
            points.append(Point("decode", 0, context, batch, statistics.median(steps)))
            print(f"decode batch {batch} at context {context}: {points[-1].seconds * 1e3:.1f} ms")
    return points


def nominal_fp32_tflops() -> float:
    """One AVX2 core's FP32 peak: 2 FMA units x 8 lanes x 2 FLOP a cycle, at its clock."""
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    mhz = [float(line.split(":")[1]) for line in lines if "MHz" in line]
    return 32 * max(mhz) * 1e6 / 1e12


def fit(points: list[Point], peak_tflops: float | None = None) -> dict[str, float]:
    """Preset values from the measured points (see the module docstring): the gemm and
    attention efficiencies from the fresh prefills' linear and quadratic terms against
    ``peak_tflops`` (None: this machine's core, whose clock differs between machines), the
    step overhead as what one sequence's decode step takes beyond the preset's model of it
    without overhead (its weight and KV reads)."""
    model = load_model("SmolLM2-135M-Instruct")
    fresh = [p for p in points if p.kind == "prefill" and p.cached_tokens == 0]
    n = np.array([p.prefill_tokens for p in fresh], dtype=float)
    t = np.array([p.seconds for p in fresh])
    (a, b, c), *_ = np.linalg.lstsq(np.stack([np.ones_like(n), n, n * n / 2], 1), t, rcond=None)
    peak = (peak_tflops or nominal_fp32_tflops()) * 1e12
    flops_per_token = 2 * (model.dense_params + model.layers * model.top_k * model.expert_params)
    attn_flops = 4 * model.q_heads * model.head_dim * model.layers
    one = next(p for p in points if p.kind == "decode" and p.batch == 1 and p.cached_tokens == 64)
    bare = StepTimeModel(
        model,
        load_hardware("CPU-core"),
        weight_dtype="fp32",
        kv_dtype="fp32",
        corrections=Corrections(step_overhead_s=0.0, layer_overhead_s=0.0),
    )
    reads = bare.step_time(0, 0, 1, one.cached_tokens + DECODE_TOKENS // 2)
    return {
        "bf16_tflops": round(peak / 1e12, 4),
        "gemm_efficiency": round(flops_per_token / b / peak, 3),
        "attention_efficiency": round(attn_flops / max(c, 1e-12) / peak, 3),
        "step_overhead_s": round(one.seconds - reads, 4),
        "prefill_intercept_s": round(float(a), 4),
    }


def check(points: list[Point]) -> None:
    """The preset's model beside each measured point."""
    perf = StepTimeModel(
        load_model("SmolLM2-135M-Instruct"),
        load_hardware("CPU-core"),
        weight_dtype="fp32",
        kv_dtype="fp32",
    )
    print(f"{'point':<34}{'measured s':>12}{'model s':>10}")
    for p in points:
        if p.kind == "prefill":
            n, c = p.prefill_tokens, p.cached_tokens
            modelled = perf.step_time(n, n * (c + n / 2), 0, 0)
            label = f"prefill {n} after {c} cached"
        else:
            context = p.batch * (p.cached_tokens + DECODE_TOKENS // 2)
            modelled = perf.step_time(0, 0, p.batch, context)
            label = f"decode step, batch {p.batch}, ctx {p.cached_tokens}"
        print(f"{label:<34}{p.seconds:>12.4f}{modelled:>10.4f}")


async def run(args: argparse.Namespace) -> list[Point]:
    install = find_vllm()
    assert install is not None
    with tempfile.TemporaryDirectory(prefix="smetric-calib-") as scratch:
        (server,) = vllm_instances(install, Path(scratch), count=1)  # core 0
        try:
            await asyncio.to_thread(start_engines, [server])
            log = server.log_tail(200_000)
            for line in log.splitlines():
                if "KV cache" in line or "max_num_batched_tokens" in line or "blocks" in line:
                    print("vllm:", line.strip()[-160:])
            timeout = aiohttp.ClientTimeout(total=600)
            async with aiohttp.ClientSession(timeout=timeout) as client:
                return await measure(Engine(server, client), args.repeats)
        finally:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the measured points here")
    parser.add_argument("--points", type=Path, help="fit points written by --json, no engine")
    parser.add_argument(
        "--peak-tflops",
        type=float,
        help="the core's FP32 peak [default: 2 FMA units x 8 lanes at its clock, AVX2's]",
    )
    args = parser.parse_args()
    t0 = time.perf_counter()
    if args.points:
        points = [Point(**p) for p in json.loads(args.points.read_text())["points"]]
    elif find_vllm() is None:
        print("vLLM is not installed: run scripts/real_engines/setup_vllm.sh first; skipping.")
        return
    else:
        points = asyncio.run(run(args))
    if args.json:
        data = {"points": [p.__dict__ for p in points], "cpus": os.cpu_count()}
        args.json.write_text(json.dumps(data, indent=1) + "\n")
    print("fitted:", json.dumps(fit(points, args.peak_tflops)))
    check(points)
    print(f"total time {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
