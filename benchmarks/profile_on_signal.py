"""Run a Python program with ``cProfile`` switched on and off by signals.

    python profile_on_signal.py OUT (-m MODULE | SCRIPT) [ARGS...]

SIGUSR1 starts profiling; SIGUSR2 stops it and writes the profile to OUT, then OUT.done,
so that a benchmark can count a server's steady state alone, without its start-up.
"""

from __future__ import annotations

import cProfile
import runpy
import signal
import sys
from pathlib import Path
from types import FrameType


def main() -> None:
    out = Path(sys.argv[1])
    profile = cProfile.Profile()

    def start(signum: int, frame: FrameType | None) -> None:
        profile.enable()

    def stop(signum: int, frame: FrameType | None) -> None:
        profile.disable()
        profile.dump_stats(out)
        out.with_name(out.name + ".done").touch()

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    if sys.argv[2] == "-m":
        sys.argv = sys.argv[3:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[2:]
        runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
