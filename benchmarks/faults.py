"""The router's fault suite at full size: the table of docs/results/fault-suite.md.

    python benchmarks/faults.py [--streams 200] [--requests 200] [--aborts 50]

Starts four mock engines (``smetric engine --speed 1``) and, per scenario, a fresh
``smetric serve`` process and any misbehaving engine, all on 127.0.0.1, and prints one
Markdown row per scenario (``smetric/testing/fault_suite.py`` says what each column
counts). ``tests/test_fault_suite.py`` runs the same scenarios smaller and asserts the
must-be-zero columns.
"""

from __future__ import annotations

import argparse
import asyncio

from smetric.testing.fault_suite import Scale, run_suite, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=Scale.streams)
    parser.add_argument("--requests", type=int, default=Scale.requests)
    parser.add_argument("--aborts", type=int, default=Scale.aborts)
    options = parser.parse_args()
    scale = Scale(streams=options.streams, requests=options.requests, aborts=options.aborts)
    print(table(asyncio.run(run_suite(scale))))


if __name__ == "__main__":
    main()
