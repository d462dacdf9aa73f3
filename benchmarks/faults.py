"""The router's fault suite at full size: the table of docs/results/fault-suite.md.

    python benchmarks/faults.py [--streams 200] [--requests 200] [--aborts 50]
    python benchmarks/faults.py --page docs/results/fault-suite.md   # rewrite that page

Starts four mock engines (``smetric engine --speed 1``) and, per scenario, a fresh
``smetric serve`` process and any misbehaving engine, all on 127.0.0.1, and prints one
Markdown row per scenario (``smetric/testing/fault_suite.py`` says what each column
counts). ``tests/test_fault_suite.py`` runs the same scenarios smaller and asserts the
must-be-zero columns.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
from pathlib import Path

from smetric.report.stamp import write_results_page
from smetric.testing.fault_suite import Scale, run_suite, table

INTRO = """\
`smetric serve` and four `smetric engine --speed 1` as processes, misbehaving engines from
`smetric/testing/faulty.py`, all on loopback, a fresh router per scenario with 5 s
first-byte and idle timeouts. Each request ends completed (a whole answer, a stream with
its `[DONE]`), with a clean error (an OpenAI-style JSON body or a stream's error event),
aborted by its client on purpose, unclean (anything else) or hung (not ended after 60 s);
then the router's `/metrics` must show nothing in flight and no live mock engine ejected.
The KV-event rows feed one engine's view from a publisher of the benchmark's own (valid
batches, the fault, five more valid batches). `tests/test_fault_suite.py` runs the same
scenarios smaller and asserts the columns that must be zero."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=Scale.streams)
    parser.add_argument("--requests", type=int, default=Scale.requests)
    parser.add_argument("--aborts", type=int, default=Scale.aborts)
    parser.add_argument("--page", type=Path, help="also write the table as this results page")
    options = parser.parse_args()
    if options.page is not None and not options.page.parent.is_dir():
        parser.error(f"--page {options.page}: folder {options.page.parent} does not exist")
    scale = Scale(streams=options.streams, requests=options.requests, aborts=options.aborts)
    markdown = table(asyncio.run(run_suite(scale)))
    print(markdown)
    if options.page is not None:
        command = shlex.join(["python", "benchmarks/faults.py", *sys.argv[1:]])
        write_results_page(options.page, "The router under faults", markdown, command, INTRO)
        print(f"wrote {options.page}")


if __name__ == "__main__":
    main()
