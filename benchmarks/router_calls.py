"""Python function calls per request: ``smetric serve`` against the bare pass-through.

    python benchmarks/router_calls.py [--duration 4] [--body tiny|stream] [--top 0]

Each target runs behind two trivial engines while ``wrk`` sends tiny chat bodies (with
``--body stream``, asking for replies that stream 64 chunks a millisecond apart) at the
body's ``BUSY`` connections, as ``router_throughput.py`` does: a second of warm-up, then
``cProfile`` switched on for the timed run alone (``profile_on_signal.py``), so that
start-up and warm-up stay out. Printed: the calls per request (all calls over the
requests wrk counted) and by where the called function lives; with ``--top N``, the N
functions called most often a request outside the builtins (a coroutine resumed counts as
a call: ``readany`` called and resumed once a chunk shows each chunk read on its own).
Calls are deterministic where timings are not, so this says what a request costs the
interpreter on any machine (within a few calls: background work such as the engines'
scrapes falls in the window or not); the profiler itself slows both targets alike. A
stream's calls are so only while the target keeps up: one that falls behind reads the
chunks that piled up in one go, and makes fewer calls for them.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from router_overhead import Processes, processes, wait_ready
from router_throughput import BUSY, HERE, Target, start_trivial_engine, write_script
from router_vs_sglang import routes_chat


def profiled(procs: Processes, out: Path, args: list[str]) -> tuple[Target, subprocess.Popen]:
    """A target started with its profiler off (``profile_on_signal.py``)."""
    command = [sys.executable, str(HERE / "profile_on_signal.py"), str(out), *args]
    url, proc = procs.start_listening(command)
    return Target(url, proc.pid), proc


def requests_sent(target: Target, script: Path, seconds: int, connections: int = 32) -> int:
    args = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "-s", str(script), target.url]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    if "Non-2xx" in out or "Socket errors" in out:
        raise RuntimeError(f"{target.url}: errors under load:\n{out}")
    return int(out.split(" requests in")[0].split()[-1])


def steady(
    target: Target, script: Path, out: Path, seconds: int, connections: int = 32
) -> tuple[int, pstats.Stats]:
    """The requests of a timed run after a second's warm-up, and its profile alone."""
    requests_sent(target, script, 1, connections)
    os.kill(target.pid, signal.SIGUSR1)
    sent = requests_sent(target, script, seconds, connections)
    os.kill(target.pid, signal.SIGUSR2)
    done = out.with_name(out.name + ".done")
    while not done.exists():
        time.sleep(0.05)
    return sent, pstats.Stats(str(out))


def where(filename: str) -> str:
    if "/smetric/" in filename:
        return "smetric"
    if "site-packages/" in filename:
        return filename.split("site-packages/")[1].split("/")[0].removesuffix(".py")
    return "builtins" if filename == "~" else "standard library"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=int, default=4)
    parser.add_argument("--body", choices=("tiny", "stream"), default="tiny")
    parser.add_argument("--top", type=int, default=0, help="list the N most called functions")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, processes() as procs:
        folder = Path(tmp)
        script = write_script(folder, args.body, [], stream=args.body == "stream")
        urls = [start_trivial_engine(procs).url for _ in range(2)]
        asyncio.run(wait_ready(urls))
        engines = [arg for url in urls for arg in ("-e", url)]
        commands = {
            "smetric serve": ["-m", "smetric", "serve", "--log-level", "warning", *engines],
            "pass-through": [str(HERE / "passthrough.py"), "0", "1", *urls],
        }
        for name, command in commands.items():
            out = folder / f"{name}.prof"
            if name == "smetric serve":
                command = [*command, "--port", "0"]
            target, proc = profiled(procs, out, command)
            asyncio.run(routes_chat(target.url))
            sent, profile = steady(target, script, out, args.duration, BUSY[args.body])
            proc.terminate()
            stats = profile.stats  # type: ignore[attr-defined]
            total = sum(calls for _, calls, *_ in stats.values())
            by: collections.Counter[str] = collections.Counter()
            for (filename, *_), (_, calls, *_) in stats.items():
                by[where(filename)] += calls
            parts = ", ".join(f"{key} {count / sent:.0f}" for key, count in by.most_common(6))
            print(f"{name:<14} {sent:>7,} requests  {total / sent:>6.0f} calls each  ({parts})")
            named = [(calls, key) for key, (_, calls, *_) in stats.items() if key[0] != "~"]
            for calls, (filename, _, function) in sorted(named, reverse=True)[: args.top]:
                print(f"{calls / sent:>10.1f}  {where(filename)}: {Path(filename).stem}.{function}")


if __name__ == "__main__":
    main()
