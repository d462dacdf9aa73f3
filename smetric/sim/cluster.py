"""The discrete-event loop: requests arrive, a policy routes them, instances step.

Events sit on one heap keyed by (time, kind, sequence number): at equal times a step's end
is applied before a wake-up and a wake-up before an arrival, and otherwise events keep
the order they were created in, so a run is a pure function of its inputs and seed.
The policy sees the same view the live router builds: per instance, the local-tier prefix
hit for this request, the requests in flight, their prompt tokens and those not yet
prefilled.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

import polars as pl

from smetric.core.blocks import reusable_hit_tokens
from smetric.core.errors import ConfigError
from smetric.core.policies import ClusterView, Learning, Observation, Policy, RoutingRequest
from smetric.core.settings import check_settings
from smetric.metrics.results import RunSummary
from smetric.metrics.summary import summarize, with_latencies
from smetric.model.kv import GlobalTier, Link, LocalPool, Route
from smetric.model.perf import (
    Corrections,
    StepTimeModel,
    kv_bytes_per_token,
    kv_capacity_tokens,
    load_hardware,
    load_medium,
    load_model,
)
from smetric.sim.config import (
    ClusterConfig,
    SimConfig,
    check_kv_load,
    parse_global_capacity,
)
from smetric.sim.holders import HolderIndex
from smetric.sim.instance import EngineLimits, Instance, SimRequest
from smetric.sim.request_log import RequestLog
from smetric.sim.workload import SimWorkload
from smetric.trace.compose import ClosedLoopIssuer

STEP_END, WAKE, ARRIVAL = 0, 1, 2


@dataclass(frozen=True)
class ClusterShape:
    """What the configuration resolves to: the numbers a user should see."""

    kv_capacity_tokens: int
    kv_bytes_per_token: int
    max_model_len: int
    global_capacity_blocks: int | None


def resolve_shape(config: ClusterConfig, block_size: int) -> ClusterShape:
    check_settings(config)  # a configuration built in code, never read from a file
    model = load_model(config.model)
    hardware = load_hardware(config.hardware, gpus=config.gpus_per_instance)
    capacity = config.kv_capacity_tokens or kv_capacity_tokens(
        model,
        hardware,
        weight_dtype=config.weight_dtype or model.weight_dtype,
        kv_dtype=config.kv_dtype,
        gpu_memory_utilization=config.gpu_memory_utilization,
        max_num_batched_tokens=config.max_num_batched_tokens,
    )
    capacity = int(capacity * config.kv_room_scale)
    if capacity <= 0:
        raise ConfigError(
            f"{config.model} ({config.weight_dtype or model.weight_dtype}) leaves no KV room on "
            f"{config.gpus_per_instance}x{config.hardware} at memory utilisation "
            f"{config.gpu_memory_utilization}"
        )
    # vLLM refuses to start when one max-length sequence cannot fit its KV pool.
    limit = min(model.max_context, capacity)
    if config.max_model_len is not None:
        limit = min(limit, config.max_model_len)
    ratio = parse_global_capacity(config.global_capacity)
    local_blocks = capacity // block_size
    global_blocks = None if ratio is None else int(ratio * local_blocks * config.instances)
    return ClusterShape(
        kv_capacity_tokens=capacity,
        kv_bytes_per_token=kv_bytes_per_token(model, config.kv_dtype),
        max_model_len=limit,
        global_capacity_blocks=global_blocks,
    )


def instances_per_server(config: ClusterConfig) -> int:
    """How many instances share a server, and so its NICs (one at least: an instance may
    span more GPUs than a server has)."""
    return max(1, config.gpus_per_server // config.gpus_per_instance)


def lane_gb_s(config: ClusterConfig) -> float:
    """One instance's own lane to the global tier: its PCIe lanes, capped by what its
    connector reaches on the medium, both scaled by the tier's bandwidth perturbation."""
    pcie = config.gpus_per_instance * config.pcie_gb_s
    medium = load_medium(config.global_medium)
    rate = min(pcie, medium.gb_s) if medium.gb_s > 0 else pcie
    return rate * config.tier_bandwidth_scale


def routes(config: ClusterConfig) -> list[Route]:
    """Each instance's route to the global tier: its own lane, its server's NICs.

    Instances fill servers in index order, ``instances_per_server`` each.
    """
    per_server = instances_per_server(config)
    servers = -(-config.instances // per_server)
    nic_bytes_s = config.nics_per_server * config.nic_gb_s * 1e9 * config.tier_bandwidth_scale
    nics = [Link(nic_bytes_s) for _ in range(servers)]
    setup = load_medium(config.global_medium).setup_s
    lane_bytes_s = lane_gb_s(config) * 1e9
    return [
        Route(Link(lane_bytes_s, setup), nics[i // per_server]) for i in range(config.instances)
    ]


def step_time_model(config: ClusterConfig) -> StepTimeModel:
    """One instance's step-time model: the cluster's model on its GPUs, at its dtypes (the
    weights at the model's own unless the cluster names one)."""
    model = load_model(config.model)
    hardware = load_hardware(config.hardware, gpus=config.gpus_per_instance)
    return StepTimeModel(
        model,
        hardware,
        weight_dtype=config.weight_dtype or model.weight_dtype,
        kv_dtype=config.kv_dtype,
        corrections=Corrections(prefill=config.prefill_slowdown),
    )


def engine_model(config: ClusterConfig, shape: ClusterShape) -> tuple[StepTimeModel, EngineLimits]:
    """The step-time model and engine limits every instance of the cluster shares."""
    perf = step_time_model(config)
    limits = EngineLimits(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        kv_bytes_per_token=shape.kv_bytes_per_token,
    )
    return perf, limits


class Simulation:
    # What the routed instances are (the disaggregated cluster's run prefills only).
    instance_class: type[Instance] = Instance

    def __init__(
        self,
        config: ClusterConfig,
        policy: Policy,
        workload: SimWorkload,
        progress: Callable[[float], None] | None = None,
        learning: Learning | None = None,
    ) -> None:
        self.policy = policy
        self.workload = workload
        self.progress = progress
        block_size = workload.block_size
        self.shape = resolve_shape(config, block_size)
        perf, limits = engine_model(config, self.shape)
        global_blocks = self.shape.global_capacity_blocks
        self.global_tier = GlobalTier(global_blocks)
        local_blocks = self.shape.kv_capacity_tokens // block_size
        # Every routed instance's local tier, indexed together so routing walks one tree.
        self.holders = HolderIndex(config.instances)
        self.instances = [
            self.instance_class(
                index=i,
                pool=LocalPool(local_blocks, self.holders.watcher(i)),
                tier_route=route,
                global_tier=self.global_tier,
                perf=perf,
                limits=limits,
                async_load=check_kv_load(config.kv_load) == "async",
            )
            for i, route in enumerate(routes(config))
        ]
        # The policy chooses among the first ``routed`` instances (all of them here).
        self.routed = len(self.instances)
        self.events: list[tuple[float, int, int, int, int]] = []
        self.sequence = 0
        # A step's end event is valid only while its instance's plan is the same version.
        self.plan_version = [0] * config.instances
        self.issuer: ClosedLoopIssuer | None = None
        # Requests issued and not yet finished; finished ones live on as rows in ``log``.
        self.inflight: dict[int, SimRequest] = {}
        self.log = RequestLog(workload.horizon_s)
        # What the policy learns from the requests' outcomes, as a live router's would.
        self.learning = learning

    def observation(self, req: SimRequest) -> Observation:
        """What a router saw of a finished request: its usage, its first token's time,
        its decode time, the prompt tokens in flight on its engine while it decoded (the
        mean of the counts at its first token and at its last, itself included) and the
        unprefilled tokens routed there meanwhile."""
        instance = self.instances[req.instance]
        return Observation(
            prompt_tokens=req.prompt,
            cached_tokens=req.local_hit + req.global_hit,
            predicted_local_tokens=req.seen_local_hit,
            queued_tokens=req.seen_queued,
            ttft_s=req.first_token_at - req.arrival,
            output_tokens=req.output,
            decode_s=req.finished_at - req.first_token_at,
            decode_tokens=(req.first_token_tokens + instance.inflight_tokens + req.prompt) / 2,
            decode_prefill_tokens=instance.routed_unprefilled - req.first_token_routed,
        )

    def push(self, time: float, kind: int, payload: int, version: int = 0) -> None:
        heapq.heappush(self.events, (time, kind, self.sequence, payload, version))
        self.sequence += 1

    def run(self) -> pl.DataFrame:
        """Run to the horizon; returns the per-request table (``metrics.request_table``)."""
        arrivals, self.issuer = self.workload.initial_arrivals()
        for t, rid in arrivals:
            self.push(t, ARRIVAL, rid)
        horizon = self.workload.horizon_s
        next_report = 0.0
        while self.events:
            t, kind, _, payload, version = heapq.heappop(self.events)
            if t > horizon:
                break
            if self.progress is not None and t >= next_report:
                self.progress(t)
                next_report = t + horizon / 200
            if kind == ARRIVAL:
                self.arrive(self.workload.request(payload), t)
            elif kind == STEP_END:
                if version == self.plan_version[payload]:
                    self.end_step(self.instances[payload], t)
            elif not self.instances[payload].busy:
                self.kick(self.instances[payload], t)
        if self.progress is not None:
            self.progress(horizon)
        return self.log.table(self.inflight.values())

    def scored(self, requests: pl.DataFrame, config: SimConfig) -> tuple[pl.DataFrame, RunSummary]:
        """The run's table (``run``'s) with each request's latencies and SLO verdict, and
        the summary over it (``metrics.summary``)."""
        horizon = self.workload.horizon_s
        table = with_latencies(requests, config.slo, horizon)
        summary = summarize(
            table, config.slo, horizon, config.cluster.instances, config.window_s, config.warmup_s
        )
        return table, summary

    def arrive(self, req: SimRequest, now: float) -> None:
        req.arrival = now
        self.inflight[req.rid] = req
        total = req.prompt + req.output
        if total > self.shape.max_model_len:
            req.rejected = True
            req.finished_at = now
            self.completed(req, now)
            return
        view = self.view(req)
        choice = self.policy.route(
            RoutingRequest(req.turn, req.prompt, req.est_hit, req.session), view
        )
        req.instance, req.branch = choice
        req.seen_local_hit = view.hit_tokens[choice.instance]
        req.seen_queued = view.unprefilled_tokens[choice.instance]
        self.dispatch(self.instances[choice.instance], self.work(req), now)

    def work(self, req: SimRequest) -> SimRequest:
        """What the routed instance runs for a request: here the request itself."""
        return req

    def dispatch(self, instance: Instance, req: SimRequest, now: float) -> None:
        """Queue a request on an instance and let the instance take it up now."""
        instance.enqueue(req, now)
        if not instance.busy:
            self.kick(instance, now)
            return
        end = instance.interrupt(now)
        if end is not None:
            self.schedule_step_end(instance, end)

    def view(self, req: SimRequest) -> ClusterView:
        bs = req.block_size
        routed = self.instances[: self.routed]
        hits = self.holders.per_instance(
            req.blocks, lambda matched: reusable_hit_tokens(matched, req.prompt, bs)
        )
        return ClusterView(
            hit_tokens=hits,
            inflight_requests=[float(i.inflight) for i in routed],
            unprefilled_tokens=[float(i.unprefilled) for i in routed],
            inflight_prompt_tokens=[float(i.inflight_tokens) for i in routed],
            global_hit_tokens=reusable_hit_tokens(
                self.global_tier.match(req.blocks), req.prompt, bs
            ),
        )

    def kick(self, instance: Instance, now: float) -> None:
        end = instance.plan_step(now)
        if end is None:
            instance.busy = False
            wake = instance.next_ready()
            # ``wake == now``: a load that took no time landed as it started.
            if wake is not None and wake >= now:
                self.push(wake, WAKE, instance.index)
            return
        instance.busy = True
        self.schedule_step_end(instance, end)

    def schedule_step_end(self, instance: Instance, end: float) -> None:
        self.plan_version[instance.index] += 1
        self.push(end, STEP_END, instance.index, self.plan_version[instance.index])

    def end_step(self, instance: Instance, now: float) -> None:
        finished = instance.finish_step(now)
        for req in finished:
            self.completed(req, now)
        self.kick(instance, now)

    def completed(self, req: SimRequest, now: float) -> None:
        del self.inflight[req.rid]
        self.log.add(req)
        if self.learning is not None and not req.rejected:
            self.learning.on_complete(self.observation(req))
        if self.issuer is None:
            return
        for t, rid in self.issuer.complete(req.rid, now):
            self.push(t, ARRIVAL, rid)
