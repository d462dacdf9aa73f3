"""The simulator prices ``smetric_cost``'s moves for the hardware it simulates."""

from __future__ import annotations

import dataclasses

import pytest

from smetric.core.policies import (
    POLICY_NAMES,
    hardware_params,
    make_policy,
    policy_params,
    resolve_policy,
)
from smetric.core.policies.registry import parameters
from smetric.core.policies.smetric_cost import SMetricCost
from smetric.core.settings import setting
from smetric.model.calibrate import HardwareRates
from smetric.model.perf import StepTimeModel, load_hardware, load_model
from smetric.sim.config import ClusterConfig, SimConfig
from smetric.sim.jobs import Job
from smetric.sim.policy import cluster_policy, cluster_rates
from smetric.sim.run import simulate
from smetric.trace.load import load_trace

H200_FP8_KV = ClusterConfig(hardware="H200", kv_dtype="fp8")


def rate_of(policy: str, param: str) -> str:
    """The hardware rate a policy's parameter declares it takes."""
    rate = parameters(policy)[param][1].rate
    assert rate is not None
    return rate


def test_the_default_cluster_derives_the_policys_defaults_exactly() -> None:
    """Every result measured with the H20 defaults stays valid: they are what the default
    cluster derives, to the bit."""
    defaults = policy_params("smetric_cost")
    rates = cluster_rates(ClusterConfig())
    hardware = hardware_params("smetric_cost")
    assert {rate_of("smetric_cost", key) for key in hardware} == set(rates)
    assert {key: rates[rate_of("smetric_cost", key)] for key in hardware} == {
        key: defaults[key] for key in hardware
    }


def test_every_hardware_parameter_of_every_policy_is_a_rate_the_calibration_derives() -> None:
    rates = {f.name for f in dataclasses.fields(HardwareRates)}
    for name in POLICY_NAMES:
        assert {rate_of(name, key) for key in hardware_params(name)} <= rates, name


def test_a_setting_names_a_hardware_rate_exactly_when_it_comes_from_the_hardware() -> None:
    with pytest.raises(TypeError, match="hardware rate"):
        setting(1.0, "x", source="hardware")
    with pytest.raises(TypeError, match="hardware rate"):
        setting(1.0, "x", rate="prefill_tokens_per_s")


def test_derived_constants_follow_the_hardware_and_links() -> None:
    h20, h200 = cluster_rates(ClusterConfig()), cluster_rates(H200_FP8_KV)
    # Prefill is compute-bound: an H200 has 6.7x an H20's BF16 peak, but Hopper GEMMs
    # reach a smaller share of theirs (0.62-0.67 against the H20's 0.83-0.92).
    assert 4.0 < h200["prefill_tokens_per_s"] / h20["prefill_tokens_per_s"] < 5.5
    # An FP8 KV token is half the bytes: twice the tokens over the same NICs.
    assert h200["fetch_tokens_per_s"] == 2 * h20["fetch_tokens_per_s"]
    assert h200["decode_kv_token_s"] < h20["decode_kv_token_s"]
    # Half the NICs halve a GPU's share; a slow PCIe lane caps it instead.
    assert cluster_rates(ClusterConfig(nics_per_server=2))["fetch_tokens_per_s"] == 55_000
    narrow = cluster_rates(ClusterConfig(pcie_gb_s=5.0))["fetch_tokens_per_s"]
    assert narrow == pytest.approx(5e9 / 98_304, rel=0.01)


def test_the_attention_fit_reproduces_the_perf_models_rate_deep_in_a_prompt() -> None:
    """The policy's prefill formula, with the derived constants, gives the step model's
    rate for an 8 k chunk after 100 k tokens of context, to the rounding."""
    perf = StepTimeModel(load_model("Qwen3-Coder-30B-A3B"), load_hardware("H200"), kv_dtype="fp8")
    chunk = 8192
    modelled = chunk / perf.step_time(chunk, chunk * (100_000 + chunk / 2), 0, 0)
    policy = make_policy("smetric_cost", cluster_rates(H200_FP8_KV))
    assert isinstance(policy, SMetricCost)
    fitted = 1.0 / ((1.0 + 100_000 / policy.attn_tokens) / policy.prefill_tps)
    assert fitted == pytest.approx(modelled, rel=0.03)


def test_the_spec_wins_and_only_hardware_parameters_are_derived() -> None:
    derived = {"prefill_tokens_per_s": 90_000.0, "work_weight": 9.0, "overload": 9.0}
    name, params = resolve_policy("smetric_cost:prefill_tps=9000", derived)
    assert name == "smetric_cost"
    assert params["prefill_tps"] == 9000.0
    assert params["work_weight"] == policy_params("smetric_cost")["work_weight"]
    assert resolve_policy("smetric_cost", derived)[1]["prefill_tps"] == 90_000.0
    # A policy without hardware constants ignores them.
    assert resolve_policy("smetric", derived)[1] == policy_params("smetric")
    cost = make_policy("smetric_cost", derived)
    assert isinstance(cost, SMetricCost) and cost.prefill_tps == 90_000.0


@pytest.mark.parametrize("pd", [False, True], ids=["colocated", "disaggregated"])
def test_simulations_route_with_the_derived_constants(pd: bool) -> None:
    cluster = dataclasses.replace(H200_FP8_KV, instances=2)
    if pd:
        cluster = dataclasses.replace(cluster, prefill_instances=2, decode_instances=1)
    config = SimConfig(cluster=cluster).override("workload", duration_s=60.0, session_rate=0.1)
    trace = load_trace("sample:weka")
    rates = cluster_rates(cluster)
    result = simulate(trace, config, "smetric_cost")
    hardware = hardware_params("smetric_cost")
    derived = {key: rates[rate_of("smetric_cost", key)] for key in hardware}
    assert {k: result.policy_params[k] for k in hardware} == derived
    policy, _ = cluster_policy("smetric_cost", cluster)
    assert isinstance(policy, SMetricCost) and policy.fetch_tps == rates["fetch_tokens_per_s"]
    pinned = simulate(trace, config, "smetric_cost:fetch_tps=1000")
    assert pinned.policy_params["fetch_tps"] == 1000.0


def test_a_run_on_other_hardware_is_another_run() -> None:
    """The derived constants follow from the cluster, which names the run in the RunStore."""
    config = SimConfig()
    h200 = dataclasses.replace(config, cluster=H200_FP8_KV)
    ids = {Job((), c, "smetric_cost").run_id for c in (config, h200)}
    assert len(ids) == 2


def test_a_run_is_named_by_the_parameters_its_policy_routes_with(monkeypatch) -> None:
    """A stored run is reused only when the policy would route the same: the default
    spelled out is the same run, another value is another, and so is a default changed in
    the code behind an unchanged spec."""
    config = SimConfig()
    bare = Job((), config, "smetric_cost").run_id
    assert Job((), config, "smetric_cost:work_weight=2").run_id == bare
    assert Job((), config, "smetric_cost:work_weight=3").run_id != bare
    monkeypatch.setattr(
        "smetric.core.policies.registry.policy_params",
        lambda name: {**policy_params(name), "work_weight": 3.0},
    )
    assert Job((), config, "smetric_cost").run_id != bare
