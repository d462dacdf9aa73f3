"""Router throughput and latency with tiny and agent-sized bodies and streamed replies,
against the peers and against the server stack itself.

    python benchmarks/router_throughput.py [--duration 4] [--rounds 3] [--history-kb 390]
                                           [--bodies tiny,agent,stream,agent+stream]
                                           [--stream-chunks 64]

Two trivial engines (``trivial_engine.py``: they read the body and answer at once) sit
behind each router, and ``wrk`` drives every target in turn from one process, in one run:
directly to an engine; through a bare aiohttp pass-through (``passthrough.py``: read the
body, post it to an engine, return the reply, a stream chunk by chunk) with 1 and 2
processes, the floor of the stack ``smetric serve`` runs on, and with 1 process as a relay
below aiohttp's client and stream API (*relay*, ``--protocol-relay``: what a request and a
chunk could cost on that stack) and with the same
engine leg read a chunk at a time by the handler (*reads*, ``--protocol-reads``); through
smg's and sglang-router's ``cache_aware`` policy (each where installed); and through
``smetric serve`` with 1 and with 2 workers. Four bodies: *tiny* (one short user message);
*agent*, an agent's history (``agentic_bodies``, ~390 KB, ~100 k tokens) plus a new user
turn per request, as a session's next call would be; *stream*, a tiny body asking for a
stream, whose reply comes as 64 chunks a millisecond apart (``--stream-chunks``), as
agents ask for every reply; and *agent+stream*, both at once: what an agent's call sends
and gets back. ``--bodies`` runs some of them. Each cell is ``--duration`` seconds at 1
connection and at ``BUSY`` connections, after a one-second warm-up of each body; rounds
interleave the targets.

Prints, per body and target, requests/s at ``BUSY`` connections, the target's CPU time per
request (all its processes), and the latency it adds at 1 connection (its mean latency
less the engine's own, measured directly in the same round), each as the median and range
over rounds. Then smetric (1 and 2 workers) over each peer and over the pass-through with
as many processes (the router's share of its stack's rate), ratio by ratio within each
round (the targets of a round ran back to back, so a burst of other load hits them alike).
The load average before and after is printed with them: figures from a busy machine
compare only within their run. Needs ``wrk`` (``apt-get install wrk``) and at least one
peer (``pip install smg==1.13.0``, ``pip install sglang-router``); without them it says
so and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from agentic_bodies import agent_messages, chat_body
from router_overhead import Processes, processes, wait_ready
from router_vs_sglang import PEERS, peer_available, routes_chat, start_peer_router
from trivial_engine import STREAM_CHUNKS

HERE = Path(__file__).parent
LUA = """
local f = io.open("%s", "rb"); local prefix = f:read("*a"); f:close()
f = io.open("%s", "rb"); local suffix = f:read("*a"); f:close()
local n = 0
request = function()
  n = n + 1
  return wrk.format("POST", "/v1/chat/completions",
                    {["Content-Type"] = "application/json"}, prefix .. n .. suffix)
end
"""
UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}
# Connections per body under load. A streamed reply takes 64 ms whatever the router, so at
# 32 connections a router that spends more per chunk is saturated, reads the chunks that
# piled up meanwhile in one go and so spends less per reply than on a load it keeps up
# with; at 8, none of the targets is saturated and each reads every chunk on its own.
BUSY = {"tiny": 32, "agent": 32, "stream": 8, "agent+stream": 8}


@dataclass(frozen=True)
class Target:
    url: str
    pid: int  # the process whose CPU time (its children's included) the target costs


@dataclass(frozen=True)
class Cell:
    rps: float
    latency_ms: float
    cpu_us: float  # the target's CPU time per request: robust to other load on the machine


def start_trivial_engine(procs: Processes, chunks: int = STREAM_CHUNKS) -> Target:
    """A trivial engine whose streamed replies come in ``chunks`` chunks."""
    script = [sys.executable, str(HERE / "trivial_engine.py"), "0", str(chunks)]
    url, proc = procs.start_listening(script)
    return Target(url, proc.pid)


def start_smetric(procs: Processes, engines: list[str], workers: int) -> Target:
    args = ["serve", "--workers", str(workers), "--log-level", "warning"]
    for engine in engines:
        args += ["-e", engine]
    url, proc = procs.start_smetric(args)
    return Target(url, proc.pid)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of ``pid`` and its live children (forked workers)."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(entry.name) == pid or int(fields[1]) == pid:
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def write_script(folder: Path, name: str, messages: list[dict], stream: bool = False) -> Path:
    """A wrk script sending ``messages`` plus a user turn numbered per request (``stream``:
    asking for a stream, last in the body, where the trivial engine looks)."""
    marker = "@@N@@"
    fields = chat_body([*messages, {"role": "user", "content": f"next {marker}"}])
    body = json.dumps({**fields, "stream": True} if stream else fields)
    prefix, suffix = body.split(marker)
    (folder / f"{name}.prefix").write_text(prefix)
    (folder / f"{name}.suffix").write_text(suffix)
    script = folder / f"{name}.lua"
    script.write_text(LUA % (folder / f"{name}.prefix", folder / f"{name}.suffix"))
    return script


def wrk(target: Target, script: Path, connections: int, seconds: int) -> Cell:
    """One wrk run against ``target``; non-2xx replies fail the run."""
    args = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--timeout", "30s"]
    args += ["-s", str(script), target.url]
    cpu = cpu_seconds(target.pid)
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    cpu = cpu_seconds(target.pid) - cpu
    if "Non-2xx" in out or "Socket errors" in out:
        raise RuntimeError(f"{target.url}: errors under load:\n{out}")
    (rps,) = _report(r"Requests/sec:\s+([\d.]+)", out)
    (requests,) = _report(r"(\d+) requests in", out)
    value, unit = _report(r"Latency\s+([\d.]+)(us|ms|s)", out)
    return Cell(float(rps), float(value) * UNITS[unit], cpu / max(int(requests), 1) * 1e6)


def _report(pattern: str, out: str) -> tuple[str, ...]:
    """The groups of ``pattern`` in wrk's report, which must hold it."""
    found = re.search(pattern, out)
    if found is None:
        raise RuntimeError(f"wrk's report has no {pattern!r}:\n{out}")
    return found.groups()


async def targets(procs: Processes, chunks: int) -> dict[str, Target]:
    engines = [start_trivial_engine(procs, chunks) for _ in range(2)]
    urls = [e.url for e in engines]
    await wait_ready(urls)
    found = {"direct": engines[0]}
    for workers in (1, 2):
        script = [sys.executable, str(HERE / "passthrough.py"), "0", str(workers), *urls]
        url, proc = procs.start_listening(script)
        found[f"pass x{workers}"] = Target(url, proc.pid)
    for name, flag in (("relay x1", "--protocol-relay"), ("reads x1", "--protocol-reads")):
        relay = [sys.executable, str(HERE / "passthrough.py"), "0", "1", *urls, flag]
        url, proc = procs.start_listening(relay)
        found[name] = Target(url, proc.pid)
    for peer in PEERS:
        if peer_available(peer):
            found[peer] = Target(start_peer_router(procs, urls, peer), procs.procs[-1].pid)
    for workers in (1, 2):
        found[f"smetric x{workers}"] = start_smetric(procs, urls, workers)
    for target in found.values():
        await routes_chat(target.url)
    return found


def spread(values: list[float], digits: int = 2) -> str:
    """Median and range: ``1.23 (1.10-1.31)``."""
    return f"{np.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def added(cells: list[Cell], direct: list[Cell]) -> list[float]:
    """Each round's mean latency less the engine's own in that round, ms."""
    return [c.latency_ms - d.latency_ms for c, d in zip(cells, direct, strict=True)]


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


Runs = dict[tuple[str, int, str], list[Cell]]


def report(runs: Runs, names: list[str], bodies: list[str]) -> None:
    """Per target, then smetric's ratios to each peer and to its own stack."""
    print(
        f"{'body':<12}{'target':<12}{'req/s busy':>24}{'CPU us/req busy':>24}"
        f"{'added ms at c=1':>24}"
    )
    for body in bodies:
        direct = runs[body, 1, "direct"]
        for name in names:
            busy = runs[body, BUSY[body], name]
            own = "(the engine)" if name == "direct" else spread(added(runs[body, 1, name], direct))
            print(
                f"{body:<12}{name:<12}{spread([c.rps for c in busy], 0):>24}"
                f"{spread([c.cpu_us for c in busy], 0):>24}{own:>24}"
            )
    print("\nsmetric over each reference, each round's ratio: median (range) over rounds")
    print(
        f"{'body':<12}{'smetric':<12}{'over':<10}{'req/s busy':>22}{'CPU/req busy':>22}"
        f"{'added ms at c=1':>22}"
    )
    for body in bodies:
        direct = runs[body, 1, "direct"]
        for workers in (1, 2):
            ours = f"smetric x{workers}"
            for other in (*(p for p in PEERS if p in names), f"pass x{workers}"):
                mine, theirs = runs[body, BUSY[body], ours], runs[body, BUSY[body], other]
                rps = [a.rps / b.rps for a, b in zip(mine, theirs, strict=True)]
                cpu = [a.cpu_us / b.cpu_us for a, b in zip(mine, theirs, strict=True)]
                mine_ms = added(runs[body, 1, ours], direct)
                theirs_ms = added(runs[body, 1, other], direct)
                lat = [a / b for a, b in zip(mine_ms, theirs_ms, strict=True) if b > 0]
                print(
                    f"{body:<12}{ours:<12}{other:<10}{spread(rps):>22}{spread(cpu):>22}"
                    f"{(spread(lat) if lat else 'n/a'):>22}"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=int, default=4)
    parser.add_argument("--history-kb", type=int, default=390)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--bodies",
        type=lambda text: text.split(","),
        default=list(BUSY),
        help=f"which bodies, comma-separated, of {','.join(BUSY)}",
    )
    parser.add_argument(
        "--stream-chunks",
        type=int,
        default=STREAM_CHUNKS,
        help="chunks in a streamed reply, a token each (an agent's reply is often hundreds)",
    )
    args = parser.parse_args()
    if args.stream_chunks < 1:
        parser.error("--stream-chunks: a streamed reply has at least one chunk")
    unknown = set(args.bodies) - set(BUSY)
    if unknown:
        parser.error(
            f"no such body: {', '.join(sorted(unknown))}; the bodies are {', '.join(BUSY)}"
        )
    if not any(map(peer_available, PEERS)) or shutil.which("wrk") is None:
        print("needs wrk (apt-get install wrk) and smg or sglang-router (pip install smg)")
        return
    t0 = time.perf_counter()
    load_before = load_average()
    history = agent_messages(args.history_kb * 1000)
    with tempfile.TemporaryDirectory() as tmp, processes() as procs:
        folder = Path(tmp)
        every = {
            "tiny": write_script(folder, "tiny", []),
            "agent": write_script(folder, "agent", history),
            "stream": write_script(folder, "stream", [], stream=True),
            "agent+stream": write_script(folder, "agent-stream", history, stream=True),
        }
        bodies = {name: script for name, script in every.items() if name in args.bodies}
        size = (folder / "agent.prefix").stat().st_size // 1000
        urls = asyncio.run(targets(procs, args.stream_chunks))
        for body, script in bodies.items():
            for url in urls.values():
                wrk(url, script, BUSY[body], 1)  # warm-up: connections, caches, the memo
        # Rounds interleave the targets, so that a burst of other load hits them all alike.
        runs: Runs = {}
        for _ in range(args.rounds):
            for body, script in bodies.items():
                for connections in (1, BUSY[body]):
                    for name, url in urls.items():
                        cell = wrk(url, script, connections, args.duration)
                        runs.setdefault((body, connections, name), []).append(cell)
    print(
        f"\n2 trivial engines; wrk -t1, {args.duration} s per cell, {args.rounds} rounds; "
        f"agent = {size} KB; streams of {args.stream_chunks} chunks; busy = {BUSY} "
        "connections; median (range) over rounds"
    )
    report(runs, list(urls), list(bodies))
    print(f"\nload average (1, 5, 15 min) before {load_before}, after {load_average()}")
    print(f"total time {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
