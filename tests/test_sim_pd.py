"""The disaggregated simulator: prefill instances, KV pulls over the links, decode instances."""

from __future__ import annotations

import dataclasses

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_sim import small_traces

from smetric.core.policies import POLICY_NAMES, Choice, ClusterView, make_policy
from smetric.core.policies.decode import DECODE_POLICY_NAMES
from smetric.core.policies.least_load import LeastLoad
from smetric.sim.config import ClusterConfig, SimConfig, WorkloadConfig
from smetric.sim.pd import DisaggSimulation
from smetric.sim.policy import cluster_policy
from smetric.sim.run import simulate
from smetric.sim.workload import build_workload

from conftest import make_trace


def pd_config(prefill: int, decode: int, **cluster) -> SimConfig:
    return SimConfig(
        cluster=ClusterConfig(
            prefill_instances=prefill,
            decode_instances=decode,
            gpus_per_server=2,
            max_num_batched_tokens=128,
            max_num_seqs=4,
            **{"kv_capacity_tokens": 640, **cluster},
        ),
        workload=WorkloadConfig(session_rate=2.0, duration_s=5.0),
    )


def run_to_completion(
    trace, config: SimConfig, policy: str
) -> tuple[DisaggSimulation, pl.DataFrame]:
    """The simulation, run past its last request, and its per-request table."""
    workload = build_workload(trace, config.workload)
    workload.horizon_s = 1e9
    sim = DisaggSimulation(config.cluster, make_policy(policy), workload)
    return sim, sim.run()


@settings(max_examples=30, deadline=None)
@given(
    trace=small_traces(),
    prefill=st.integers(1, 3),
    decode=st.integers(0, 2),
    kv_tokens=st.integers(24, 60).map(lambda b: b * 16),
    glob=st.sampled_from(["none", "1x", "full"]),
    policy=st.sampled_from(POLICY_NAMES),
    rule=st.sampled_from(sorted(DECODE_POLICY_NAMES)),
)
def test_disaggregated_runs_free_every_block_and_are_deterministic(
    trace, prefill, decode, kv_tokens, glob, policy, rule
) -> None:
    config = pd_config(
        prefill, decode, kv_capacity_tokens=kv_tokens, global_capacity=glob, decode_policy=rule
    )
    sim, table = run_to_completion(trace, config, policy)
    for req in table.iter_rows(named=True):
        if req["rejected"]:
            continue
        handoff = sim.handoffs[req["request_id"]]
        assert req["arrival_s"] <= handoff.prefill_done <= req["first_token_s"]
        assert req["first_token_s"] <= req["finished_s"]
        assert 0 <= req["instance"] < prefill
        assert (handoff.decode_instance >= 0) == (decode > 0)
    for inst in sim.instances:
        assert (inst.pool.private, inst.pool.cache.locked, inst.inflight) == (0, 0, 0)
        assert inst.unprefilled == 0
    for decoder in sim.decoders:
        assert (
            decoder.tier_route.pcie.bytes_moved == 0
        )  # only prefill instances use the global tier
        assert not decoder.sources
    first = simulate(trace, config, policy)
    second = simulate(trace, config, policy)
    assert first.requests.equals(second.requests)
    assert first.summary == second.summary


def one_request_trace(blocks: int, output: int):
    row = {
        "session_id": "s0",
        "turn": 0,
        "parent_id": None,
        "block_ids": list(range(1, blocks + 1)),
        "input_tokens": 16 * blocks,
        "output_tokens": output,
        "think_time_s": 0.0,
        "session_time_s": 0.0,
        "block_size": 16,
    }
    return make_trace([row])


def test_the_decode_pulls_the_prompt_over_both_servers_nics_before_its_first_token() -> None:
    # 8 blocks of prompt; the decode recomputes the last block's tokens (vLLM recomputes
    # at least the last token), so 7 blocks = 112 tokens cross 1 MB/s NICs. No global tier:
    # its write of the prompt would take the prefill server's NIC first (FCFS, shared).
    config = pd_config(
        1, 1, nics_per_server=1, nic_gb_s=0.001, kv_capacity_tokens=4096, global_capacity="none"
    )
    config = config.override("workload", session_rate=0.001, arrival="uniform")
    sim, table = run_to_completion(one_request_trace(8, 5), config, "smetric")
    (req,) = table.iter_rows(named=True)
    handoff = sim.handoffs[req["request_id"]]
    pull_s = 112 * sim.shape.kv_bytes_per_token / 1e6
    assert handoff.transfer_tokens == 112
    assert pull_s < req["first_token_s"] - handoff.prefill_done < pull_s + 0.5
    prefill_nic, decode_nic = sim.instances[0].tier_route.nic, sim.decoders[0].tier_route.nic
    assert prefill_nic is not decode_nic  # the two pools sit on their own servers
    assert prefill_nic.bytes_moved == decode_nic.bytes_moved == 112 * sim.shape.kv_bytes_per_token


def test_prefill_only_counts_prompt_tokens_and_the_first_token_at_the_prefills_end() -> None:
    config = pd_config(2, 0, kv_capacity_tokens=4096).override(
        "workload", duration_s=50.0, session_rate=0.001, arrival="uniform"
    )
    result = simulate(one_request_trace(8, 40), config, "smetric")
    row = result.requests.row(0, named=True)
    assert row["first_token_s"] == row["finished_s"] == row["prefill_done_s"]
    assert row["decode_instance"] == -1
    summary = result.summary
    assert summary.pd is not None
    assert summary.pd.mode == "prefill-only"
    assert summary.tps_within_slo == pytest.approx(128 / 50.0)  # prompt tokens only
    assert summary.tpot_s.p50 is None
    assert summary.pd.transfer_bytes == 0


def test_full_pd_counts_prompt_tokens_within_both_slos_and_reports_end_to_end_tps() -> None:
    config = pd_config(1, 1, kv_capacity_tokens=4096).override(
        "workload", duration_s=50.0, session_rate=0.001, arrival="uniform"
    )
    summary = simulate(one_request_trace(8, 40), config, "smetric").summary
    assert summary.pd is not None
    assert summary.tps_within_slo == pytest.approx(128 / 50.0)
    assert summary.pd.end_to_end_tps_within_slo == pytest.approx((128 + 40) / 50.0)
    assert (summary.tpot_s.p50 or 0) > 0
    assert summary.pd.requests_per_decoder == [1]


class Recorder:
    """Routes like least-load on unprefilled tokens and keeps each view it was shown."""

    name = "recorder"
    branches = ("only",)

    def __init__(self) -> None:
        self.views: list[ClusterView] = []

    def route(self, request, view: ClusterView) -> Choice:
        queued = list(view.unprefilled_tokens)
        self.views.append(dataclasses.replace(view, unprefilled_tokens=queued))
        return Choice(min(range(len(queued)), key=queued.__getitem__), "only")


def first_turns(sessions: int, blocks: int, output: int):
    """``sessions`` one-turn sessions of ``blocks`` distinct blocks each."""
    row = {"turn": 0, "parent_id": None, "output_tokens": output, "block_size": 16}
    return make_trace(
        [
            {
                **row,
                "session_id": f"s{i}",
                "block_ids": list(range(100 * i, 100 * i + blocks)),
                "input_tokens": 16 * blocks,
            }
            for i in range(sessions)
        ]
    )


def test_the_policys_load_is_unprefilled_prompt_tokens_on_prefill_instances_only() -> None:
    config = pd_config(2, 3).override("workload", session_rate=100.0, duration_s=0.06)
    workload = build_workload(first_turns(6, 20, 4), config.workload)
    recorder = Recorder()
    DisaggSimulation(config.cluster, recorder, workload).run()
    assert all(len(v.unprefilled_tokens) == 2 for v in recorder.views)
    assert all(len(v.inflight_requests) == 2 for v in recorder.views)
    assert any(max(v.unprefilled_tokens) >= 320 for v in recorder.views)  # counted whole
    disaggregated = cluster_policy("least_load", config.cluster)[0]
    assert isinstance(disaggregated, LeastLoad)
    assert disaggregated.load == "unprefilled_tokens"
    colocated = dataclasses.replace(config.cluster, prefill_instances=0, decode_instances=0)
    colocated_policy = cluster_policy("least_load", colocated)[0]
    assert isinstance(colocated_policy, LeastLoad)
    assert colocated_policy.load == "inflight_requests"


def test_decode_rules_spread_a_burst_over_the_decode_instances() -> None:
    trace = first_turns(6, 4, 50)
    for rule in DECODE_POLICY_NAMES:
        config = pd_config(1, 3, decode_policy=rule, kv_capacity_tokens=4096)
        config = config.override("workload", session_rate=100.0, duration_s=0.06)
        sim, _ = run_to_completion(trace, config, "least_load")
        used = sorted(h.decode_instance for h in sim.handoffs.values())
        assert used == [0, 0, 1, 1, 2, 2], rule
    with pytest.raises(ValueError, match="decode_policy 'nope': use one of least_kv"):
        run_to_completion(trace, pd_config(1, 1, decode_policy="nope"), "smetric")
