"""benchmarks/gpu_probe.py: from timings to a hardware preset the model reads.

The timing itself needs torch (and, to mean anything, a GPU): where torch is installed the
probe runs on the CPU with tiny shapes, which checks that it runs end to end and writes a
file in the presets' shape, not what any number is.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest
from typer.testing import CliRunner

from smetric.cli import app
from smetric.model.perf import Hardware, load_hardware

PROBE = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_probe.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_probe", PROBE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


probe = _load()


def base() -> dict:
    fields = dataclasses.asdict(load_hardware("H200"))
    return {k: v for k, v in fields.items() if k not in ("name", "gpus")}


def synthetic() -> list:
    m = probe.Measurement
    # Rates chosen as fractions of the H200's peaks (989.5 TFLOP/s, 4,800 GB/s).
    return [
        m("dense_gemm", 1.0, flops=0.6 * 989.5e12),
        m("grouped_gemm", 1.0, flops=0.45 * 989.5e12),
        m("prefill_attention_0", 1.0, flops=0.5 * 989.5e12),
        m("prefill_attention_57344", 3.0, flops=3 * 0.7 * 989.5e12),
        m("decode_attention_b1", 1.0, nbytes=0.3 * 4800e9),
        m("decode_attention_b64", 1.0, nbytes=0.8 * 4800e9),
        m("stream", 1.0, nbytes=0.9 * 4800e9),
        m("host_to_device", 1.0, nbytes=53e9),
    ]


def test_measurements_become_the_preset_fields_they_measure() -> None:
    preset, links = probe.fitted(synthetic(), base(), memory_mib=143_771.0)
    assert preset["gemm_efficiency"] == pytest.approx(0.6)
    assert preset["grouped_gemm_efficiency"] == pytest.approx(0.45)
    # Total FLOPs over total time: the deep chunk weighs three times the shallow one.
    assert preset["attention_efficiency"] == pytest.approx((0.5 + 3 * 0.7) / 4)
    assert preset["decode_seq_bw_efficiency"] == pytest.approx(0.3)
    assert preset["decode_attention_bw_efficiency"] == pytest.approx(0.8)
    assert preset["memory_efficiency"] == pytest.approx(0.9)
    assert preset["memory_mib"] == 143_771
    assert links == {"pcie_gb_s": pytest.approx(53.0)}
    # What kernels cannot measure stays the base preset's.
    assert preset["layer_overhead_s"] == base()["layer_overhead_s"]


def test_the_file_is_a_preset_the_model_reads(tmp_path: Path) -> None:
    preset, links = probe.fitted(synthetic(), base(), memory_mib=None)
    path = tmp_path / "probed.toml"
    path.write_text(probe.to_toml(preset, links, ["a note"]))
    table = tomllib.loads(path.read_text())["hardware"]
    assert set(table) == {f.name for f in dataclasses.fields(Hardware)} - {"name", "gpus"}
    result = CliRunner().invoke(
        app, ["model", "--hardware", "H200", "--preset-file", str(path), "--json"]
    )
    assert result.exit_code == 0, result.output
    probed = json.loads(result.output)
    plain = json.loads(CliRunner().invoke(app, ["model", "--hardware", "H200", "--json"]).output)
    # Lower GEMM and attention fractions than the preset's: a slower prefill.
    assert probed["prefill"]["seconds"] > plain["prefill"]["seconds"]


def test_the_probe_runs_end_to_end_on_a_cpu(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "cpu.toml"
    monkeypatch.setattr(
        sys,
        "argv",
        ["gpu_probe.py", "--device", "cpu", "--quick", "--repeats", "1", "--out", str(out)],
    )
    probe.main()
    table = tomllib.loads(out.read_text())["hardware"]
    for key in ("gemm_efficiency", "attention_efficiency", "decode_attention_bw_efficiency"):
        assert table[key] > 0
