"""PD disaggregation: prefill-only instances hand their KV to decode instances over links.

The paper's Figure 4c. The router picks a prefill instance with the policy under test,
balancing the instances' unprefilled prompt tokens as load (Figure 13, line 29), and a
decode instance with a decode policy (``core.policies.decode``). Only prefill instances read
and write the global tier. What each side does is what vLLM does with its NIXL
connector behind the disaggregated proxy:

- The proxy sends the prefill instance the request with ``max_tokens=1`` and
  ``kv_transfer_params={"do_remote_decode": true}``: the prefill instance runs a copy of
  the request that asks for one token (``work``).
- When that request finishes, the connector's ``request_finished`` keeps its blocks
  (``delay_free_blocks``) until the decode side has read them: here the prefill instance
  keeps the prompt's blocks pinned until the pull lands (``PrefillInstance``).
- The decode instance gets the original request with the returned parameters
  (``do_remote_prefill``); its connector's ``get_num_new_matched_tokens`` reports the
  prompt blocks its own prefix cache lacks as external and loads them asynchronously,
  the request holding its blocks in ``WAITING_FOR_REMOTE_KVS`` while the batch runs on.
  It then computes the rest of the prompt (vLLM recomputes at least the last token) and
  decodes (``DecodeInstance``). The pull crosses the prefill server's NICs and the decode
  server's NICs, the same ``Link`` queues the global tier's traffic uses.
- A decode request preempted later recomputes on its decode instance, as vLLM does: the
  prefill side has freed the blocks by then.

With no decode instances the run is the paper's prefill-only evaluation: the first
token comes when the prefill ends, and the session's next turn is released as if a
decode had produced each output token in ``assumed_tpot_s``.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import numpy as np
import polars as pl

from smetric.core.policies import Learning, Observation, Policy
from smetric.core.policies.decode import DecodeView, make_decode_policy
from smetric.core.prefix_cache import Handle
from smetric.metrics.pd import disaggregated_summary, with_prefill_latency
from smetric.metrics.results import LinkUse, NicUse, RunSummary
from smetric.metrics.summary import with_latencies
from smetric.model.kv import GlobalTier, Link, LocalPool, Route
from smetric.sim.cluster import WAKE, Simulation, engine_model, routes
from smetric.sim.config import ClusterConfig, SimConfig
from smetric.sim.instance import Instance, SimRequest
from smetric.sim.workload import SimWorkload


@dataclass(eq=False)
class PrefillInstance(Instance):
    """Runs prefills only; keeps a finished prompt's blocks until its decode has pulled them."""

    hold_for_pull: bool = False
    held: dict[int, Handle] = field(default_factory=dict)
    # (when the pull lands, request id), earliest first.
    pulls: list[tuple[float, int]] = field(default_factory=list)

    def pulled(self, rid: int, at: float) -> None:
        heapq.heappush(self.pulls, (at, rid))

    def plan_step(self, now: float) -> float | None:
        while self.pulls and self.pulls[0][0] <= now:
            at, rid = heapq.heappop(self.pulls)
            self.pool.cache.unlock(self.held.pop(rid), at)
        return super().plan_step(now)

    def _retire(self, req: SimRequest, now: float) -> None:
        if self.hold_for_pull and req.handle is not None:
            self.held[req.rid], req.handle = req.handle, None
        super()._retire(req, now)


@dataclass(eq=False)
class DecodeInstance(Instance):
    """Decodes requests whose prompt KV waits on a prefill instance, reached by ``sources``."""

    sources: dict[int, Route] = field(default_factory=dict)
    # Told (request id, when the pull lands) so that the prefill side can free the blocks.
    on_pull: Callable[[int, float], None] | None = None

    def _remote_blocks(self, req: SimRequest) -> int:
        return len(req.blocks) if req.rid in self.sources else 0

    def _load(self, req: SimRequest, now: float, nbytes: float) -> float:
        ready = self.sources.pop(req.rid).transfer(now, nbytes)
        self._pulled(req.rid, ready)
        return ready

    def _allocate(self, req: SimRequest, now: float) -> int | None:
        external = super()._allocate(req, now)
        if external == 0 and req.rid in self.sources:
            del self.sources[req.rid]  # its own prefix cache held the prompt: nothing to pull
            self._pulled(req.rid, now)
        return external

    def _pulled(self, rid: int, at: float) -> None:
        if self.on_pull is not None:
            self.on_pull(rid, at)


def _kv_used_fraction(decoder: DecodeInstance) -> float:
    """Share of the KV pool in use or claimed by the queue (cached free blocks excluded).

    vLLM's ``kv_cache_usage`` counts only blocks running requests hold; the queue is added
    so that a burst routed before the instance admits anything does not all land on it.
    """
    pool = decoder.pool
    in_use = pool.private + pool.cache.locked
    queued = sum(-(-r.prompt // r.block_size) for r in decoder.waiting if not r.loading)
    return (in_use + queued) / pool.capacity


def decode_view(decoders: list[DecodeInstance]) -> DecodeView:
    return DecodeView(
        inflight_requests=[d.inflight for d in decoders],
        kv_used_fraction=[_kv_used_fraction(d) for d in decoders],
    )


@dataclass(slots=True)
class Handoff:
    """One request's way through the disaggregated cluster, beyond what its record holds."""

    prefill_done: float
    decode_instance: int = -1
    transfer_tokens: int = 0


class DisaggSimulation(Simulation):
    """The event loop over prefill instances (routed by the policy) and decode instances."""

    instance_class = PrefillInstance

    def __init__(
        self,
        config: ClusterConfig,
        policy: Policy,
        workload: SimWorkload,
        progress: Callable[[float], None] | None = None,
        learning: Learning | None = None,
    ) -> None:
        prefill, decode = config.prefill_instances, config.decode_instances
        super().__init__(
            dataclasses.replace(config, instances=prefill), policy, workload, progress, learning
        )
        self.decode_policy = make_decode_policy(config.decode_policy)
        self.assumed_tpot_s = config.assumed_tpot_s
        perf, limits = engine_model(config, self.shape)
        blocks = self.instances[0].pool.capacity
        self.decoders = (
            [
                DecodeInstance(
                    index=prefill + j,
                    pool=LocalPool(blocks),
                    tier_route=route,
                    global_tier=GlobalTier(0),
                    perf=perf,
                    limits=limits,
                    async_load=True,
                    on_pull=self._pulled,
                )
                for j, route in enumerate(routes(dataclasses.replace(config, instances=decode)))
            ]
            if decode
            else []
        )
        self.prefills: list[PrefillInstance] = []
        for instance in self.instances:
            assert isinstance(instance, PrefillInstance)
            instance.hold_for_pull = bool(self.decoders)
            self.prefills.append(instance)
        self.instances += self.decoders
        self.plan_version += [0] * decode
        self.handoffs: dict[int, Handoff] = {}

    def work(self, req: SimRequest) -> SimRequest:
        """The proxy's prefill request: the same prompt, one token (``max_tokens=1``)."""
        return req.leg(output=1, est_hit=req.est_hit, instance=req.instance)

    def completed(self, req: SimRequest, now: float) -> None:
        client = self.inflight[req.rid]
        if req is client:  # rejected at arrival
            super().completed(req, now)
        elif req.instance < self.routed:
            self._prefilled(client, req, now)
        else:
            client.first_token_at, client.finished_at = req.first_token_at, now
            client.preemptions += req.preemptions
            self.handoffs[req.rid].transfer_tokens = req.global_hit
            super().completed(client, now)

    def observation(self, req: SimRequest) -> Observation:
        """What the router saw of the prefill leg, the one it routed: its first token is
        the prefill's, and its decode, elsewhere, tells nothing here."""
        done = super().observation(req)
        ttft = self.handoffs[req.rid].prefill_done - req.arrival
        return dataclasses.replace(done, ttft_s=ttft, decode_s=math.nan)

    def _prefilled(self, client: SimRequest, req: SimRequest, now: float) -> None:
        client.local_hit, client.global_hit = req.local_hit, req.global_hit
        client.preemptions += req.preemptions
        handoff = self.handoffs[req.rid] = Handoff(now)
        if not self.decoders:
            client.first_token_at = client.finished_at = now
            super().completed(client, now + client.output * self.assumed_tpot_s)
            return
        decoder = self.decoders[self.decode_policy.choose(decode_view(self.decoders)).instance]
        handoff.decode_instance = decoder.index - self.routed
        # The pull crosses the prefill server's NICs, then the decode server's.
        decoder.sources[req.rid] = Route(
            self.instances[req.instance].tier_route.nic, decoder.tier_route.nic
        )
        decode = client.leg(output=client.output, est_hit=0, instance=decoder.index)
        self.dispatch(decoder, decode, now)

    def _pulled(self, rid: int, at: float) -> None:
        source = self.inflight[rid].instance
        self.prefills[source].pulled(rid, at)
        self.push(at, WAKE, source)  # so an idle prefill instance frees the blocks

    def nic_links(self) -> tuple[list[Link], list[Link]]:
        """The distinct NIC links of the prefill servers and of the decode servers."""

        def distinct(instances: list) -> list[Link]:
            return list({id(i.tier_route.nic): i.tier_route.nic for i in instances}.values())

        return distinct(self.instances[: self.routed]), distinct(self.decoders)

    def scored(self, requests: pl.DataFrame, config: SimConfig) -> tuple[pl.DataFrame, RunSummary]:
        """The colocated scoring with each request's handoff, the prefill stage's latency
        and the PD section (``pd_summary``)."""
        horizon = self.workload.horizon_s
        table = requests.join(handoff_table(self), on="request_id", how="left")
        table = with_prefill_latency(
            with_latencies(table, config.slo, horizon), config.slo, horizon
        )
        return table, pd_summary(table, config, self, horizon)


def handoff_table(sim: DisaggSimulation) -> pl.DataFrame:
    rids = sorted(sim.handoffs)
    return pl.DataFrame(
        {
            "request_id": rids,
            "prefill_done_s": [sim.handoffs[r].prefill_done for r in rids],
            "decode_instance": [sim.handoffs[r].decode_instance for r in rids],
            "transfer_tokens": [sim.handoffs[r].transfer_tokens for r in rids],
        },
        schema={
            "request_id": pl.Int64,
            "prefill_done_s": pl.Float64,
            "decode_instance": pl.Int64,
            "transfer_tokens": pl.Int64,
        },
    )


def pd_summary(
    table: pl.DataFrame, config: SimConfig, sim: DisaggSimulation, horizon: float
) -> RunSummary:
    """``disaggregated_summary`` plus what only the simulator sees: bytes on the links."""
    cluster = config.cluster
    full = cluster.decode_instances > 0
    summary = disaggregated_summary(
        table,
        config.slo,
        horizon,
        cluster.prefill_instances,
        full,
        config.window_s,
        config.warmup_s,
    )

    def utilisation(links: list[Link]) -> LinkUse:
        shares = [link.bytes_moved / (link.bytes_per_s * horizon) for link in links]
        if not shares:
            return LinkUse(mean=None, max=None)
        return LinkUse(mean=float(np.mean(shares)), max=float(np.max(shares)))

    prefill_nics, decode_nics = sim.nic_links()
    assert summary.pd is not None
    pd = msgspec.structs.replace(
        summary.pd,
        decode_instances=cluster.decode_instances,
        decode_policy=cluster.decode_policy if full else None,
        transfer_bytes=summary.pd.transfer_tokens * sim.shape.kv_bytes_per_token,
        nic_utilisation=NicUse(prefill=utilisation(prefill_nics), decode=utilisation(decode_nics)),
    )
    return msgspec.structs.replace(summary, pd=pd)
