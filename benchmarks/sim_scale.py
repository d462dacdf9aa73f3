"""How a simulation's time and peak memory grow with instances, simulated hours and requests.

    python benchmarks/sim_scale.py [TRACE] --instances 8,16,32 --hours 1 --label after
    python benchmarks/sim_scale.py [TRACE] --instances 32 --hours 1,2,4 --label after
    python benchmarks/sim_scale.py --plot benchmarks/results/sim_scale.jsonl -o sim_scale.png

Each point is one ``smetric.sim.run.simulate`` call (one policy, one core) in a fresh
process, so its peak resident memory (the kernel's high-water mark) is its own. The offered
load grows with the cluster, ``--rate-per-instance`` session starts per second per instance,
so a point's request count grows with both instances and hours. Time is CPU time (the
machine may be shared; wall time is recorded too) and ``x real`` is simulated seconds per
CPU second. The memory a run adds is its peak minus the resident size after loading the
trace (which every run shares and no run can avoid); per request it is that divided by the
requests the run issued.

Points are appended to a JSON-lines file as they finish, labelled (say ``before`` and
``after`` a change), and ``--plot`` draws every label's curves side by side.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_OUT = Path(__file__).parent / "results" / "sim_scale.jsonl"


def _memory_mb(field: str) -> float:
    """A field of /proc/self/status (VmRSS now, VmHWM the peak), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(trace_source: str, instances: int, hours: float, rate_per_instance: float) -> dict:
    """One point, measured in this process: call it in a fresh one."""
    from smetric.sim.config import SimConfig
    from smetric.sim.run import simulate
    from smetric.trace.load import load_trace

    trace = load_trace(trace_source)
    loaded_mb = _memory_mb("VmRSS")
    config = (
        SimConfig()
        .override("cluster", instances=instances)
        .override("workload", session_rate=rate_per_instance * instances, duration_s=hours * 3600)
    )
    wall, cpu = time.perf_counter(), time.process_time()
    result = simulate(trace, config, "smetric")
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak_mb = _memory_mb("VmHWM")
    issued = result.summary.requests.issued
    return {
        "instances": instances,
        "hours": hours,
        "rate": rate_per_instance * instances,
        "requests": issued,
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "sim_x_real": round(hours * 3600 / cpu, 1),
        "trace_mb": round(loaded_mb),
        "peak_mb": round(peak_mb),
        "kb_per_request": round(max(peak_mb - loaded_mb, 0.0) * 1024 / max(issued, 1), 2),
        "tps_within_slo": round(result.summary.tps_within_slo),
    }


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def run_points(args: argparse.Namespace) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"{'label':>8} {'inst':>5} {'hours':>5} {'requests':>9} {'CPU s':>8} {'wall s':>8} "
        f"{'x real':>7} {'peak MB':>8} {'KB/req':>7}"
    )
    for hours in _floats(args.hours):
        for instances in (int(v) for v in _floats(args.instances)):
            spec = [args.trace, str(instances), str(hours), str(args.rate_per_instance)]
            child = subprocess.run(
                [sys.executable, __file__, "--point", *spec],
                capture_output=True,
                text=True,
                check=False,
            )
            if child.returncode:
                print(child.stderr, file=sys.stderr)
                raise SystemExit(f"point {instances} instances x {hours} h failed")
            point = {"label": args.label, "trace": args.trace, **json.loads(child.stdout)}
            with args.out.open("a") as f:
                f.write(json.dumps(point) + "\n")
            print(
                f"{args.label:>8} {instances:>5} {hours:>5g} {point['requests']:>9,} "
                f"{point['cpu_s']:>8.1f} {point['wall_s']:>8.1f} {point['sim_x_real']:>7.0f} "
                f"{point['peak_mb']:>8,} "
                f"{point['kb_per_request']:>7.1f}"
            )


def plot(points_file: Path, out: Path) -> None:
    """CPU time and peak memory against requests issued, one line per label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [json.loads(line) for line in points_file.read_text().splitlines() if line]
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.2))
    series: dict[str, list[dict]] = {}
    for p in points:
        series.setdefault(p["label"], []).append(p)
    for label, rows in series.items():
        rows.sort(key=lambda p: p["requests"])
        x = [p["requests"] for p in rows]
        ax_time.plot(x, [p["cpu_s"] for p in rows], "o-", label=label)
        ax_mem.plot(x, [p["peak_mb"] / 1024 for p in rows], "o-", label=label)
        for p in rows:
            tag = f"{p['instances']}i·{p['hours']:g}h"
            ax_mem.annotate(tag, (p["requests"], p["peak_mb"] / 1024), fontsize=7)
            ax_time.annotate(tag, (p["requests"], p["cpu_s"]), fontsize=7)
    ax_time.set_yscale("log")
    for ax, ylabel in ((ax_time, "CPU time, s"), (ax_mem, "peak resident memory, GB")):
        ax.set_xscale("log")
        ax.set_xlabel("requests issued")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("smetric simulate: one policy, one core (points: instances · simulated hours)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--point":
        trace, instances, hours, rate = sys.argv[2:6]
        print(json.dumps(measure(trace, int(instances), float(hours), float(rate))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", nargs="?", default="sample:weka")
    parser.add_argument("--instances", default="8,16,32", help="comma-separated")
    parser.add_argument("--hours", default="1", help="comma-separated simulated hours")
    parser.add_argument(
        "--rate-per-instance",
        type=float,
        default=0.0125,
        help="session starts per second per instance [0.0125: 0.4/s for 32]",
    )
    parser.add_argument("--label", default="now")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON-lines file")
    parser.add_argument("--plot", type=Path, help="draw this points file instead of running")
    parser.add_argument("-o", "--png", type=Path, default=Path("sim_scale.png"))
    args = parser.parse_args()
    if args.plot:
        plot(args.plot, args.png)
    else:
        run_points(args)


if __name__ == "__main__":
    main()
