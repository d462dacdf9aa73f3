"""Turn a trace into the requests one simulation issues, and the order it issues them in.

Session traces (no clock) are composed into closed-loop sessions started at a rate (the
paper scales offered load by sampling sessions; a rate does the same for a trace whose
sessions have no clock); traces with a clock can be replayed open loop at their recorded
arrivals, sped up or slowed down. Output lengths are the trace's, as the paper forces them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from smetric.sim.config import WorkloadConfig
from smetric.sim.instance import SimRequest
from smetric.trace.compose import (
    ClosedLoopIssuer,
    Workload,
    compose_sessions,
    open_loop_issue_times,
    replay_arrivals,
)
from smetric.trace.schema import Trace, common_prefix_len


@dataclass
class SimWorkload:
    workload: Workload
    requests: list[SimRequest]
    # The run measures what completes by this time (the period sessions start or arrive in).
    horizon_s: float

    def initial_arrivals(self) -> tuple[list[tuple[float, int]], ClosedLoopIssuer | None]:
        if self.workload.closed_loop:
            issuer = ClosedLoopIssuer(self.workload)
            return issuer.initial(), issuer
        times = open_loop_issue_times(self.workload)
        return [(float(t), rid) for rid, t in enumerate(times)], None


def build_workload(trace: Trace, config: WorkloadConfig) -> SimWorkload:
    if config.open_loop:
        sampled = sample_sessions(trace, config.sample, config.seed)
        workload = replay_arrivals(sampled, speed=config.speed, limit_s=config.duration_s)
        horizon = config.duration_s
    else:
        workload = compose_sessions(
            trace,
            rate=config.session_rate,
            duration_s=config.duration_s,
            seed=config.seed,
            arrival=config.arrival,
        )
        horizon = config.duration_s
    return SimWorkload(workload, sim_requests(workload), horizon)


def sample_sessions(trace: Trace, fraction: float, seed: int) -> Trace:
    """Keep each session with probability ``fraction``: fewer sessions, same timing."""
    if not 0 < fraction <= 1:
        raise ValueError(f"sample fraction must be in (0, 1], got {fraction}")
    if fraction == 1:
        return trace
    sessions = trace.requests["session_id"].unique(maintain_order=True)
    keep = np.random.default_rng(seed).random(len(sessions)) < fraction
    kept = trace.requests.filter(pl.col("session_id").is_in(sessions.filter(keep).implode()))
    if kept.height == 0:
        raise ValueError(f"sampling {fraction:g} of {len(sessions)} sessions kept none")
    return trace.with_requests(renumber(kept))


def renumber(frame: pl.DataFrame) -> pl.DataFrame:
    """Request ids 0..n-1 again after rows were dropped; parents outside become roots."""
    old = frame["request_id"]
    new = pl.int_range(frame.height, dtype=pl.Int64, eager=True)
    return frame.with_columns(
        request_id=new,
        parent_id=pl.col("parent_id").replace_strict(old, new, default=None),
    )


def sim_requests(workload: Workload) -> list[SimRequest]:
    """One SimRequest per workload row, with the hit its carried history should give.

    The expected hit is what the request shares with its parent's prompt: the history an
    agent resends, whatever it appended since.
    """
    frame = workload.requests
    flat = frame["block_ids"].explode().drop_nulls().to_numpy().astype(np.int64)
    lengths = frame["block_ids"].list.len().to_numpy()
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    parents = frame["parent_id"].fill_null(-1).to_numpy()
    columns = frame.select(
        "session_id", "agent_id", "turn", "input_tokens", "output_tokens", "block_size"
    ).rows()
    out: list[SimRequest] = []
    for rid, (session, agent, turn, prompt, output, bs) in enumerate(columns):
        blocks = flat[offsets[rid] : offsets[rid + 1]]
        parent = int(parents[rid])
        est_hit = 0
        if turn > 0 and parent >= 0:
            shared = common_prefix_len(flat[offsets[parent] : offsets[parent + 1]], blocks)
            est_hit = min(shared * bs, prompt)
        out.append(
            SimRequest(
                rid=rid,
                session=session,
                turn=turn,
                blocks=blocks,
                prompt=prompt,
                output=max(output, 1),
                est_hit=est_hit,
                block_size=bs,
                agent=agent,
                parent=parent,
            )
        )
    return out
