"""SMetric's router against smg's and sglang-router's cache-aware policies on the same
agentic load.

    python benchmarks/router_vs_sglang.py [--duration 30] [--engines 4] [--speed 0.05]

Each router gets 4 fresh mock engines (subprocesses, so no router inherits another's warm
caches) and the same closed-loop agentic sessions from the embedded WEKA sample, driven by
``smetric replay``'s ``Replayer`` with the same seed and duration: every turn resends the
conversation so far plus the engine's answer and new tool output, so a router that keeps
a session on one engine turns most of each prompt into cache hits. Reported per router:
completed requests/s and p50/p90 end-to-end latency (streamed, send to last token, as the
replayer measures it), the cluster's prefix-cache hit ratio and the load imbalance (max
over mean of requests finished per engine), both from the engines' ``/metrics`` deltas,
which every router leaves equally observable.

Neither peer is a dependency: ``pip install smg==1.13.0`` or ``pip install sglang-router``
first; each runs where installed, and without either this prints why and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from router_overhead import (
    LOCALHOST,
    Processes,
    processes,
    quantile_ms,
    start_engine,
    start_smetric_router,
    wait_ready,
)

from smetric.demo import DemoOptions
from smetric.engine import EngineConfig
from smetric.replay import Replayer, ReplayOptions
from smetric.testing.ports import port_for_external
from smetric.trace.load import DEFAULT_SAMPLE, load_trace
from smetric.trace.schema import Trace

COUNTERS = (
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:request_success_total",
)
# What the mock engines report, and every request names: smg routes by it.
MODEL = EngineConfig().served_model_name
# "policy xN" runs ``smetric serve --workers N``.
# "PEER cache_aware" runs that peer's router (``PEERS``), where it is installed.
ROUTERS = ("smetric", "smetric x2", "least_load", "sglang cache_aware", "smg cache_aware")


@dataclass
class Outcome:
    router: str
    duration_s: float
    latencies: list[float] = field(default_factory=list)
    failed: int = 0
    per_engine: list[dict[str, float]] = field(default_factory=list)

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.duration_s

    @property
    def hit_ratio(self) -> float:
        hits = sum(e["vllm:prefix_cache_hits_total"] for e in self.per_engine)
        queries = sum(e["vllm:prefix_cache_queries_total"] for e in self.per_engine)
        return hits / queries if queries else 0.0

    @property
    def imbalance(self) -> float:
        served = [e["vllm:request_success_total"] for e in self.per_engine]
        mean = sum(served) / len(served)
        return max(served) / mean if mean else float("nan")


# Rust routers with cache-aware policies and a Python launcher each, same flags:
# ``pip install sglang-router`` and ``pip install smg`` (1.13).
PEERS = {"sglang": "sglang_router", "smg": "smg"}


def peer_available(peer: str) -> bool:
    return importlib.util.find_spec(PEERS[peer]) is not None


def start_peer_router(procs: Processes, engines: Sequence[str], peer: str = "sglang") -> str:
    """``peer``'s router (``PEERS``) with its ``cache_aware`` policy in front of ``engines``."""
    # Picked here: the router says the ports it bound nowhere this reads. A benchmark
    # runs alone on a quiet machine, where a port is not taken meanwhile; if it were, the
    # router would exit and the wait for it fail plainly.
    port = port_for_external()
    args = [sys.executable, "-m", f"{PEERS[peer]}.launch_router", "--worker-urls", *engines]
    args += ["--policy", "cache_aware", "--host", LOCALHOST, "--port", str(port)]
    args += ["--log-level", "warn", "--prometheus-port", str(port_for_external())]
    procs.start(args)
    return f"http://{LOCALHOST}:{port}"


async def scrape(client: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with client.get(url + "/metrics") as reply:
        text = await reply.text()
    values = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name] += sample.value
    return values


async def routes_chat(router: str, model: str = "m", timeout_s: float = 60.0) -> None:
    """Wait until a chat request goes through: a router may be up before its workers are.
    It names the engines' ``model``, which smg needs to route it."""
    body = {"model": model, "messages": [{"role": "user", "content": "ready?"}], "max_tokens": 1}
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as client:
        while True:
            try:
                async with client.post(router + "/v1/chat/completions", json=body) as reply:
                    if reply.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{router} does not route chat requests")
            await asyncio.sleep(0.5)


async def measure(
    name: str, router: str, engines: Sequence[str], trace: Trace, options: ReplayOptions
) -> tuple[Outcome, Replayer]:
    """Replay ``options`` through ``router``; the engines' counters are read before and after."""
    outcome = Outcome(name, options.duration_s)
    async with aiohttp.ClientSession() as probe:
        before = [await scrape(probe, url) for url in engines]
        replayer = Replayer(trace, options)
        await replayer.run()
        after = [await scrape(probe, url) for url in engines]
    # End-to-end time of every request that finished (streamed, to its last token).
    outcome.latencies = [
        r.finished_s - r.arrival_s
        for r in replayer.records.values()
        if r.finished_s is not None and not r.rejected
    ]
    outcome.failed = replayer.progress.failed
    outcome.per_engine = [
        {k: a[k] - b[k] for k in COUNTERS} for a, b in zip(after, before, strict=True)
    ]
    return outcome, replayer


async def run_one(name: str, args: argparse.Namespace, trace: Trace) -> Outcome:
    options = DemoOptions(
        engines=args.engines,
        session_rate=args.rate,
        duration_s=args.duration,
        engine_speed=args.speed,
        seed=args.seed,
    )
    with processes() as procs:
        engines = [start_engine(procs, args.speed, options.kv_blocks) for _ in range(args.engines)]
        await wait_ready(engines)
        peer = name.split()[0]
        if peer in PEERS:
            router = start_peer_router(procs, engines, peer)
        else:
            policy, _, workers = name.partition(" x")
            router = start_smetric_router(
                procs, engines, policy, options.kv_blocks, int(workers or 1)
            )
        await routes_chat(router, MODEL)
        replay = ReplayOptions(
            url=router,
            model=MODEL,
            rate=options.session_rate,
            duration_s=options.duration_s,
            time_scale=options.time_scale,
            token_scale=options.token_scale,
            seed=options.seed,
        )
        outcome, _ = await measure(name, router, engines, trace, replay)
    return outcome


def report(outcomes: list[Outcome], title: str) -> None:
    """One row per router, then the first router's ratios to each of the others."""
    print(f"\n{title}")
    head = f"{'router':<20}{'req/s':>8}{'p50 ms':>9}{'p90 ms':>9}{'hit ratio':>11}"
    print(head + f"{'imbalance':>11}{'failed':>8}  requests per engine")
    for o in outcomes:
        served = " ".join(f"{e['vllm:request_success_total']:.0f}" for e in o.per_engine)
        print(
            f"{o.router:<20}{o.rps:>8.1f}{quantile_ms(o.latencies, 0.5):>9.1f}"
            f"{quantile_ms(o.latencies, 0.9):>9.1f}{o.hit_ratio:>11.3f}{o.imbalance:>11.2f}"
            f"{o.failed:>8}  {served}"
        )
    ours = outcomes[0]
    for other in outcomes[1:]:
        print(
            f"smetric / {other.router}: req/s {ours.rps / other.rps:.2f}, "
            f"p50 {quantile_ms(ours.latencies, 0.5) / quantile_ms(other.latencies, 0.5):.2f}, "
            f"p90 {quantile_ms(ours.latencies, 0.9) / quantile_ms(other.latencies, 0.9):.2f}, "
            f"hit ratio {ours.hit_ratio / other.hit_ratio:.2f}, "
            f"imbalance {ours.imbalance / other.imbalance:.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--speed", type=float, default=0.05)
    parser.add_argument("--rate", type=float, default=2.0, help="session starts per second")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    routers = [r for r in ROUTERS if r.split()[0] not in PEERS or peer_available(r.split()[0])]
    if not any(r.split()[0] in PEERS for r in routers):
        print("neither smg nor sglang-router is installed (pip install smg); skipping.")
        return
    t0 = time.perf_counter()
    trace = load_trace(DEFAULT_SAMPLE)
    outcomes = [asyncio.run(run_one(name, args, trace)) for name in routers]
    report(
        outcomes,
        f"{args.engines} mock engines at speed {args.speed}, {DEFAULT_SAMPLE} sessions at "
        f"{args.rate}/s, {args.duration:.0f} s each, seed {args.seed}",
    )
    print(f"total time {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
