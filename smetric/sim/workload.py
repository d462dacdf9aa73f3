"""Turn a trace into the requests one simulation issues, and the order it issues them in.

Session traces (no clock) are composed into closed-loop sessions started at a rate (the
paper scales offered load by sampling sessions; a rate does the same for a trace whose
sessions have no clock); traces with a clock can be replayed open loop at their recorded
arrivals, sped up or slowed down. Output lengths are the trace's, as the paper forces them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from smetric.sim.config import WorkloadConfig
from smetric.sim.instance import SimRequest
from smetric.trace.compose import (
    ClosedLoopIssuer,
    Workload,
    compose_sessions,
    open_loop_issue_times,
    replay_arrivals,
)
from smetric.trace.sample import sample_sessions
from smetric.trace.schema import Trace


@dataclass
class SimWorkload:
    """A workload as the simulator issues it: each request becomes a ``SimRequest`` only
    when it is issued (``request``), and is dropped once its row is recorded, so a run
    holds the state of the requests in flight, not of every request it issues."""

    workload: Workload
    # The run measures what completes by this time (the period sessions start or arrive in).
    horizon_s: float
    _columns: dict[str, list] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        names = ("session_id", "agent_id", "turn", "input_tokens", "output_tokens", "block_size")
        frame = self.workload.trace.requests.select(names)
        self._columns = {name: frame[name].to_list() for name in names}

    @property
    def num_requests(self) -> int:
        return self.workload.num_requests

    @property
    def block_size(self) -> int:
        """The block size of the workload's first request (16 for an empty one)."""
        if not self.num_requests:
            return 16
        return self._columns["block_size"][int(self.workload.source[0])]

    def initial_arrivals(self) -> tuple[list[tuple[float, int]], ClosedLoopIssuer | None]:
        if self.workload.closed_loop:
            issuer = ClosedLoopIssuer(self.workload)
            return issuer.initial(), issuer
        times = open_loop_issue_times(self.workload)
        return [(float(t), rid) for rid, t in enumerate(times)], None

    def request(self, rid: int) -> SimRequest:
        """Request ``rid`` as the simulator runs it, with the hit its history should give.

        The expected hit is what the request shares with its parent's prompt: the history
        an agent resends, whatever it appended since.
        """
        workload, columns = self.workload, self._columns
        row = int(workload.source[rid])
        session = columns["session_id"][row]
        if workload.closed_loop:
            session = f"{session}#{workload.copy[rid]}"
        turn, prompt, bs = (
            columns["turn"][row],
            columns["input_tokens"][row],
            columns["block_size"][row],
        )
        blocks = workload.block_ids(rid)
        parent = int(workload.parent[rid])
        est_hit = 0
        if turn > 0 and parent >= 0:
            copy = int(workload.copy[rid])
            shared = workload.blocks.common_prefix(int(workload.source[parent]), row, copy)
            est_hit = min(shared * bs, prompt)
        return SimRequest(
            rid=rid,
            session=session,
            turn=turn,
            blocks=blocks,
            prompt=prompt,
            output=max(columns["output_tokens"][row], 1),
            est_hit=est_hit,
            block_size=bs,
            agent=columns["agent_id"][row],
            parent=parent,
        )


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
    return SimWorkload(workload, horizon)
