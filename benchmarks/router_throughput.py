"""Router throughput and latency with tiny and agent-sized bodies, against sglang-router.

    python benchmarks/router_throughput.py [--duration 4] [--rounds 3] [--history-kb 390]

Two trivial engines (``trivial_engine.py``: they read the body and answer at once) sit
behind each router, and ``wrk`` drives every target in turn from one process, in one run:
directly to an engine, through sglang-router's ``cache_aware`` policy, and through
``smetric serve`` with 1 and with 2 workers. Two bodies: *tiny* (one short user message)
and *long*, an agent's history (``agent_bodies``, ~390 KB, ~100 k tokens) plus a new user
turn per request, as a session's next call would be. Each cell is ``--duration`` seconds at
1 and at 32 connections, after a one-second warm-up of each body; rounds interleave the
targets and each cell reports its median over them.

Prints requests/s and mean latency per cell, then smetric (1 and 2 workers) over
sglang-router: throughput ratio and latency ratio. Needs
``wrk`` (``apt-get install wrk``) and ``pip install sglang-router``; without them it says
so and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from agentic_bodies import agent_messages, chat_body
from router_overhead import LOCALHOST, Processes, free_port, processes, wait_ready
from router_vs_sglang import routes_chat, sglang_available, start_sglang_router

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


def start_trivial_engine(procs: Processes) -> str:
    port = free_port()
    procs.start([sys.executable, str(HERE / "trivial_engine.py"), str(port)])
    return f"http://{LOCALHOST}:{port}"


def start_smetric(procs: Processes, engines: list[str], workers: int) -> str:
    port = free_port()
    args = [sys.executable, "-m", "smetric", "serve", "--port", str(port), "--workers"]
    args += [str(workers), "--log-level", "warning"]
    for url in engines:
        args += ["-e", url]
    procs.start(args)
    return f"http://{LOCALHOST}:{port}"


def write_script(folder: Path, name: str, messages: list[dict]) -> Path:
    """A wrk script sending ``messages`` plus a user turn numbered per request."""
    marker = "@@N@@"
    body = json.dumps(chat_body([*messages, {"role": "user", "content": f"next {marker}"}]))
    prefix, suffix = body.split(marker)
    (folder / f"{name}.prefix").write_text(prefix)
    (folder / f"{name}.suffix").write_text(suffix)
    script = folder / f"{name}.lua"
    script.write_text(LUA % (folder / f"{name}.prefix", folder / f"{name}.suffix"))
    return script


def median_cell(cells: list[tuple[float, float]]) -> tuple[float, float]:
    """The median requests/s and the median mean latency over rounds."""
    return float(np.median([c[0] for c in cells])), float(np.median([c[1] for c in cells]))


def wrk(url: str, script: Path, connections: int, seconds: int) -> tuple[float, float]:
    """Requests/s and mean latency in ms of one wrk run; non-2xx replies fail the run."""
    args = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "-s", str(script), url]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    if "Non-2xx" in out or "Socket errors" in out:
        raise RuntimeError(f"{url}: errors under load:\n{out}")
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    value, unit = re.search(r"Latency\s+([\d.]+)(us|ms|s)", out).groups()
    return rps, float(value) * UNITS[unit]


async def targets(procs: Processes) -> dict[str, str]:
    engines = [start_trivial_engine(procs) for _ in range(2)]
    await wait_ready(engines)
    urls = {"direct": engines[0], "sglang": start_sglang_router(procs, engines)}
    for workers in (1, 2):
        urls[f"smetric x{workers}"] = start_smetric(procs, engines, workers)
    for url in urls.values():
        await routes_chat(url)
    return urls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=int, default=4)
    parser.add_argument("--history-kb", type=int, default=390)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not sglang_available() or shutil.which("wrk") is None:
        print("needs wrk (apt-get install wrk) and sglang-router (pip install sglang-router)")
        return
    t0 = time.perf_counter()
    history = agent_messages(args.history_kb * 1000)
    with tempfile.TemporaryDirectory() as tmp, processes() as procs:
        folder = Path(tmp)
        bodies = {"tiny": write_script(folder, "tiny", [])}
        bodies["long"] = write_script(folder, "long", history)
        size = (folder / "long.prefix").stat().st_size // 1000
        urls = asyncio.run(targets(procs))
        results: dict[tuple[str, int, str], tuple[float, float]] = {}
        for body, script in bodies.items():
            for name, url in urls.items():
                wrk(url, script, 32, 1)  # warm-up: connections, caches, the memo
                for connections in (1, 32):
                    results[body, connections, name] = wrk(url, script, connections, args.duration)
    print(f"\n2 trivial engines; wrk -t1, {args.duration:.0f} s per cell; long = {size} KB")
    print(
        f"{'body':<6}{'c':>4}" + "".join(f"{n:>24}" for n in urls) + f"{'smetric x1 / sglang':>24}"
    )
    for body in bodies:
        for connections in (1, 32):
            row = [results[body, connections, n] for n in urls]
            cells = "".join(f"{rps:>10.0f} req/s {ms:>6.2f} ms" for rps, ms in row)
            ours, theirs = (
                results[body, connections, "smetric x1"],
                results[body, connections, "sglang"],
            )
            ratio = f"{ours[0] / theirs[0]:>8.2f}x {ours[1] / theirs[1]:>6.2f}x lat"
            print(f"{body:<6}{connections:>4}{cells}{ratio:>24}")
    print(f"total time {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
