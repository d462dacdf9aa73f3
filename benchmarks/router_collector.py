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

``wrk`` sends tiny bodies and then agent bodies (``agentic_bodies``, ~414 KB) at 32
connections to each in a rotating order, as ``router_throughput.py`` does. Printed per
body and target: requests/s and CPU time per request, the median and range over rounds;
then, over the whole run, each target's collector passes per generation, per thousand
requests, their mean CPU time and the objects they freed (a full pass lands on whatever
requests are in flight), and how many objects each tracks at the end.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from router_overhead import processes
from router_throughput import Target
from side_by_side import bodies_and_engines, print_cells, serve_command, side_by_side, start_target

# Run before ``smetric serve``: the collector's setting, and a record of every pass once it
# serves (generation: passes, CPU ns, objects freed) and of the objects the collector
# tracks at the end, written as JSON when the process exits.
PRELUDE = """
import atexit, gc, json, time
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
    count, ns, freed = passes.get(info["generation"], (0, 0, 0))
    spent = time.thread_time_ns() - started[0]
    passes[info["generation"]] = (count + 1, ns + spent, freed + info["collected"])
gc.callbacks.append(_timed)
def _record():
    with open({out!r}, "w") as out:
        json.dump({{"passes": passes, "tracked": len(gc.get_objects())}}, out)
atexit.register(_record)
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
        targets: dict[str, Target] = {}
        servers: list[subprocess.Popen[bytes]] = []
        for setting in SETTINGS:
            prelude = PRELUDE.format(setting=setting, out=str(folder / f"{setting}.json"))
            targets[setting], server = start_target(procs, serve_command(urls, prelude))
            servers.append(server)
        cells = side_by_side(targets, bodies, args.rounds, args.duration)
        for server in servers:  # a clean exit writes the record
            server.terminate()
            server.wait(30)
        records = {s: json.loads((folder / f"{s}.json").read_text()) for s in SETTINGS}
    print_cells(cells, "collector", 10, args.duration, args.rounds)
    served = dict.fromkeys(SETTINGS, 0.0)
    for (_, setting), runs in cells.items():
        served[setting] += sum(cell.rps for cell in runs) * args.duration
    print("\ncollector passes over the whole run (warm-ups included, about as many requests)")
    header = f"{'generation':>10} {'per 1,000 requests':>20} {'mean CPU ms':>12} {'freed':>8}"
    print(f"{'collector':<10} {header}")
    for setting, record in records.items():
        for generation, (count, ns, freed) in sorted(record["passes"].items()):
            per = count / served[setting] * 1000
            print(
                f"{setting:<10} {generation:>10} {per:>20.2f} {ns / count / 1e6:>12.3f} {freed:>8}"
            )
    print("\nobjects the collector tracks at the end (not frozen), in thousands:")
    print(", ".join(f"{s} {r['tracked'] / 1000:.0f}" for s, r in records.items()))


if __name__ == "__main__":
    main()
