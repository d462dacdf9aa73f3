"""The step-time model: presets, sanity properties, and the public measurements it must meet.

The anchor rows live in presets/anchors.toml and how each benchmark is rebuilt in
smetric/model/fidelity.py (``smetric fidelity`` prints the table); here every row must land
within the tolerance or say why it does not.
"""

from __future__ import annotations

import time

import pytest

from smetric.model import fidelity
from smetric.model.perf import (
    HARDWARE_NAMES,
    MODEL_NAMES,
    Corrections,
    StepTimeModel,
    kv_bytes_per_token,
    kv_capacity_tokens,
    load_hardware,
    load_model,
    weight_bytes,
)


@pytest.fixture(scope="module")
def h20_30b() -> StepTimeModel:
    return StepTimeModel(load_model("Qwen3-30B-A3B"), load_hardware("H20"))


# -- presets -------------------------------------------------------------------------------


def test_presets_cover_the_paper_setups() -> None:
    assert set(HARDWARE_NAMES) >= {"H20", "H100", "H200"}
    assert set(MODEL_NAMES) >= {"Qwen3-30B-A3B", "Qwen3-Coder-30B-A3B", "Qwen3-235B-A22B-FP8"}
    for name in HARDWARE_NAMES:
        assert load_hardware(name).gpus == 1
    for name in MODEL_NAMES:
        load_model(name)  # also checks published parameter counts against the shape


@pytest.mark.parametrize(
    ("name", "total", "active", "kv", "dtype"),
    [
        ("Qwen3-30B-A3B", 30.5e9, 3.0e9, 98_304, "bf16"),
        ("Qwen3-Coder-30B-A3B", 30.5e9, 3.0e9, 98_304, "bf16"),
        ("Qwen3-Coder-30B-A3B-FP8", 30.5e9, 3.0e9, 98_304, "fp8"),
        ("Qwen3-235B-A22B-FP8", 235e9, 21.6e9, 192_512, "fp8"),
    ],
)
def test_model_shapes_match_perf_anchors(
    name: str, total: float, active: float, kv: int, dtype: str
) -> None:
    model = load_model(name)
    assert model.shape_total_params == pytest.approx(total, rel=0.01)
    assert model.shape_active_params == pytest.approx(active, rel=0.02)
    assert kv_bytes_per_token(model, "bf16") == kv
    assert kv_bytes_per_token(model, "fp8") == kv // 2
    assert model.weight_dtype == dtype


def test_context_lengths() -> None:
    assert load_model("Qwen3-Coder-30B-A3B").max_context == 262_144
    assert load_model("Qwen3-30B-A3B").max_context == 40_960
    assert load_model("Qwen3-235B-A22B-FP8").max_context_yarn == 131_072


def test_weights_in_memory() -> None:
    assert weight_bytes(load_model("Qwen3-30B-A3B"), "bf16") == pytest.approx(61e9, rel=0.01)
    # FP8 checkpoint: ~235 GB, embedding and lm_head kept in BF16.
    fp8 = weight_bytes(load_model("Qwen3-235B-A22B-FP8"), "fp8")
    assert 235e9 < fp8 < 238e9


def test_unknown_names_and_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown hardware"):
        load_hardware("A100")
    with pytest.raises(ValueError, match="unknown model"):
        load_model("Llama-3-8B")
    with pytest.raises(ValueError, match="at least one GPU"):
        load_hardware("H20", gpus=0)
    with pytest.raises(ValueError, match="unknown dtype"):
        StepTimeModel(load_model("Qwen3-30B-A3B"), load_hardware("H20"), weight_dtype="int4")


def test_an_instance_spans_gpus() -> None:
    one, four = load_hardware("H20"), load_hardware("H20", gpus=4)
    assert four.gpus == 4
    assert one.scale == 1.0
    assert 3.0 < four.scale < 4.0


# -- memory --------------------------------------------------------------------------------


def test_kv_capacity_of_30b_on_one_h20() -> None:
    # vLLM's way: 0.9 x the 97,871 MiB the device reports, minus 61 GB of weights and the
    # profiled activations of an 8,192-token pass: 28 GB, about 288 k tokens.
    model, hardware = load_model("Qwen3-30B-A3B"), load_hardware("H20")
    tokens = kv_capacity_tokens(model, hardware, weight_dtype="bf16", kv_dtype="bf16")
    assert tokens * kv_bytes_per_token(model, "bf16") == pytest.approx(28.3e9, rel=0.02)
    assert 267_000 < tokens < 298_000
    assert tokens < 64 * 8192  # 64 sequences of 8 k context do not fit
    fp8_kv = kv_capacity_tokens(model, hardware, weight_dtype="bf16", kv_dtype="fp8")
    assert fp8_kv == pytest.approx(2 * tokens, abs=2)
    # A smaller profiling pass leaves more room, as vLLM's does.
    small = kv_capacity_tokens(
        model, hardware, weight_dtype="bf16", kv_dtype="bf16", max_num_batched_tokens=2048
    )
    assert small > tokens


def test_kv_capacity_of_235b() -> None:
    model = load_model("Qwen3-235B-A22B-FP8")
    four = load_hardware("H20", gpus=4)
    assert kv_capacity_tokens(model, four, weight_dtype="fp8", kv_dtype="bf16") > 400_000
    # In BF16 (~470 GB) it does not fit four H20s at all.
    assert kv_capacity_tokens(model, four, weight_dtype="bf16", kv_dtype="bf16") == 0
    # Nor, in FP8, one H200.
    one = load_hardware("H200")
    assert kv_capacity_tokens(model, one, weight_dtype="fp8", kv_dtype="bf16") == 0


def test_8k_prefix_load_beats_recompute(h20_30b: StepTimeModel) -> None:
    # Public figures: 8 k tokens are ~805 MB of KV and ~0.5-0.6 s to recompute on an H20.
    model = load_model("Qwen3-30B-A3B")
    assert 8192 * kv_bytes_per_token(model, "bf16") == pytest.approx(805e6, rel=0.01)
    recompute = fidelity.prefill_seconds(h20_30b, 8192)
    assert 0.45 < recompute < 0.65


# -- sanity --------------------------------------------------------------------------------


def test_4k_prefill_on_h20(h20_30b: StepTimeModel) -> None:
    measured = 4096 / 16594
    assert h20_30b.step_time(4096, 4096 * 2048, 0, 0) == pytest.approx(measured, rel=0.15)


def test_step_time_grows_with_work(h20_30b: StepTimeModel) -> None:
    base = h20_30b.step_time(512, 512 * 256, 16, 16 * 4000)
    assert h20_30b.step_time(1024, 512 * 256, 16, 16 * 4000) > base
    assert h20_30b.step_time(512, 512 * 2000, 16, 16 * 4000) > base
    assert h20_30b.step_time(512, 512 * 256, 32, 16 * 4000) > base
    assert h20_30b.step_time(512, 512 * 256, 16, 16 * 8000) > base
    times = [h20_30b.step_time(n, n * n / 2, 0, 0) for n in (256, 1024, 4096, 16384)]
    assert times == sorted(times)


def test_decode_grows_sublinearly_until_experts_saturate(h20_30b: StepTimeModel) -> None:
    def step(batch: int) -> float:
        return h20_30b.step_time(0, 0.0, batch, batch * 2048)

    for batch in (1, 2, 4, 8, 16, 32, 64, 128):
        assert step(batch) < step(2 * batch) < 2 * step(batch)
    # An extra sequence costs its expert reads while the batch still touches new
    # experts, then only its KV reads and FLOPs.
    early = step(2) - step(1)
    late = step(129) - step(128)
    assert early > 5 * late
    assert step(256) - step(255) == pytest.approx(late, rel=0.05)


def test_breakdown_adds_up_to_step_time() -> None:
    for name, hw, gpus in (("Qwen3-30B-A3B", "H100", 1), ("Qwen3-235B-A22B-FP8", "H20", 4)):
        spec = load_model(name)
        perf = StepTimeModel(spec, load_hardware(hw, gpus), weight_dtype=spec.weight_dtype)
        for args in ((0, 0.0, 1, 3000), (2048, 2048 * 5000.0, 40, 40 * 9000), (8192, 3e7, 0, 0)):
            assert perf.breakdown(*args).total == pytest.approx(perf.step_time(*args))


def test_an_empty_step_is_refused(h20_30b: StepTimeModel) -> None:
    with pytest.raises(ValueError, match="at least one token"):
        h20_30b.step_time(0, 0.0, 0, 0)


def test_corrections_scale_their_terms() -> None:
    model, hardware = load_model("Qwen3-30B-A3B"), load_hardware("H20")
    plain = StepTimeModel(model, hardware)
    prefill, decode = (8192, 8192 * 4096.0, 0, 0), (0, 0.0, 64, 64 * 8000)

    def term(perf: StepTimeModel, args: tuple[int, float, int, int], name: str) -> float:
        return getattr(perf.breakdown(*args), name)

    slow_compute = StepTimeModel(model, hardware, corrections=Corrections(compute=2.0))
    assert term(slow_compute, prefill, "experts") == pytest.approx(
        2 * term(plain, prefill, "experts")
    )
    slow_memory = StepTimeModel(model, hardware, corrections=Corrections(memory=2.0))
    assert term(slow_memory, decode, "experts") == pytest.approx(2 * term(plain, decode, "experts"))
    slow_attention = StepTimeModel(model, hardware, corrections=Corrections(attention=1.5))
    for args in (prefill, decode):
        assert term(slow_attention, args, "attention") == pytest.approx(
            1.5 * term(plain, args, "attention")
        )
    overheads = Corrections(step_overhead_s=0.0, layer_overhead_s=0.0)
    bare = StepTimeModel(model, hardware, corrections=overheads)
    fitted = hardware.step_overhead_s + 48 * hardware.layer_overhead_s
    assert plain.step_time(*decode) - bare.step_time(*decode) == pytest.approx(fitted)
    # A prefill slowdown stretches compute-bound prefill, not decode's weight and KV reads.
    slow = StepTimeModel(model, hardware, corrections=Corrections(prefill=1.25))
    assert term(slow, prefill, "experts") == pytest.approx(1.25 * term(plain, prefill, "experts"))
    assert term(slow, prefill, "attention") == pytest.approx(
        1.25 * term(plain, prefill, "attention")
    )
    assert slow.step_time(*decode) == pytest.approx(plain.step_time(*decode), rel=0.01)


def test_one_sequence_cannot_fill_the_gpu_with_decode_attention(h20_30b: StepTimeModel) -> None:
    # A single sequence reads its KV at about 1.1 TB/s, a full batch at about 3 TB/s.
    one = h20_30b.breakdown(0, 0.0, 1, 100_000).attention
    eight = h20_30b.breakdown(0, 0.0, 8, 800_000).attention
    assert one == pytest.approx(eight / 8 * 0.76 / 0.275, rel=0.01)


def test_tensor_parallel_scales_with_a_cost() -> None:
    model = load_model("Qwen3-30B-A3B")
    one = StepTimeModel(model, load_hardware("H20"))
    four = StepTimeModel(model, load_hardware("H20", gpus=4))
    prefill = (8192, 8192 * 4096.0, 0, 0)
    assert one.step_time(*prefill) / 4 < four.step_time(*prefill) < one.step_time(*prefill) / 2.5
    assert one.breakdown(*prefill).comm == 0
    assert four.breakdown(*prefill).comm > 0
    no_comm = StepTimeModel(model, load_hardware("H20", gpus=4), corrections=Corrections(comm=0))
    assert no_comm.breakdown(*prefill).comm == 0


def test_fp8_weights_halve_weight_streaming() -> None:
    model = load_model("Qwen3-235B-A22B-FP8")
    hardware = load_hardware("H20", gpus=4)
    bf16 = StepTimeModel(model, hardware, weight_dtype="bf16")
    fp8 = StepTimeModel(model, hardware, weight_dtype="fp8")
    decode = (0, 0.0, 8, 8 * 2000)
    assert fp8.breakdown(*decode).experts == pytest.approx(bf16.breakdown(*decode).experts / 2)
    # Compute-bound prefill gains less than 2x: block-scaled FP8 GEMMs are derated.
    prefill = (8192, 0.0, 0, 0)
    gain = bf16.breakdown(*prefill).experts / fp8.breakdown(*prefill).experts
    assert gain == pytest.approx(2 * hardware.fp8_gemm_derate)


def test_faster_hardware_is_faster() -> None:
    model = load_model("Qwen3-30B-A3B")
    h20, h100, h200 = (StepTimeModel(model, load_hardware(n)) for n in ("H20", "H100", "H200"))
    prefill, decode = (8192, 8192 * 4096.0, 0, 0), (0, 0.0, 32, 32 * 8000)
    assert h100.step_time(*prefill) < h20.step_time(*prefill) / 4
    assert h200.step_time(*decode) < h20.step_time(*decode) < h100.step_time(*decode)


def test_step_time_is_cheap(h20_30b: StepTimeModel) -> None:
    calls = 100_000
    start = time.perf_counter()
    for i in range(calls):
        h20_30b.step_time(i & 1023, 1000.0 * i, 32, 32 * 4000 + i)
    assert (time.perf_counter() - start) / calls < 10e-6


# -- public measurements -------------------------------------------------------------------


@pytest.mark.parametrize("anchor", fidelity.anchors(), ids=lambda a: a.id)
def test_every_anchor_is_met_or_explained(anchor: fidelity.Anchor) -> None:
    ratio = anchor.ratio()
    assert anchor.within or anchor.why, f"{anchor.id}: model/measured = {ratio:.2f}, no reason"


def test_fitted_and_held_out_rows_both_exist_and_mostly_hold() -> None:
    s = fidelity.summary()
    assert s.fitted_rows and s.held_out_rows
    assert s.fitted_within == s.fitted_rows
    assert s.held_out_within >= s.held_out_rows // 2
    assert s.within + s.explained_outside == s.rows


def test_every_gpu_preset_has_a_measured_anchor() -> None:
    covered = {a.params.get("hardware") for a in fidelity.anchors()}
    assert set(HARDWARE_NAMES) <= covered


def test_long_context_is_fitted_and_checked() -> None:
    prompt = {a.id: a.params.get("prompt", 0) for a in fidelity.anchors()}
    rows = fidelity.anchors()
    assert any(a.fit and a.within and prompt[a.id] >= 64_000 for a in rows)
    assert any(not a.fit and a.within and prompt[a.id] >= 60_000 for a in rows)


def test_long_context_rows_are_counted_per_gpu_and_shown() -> None:
    counts = fidelity.long_context_rows()
    assert set(counts) == {n for n in HARDWARE_NAMES if n != "CPU-core"}
    assert counts["H20"] >= 2 and counts["H200"] >= 1
    long = [
        a
        for a in fidelity.anchors()
        if a.params.get("prompt", 0) >= 64_000 and a.params.get("hardware") != "CPU-core"
    ]
    assert sum(counts.values()) == len(long)
    page = fidelity.markdown()
    for gpu, n in counts.items():
        assert (f"{gpu} {n} row" in page) if n else (f"{gpu} none" in page)


def test_explained_rows_state_a_reason_the_step_model_cannot_see() -> None:
    # The TTFT rows include server and client time: the engine steps alone are faster.
    for anchor in fidelity.anchors():
        if anchor.kind == "ttft_ms" and not anchor.within:
            assert anchor.ratio() < 1 or "FP8" in anchor.why
