"""Simulator speed: simulated requests per wall-clock second, and simulated time per second.

    python benchmarks/sim_speed.py [TRACE] [--rate 0.4] [--duration 3600] [--instances 32]

The target: 32 instances x one hour of agentic traffic (about 50 k requests) in at
most 60 s on one core. Runs one policy in this process (one core) and reports the work
split: building the workload vs the event loop.
"""

from __future__ import annotations

import argparse
import time

from smetric.sim.cluster import Simulation
from smetric.sim.config import SimConfig
from smetric.sim.policy import cluster_policy
from smetric.sim.workload import build_workload
from smetric.trace.load import load_trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", nargs="?", default="sample:weka")
    parser.add_argument("--rate", type=float, default=0.4)
    parser.add_argument("--duration", type=float, default=3600.0)
    parser.add_argument("--instances", type=int, default=32)
    parser.add_argument("--policy", default="smetric")
    args = parser.parse_args()

    trace = load_trace(args.trace)
    config = (
        SimConfig()
        .override("cluster", instances=args.instances)
        .override("workload", session_rate=args.rate, duration_s=args.duration)
    )
    t0 = time.process_time()
    workload = build_workload(trace, config.workload)
    t1 = time.process_time()
    sim = Simulation(config.cluster, cluster_policy(args.policy, config.cluster)[0], workload)
    issued = sim.run().height
    t2 = time.process_time()
    loop = t2 - t1
    print(f"trace {trace.name}: {args.instances} instances, {args.duration:g} s simulated")
    print(f"requests issued          {issued:>10,}")
    print(f"events handled           {sim.sequence:>10,}")
    print(f"workload build (CPU s)   {t1 - t0:>10.1f}")
    print(f"event loop (CPU s)       {loop:>10.1f}")
    print(f"requests / CPU second    {issued / loop:>10,.0f}")
    print(f"simulated s / CPU second {args.duration / loop:>10.1f}x real time")
    print(f"one hour at this pace    {3600 / args.duration * (t2 - t0):>10.1f} CPU s (target 60)")


if __name__ == "__main__":
    main()
