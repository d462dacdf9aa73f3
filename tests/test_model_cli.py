"""``smetric model`` answers from the simulator's own model; ``smetric fidelity`` writes the
table the docs show."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from smetric.cli import app
from smetric.model import fidelity
from smetric.sim.cluster import resolve_shape
from smetric.sim.config import ClusterConfig

runner = CliRunner()


def ask(*args: str) -> dict:
    result = runner.invoke(app, ["model", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_kv_room_is_the_simulators() -> None:
    answer = ask()
    assert answer["kv_room"]["tokens"] == resolve_shape(ClusterConfig(), 16).kv_capacity_tokens
    h200 = ask("--hardware", "H200", "--max-batched-tokens", "4096", "--model", "Qwen3-30B-A3B")
    # vLLM's own pool on one H200 at these settings: 744,304 tokens.
    assert abs(h200["kv_room"]["tokens"] / 744_304 - 1) < 0.01


def test_cached_tokens_make_new_ones_dearer_and_media_rank_by_speed() -> None:
    fresh = ask("--new", "8192")["prefill"]["seconds"]
    deep = ask("--new", "8192", "--cached", "100000")["prefill"]["seconds"]
    assert deep > 1.5 * fresh
    media = ask()["global_tier_load"]["media"]
    order = [media[m]["seconds"] for m in ("line-rate", "lmcache-cpu", "mooncake-rdma")]
    assert order == sorted(order)
    assert media["mooncake-tcp"]["seconds"] > media["mooncake-rdma"]["seconds"]
    # 100 k tokens of KV (9.8 GB) at MooncakeStore's 6.4 GB/s take about 1.5 s.
    assert 1.4 < media["mooncake-rdma"]["seconds"] < 1.7
    one = ask("--medium", "mooncake-tcp")["global_tier_load"]["media"]
    assert list(one) == ["mooncake-tcp"]


def test_a_bigger_batch_makes_a_longer_step_but_more_tokens() -> None:
    small, big = ask("--batch", "8")["decode_step"], ask("--batch", "64")["decode_step"]
    assert big["seconds"] > small["seconds"]
    assert big["output_tokens_per_s"] > small["output_tokens_per_s"]


def test_a_users_preset_file_overrides_the_named_preset(tmp_path: Path) -> None:
    path = tmp_path / "my-gpu.toml"
    path.write_text("[hardware]\nmemory_mib = 195000\nbf16_tflops = 296.0\n")
    base, mine = ask(), ask("--preset-file", str(path))
    assert mine["kv_room"]["tokens"] > 2 * base["kv_room"]["tokens"]
    assert mine["prefill"]["seconds"] < base["prefill"]["seconds"]
    path.write_text("[hardware]\nwarp_speed = 9\n")
    bad = runner.invoke(app, ["model", "--preset-file", str(path)])
    assert bad.exit_code == 2
    assert "warp_speed" in bad.output
    assert "Traceback" not in bad.output
    # A value of the wrong type is named, not taken (it would fail deep in a formula).
    path.write_text('[hardware]\nbf16_tflops = "fast"\n')
    bad = runner.invoke(app, ["model", "--preset-file", str(path)], env={"COLUMNS": "200"})
    assert bad.exit_code == 2 and "Traceback" not in bad.output
    assert "hardware.bf16_tflops must be a number, got 'fast'" in bad.output
    # What a preset is called and how many GPUs it has are chosen on the command line.
    for table, key, chooser in (
        ("hardware", "gpus = 0", "--gpus sets it"),
        ("hardware", 'name = "B200"', "the preset's name sets it"),
        ("model", 'name = "mine"', "the preset's name sets it"),
    ):
        path.write_text(f"[{table}]\n{key}\n")
        bad = runner.invoke(app, ["model", "--preset-file", str(path)], env={"COLUMNS": "200"})
        assert bad.exit_code == 2 and "Traceback" not in bad.output
        assert f"[{table}] cannot set {key.split()[0]}; {chooser}" in bad.output


def test_unknown_names_fail_with_the_choices() -> None:
    for args in (["--hardware", "A100"], ["--medium", "carrier-pigeon"]):
        result = runner.invoke(app, ["model", *args])
        assert result.exit_code == 2
        assert "presets:" in result.output


@pytest.mark.subprocess
def test_fidelity_writes_a_stamped_page_with_every_row(tmp_path: Path) -> None:
    page = tmp_path / "fidelity.md"
    result = runner.invoke(app, ["fidelity", "--page", str(page)])
    assert result.exit_code == 0, result.output
    text = page.read_text()
    assert text.startswith("# Fidelity of the performance model")
    assert "How this page was made" in text
    for anchor in fidelity.anchors():
        assert f"| {anchor.id} |" in text
    outside = [a for a in fidelity.anchors() if not a.within]
    for anchor in outside:
        assert f"- **{anchor.id}**" in text and anchor.why in text
    data = json.loads(runner.invoke(app, ["fidelity", "--json"]).output)
    assert data["summary"]["rows"] == len(fidelity.anchors())
    assert data["summary"]["fitted_within"] == data["summary"]["fitted_rows"]
