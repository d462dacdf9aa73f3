"""``smetric serve`` and the bare pass-through under several Python interpreters, side by side.

    python benchmarks/router_interpreters.py --python 3.11=/path/to/python \\
        --python 3.12=/other/venv/bin/python [--rounds 3] [--duration 4]

Each interpreter needs smetric installed (``python -m pip install .`` in a venv of its
own) and, for a fair comparison, the same versions of aiohttp, uvloop and numpy. One pair
of trivial engines serves every target; ``wrk`` sends tiny bodies and then agent bodies
(``agentic_bodies``, ~414 KB) at 32 connections to each in a rotating order, as
``router_throughput.py`` does. Printed per body and target: requests/s and CPU time per
request, the median and range over rounds. Whether a newer interpreter (or another build
of the same one) buys the router time shows here, beside what it buys the stack itself.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from router_overhead import processes
from router_throughput import HERE, Target
from side_by_side import bodies_and_engines, print_cells, serve_command, side_by_side, start_target


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", action="append", default=[], help="NAME=PATH (repeatable)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=int, default=4)
    args = parser.parse_args()
    pythons = interpreters(args.python)
    with tempfile.TemporaryDirectory() as tmp, processes() as procs:
        bodies, urls = bodies_and_engines(procs, Path(tmp))
        targets: dict[str, Target] = {}
        for name, python in pythons.items():
            commands = {
                f"smetric {name}": serve_command(urls, python=python),
                f"pass {name}": [python, str(HERE / "passthrough.py"), "0", "1", *urls],
            }
            for label, command in commands.items():
                targets[label], _ = start_target(procs, command)
        cells = side_by_side(targets, bodies, args.rounds, args.duration)
    print_cells(cells, "target", 22, args.duration, args.rounds)


if __name__ == "__main__":
    main()
