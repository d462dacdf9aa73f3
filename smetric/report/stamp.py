"""Results pages: a measurement as a docs page, stamped with where it came from.

A number is only worth what is known of how it was made, so every results page says which
commit of the code, on which date, on which machine and by which command it was measured.
Commands that measure something (``smetric reproduce``, ``smetric grid``, the benchmarks)
write their page with :func:`write_results_page`; running the command again rewrites it.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

from smetric.core.errors import UserError

_REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Stamp:
    commit: str
    date: str
    machine: str
    command: str

    @classmethod
    def now(cls, command: str, repo: Path = _REPO) -> Stamp:
        """The stamp of a measurement made now, by ``command``, with the code in ``repo``."""
        when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        return cls(commit=git_commit(repo), date=when, machine=machine(), command=command)

    def markdown(self) -> str:
        """The stamp as an admonition block, to open a results page with."""
        return (
            '!!! info "How this page was made"\n\n'
            f"    - **Command:** `{self.command}`\n"
            f"    - **Commit:** {self.commit}\n"
            f"    - **Date:** {self.date}\n"
            f"    - **Machine:** {self.machine}\n"
        )


def git_commit(repo: Path = _REPO) -> str:
    """The commit the code was at, ``+ changes`` if its tree differed from it; the
    package version where the code is not a git checkout."""

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True
        )
        return done.stdout.strip()

    try:
        commit = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"unknown (smetric {version('smetric')}, not a git checkout)"
        except PackageNotFoundError:
            return "unknown (not a git checkout)"
    return f"{commit} + uncommitted changes" if dirty else commit


def machine() -> str:
    """CPU model, cores, memory and OS, as far as the platform tells them."""
    cpu = platform.processor() or platform.machine()
    try:
        info = Path("/proc/cpuinfo").read_text()
        cpu = next(
            line.split(":", 1)[1].strip() for line in info.splitlines() if "model name" in line
        )
    except (OSError, StopIteration):
        pass
    parts = [cpu, f"{os.cpu_count()} cores"]
    try:
        meminfo = Path("/proc/meminfo").read_text().split()
        parts.append(f"{int(meminfo[meminfo.index('MemTotal:') + 1]) / 2**20:.0f} GiB memory")
    except (OSError, ValueError, IndexError):
        pass
    parts.append(f"{platform.system()} {platform.release()}, Python {platform.python_version()}")
    return ", ".join(parts)


def results_page(title: str, body: str, stamp: Stamp, intro: str = "") -> str:
    """A results page: its title, the stamp, an optional introduction, then ``body``."""
    parts = [f"# {title}", stamp.markdown()]
    if intro:
        parts.append(intro.strip())
    parts.append(body.strip())
    return "\n\n".join(parts) + "\n"


def write_results_page(
    path: Path, title: str, body: str, command: str, intro: str = "", stamp: Stamp | None = None
) -> Path:
    """Write the page for a measurement ``command`` just made; the folder must exist (a
    typo in the path fails rather than scattering pages)."""
    if not path.parent.is_dir():
        raise UserError(f"{path}: folder {path.parent} does not exist")
    path.write_text(results_page(title, body, stamp or Stamp.now(command), intro))
    return path
