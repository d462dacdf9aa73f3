"""Loading and analysing the real WEKA Claude Code folder: time and peak memory.

    python benchmarks/trace_load.py [PATH/weka-claude-code]

Each stage runs in a fresh process so that its peak RSS is its own. The baseline is the
least any loader must do, gunzip + json.load of every file; the ratio says what the
normalised table (ids namespaced, sessions linked, triggers classified) costs on top.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DEFAULT = Path(__file__).resolve().parents[2] / "shared" / "traces" / "weka-claude-code"

STAGES = {
    "gunzip + json.load (baseline)": """
import gzip, json
from pathlib import Path
for f in sorted(Path(FOLDER).glob("*.json.gz")):
    json.load(gzip.open(f))
""",
    "smetric load (normalised table)": """
from smetric.trace.load import load_trace
load_trace(FOLDER)
""",
    "smetric load + analyze": """
from smetric.trace.load import load_trace
from smetric.trace.analysis import analyze
analyze(load_trace(FOLDER))
""",
}

TIMER = """
import resource, time
t0 = time.perf_counter()
{body}
elapsed = time.perf_counter() - t0
print(elapsed, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def run(body: str, folder: Path) -> tuple[float, float]:
    code = TIMER.format(body=body.replace("FOLDER", repr(str(folder))))
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    seconds, kib = out.stdout.split()
    return float(seconds), float(kib) / 1024


def main() -> None:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT
    results = {name: run(body, folder) for name, body in STAGES.items()}
    base = next(iter(results.values()))[0]
    print(f"{'stage':34} {'seconds':>8} {'peak MiB':>9} {'vs baseline':>12}")
    for name, (seconds, mib) in results.items():
        print(f"{name:34} {seconds:8.2f} {mib:9.0f} {seconds / base:11.2f}x")


if __name__ == "__main__":
    main()
