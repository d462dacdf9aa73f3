"""What the side-by-side router benchmarks share: the bodies and the trivial engines, a
router started under a prelude, and rounds in a rotating order, so that targets measured
in one run drift together (``router_interpreters``, ``router_commits``,
``router_collector``, ``router_parts``)."""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from agentic_bodies import agent_messages
from router_overhead import Processes, wait_ready
from router_throughput import BUSY, Cell, Target, start_trivial_engine, write_script, wrk
from router_vs_sglang import routes_chat

# ``smetric serve`` as ``python -c`` runs it, after whatever a prelude set up.
_SERVE = (
    "import runpy, sys\nsys.argv[0] = 'smetric'\nrunpy.run_module('smetric', run_name='__main__')\n"
)


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


def serve_command(
    urls: Sequence[str], prelude: str = "", python: str = sys.executable
) -> list[str]:
    """``smetric serve`` (one worker, on a free port) in front of ``urls``, ``prelude``
    run first in the same process."""
    engines = [arg for url in urls for arg in ("-e", url)]
    return [
        python,
        "-c",
        prelude + _SERVE,
        "serve",
        "--log-level",
        "warning",
        *engines,
        "--port",
        "0",
    ]


def start_target(procs: Processes, command: list[str]) -> tuple[Target, subprocess.Popen[bytes]]:
    """A router started and routing."""
    url, proc = procs.start_listening(command)
    asyncio.run(routes_chat(url))
    return Target(url, proc.pid), proc


def side_by_side(
    targets: dict[str, Target], bodies: dict[str, Path], rounds: int, duration: int
) -> dict[tuple[str, str], list[Cell]]:
    """Each body to every target at its ``BUSY`` connections (``router_throughput``),
    after a warm-up, in an order that rotates round by round so that none always runs
    first: cells by (body, target)."""
    cells: dict[tuple[str, str], list[Cell]] = {}
    for body, script in bodies.items():
        connections = BUSY[body]
        for target in targets.values():
            wrk(target, script, connections, 1)  # warm-up
        for round_ in range(rounds):
            order = list(targets.items())
            order = order[round_ % len(order) :] + order[: round_ % len(order)]
            for label, target in order:
                cell = wrk(target, script, connections, duration)
                cells.setdefault((body, label), []).append(cell)
    return cells


def print_cells(
    cells: dict[tuple[str, str], list[Cell]], label: str, width: int, duration: int, rounds: int
) -> None:
    """Requests/s and CPU time per request, median and range over rounds, per cell."""
    bodies = dict.fromkeys(body for body, _ in cells)
    at = ", ".join(f"{body} at c={BUSY[body]}" for body in bodies)
    print(f"wrk: {at}; {duration} s per cell, {rounds} rounds; median (range) over rounds")
    print(f"{'body':<6} {label:<{width}} {'req/s':>22} {'CPU us/req':>20}")
    for (body, name), runs in cells.items():
        rps, cpu = [c.rps for c in runs], [c.cpu_us for c in runs]
        print(f"{body:<6} {name:<{width}} {spread(rps, 8)} {spread(cpu, 7)}")
