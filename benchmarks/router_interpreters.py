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
from router_overhead import Processes, processes, wait_ready
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


def bodies_and_engines(
    procs: Processes, folder: Path, stream: bool = False
) -> tuple[dict[str, Path], list[str]]:
    """The wrk scripts of a tiny and an agent body (``stream``: and of a tiny body whose
    reply streams), and two trivial engines' URLs."""
    bodies = {
        "tiny": write_script(folder, "tiny", []),
        "agent": write_script(folder, "agent", agent_messages(414_000)),
    }
    if stream:
        bodies["stream"] = write_script(folder, "stream", [], stream=True)
    urls = [start_trivial_engine(procs).url for _ in range(2)]
    asyncio.run(wait_ready(urls))
    return bodies, urls


def side_by_side(
    targets: dict[str, Target], bodies: dict[str, Path], rounds: int, duration: int
) -> dict[tuple[str, str], list[Cell]]:
    """Each body to every target at 32 connections, after a warm-up, in an order that
    rotates round by round so that none always runs first: cells by (body, target)."""
    cells: dict[tuple[str, str], list[Cell]] = {}
    for body, script in bodies.items():
        for target in targets.values():
            wrk(target, script, 32, 1)  # warm-up
        for round_ in range(rounds):
            order = list(targets.items())
            order = order[round_ % len(order) :] + order[: round_ % len(order)]
            for label, target in order:
                cells.setdefault((body, label), []).append(wrk(target, script, 32, duration))
    return cells


def print_cells(cells: dict[tuple[str, str], list[Cell]], label: str, width: int) -> None:
    """Requests/s and CPU time per request, median and range over rounds, per cell."""
    print(f"{'body':<6} {label:<{width}} {'req/s':>22} {'CPU us/req':>20}")
    for (body, name), runs in cells.items():
        rps, cpu = [c.rps for c in runs], [c.cpu_us for c in runs]
        print(f"{body:<6} {name:<{width}} {spread(rps, 8)} {spread(cpu, 7)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", action="append", default=[], help="NAME=PATH (repeatable)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=int, default=4)
    args = parser.parse_args()
    pythons = interpreters(args.python)
    with tempfile.TemporaryDirectory() as tmp, processes() as procs:
        bodies, urls = bodies_and_engines(procs, Path(tmp))
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
        cells = side_by_side(targets, bodies, args.rounds, args.duration)
    print(f"wrk -c32, {args.duration} s per cell, {args.rounds} rounds; median (range) over rounds")
    print_cells(cells, "target", 22)


if __name__ == "__main__":
    main()
