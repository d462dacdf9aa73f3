"""What ``smetric serve --record`` costs on the request path: the same router with and without.

    python benchmarks/record_overhead.py [--rounds 5] [--requests 400] [--concurrency 16]

One mock engine (``--speed 0``: steps take no modelled time) sits behind two routers
started alike, one of them recording into a temporary folder. Both get the same load in
the same run, rounds interleaved (plain, recording, plain, ...), so that both see the same
machine state: agent sessions (``agentic_bodies``: system prompt, tools, a history of tool
calls and outputs growing by one exchange per request, ~20-120 kB), several sessions in
flight at once as an agent fleet sends them, and tiny bodies (one short message). Every
phase sends bodies no phase sent before, so neither router finds the other's prompts
cached. The recording router rotates a segment every second by default (``--rotate``;
``serve``'s default is 300 s), so its writer thread hashes, encodes and writes while the
load runs.

Prints, per body shape, requests/s, p50/p99 latency and the router process's CPU time per
request (its writer thread's included, read from /proc) as the median over rounds, and
recording/plain ratios with their range over rounds; then what was written. Throughput
and latency show what a client sees on this machine, where client, engine and routers
share the cores; the CPU ratio is the recording's cost wherever the bottleneck lies.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agentic_bodies import agent_messages, chat_body, session_turns
from router_overhead import (
    PhaseResult,
    Processes,
    drive,
    processes,
    quantile_ms,
    wait_ready,
)

from smetric.trace.load import load_trace

HISTORY_CHARS = 120_000


def agent_bodies(round_: int, tag: str, sessions: int) -> list[dict]:
    """Every turn of ``sessions`` agent sessions, interleaved (turn 0 of each, then turn 1,
    ...), each opening with the phase's tag so no other phase shares its prompts."""
    turns = []
    for s in range(sessions):
        messages = agent_messages(HISTORY_CHARS, seed=1000 * round_ + s)
        messages[1] = {"role": "user", "content": f"{tag} {round_}/{s}: {messages[1]['content']}"}
        turns.append([chat_body(t, max_tokens=8) for t in session_turns(messages)])
    longest = max(len(t) for t in turns)
    return [t[i] for i in range(longest) for t in turns if i < len(t)]


def tiny_bodies(round_: int, tag: str, count: int) -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": f"{tag} {round_}/{i}: hi"}], "max_tokens": 8}
        for i in range(count)
    ]


def cpu_s(pid: int) -> float:
    """User plus system CPU seconds a process has used (its threads' included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Phase:
    result: PhaseResult
    # The router's CPU seconds per request, the writer thread's included.
    cpu_per_request_s: float


def start_router(
    procs: Processes, engine: str, record: Path | None, rotate_s: float = 1.0
) -> tuple[str, int]:
    args = ["serve", "-e", engine]
    args += ["--kv-blocks", "65536", "--health-interval", "1", "--log-level", "warning"]
    if record is not None:
        args += ["--record", str(record), "--record-rotate", str(rotate_s)]
    url, proc = procs.start_smetric(args)
    return url, proc.pid


def summary(phases: Sequence[Phase]) -> tuple[float, float, float, float]:
    latencies = [x for p in phases for x in p.result.latencies]
    rps = statistics.median(p.result.rps for p in phases)
    cpu = statistics.median(p.cpu_per_request_s for p in phases)
    return rps, quantile_ms(latencies, 0.5), quantile_ms(latencies, 0.99), cpu * 1000


def ratio(name: str, values: Sequence[float]) -> str:
    return f"{name} {statistics.median(values):.3f} (rounds {min(values):.3f}-{max(values):.3f})"


def ratios(plain: Sequence[Phase], recording: Sequence[Phase]) -> str:
    pairs = list(zip(plain, recording, strict=True))
    throughput = [b.result.rps / a.result.rps for a, b in pairs]
    p50 = [
        quantile_ms(b.result.latencies, 0.5) / quantile_ms(a.result.latencies, 0.5)
        for a, b in pairs
    ]
    cpu = [b.cpu_per_request_s / a.cpu_per_request_s for a, b in pairs]
    return ", ".join(
        (ratio("throughput", throughput), ratio("p50 latency", p50), ratio("router CPU", cpu))
    )


async def run(
    rounds: int, requests: int, concurrency: int, sessions: int, rotate_s: float, shapes: str
) -> None:
    with tempfile.TemporaryDirectory() as scratch, processes() as procs:
        folder = Path(scratch) / "recording"
        engine, _ = procs.start_smetric(["engine", "--speed", "0", "--kv-blocks", "65536"])
        await wait_ready([engine])
        plain, plain_pid = start_router(procs, engine, None)
        recording, recording_pid = start_router(procs, engine, folder, rotate_s)
        await wait_ready([plain, recording])
        pids = {plain: plain_pid, recording: recording_pid}
        results: dict[tuple[str, str], list[Phase]] = {}
        makers = {
            "agent": lambda r, tag: agent_bodies(r, tag, sessions),
            "tiny": lambda r, tag: tiny_bodies(r, tag, requests),
        }
        chosen = {name: makers[name] for name in shapes.split(",")}
        for url, tag in ((plain, "warm-plain"), (recording, "warm-rec")):
            await drive(url, agent_bodies(99, tag, 2), concurrency, "warm")
        for r in range(rounds):
            for shape, make in chosen.items():
                for name, url in (("plain", plain), ("recording", recording)):
                    bodies = make(r, f"{name}-{shape}")
                    before = cpu_s(pids[url])
                    result = await drive(url, bodies, concurrency, name)
                    # The writer drains a few times a second: let it finish this phase.
                    await asyncio.sleep(0.5)
                    used = (cpu_s(pids[url]) - before) / max(result.requests, 1)
                    results.setdefault((shape, name), []).append(Phase(result, used))
        procs.stop()  # SIGTERM: the recording router writes what it still holds
        for shape in chosen:
            count = results[(shape, "plain")][0].result.requests
            print(f"\n{shape} bodies, {count} requests a round, concurrency {concurrency}:")
            print(f"{'':<12}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'CPU ms/req':>12}")
            for name in ("plain", "recording"):
                rps, p50, p99, cpu = summary(results[(shape, name)])
                print(f"{name:<12}{rps:>10.1f}{p50:>10.2f}{p99:>10.2f}{cpu:>12.3f}")
            both = results[(shape, "plain")], results[(shape, "recording")]
            print(f"recording / plain: {ratios(*both)}")
        failed = sum(p.result.failed for ps in results.values() for p in ps)
        trace = load_trace(folder)
        size = sum(p.stat().st_size for p in folder.glob("requests-*.parquet"))
        print(
            f"\nrecorded {trace.num_requests:,} requests in {size / 1e6:.2f} MB "
            f"({size / max(trace.num_requests, 1):,.0f} B a request); failed requests: {failed}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=400, help="Tiny bodies per round.")
    parser.add_argument("--sessions", type=int, default=8, help="Agent sessions per round.")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--rotate", type=float, default=1.0, help="Seconds between the recording's segments."
    )
    parser.add_argument("--shapes", default="agent,tiny", help="Body shapes: agent, tiny.")
    args = parser.parse_args()
    t0 = time.perf_counter()
    asyncio.run(
        run(args.rounds, args.requests, args.concurrency, args.sessions, args.rotate, args.shapes)
    )
    print(f"total time {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
