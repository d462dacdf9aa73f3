"""Perturbed worlds: the simulated engines change, what the policy is told does not."""

from __future__ import annotations

import dataclasses

import pytest

from smetric.core.policies import SMetricCost
from smetric.sim.calibrate import policy_constants
from smetric.sim.cluster import engine_model, resolve_shape, routes, step_time_model
from smetric.sim.config import ClusterConfig, SimConfig, from_dict
from smetric.sim.parallel import Job
from smetric.sim.run import simulate
from smetric.sim.world import World
from smetric.trace.load import load_trace

NOMINAL = ClusterConfig(instances=8)


def perturbed(**factors: float) -> ClusterConfig:
    return dataclasses.replace(NOMINAL, world=World(**factors))


def test_the_policy_is_told_the_configured_world() -> None:
    for factors in ({"prefill_slowdown": 1.25}, {"kv_room": 0.8}, {"tier_bandwidth": 1 / 8}):
        assert policy_constants(perturbed(**factors)) == policy_constants(NOMINAL)


def test_slower_prefill_stretches_only_the_prefill_part_of_a_step() -> None:
    config = perturbed(prefill_slowdown=1.25)
    shape = resolve_shape(config, 16)
    slow, _ = engine_model(config, shape)
    fast = step_time_model(NOMINAL)
    decode = fast.step_time(0, 0.0, 32, 32 * 20_000)
    mixed = fast.step_time(4096, 4096 * 30_000.0, 32, 32 * 20_000)
    assert slow.step_time(0, 0.0, 32, 32 * 20_000) == decode
    assert slow.step_time(4096, 4096 * 30_000.0, 32, 32 * 20_000) == pytest.approx(
        decode + 1.25 * (mixed - decode)
    )
    assert slow.step_time(8192, 8192 * 4096.0, 0, 0) == pytest.approx(
        1.25 * fast.step_time(8192, 8192 * 4096.0, 0, 0)
    )


def test_kv_room_and_tier_bandwidth_scale_the_engines() -> None:
    room = resolve_shape(NOMINAL, 16).kv_capacity_tokens
    assert resolve_shape(perturbed(kv_room=0.8), 16).kv_capacity_tokens == int(room * 0.8)
    nominal, slow = routes(NOMINAL)[0], routes(perturbed(tier_bandwidth=1 / 8))[0]
    assert slow.pcie.bytes_per_s == pytest.approx(nominal.pcie.bytes_per_s / 8)
    assert slow.nic.bytes_per_s == pytest.approx(nominal.nic.bytes_per_s / 8)


def test_a_world_is_part_of_a_run_name_and_of_its_configuration_file() -> None:
    base = SimConfig().override("cluster", instances=8)
    other = base.override("cluster", world=World(kv_room=1.2))
    assert Job((), base, "least_load").run_id != Job((), other, "least_load").run_id
    assert "world" not in base.to_dict()["cluster"]
    assert from_dict(other.to_dict()) == other
    with pytest.raises(ValueError, match="kv_room must be positive"):
        World(kv_room=0.0)


def test_the_learner_finds_a_slower_prefill_the_policy_was_not_told_of() -> None:
    """Same cluster, same requests: with every prefill 1.5x slower the learned prices put
    a 30 k-token prefill dearer than in the configured world."""
    trace = load_trace("sample:weka")
    config = (
        SimConfig()
        .override("cluster", instances=2, global_capacity="full")
        .override("workload", session_rate=0.02, duration_s=900.0)
    )
    slow = config.override("cluster", world=World(prefill_slowdown=1.5))

    def prefill_s(run: SimConfig) -> float:
        learned = simulate(trace, run, "smetric_cost").summary["learned_params"]
        return SMetricCost(**learned).prefill_s(30_000)

    assert prefill_s(slow) > 1.2 * prefill_s(config)
