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
import subprocess
import sys
import tempfile
from pathlib import Path

from router_interpreters import bodies_and_engines, print_cells, side_by_side
from router_overhead import processes
from router_throughput import Target
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, processes() as procs:
        folder = Path(tmp)
        bodies, urls = bodies_and_engines(procs, folder)
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
        cells = side_by_side(
            {s: t for s, (t, _) in targets.items()}, bodies, args.rounds, args.duration
        )
        for server in servers:  # a clean exit writes the passes
            server.terminate()
            server.wait(30)
        passes = {s: json.loads(out.read_text()) for s, (_, out) in targets.items()}
    print(f"wrk -c32, {args.duration} s per cell, {args.rounds} rounds; median (range) over rounds")
    print_cells(cells, "collector", 10)
    served = dict.fromkeys(SETTINGS, 0.0)
    for (_, setting), runs in cells.items():
        served[setting] += sum(cell.rps for cell in runs) * args.duration
    print("\ncollector passes over the whole run (warm-ups included, about as many requests)")
    print(f"{'collector':<10} {'generation':>10} {'per 1,000 requests':>20} {'mean CPU ms':>12}")
    for setting, generations in passes.items():
        for generation, (count, ns) in sorted(generations.items()):
            per = count / served[setting] * 1000
            print(f"{setting:<10} {generation:>10} {per:>20.2f} {ns / count / 1e6:>12.3f}")


if __name__ == "__main__":
    main()
