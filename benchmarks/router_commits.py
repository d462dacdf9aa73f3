"""``smetric serve`` at several commits of this repository, side by side in one run.

    python benchmarks/router_commits.py --commit before=HEAD~1 --commit after=HEAD \\
        [--rounds 3] [--duration 4] [--stream]

Each commit is checked out in a temporary git worktree and served from there
(``PYTHONPATH`` puts it before the installed package), with this environment's packages;
the REV ``working`` serves the working tree as it is. One pair of trivial
engines serves every target; ``wrk`` sends tiny bodies and then agent bodies
(``agentic_bodies``, ~414 KB), with ``--stream`` tiny bodies whose replies stream 64 chunks
a millisecond apart, each at its ``BUSY`` connections (``router_throughput``: 32, a stream
8) to each in a rotating order, as ``router_interpreters.py`` does. Printed per body and
commit: requests/s and CPU time per request, the median and range over rounds. Runs
apart drift by more than a change's gain on this machine; targets side by side in one run
drift together.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from router_overhead import processes
from router_throughput import Target
from side_by_side import bodies_and_engines, print_cells, serve_command, side_by_side, start_target

REPO = Path(__file__).resolve().parent.parent


def commits(specs: list[str]) -> dict[str, str]:
    """``NAME=REV`` pairs (REV ``working``: the working tree)."""
    found = {}
    for spec in specs:
        name, _, rev = spec.partition("=")
        if not rev:
            sys.exit(f"--commit wants NAME=REV, not {spec!r}")
        found[name] = rev
    if len(found) < 2:
        sys.exit("give at least two --commit NAME=REV to compare")
    return found


@contextlib.contextmanager
def checked_out(revs: dict[str, str], folder: Path) -> Iterator[dict[str, Path]]:
    """A source tree per name: a detached worktree of its commit, removed afterwards."""
    trees: dict[str, Path] = {}
    try:
        for name, rev in revs.items():
            if rev == "working":
                trees[name] = REPO
                continue
            tree = folder / f"tree-{name}"
            git = ["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet"]
            subprocess.run([*git, str(tree), rev], check=True)
            trees[name] = tree
        yield trees
    finally:
        for tree in trees.values():
            if tree != REPO:
                remove = ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)]
                subprocess.run(remove, check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", action="append", default=[], help="NAME=REV (repeatable)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=int, default=4)
    parser.add_argument("--stream", action="store_true", help="also streamed replies")
    args = parser.parse_args()
    revs = commits(args.commit)
    with (
        tempfile.TemporaryDirectory() as tmp,
        checked_out(revs, Path(tmp)) as trees,
        processes() as procs,
    ):
        bodies, urls = bodies_and_engines(procs, Path(tmp), args.stream)
        targets: dict[str, Target] = {}
        for name, tree in trees.items():
            os.environ["PYTHONPATH"] = str(tree)  # inherited by the server started next
            targets[name], _ = start_target(procs, serve_command(urls))
        del os.environ["PYTHONPATH"]
        cells = side_by_side(targets, bodies, args.rounds, args.duration)
    print_cells(cells, "commit", 16, args.duration, args.rounds)


if __name__ == "__main__":
    main()
