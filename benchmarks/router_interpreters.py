"""``smetric serve`` and the bare pass-through under several Python interpreters, side by side.

    python benchmarks/router_interpreters.py --python 3.11=/path/to/python \\
        --python 3.12=/other/venv/bin/python [--rounds 3] [--duration 4]

Each interpreter needs smetric installed (``python -m pip install .`` in a venv of its
own) and, for a fair comparison, the same versions of aiohttp, uvloop and numpy. One pair
of trivial engines serves every target; ``wrk`` sends tiny bodies and then agent bodies
(``agent_bodies``, ~414 KB) at 32 connections to each in a rotating order, as
``router_throughput.py`` does. Printed per body and target: requests/s and CPU time per
request, the median and range over rounds. Whether a newer interpreter (or another build
of the same one) buys the router time shows here, beside what it buys the stack itself.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

from agentic_bodies import agent_messages
from router_overhead import processes, wait_ready
from router_throughput import HERE, Cell, Target, start_trivial_engine, write_script, wrk
from router_vs_sglang import routes_chat


def interpreters(specs: list[str]) -> dict[str, str]:
    """``NAME=PATH`` pairs; this interpreter alone without any."""
    if not specs:
        return {f"{sys.version_info.major}.{sys.version_info.minor}": sys.executable}
    found = {}
    for spec in specs:
        name, _, path = spec.partition("=")
        if not path or not Path(path).is_file():
            sys.exit(f"--python wants NAME=PATH to an interpreter, not {spec!r}")
        found[name] = path
    return found


def spread(values: list[float], width: int) -> str:
    return f"{statistics.median(values):>{width},.0f} ({min(values):,.0f}-{max(values):,.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", action="append", default=[], help="NAME=PATH (repeatable)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=int, default=4)
    args = parser.parse_args()
    pythons = interpreters(args.python)
    with tempfile.TemporaryDirectory() as tmp, processes() as procs:
        folder = Path(tmp)
        bodies = {
            "tiny": write_script(folder, "tiny", []),
            "agent": write_script(folder, "agent", agent_messages(414_000)),
        }
        urls = [start_trivial_engine(procs).url for _ in range(2)]
        asyncio.run(wait_ready(urls))
        engines = [arg for url in urls for arg in ("-e", url)]
        targets: dict[str, Target] = {}
        for name, python in pythons.items():
            commands = {
                f"smetric {name}": [
                    python,
                    "-m",
                    "smetric",
                    "serve",
                    "--log-level",
                    "warning",
                    *engines,
                    "--port",
                    "0",
                ],
                f"pass {name}": [python, str(HERE / "passthrough.py"), "0", "1", *urls],
            }
            for label, command in commands.items():
                url, proc = procs.start_listening(command)
                asyncio.run(routes_chat(url))
                targets[label] = Target(url, proc.pid)
        cells: dict[tuple[str, str], list[Cell]] = {}
        for body, script in bodies.items():
            for target in targets.values():
                wrk(target, script, 32, 1)  # warm-up
            for round_ in range(args.rounds):
                order = list(targets.items())
                order = order[round_ % len(order) :] + order[: round_ % len(order)]
                for label, target in order:
                    cell = wrk(target, script, 32, args.duration)
                    cells.setdefault((body, label), []).append(cell)
    print(f"wrk -c32, {args.duration} s per cell, {args.rounds} rounds; median (range) over rounds")
    print(f"{'body':<6} {'target':<22} {'req/s':>22} {'CPU us/req':>20}")
    for (body, label), runs in cells.items():
        rps, cpu = [c.rps for c in runs], [c.cpu_us for c in runs]
        print(f"{body:<6} {label:<22} {spread(rps, 8)} {spread(cpu, 7)}")


if __name__ == "__main__":
    main()
