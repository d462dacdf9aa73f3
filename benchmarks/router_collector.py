"""``smetric serve`` with its garbage-collector settings, with CPython's defaults, and with
the collector off, side by side.

    python benchmarks/router_collector.py [--rounds 3] [--duration 4]

The three targets are the same ``smetric serve`` (one worker) in front of one pair of
trivial engines; they differ only in what runs before it serves:

- *settled*: ``serve.collector.settle``, as shipped (what exists frozen out of
  collection, young passes every ``collector.YOUNG`` net allocations);
- *default*: what exists frozen, CPython's default thresholds (700, 10, 10);
- *off*: what exists frozen, the collector disabled: the floor, not a setting to ship
  (nothing would ever free a cycle).

``wrk`` sends tiny bodies and then agent bodies (``agent_bodies``, ~414 KB) at 32
connections to each in a rotating order, as ``router_throughput.py`` does. Printed per
body and target: requests/s and CPU time per request, the median and range over rounds;
then, over the whole run, each target's collector passes per generation, per thousand
requests, and their mean CPU time: a full pass lands on whatever requests are in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from agentic_bodies import agent_messages
from router_overhead import processes, wait_ready
from router_throughput import Cell, Target, start_trivial_engine, write_script, wrk
from router_vs_sglang import routes_chat

# Run before ``smetric serve``: the collector's setting, and a record of every pass
# (generation, CPU time) written as JSON when the process exits.
PRELUDE = """
import atexit, gc, json, sys, time
from smetric.serve import collector
SETTINGS = {{
    "settled": collector.settle,
    "default": gc.freeze,
    "off": lambda: (gc.freeze(), gc.disable()),
}}
passes = {{}}
# Only the passes once it serves: start-up's imports make many.
collector.settle = lambda: (SETTINGS[{setting!r}](), passes.clear())
started = [0]
def _timed(phase, info):
    if phase == "start":
        started[0] = time.thread_time_ns()
        return
    count, ns = passes.get(info["generation"], (0, 0))
    passes[info["generation"]] = (count + 1, ns + time.thread_time_ns() - started[0])
gc.callbacks.append(_timed)
atexit.register(lambda: open({out!r}, "w").write(json.dumps(passes)))
sys.argv = ["smetric", *sys.argv[1:]]
import runpy
runpy.run_module("smetric", run_name="__main__")
"""

SETTINGS = ("settled", "default", "off")


def spread(values: list[float], width: int) -> str:
    return f"{statistics.median(values):>{width},.0f} ({min(values):,.0f}-{max(values):,.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, processes() as procs:
        folder = Path(tmp)
        bodies = {
            "tiny": write_script(folder, "tiny", []),
            "agent": write_script(folder, "agent", agent_messages(414_000)),
        }
        urls = [start_trivial_engine(procs).url for _ in range(2)]
        asyncio.run(wait_ready(urls))
        engines = [arg for url in urls for arg in ("-e", url)]
        targets: dict[str, tuple[Target, Path]] = {}
        servers: list[subprocess.Popen[bytes]] = []
        for setting in SETTINGS:
            out = folder / f"{setting}.json"
            code = PRELUDE.format(setting=setting, out=str(out))
            command = [sys.executable, "-c", code, "serve", "--log-level", "warning"]
            url, proc = procs.start_listening([*command, *engines, "--port", "0"])
            asyncio.run(routes_chat(url))
            targets[setting] = (Target(url, proc.pid), out)
            servers.append(proc)
        cells: dict[tuple[str, str], list[Cell]] = {}
        served = dict.fromkeys(SETTINGS, 0.0)
        for body, script in bodies.items():
            for target, _ in targets.values():
                wrk(target, script, 32, 1)  # warm-up
            for round_ in range(args.rounds):
                order = list(targets.items())
                order = order[round_ % len(order) :] + order[: round_ % len(order)]
                for setting, (target, _) in order:
                    cell = wrk(target, script, 32, args.duration)
                    cells.setdefault((body, setting), []).append(cell)
                    served[setting] += cell.rps * args.duration
        for server in servers:  # a clean exit writes the passes
            server.terminate()
            server.wait(30)
        passes = {s: json.loads(out.read_text()) for s, (_, out) in targets.items()}
    print(f"wrk -c32, {args.duration} s per cell, {args.rounds} rounds; median (range) over rounds")
    print(f"{'body':<6} {'collector':<10} {'req/s':>22} {'CPU us/req':>20}")
    for (body, setting), runs in cells.items():
        rps, cpu = [c.rps for c in runs], [c.cpu_us for c in runs]
        print(f"{body:<6} {setting:<10} {spread(rps, 8)} {spread(cpu, 7)}")
    print("\ncollector passes over the whole run (warm-ups included, about as many requests)")
    print(f"{'collector':<10} {'generation':>10} {'per 1,000 requests':>20} {'mean CPU ms':>12}")
    for setting, generations in passes.items():
        for generation, (count, ns) in sorted(generations.items()):
            per = count / served[setting] * 1000
            print(f"{setting:<10} {generation:>10} {per:>20.2f} {ns / count / 1e6:>12.3f}")


if __name__ == "__main__":
    main()
