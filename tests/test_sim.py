"""The simulator: instance mechanics worked out by hand, and whole-run properties."""

from __future__ import annotations

import math
from typing import cast

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smetric.core.policies import POLICY_NAMES, make_policy
from smetric.model.kv import GlobalTier, Link, LocalPool, Route
from smetric.model.perf import StepTimeModel
from smetric.sim.cluster import WAKE, Simulation
from smetric.sim.config import ClusterConfig, SimConfig, WorkloadConfig
from smetric.sim.instance import EngineLimits, Instance, SimRequest
from smetric.sim.run import simulate
from smetric.sim.workload import build_workload
from smetric.trace.sample import sample_sessions

from conftest import make_trace


class OneSecondSteps:
    """Every engine step takes one second, so times can be worked out by hand."""

    def step_time(self, prefill: int, attn2: float, decode_seqs: int, decode_context: int) -> float:
        return 1.0


def instance(
    capacity_blocks: int = 100,
    budget: int = 64,
    global_blocks=0,
    bytes_per_s: float = 1000.0,
    async_load: bool = False,
) -> Instance:
    return Instance(
        index=0,
        pool=LocalPool(capacity_blocks),
        tier_route=Route(Link(bytes_per_s), Link(bytes_per_s)),
        global_tier=GlobalTier(global_blocks),
        perf=cast(StepTimeModel, OneSecondSteps()),  # the instance calls only step_time
        limits=EngineLimits(max_num_seqs=8, max_num_batched_tokens=budget, kv_bytes_per_token=1),
        async_load=async_load,
    )


def request(rid: int, blocks: list[int], prompt: int, output: int) -> SimRequest:
    return SimRequest(rid, "s", 0, np.array(blocks, dtype=np.int64), prompt, output, 0, 16)


def drive(inst: Instance, start: float = 0.0) -> list[tuple[int, float]]:
    """Run the instance until idle; returns (request id, finish time) in finish order."""
    done: list[tuple[int, float]] = []
    now = start
    while (end := inst.plan_step(now)) is not None:
        now = end
        done += [(r.rid, now) for r in inst.finish_step(now)]
    return done


def drive_from(inst: Instance, now: float) -> list[tuple[int, float]]:
    """Finish the step that ends at ``now``, then run the instance until idle."""
    done = [(r.rid, now) for r in inst.finish_step(now)]
    return done + drive(inst, now)


def test_chunked_prefill_then_decode_timeline() -> None:
    inst = instance()
    a = request(0, [1, 2, 3, 4, 5, 6], prompt=100, output=3)
    inst.enqueue(a, 0.0)
    # Steps of 64 prompt tokens: 64 then 36 -> first token at t=2; two decode steps -> t=4.
    assert drive(inst) == [(0, 4.0)]
    assert a.first_token_at == 2.0
    assert (inst.pool.private, inst.pool.cache.size, inst.pool.cache.locked) == (0, 6, 0)


def test_follow_up_hits_the_cached_prefix() -> None:
    inst = instance()
    inst.enqueue(request(0, [1, 2, 3, 4, 5, 6], 100, 1), 0.0)
    drive(inst)
    b = request(1, [1, 2, 3, 4, 5, 6, 7, 8], prompt=130, output=2)
    inst.enqueue(b, 10.0)
    # 6 cached blocks (96 tokens) hit; 34 tokens fit one step -> first token at 11.
    assert drive(inst, 10.0) == [(1, 12.0)]
    assert (b.local_hit, b.global_hit, b.first_token_at) == (96, 0, 11.0)


def test_synchronous_global_load_stretches_the_admitting_step() -> None:
    inst = instance(global_blocks=None)
    inst.global_tier.write(np.array([1, 2, 3, 4], dtype=np.int64), 0.0)
    c = request(0, [1, 2, 3, 4], prompt=80, output=1)
    inst.enqueue(c, 0.0)
    # Admitted at t=0: 4 blocks x 16 tokens x 1 byte over 1000 B/s land at t=0.064, then
    # the forward pass computes the last 16 tokens in one second.
    assert inst.plan_step(0.0) == pytest.approx(1.064)
    assert (c.local_hit, c.global_hit) == (0, 64)


def two_requests(async_load: bool) -> tuple[Instance, SimRequest, SimRequest]:
    """A (32-token prompt, no hit, 10 tokens out) and B (80 tokens, 64 in the global tier,
    1 token out) arrive together at an instance whose link carries 16 B/s: B's load takes
    64 B / 16 B/s = 4 s."""
    inst = instance(global_blocks=None, bytes_per_s=16.0, async_load=async_load)
    inst.global_tier.write(np.array([5, 6, 7, 8], dtype=np.int64), 0.0)
    a = request(0, [1, 2], prompt=32, output=10)
    b = request(1, [5, 6, 7, 8], prompt=80, output=1)
    inst.enqueue(a, 0.0)
    inst.enqueue(b, 0.0)
    return inst, a, b


def test_synchronous_load_holds_the_whole_batch() -> None:
    inst, a, b = two_requests(async_load=False)
    # Step 1 admits both: B's 4 s load, then one 1 s forward pass (A's 32 tokens and B's
    # last 16): both first tokens at t=5; A's nine more tokens take nine steps.
    assert drive(inst) == [(1, 5.0), (0, 14.0)]
    assert (a.first_token_at, b.first_token_at) == (5.0, 5.0)
    assert b.global_hit == 64


def test_asynchronous_load_holds_the_request_not_the_batch() -> None:
    inst, a, b = two_requests(async_load=True)
    # A prefills alone (first token t=1) and decodes on; B's load lands at t=4 and B joins
    # the step 4-5. A's ten tokens end at t=10, as if B had never come.
    assert drive(inst) == [(1, 5.0), (0, 10.0)]
    assert (a.first_token_at, b.first_token_at) == (1.0, 5.0)
    assert b.global_hit == 64


def test_an_asynchronous_load_that_lands_at_once_joins_the_next_step() -> None:
    # Regression: a load taking no time (a free tier) landed at the very moment it
    # started, which the instance did not count as a landing, so the request waited for
    # the whole decode run planned beside it (here until A's decode needs a new block,
    # eight tokens on).
    inst = instance(global_blocks=None, bytes_per_s=math.inf, async_load=True)
    inst.global_tier.write(np.array([5, 6, 7, 8], dtype=np.int64), 0.0)
    a = request(0, [1, 2], prompt=40, output=50)
    inst.enqueue(a, 0.0)
    assert inst.plan_step(0.0) == 1.0
    inst.finish_step(1.0)  # A's first token; A decodes on
    b = request(1, [5, 6, 7, 8], prompt=80, output=1)
    inst.enqueue(b, 1.0)
    # B's load lands as it starts; as in vLLM, the step it lands in reports it and the
    # next admits B: a one-step decode run, then B's last 16 tokens, first token at 3.
    assert inst.plan_step(1.0) == 2.0
    finished = drive_from(inst, 2.0)
    assert b.first_token_at == 3.0
    assert finished[0] == (1, 3.0)
    assert b.global_hit == 64


def test_an_idle_instance_wakes_for_an_asynchronous_load_that_lands_at_once() -> None:
    # The same load on an idle instance: nothing is planned, and the load has landed, so
    # the instance must be woken now rather than at the next arrival.
    inst = instance(global_blocks=None, bytes_per_s=math.inf, async_load=True)
    inst.global_tier.write(np.array([5, 6, 7, 8], dtype=np.int64), 0.0)
    inst.enqueue(request(0, [5, 6, 7, 8], prompt=80, output=1), 3.0)
    sim = Simulation.__new__(Simulation)  # kick reads and writes nothing else of it
    woken: list[tuple[float, int, int]] = []
    sim.push = lambda t, kind, index, *rest: woken.append((t, kind, index))  # type: ignore[method-assign]
    sim.kick(inst, 3.0)  # plans nothing: the load has started, the request is held
    assert not inst.busy
    assert woken == [(3.0, WAKE, 0)]
    # Woken, it admits the request at once.
    assert inst.plan_step(3.0) == 4.0


def test_a_request_whose_local_prefix_is_evicted_while_queued_loads_it_globally() -> None:
    # Regression: the global tier used to be looked up only at routing, where the local
    # hit was as long, so the request recomputed its prefix after the local copy went.
    inst = instance(global_blocks=None)
    blocks = [1, 2, 3, 4]
    inst.enqueue(request(0, blocks, prompt=64, output=1), 0.0)
    drive(inst)
    assert inst.pool.cache.match(np.array(blocks)) == 4
    assert inst.global_tier.match(np.array(blocks)) == 4
    late = request(1, [*blocks, 9], prompt=80, output=1)
    inst.enqueue(late, 10.0)
    inst.pool.cache.evict(4)  # evicted while it waits
    finished = drive(inst, 10.0)
    assert [rid for rid, _ in finished] == [1]
    assert finished[0][1] == pytest.approx(11.064)
    assert (late.local_hit, late.global_hit) == (0, 64)


def test_decode_out_of_blocks_preempts_the_latest_request() -> None:
    # 10 blocks: two 64-token prompts take 4 each; their decodes need a block every 16
    # tokens, so the second admitted is preempted and recomputes after the first ends.
    inst = instance(capacity_blocks=10, budget=256)
    a = request(0, [1, 2, 3, 4], prompt=64, output=40)
    b = request(1, [11, 12, 13, 14], prompt=64, output=40)
    inst.enqueue(a, 0.0)
    inst.enqueue(b, 0.0)
    finished = drive(inst)
    assert [rid for rid, _ in finished] == [0, 1]
    assert (a.preemptions, b.preemptions) == (0, 1)
    assert b.first_token_at == 1.0  # its first token was out before the preemption
    assert (inst.pool.private, inst.pool.cache.locked) == (0, 0)
    assert inst.pool.cache.size <= 10


class CheckedSimulation(Simulation):
    """A simulation that checks the KV invariants after every event it handles."""

    def check(self) -> None:
        for inst in self.instances:
            assert inst.pool.cache.size + inst.pool.private <= inst.pool.capacity
            assert inst.pool.private >= 0
            for req in inst.running.values():
                # A running request's pinned prefix is never evicted.
                assert inst.pool.cache.match(req.blocks) >= req.pinned_blocks

    def arrive(self, req, now):
        super().arrive(req, now)
        self.check()

    def end_step(self, inst, now):
        super().end_step(inst, now)
        self.check()


@st.composite
def small_traces(draw):
    rows = []
    next_block = 1000
    for s in range(draw(st.integers(1, 4))):
        blocks: list[int] = [1, 2]  # a shared system prompt
        parent = None
        for turn in range(draw(st.integers(1, 4))):
            grow = draw(st.integers(1, 12))
            blocks = blocks + list(range(next_block, next_block + grow))
            next_block += grow
            rows.append(
                {
                    "session_id": f"s{s}",
                    "turn": turn,
                    "parent_id": parent,
                    "block_ids": list(blocks),
                    "input_tokens": 16 * len(blocks) + draw(st.integers(0, 15)),
                    "output_tokens": draw(st.integers(1, 40)),
                    "think_time_s": draw(st.floats(0, 5)),
                    "session_time_s": 0.0,
                    "block_size": 16,
                    "shared_prefix_blocks": 2,
                }
            )
            parent = len(rows) - 1
    return make_trace(rows)


def small_config(
    instances: int, kv_tokens: int, glob: str, seed: int, kv_load: str = "sync"
) -> SimConfig:
    return SimConfig(
        cluster=ClusterConfig(
            instances=instances,
            gpus_per_server=2,
            kv_load=kv_load,
            kv_capacity_tokens=kv_tokens,
            max_num_batched_tokens=128,
            max_num_seqs=4,
            global_capacity=glob,
        ),
        workload=WorkloadConfig(session_rate=2.0, duration_s=5.0, seed=seed),
    )


@settings(max_examples=40, deadline=None)
@given(
    trace=small_traces(),
    instances=st.integers(1, 3),
    kv_tokens=st.integers(24, 60).map(lambda b: b * 16),
    glob=st.sampled_from(["none", "1x", "full"]),
    policy=st.sampled_from(POLICY_NAMES),
    seed=st.integers(0, 3),
    kv_load=st.sampled_from(["sync", "async"]),
)
def test_runs_conserve_blocks_and_are_deterministic(
    trace, instances, kv_tokens, glob, policy, seed, kv_load
) -> None:
    config = small_config(instances, kv_tokens, glob, seed, kv_load)
    config = config.override("workload", duration_s=5.0)
    workload = build_workload(trace, config.workload)
    workload.horizon_s = 1e9  # run to completion
    sim = CheckedSimulation(config.cluster, make_policy(policy), workload)
    table = sim.run()
    assert table["request_id"].to_list() == list(range(workload.num_requests))
    assert not sim.inflight
    rejected = table.filter(pl.col("rejected"))
    too_long = rejected["prompt_tokens"] + rejected["output_tokens"] > sim.shape.max_model_len
    assert too_long.all()
    served = table.filter(~pl.col("rejected"))
    assert (served["arrival_s"] <= served["first_token_s"]).all()
    assert (served["first_token_s"] <= served["finished_s"]).all()
    for inst in sim.instances:
        assert (inst.pool.private, inst.pool.cache.locked, inst.inflight) == (0, 0, 0)
        assert inst.unprefilled == 0
    first = simulate(trace, config, policy)
    second = simulate(trace, config, policy)
    assert first.requests.equals(second.requests)
    assert first.summary == second.summary


def test_sticky_policy_keeps_sessions_home_and_least_load_spreads_them() -> None:
    rows = []
    for s in range(6):
        blocks = [1, 2]
        parent = None
        for turn in range(6):
            blocks = blocks + [1000 * (s + 1) + turn * 10 + k for k in range(8)]
            rows.append(
                {
                    "session_id": f"s{s}",
                    "turn": turn,
                    "parent_id": parent,
                    "block_ids": list(blocks),
                    "input_tokens": 16 * len(blocks),
                    "output_tokens": 20,
                    "think_time_s": 1.0,
                    "session_time_s": 0.0,
                    "block_size": 16,
                }
            )
            parent = len(rows) - 1
    trace = make_trace(rows)
    config = small_config(3, 4096, "full", 0).override("workload", duration_s=3.0)
    sticky = simulate(trace, config, "smetric").summary
    spread = simulate(trace, config, "round_robin").summary
    assert min(sticky.stickiness.to_builtins().values()) > 0.9
    assert sticky.reuse.local > spread.reuse.local
    assert spread.reuse.global_ > sticky.reuse.global_


def test_open_loop_session_sampling_keeps_whole_sessions() -> None:
    from smetric.trace.load import load_trace

    trace = load_trace("sample:mooncake")
    half = sample_sessions(trace, 0.5, seed=3)
    again = sample_sessions(trace, 0.5, seed=3)
    assert half.requests.equals(again.requests)
    assert 0.3 * trace.num_sessions < half.num_sessions < 0.7 * trace.num_sessions
    kept = set(half.requests["session_id"].to_list())
    original = trace.requests.filter(trace.requests["session_id"].is_in(list(kept)))
    assert original.height == half.num_requests  # no session is cut
    assert half.requests["request_id"].to_list() == list(range(half.num_requests))
    with pytest.raises(ValueError, match="fraction"):
        sample_sessions(trace, 0.0, seed=0)


def test_gpus_of_a_server_share_its_nics_but_not_their_pcie_lanes() -> None:
    from smetric.sim.cluster import routes

    config = ClusterConfig(
        instances=3, gpus_per_server=2, nics_per_server=1, nic_gb_s=1.0, pcie_gb_s=4.0
    )
    first, second, third = routes(config)
    assert first.nic is second.nic and third.nic is not first.nic
    # 1 GB over the shared 1 GB/s NIC: the second transfer queues behind the first; the
    # other server's instance does not.
    assert first.transfer(0.0, 1e9) == pytest.approx(1.0)
    assert second.transfer(0.0, 1e9) == pytest.approx(2.0)
    assert third.transfer(0.0, 1e9) == pytest.approx(1.0)
    assert first.bytes_moved == 1e9


def test_a_preempted_request_looks_the_global_tier_up_again() -> None:
    inst = instance(global_blocks=None)
    req = request(0, [1, 2, 3, 4], prompt=64, output=40)
    inst.enqueue(req, 0.0)
    now = inst.plan_step(0.0)  # the prefill: 64 tokens, first token at t=1
    assert now is not None
    inst.finish_step(now)
    assert req.decoding and inst.global_tier.match(req.blocks) == 4
    inst._preempt(req, now)  # as a decode short of blocks would
    inst.pool.cache.evict(4)  # and its local prefix goes meanwhile
    moved = inst.tier_route.bytes_moved
    # Re-admitted, it loads its 4 prompt blocks (64 B, 0.064 s) instead of recomputing
    # them, queued behind the write of those blocks that its prefill started at t=1 (the
    # link is first come, first served), so they land at 1.128; then it computes only
    # the token it had generated, in one 1 s step.
    assert inst.plan_step(now) == pytest.approx(now + 0.128 + 1.0)
    assert inst.tier_route.bytes_moved - moved == 64
    assert req.done == 64 and req.target == 65
