"""What parts of ``smetric serve``'s request path cost, by taking each out in turn.

    python benchmarks/router_parts.py [--rounds 5] [--duration 4] [--body tiny|agent|stream]

Every target is the same ``smetric serve`` (one worker, as shipped) in front of one pair
of trivial engines, but for one part replaced by a stand-in that does nothing, so that
the difference in CPU time per request is what the part costs, measured where it runs
(with the caches, the allocator and the loop as they are under load) rather than
estimated from a profile:

- *read timeouts*: an attempt's reads of the engine's reply unbounded (``Attempt._bound``);
- *metrics*: prometheus_client's counters, gauges and histograms updated by nothing;
- *usage*: the reply's ``usage`` not parsed (no cached or output tokens counted);
- *collector*: the garbage collector off once serving (the floor its passes allow);

*none of these*, all four taken out at once (what the rest of the path costs); and *as
shipped, again*, a second process of the router as shipped: what two processes
of the same code differ by, the noise floor under these differences.

Such a router is not one to run: each stand-in breaks what the part is for. ``wrk`` sends
the chosen body at its ``BUSY`` connections (32, a stream 8) to each target in a
rotating order, as ``router_throughput.py`` does; printed per target: requests/s, CPU
time per request (median and range over rounds), and the median of each round's
difference from the router as shipped.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from router_overhead import processes
from router_throughput import Target
from side_by_side import bodies_and_engines, print_cells, serve_command, side_by_side, start_target

# Run before ``smetric serve``, each taking one part out.
STAND_INS = {
    "as shipped": "",
    # A second process of the same code: the differences between two alike, the floor
    # under which a part's cost reads as nothing.
    "as shipped, again": "",
    "no read timeouts": (
        "from smetric.serve import upstream\nupstream.Attempt._bound = lambda self, seconds: None\n"
    ),
    "no metrics": (
        "from prometheus_client import metrics, values\n"
        "for name in ('inc', 'set'):\n"
        "    setattr(values.MutexValue, name, lambda self, *args, **kwargs: None)\n"
        "metrics.Histogram.observe = lambda self, *args, **kwargs: None\n"
    ),
    "no usage": (
        "from smetric.serve import forwarding\nforwarding.UsageTap._usages = lambda self: []\n"
    ),
    "no collector": (
        "import gc\n"
        "from smetric.serve import collector\n"
        "collector.settle = lambda: (gc.freeze(), gc.disable())\n"
    ),
}
STAND_INS["none of these"] = "".join(STAND_INS.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=int, default=4)
    parser.add_argument("--body", choices=("tiny", "agent", "stream"), default="tiny")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, processes() as procs:
        bodies, urls = bodies_and_engines(procs, Path(tmp), stream=args.body == "stream")
        targets: dict[str, Target] = {}
        for name, stand_in in STAND_INS.items():
            targets[name], _ = start_target(procs, serve_command(urls, stand_in))
        body = {args.body: bodies[args.body]}
        cells = side_by_side(targets, body, args.rounds, args.duration)
    print_cells(cells, "target", 20, args.duration, args.rounds)
    shipped = cells[(args.body, "as shipped")]
    print("\nwhat the part costs a request: the median of each round's CPU us difference")
    for (_, name), runs in cells.items():
        if name != "as shipped":
            saved = [a.cpu_us - b.cpu_us for a, b in zip(shipped, runs, strict=True)]
            print(f"{name:<20} {statistics.median(saved):>8.1f} us")


if __name__ == "__main__":
    main()
