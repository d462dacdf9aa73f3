"""``smetric pick`` behind Envoy against ``smetric serve``, on agent-sized bodies.

    python benchmarks/picker_vs_serve.py [--rounds 3] [--requests 200] [--concurrency 8]
                                         [--stream]

Four paths to the same two trivial engines (``trivial_engine.py``: they answer at once,
so what is measured is the path, not the engine), all in one run, round by round in a
rotating order so that every path sees the same machine state:

- **direct**: client to engine;
- **envoy**: client, Envoy (the shipped configuration less its ext_proc filter, round robin
  over the engines), engine: what the gateway costs by itself;
- **serve**: client, ``smetric serve``, engine;
- **pick**: client, Envoy, ext_proc to ``smetric pick`` (the body sent there whole over
  gRPC, the decision made, Envoy forwarding its own copy), engine;
- **null**: the same, to a picker that decides nothing (``null_picker.py``: the picker's
  gRPC stack and messages, always naming the first engine): the floor under any picker
  on that stack, so that what pick costs splits into the exchange and the picker's work.

Bodies are coding-agent sessions (``agentic_bodies.py``): the last turns of sessions of
about ``--body-kb`` KB each, resent as an agent resends them. With ``--stream`` they ask
for a streamed reply, as an agent's calls do: the engines send 64 chunks a millisecond
apart, and Envoy passes each to the picker and waits for its answer before it passes it
on, so the CPU per request then holds what each path spends per chunk. The rates are
then bounded by the replies' 64 ms rather than by the paths. Each round measures every
path's throughput (closed loop, ``--concurrency`` clients; one request is one routing
decision for serve and pick) and its latency at concurrency 1. Reported: the median over
rounds and the spread (min to max); the added latency of each path over direct; the gRPC
hop's cost, pick's latency less Envoy's and less the picker's own analysis and decision,
timed in this process on the same bodies with the same routing core; and the CPU each
process on a path spends per request in the throughput phases (from ``/proc``, Linux),
which, unlike the rates, hardly moves with what else the machine runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
from agentic_bodies import agent_messages, chat_body, session_turns
from router_overhead import processes, quantile_ms, wait_ready

from smetric.gateway.picker import Picker
from smetric.serve.app import Router, RouterSettings
from smetric.serve.engines import Engine
from smetric.testing.gateway import gateway_config, run_envoy, run_picker

TRIVIAL = Path(__file__).resolve().parent / "trivial_engine.py"
NULL_PICKER = Path(__file__).resolve().parent / "null_picker.py"
PATHS = ("direct", "envoy", "serve", "pick", "null")
ROLES = ("envoy", "router", "engines")
"""The processes a path's CPU is counted for: Envoy, the router (serve or the picker), and
the engines."""


def bodies(sessions: int, turns: int, body_kb: int, stream: bool = False) -> list[bytes]:
    """The last ``turns`` turns of each session, interleaved as concurrent agents send them
    (``stream``: asking for a streamed reply, last in the body, where the trivial engine
    looks)."""
    per_session = [
        session_turns(agent_messages(body_kb * 1000, seed=s))[-turns:] for s in range(sessions)
    ]
    return [
        json.dumps(
            {**chat_body(turn, max_tokens=8), **({"stream": True} if stream else {})}
        ).encode()
        for step in range(turns)
        for session in per_session
        for turn in session[step : step + 1]
    ]


def envoy_only(engines: Sequence[str]) -> dict:
    """The shipped Envoy configuration without the picker (its filter and its cluster):
    round robin over the engines."""
    config = gateway_config(0, list(engines))
    resources = config["static_resources"]
    manager = resources["listeners"][0]["filter_chains"][0]["filters"][0]
    filters = manager["typed_config"]["http_filters"]
    manager["typed_config"]["http_filters"] = [
        f for f in filters if f["name"] != "envoy.filters.http.ext_proc"
    ]
    resources["clusters"] = [c for c in resources["clusters"] if c["name"] != "picker"]
    return config


async def drive(url: str, payloads: Sequence[bytes], concurrency: int) -> tuple[float, list[float]]:
    """Closed loop over ``payloads``: (requests/s, latencies); any failure aborts."""
    latencies: list[float] = []
    queue = iter(payloads)
    headers = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as client:

        async def worker() -> None:
            for payload in queue:
                start = time.perf_counter()
                async with client.post(
                    url + "/v1/chat/completions", data=payload, headers=headers
                ) as reply:
                    body = await reply.read()
                    if reply.status != 200:
                        raise RuntimeError(f"{url}: {reply.status} {body[:200]!r}")
                latencies.append(time.perf_counter() - start)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return len(latencies) / wall, latencies


async def decision_cost(engines: Sequence[str], payloads: Sequence[bytes]) -> float:
    """Median seconds the picker spends analysing and deciding one body, in process."""
    router = Router([Engine(u, 16384) for u in engines], RouterSettings(policy="smetric"))
    picker = Picker(router)
    headers = {":method": "POST", "content-type": "application/json"}
    costs = []
    for payload in payloads:
        started = time.perf_counter()
        pick = await picker.pick("/v1/chat/completions", headers, payload, None)
        costs.append(time.perf_counter() - started)
        picker.served(pick, pick.endpoint, 200)
        picker.finished(pick, complete=True)
    return statistics.median(costs[len(costs) // 4 :])  # past the first, memo-cold quarter


def cpu_seconds(pids: Sequence[int]) -> float:
    """User and system CPU the processes ``pids`` (all their threads) have used so far;
    NaN where ``/proc`` is not there to read."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return float("nan")
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def spread(values: Sequence[float], digits: int = 1) -> str:
    low, mid, high = (
        f"{v:.{digits}f}" for v in (min(values), statistics.median(values), max(values))
    )
    return f"{mid} ({low}-{high})"


async def measure(
    args: argparse.Namespace,
    urls: dict[str, str],
    payloads: list[bytes],
    pids: dict[str, dict[str, list[int]]],
) -> dict:
    """Each path's rates, latencies and CPU per request by role (``pids``: path, role,
    its processes), round by round."""
    results: dict[str, dict[str, list[float]]] = {
        p: {"rps": [], "p50": [], "p99": [], **{r: [] for r in ROLES}} for p in PATHS
    }
    single = payloads[: args.latency_requests]
    for path in PATHS:  # warm every path (connections, the routers' memos) before measuring
        await drive(urls[path], payloads[: 2 * args.concurrency], args.concurrency)
    for round_ in range(args.rounds):
        order = PATHS[round_ % len(PATHS) :] + PATHS[: round_ % len(PATHS)]
        for path in order:
            before = {role: cpu_seconds(pids[path].get(role, [])) for role in ROLES}
            rps, _ = await drive(urls[path], payloads, args.concurrency)
            for role in ROLES:
                used = cpu_seconds(pids[path].get(role, [])) - before[role]
                results[path][role].append(used / len(payloads) * 1000)
            _, latencies = await drive(urls[path], single, 1)
            results[path]["rps"].append(rps)
            results[path]["p50"].append(quantile_ms(latencies, 0.5))
            results[path]["p99"].append(quantile_ms(latencies, 0.99))
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    return results


def report(args: argparse.Namespace, results: dict, decision_ms: float, size_kb: float) -> None:
    print(
        f"\n{args.rounds} rounds; {args.requests} requests per throughput phase at concurrency "
        f"{args.concurrency}, {args.latency_requests} at concurrency 1; bodies {size_kb:.0f} KB "
        "on average; median over rounds (min-max)\n"
    )
    print("| path | requests/s | p50 ms (c=1) | p99 ms (c=1) | added p50 ms over direct |")
    print("|---|---|---|---|---|")
    direct = statistics.median(results["direct"]["p50"])
    for path in PATHS:
        row = results[path]
        added = [p - direct for p in row["p50"]]
        added_text = "-" if path == "direct" else spread(added)
        print(
            f"| {path} | {spread(row['rps'])} | {spread(row['p50'])} | {spread(row['p99'])} "
            f"| {added_text} |"
        )
    print("\nCPU ms per request (c=8), median over rounds (min-max)\n")
    print("| path | " + " | ".join(ROLES) + " | all |")
    print("|---" * (len(ROLES) + 2) + "|")
    for path in PATHS:
        row = results[path]
        total = [sum(parts) for parts in zip(*(row[r] for r in ROLES), strict=True)]
        cells = [spread(row[r], 2) if any(row[r]) else "-" for r in ROLES]
        print(f"| {path} | " + " | ".join(cells) + f" | {spread(total, 2)} |")
    pick_over_envoy = [
        p - e for p, e in zip(results["pick"]["p50"], results["envoy"]["p50"], strict=True)
    ]
    hop = [x - decision_ms for x in pick_over_envoy]
    rps = [p / s for p, s in zip(results["pick"]["rps"], results["serve"]["rps"], strict=True)]
    print(f"\npick / serve throughput (decisions/s): {spread(rps)}x")
    print(f"pick over envoy alone, p50: {spread(pick_over_envoy)} ms")
    print(f"the picker's analysis and decision, in process: {decision_ms:.2f} ms per body")
    print(f"the gRPC hop (pick over envoy, less the decision): {spread(hop)} ms")
    floor = [n / s for n, s in zip(results["null"]["rps"], results["serve"]["rps"], strict=True)]
    print(f"a picker that decides nothing / serve throughput: {spread(floor)}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--latency-requests", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--body-kb", type=int, default=400)
    parser.add_argument(
        "--stream",
        action="store_true",
        help="ask for streamed replies: 64 chunks a millisecond apart, as an agent's call",
    )
    args = parser.parse_args()
    turns = max(1, args.requests // args.sessions)
    payloads = bodies(args.sessions, turns, args.body_kb, args.stream)[: args.requests]
    size_kb = statistics.mean(len(p) for p in payloads) / 1000
    with processes() as procs:
        started = [procs.start_listening([sys.executable, str(TRIVIAL), "0"]) for _ in range(2)]
        engines = [url for url, _ in started]
        serve_args = ["serve", "--policy", "smetric", "--log-level", "warning"]
        serve, serving = procs.start_smetric(
            [*serve_args, *(a for e in engines for a in ("-e", e))]
        )
        urls = {"direct": engines[0], "serve": serve}
        asyncio.run(wait_ready([*engines, urls["serve"]]))
        pick_args = [a for e in engines for a in ("-e", e)]
        null_url, null_picker = procs.start_listening(
            [sys.executable, str(NULL_PICKER), urlsplit(engines[0]).netloc]
        )
        with (
            run_picker([*pick_args, "--policy", "smetric", "--log-level", "warning"]) as picker,
            run_envoy(gateway_config(picker.grpc_port, engines)) as gateway,
            run_envoy(gateway_config(urlsplit(null_url).port or 0, engines)) as floor,
            run_envoy(envoy_only(engines)) as plain,
        ):
            urls |= {"pick": gateway.url, "null": floor.url, "envoy": plain.url}
            both = {"engines": [proc.pid for _, proc in started]}
            pids = {
                "direct": {"engines": both["engines"][:1]},
                "envoy": {**both, "envoy": [plain.process.pid]},
                "serve": {**both, "router": [serving.pid]},
                "pick": {**both, "envoy": [gateway.process.pid], "router": [picker.process.pid]},
                "null": {**both, "envoy": [floor.process.pid], "router": [null_picker.pid]},
            }
            results = asyncio.run(measure(args, urls, payloads, pids))
        decision_ms = asyncio.run(decision_cost(engines, payloads)) * 1000
    report(args, results, decision_ms, size_kb)


if __name__ == "__main__":
    main()
