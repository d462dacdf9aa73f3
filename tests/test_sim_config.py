"""Simulation settings: checked the same way from YAML and flags, errors that name the
file and the key, and a reference generated from the one declaration."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from smetric.core.settings import settings_of
from smetric.sim.config import ClusterConfig, SimConfig, check_config, load_yaml


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("slo:\n  tpot_s: -1\n", "slo.tpot_s must lie in (0, inf], got -1.0"),
        ("cluster:\n  instances: 0\n", "cluster.instances must lie in [1, inf], got 0"),
        ("workload:\n  session_rate: -2\n", "workload.session_rate must lie in (0, inf]"),
        ("workload:\n  sample: 1.5\n", "workload.sample must lie in (0, 1.0], got 1.5"),
        ("warmup_s: -1\n", "warmup_s must lie in [0, inf], got -1.0"),
        ("cluster:\n  kv_blcks: 3\n", "unknown key 'cluster.kv_blcks'"),
        ("cluster: [\n  instances: 0\n", "line 1, column 10"),
    ],
)
def test_a_bad_yaml_file_is_an_error_naming_the_file_and_the_key(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as error:
        load_yaml(path)
    assert str(path) in str(error.value)
    assert message in str(error.value)


def test_flags_are_checked_against_the_same_bounds() -> None:
    config = SimConfig().override("slo", tpot_s=-0.5)
    with pytest.raises(ValueError, match=r"slo.tpot_s must lie in \(0, inf\]"):
        check_config(config)
    assert check_config(SimConfig()) == SimConfig()


HOOKS = Path(__file__).resolve().parents[1] / "scripts" / "docs" / "hooks.py"


def test_every_simulation_setting_is_declared_with_help_and_in_the_reference() -> None:
    # The configuration page the docs build generates from the declarations.
    spec = importlib.util.spec_from_file_location("docs_hooks", HOOKS)
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    reference = hooks.config_page()
    declared = {f.name for f, _ in settings_of(ClusterConfig)}
    assert declared == {f.name for f in dataclasses.fields(ClusterConfig)}
    for f, meta in settings_of(ClusterConfig):
        assert meta.help
        assert f"| `{f.name}` |" in reference
    tpot = "| `tpot_s` | `float` | `0.03` | TPOT SLO: seconds per output token. Range: (0, inf]. |"
    assert tpot in reference
