"""Python function calls per tiny request: ``smetric serve`` against the bare pass-through.

    python benchmarks/router_calls.py [--duration 4]

Each target runs behind two trivial engines while ``wrk`` sends tiny chat bodies at 32
connections (as ``router_throughput.py`` does): a second of warm-up, then ``cProfile``
switched on for the timed run alone (``profile_on_signal.py``), so that start-up and
warm-up stay out. Printed: the calls per request (all calls over the requests wrk
counted) and by where the called function lives. Calls are deterministic where timings
are not, so this says what a request costs the interpreter on any machine (within a few
calls: background work such as the engines' scrapes falls in the window or not); the
profiler itself slows both targets alike.
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
from router_throughput import HERE, Target, start_trivial_engine, write_script
from router_vs_sglang import routes_chat


def profiled(procs: Processes, out: Path, args: list[str]) -> tuple[Target, subprocess.Popen]:
    """A target started with its profiler off (``profile_on_signal.py``)."""
    command = [sys.executable, str(HERE / "profile_on_signal.py"), str(out), *args]
    url, proc = procs.start_listening(command)
    return Target(url, proc.pid), proc


def requests_sent(target: Target, script: Path, seconds: int) -> int:
    args = ["wrk", "-t1", "-c32", f"-d{seconds}s", "-s", str(script), target.url]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    if "Non-2xx" in out or "Socket errors" in out:
        raise RuntimeError(f"{target.url}: errors under load:\n{out}")
    return int(out.split(" requests in")[0].split()[-1])


def steady(target: Target, script: Path, out: Path, seconds: int) -> tuple[int, pstats.Stats]:
    """The requests of a timed run after a second's warm-up, and its profile alone."""
    requests_sent(target, script, 1)
    os.kill(target.pid, signal.SIGUSR1)
    sent = requests_sent(target, script, seconds)
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
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, processes() as procs:
        folder = Path(tmp)
        script = write_script(folder, "tiny", [])
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
            sent, profile = steady(target, script, out, args.duration)
            proc.terminate()
            stats = profile.stats  # type: ignore[attr-defined]
            total = sum(calls for _, calls, *_ in stats.values())
            by: collections.Counter[str] = collections.Counter()
            for (filename, *_), (_, calls, *_) in stats.items():
                by[where(filename)] += calls
            parts = ", ".join(f"{key} {count / sent:.0f}" for key, count in by.most_common(6))
            print(f"{name:<14} {sent:>7,} requests  {total / sent:>6.0f} calls each  ({parts})")


if __name__ == "__main__":
    main()
