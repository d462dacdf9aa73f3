"""The simulator as the real-vLLM benchmark's setup: presets, derived workload, twin run.

No engine runs here: the workload is tokenised by bytes (a larger token scale makes byte
counts the size of the model's tokens), which exercises the same derivation the twin runs
with the model's tokenizer.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from smetric.core.blocks import ByteTokenizer
from smetric.core.conversation import analyze_request
from smetric.model.perf import StepTimeModel, kv_bytes_per_token, load_hardware, load_model
from smetric.replay import next_conversation, replayed_trace, scaled_output
from smetric.sim.config import load_yaml
from smetric.trace.compose import compose_sessions
from smetric.trace.load import DEFAULT_SAMPLE, load_trace
from smetric.trace.schema import common_prefix_len

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
BYTE_SCALE = 100.0  # bytes: about 3.4 per model token, so this is about tokens / 30


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


twin = _load("real_vllm_twin")
calibration = _load("vllm_cpu_calibration")


@pytest.fixture(scope="module")
def trace():
    return replayed_trace(load_trace(DEFAULT_SAMPLE), BYTE_SCALE, ByteTokenizer(), None, 32, 2048)


def test_the_model_preset_has_the_engines_kv_size() -> None:
    """vLLM logs 23,296 tokens for 1 GiB of KV: 46,080 bytes a float32 token."""
    model = load_model("SmolLM2-135M-Instruct")
    assert kv_bytes_per_token(model, "fp32") == 46_080
    assert load_yaml(twin.CONFIG).cluster.kv_capacity_tokens == (2**30 // 46_080) // 32 * 32


def test_the_cpu_preset_reproduces_what_it_was_fitted_on() -> None:
    """Points timed by the preset's own model fit back to the preset's values."""
    hardware = load_hardware("CPU-core")
    model = load_model("SmolLM2-135M-Instruct")
    perf = StepTimeModel(model, hardware, weight_dtype="fp32", kv_dtype="fp32")
    point = calibration.Point
    points = [
        point("prefill", n, 0, 1, perf.step_time(n, n * n / 2, 0, 0)) for n in (64, 512, 1536)
    ]
    context = 64 + calibration.DECODE_TOKENS // 2
    points.append(point("decode", 0, 64, 1, perf.step_time(0, 0, 1, context)))
    fitted = calibration.fit(points, peak_tflops=hardware.bf16_tflops)
    assert fitted["gemm_efficiency"] == pytest.approx(hardware.gemm_efficiency, rel=1e-2)
    assert fitted["attention_efficiency"] == pytest.approx(hardware.attention_efficiency, rel=2e-2)
    assert fitted["step_overhead_s"] == pytest.approx(hardware.step_overhead_s, abs=1e-3)


def test_a_derived_row_is_the_prompt_the_replayer_sends(trace) -> None:
    source = load_trace(DEFAULT_SAMPLE).requests
    first = source.row(0, named=True)
    messages = next_conversation(f"{first['session_id']}#0", 0, first["input_tokens"], None, 100)
    facts = analyze_request({"messages": messages}, "chat", ByteTokenizer(), 32)
    row = trace.requests.row(0, named=True)
    assert row["input_tokens"] == facts.prompt_tokens
    assert row["output_tokens"] == scaled_output(first["output_tokens"], BYTE_SCALE)
    assert len(row["block_ids"]) == len(facts.blocks)
    # The system prompt is common to every session: its whole blocks are shared, the
    # session's own task is not.
    system_blocks = (len(messages[0]["content"]) + len("<|system|>\n")) // 32
    assert 0 < system_blocks <= row["shared_prefix_blocks"] < len(facts.blocks) - 1


def test_a_follow_up_shares_its_whole_history(trace) -> None:
    rows = trace.requests
    child = rows.filter(rows["turn"] == 1).row(0, named=True)
    parent = rows.row(child["parent_id"], named=True)
    shared = common_prefix_len(np.array(parent["block_ids"]), np.array(child["block_ids"]))
    # All of the parent's whole blocks but the one its answer starts in.
    assert shared >= len(parent["block_ids"]) - 1
    assert child["input_tokens"] > parent["input_tokens"]


def test_a_refused_request_ends_its_session(trace) -> None:
    rows = trace.requests
    over = rows.filter(rows["input_tokens"] + rows["output_tokens"] > 2048)
    assert over.height > 0
    assert not rows["parent_id"].is_in(over["request_id"].implode()).any()


def test_the_twin_draws_the_benchmarks_sessions(trace) -> None:
    """Rows are dropped only past a refusal, so the draw sees the same sessions."""
    config = load_yaml(twin.CONFIG).workload
    ours = compose_sessions(trace, rate=config.session_rate, duration_s=config.duration_s)
    theirs = compose_sessions(
        load_trace(DEFAULT_SAMPLE), rate=config.session_rate, duration_s=config.duration_s
    )
    assert set(ours.requests["session_id"]) <= set(theirs.requests["session_id"])
    assert ours.requests.filter(ours.requests["turn"] == 0).height > 5


def test_the_twin_simulates_the_policies(trace) -> None:
    config = load_yaml(twin.CONFIG)
    assert config.cluster.instances == 2 and config.cluster.global_capacity == "none"
    runs = twin.simulated(trace, config)
    assert set(runs) == {"smetric_cost", "smetric", "cache_aware", "least_load"}
    for figures in runs.values():
        assert figures["completed"] > 20
        assert 0.5 < figures["hit_ratio"] < 1.0
        assert figures["latency_p90_s"] >= figures["latency_p50_s"] > 0
    # Least-load ignores the caches: it finds less of each session's history.
    assert runs["least_load"]["hit_ratio"] < runs["cache_aware"]["hit_ratio"]


def test_requests_are_matched_by_session_and_turn_where_unique() -> None:
    sim = [["a#0", 0, 100, 0], ["a#0", 1, 200, 96], ["b#0", 0, 50, 0], ["b#0", 0, 60, 32]]
    real = [["a#0", 0, 101, 0], ["a#0", 1, 198, 64], ["b#0", 0, 50, 0], ["c#0", 0, 10, 0]]
    n, gap, hit, measured = twin.matched(sim, real)
    assert n == 2  # b#0 turn 0 is ambiguous in the simulated run, c#0 only measured
    assert gap == pytest.approx((1 / 101 + 2 / 198) / 2)
    assert hit == pytest.approx(96 / 300) and measured == pytest.approx(64 / 299)
