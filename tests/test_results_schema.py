"""Run results are one typed schema, and ``summary.json`` is exactly its JSON form: real
runs' summaries convert both ways without a key changing, and a file that does not match
is refused with a message naming the schema version."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from smetric.core.errors import UserError
from smetric.metrics.results import (
    SCHEMA_VERSION,
    RunSummary,
    read_summaries,
    write_summaries,
)

GOLDEN = json.loads(Path(__file__).with_name("sim_golden.json").read_text())


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_a_stored_summary_converts_both_ways_unchanged(name: str) -> None:
    stored = json.loads(GOLDEN[name]["summary"])
    summary = RunSummary.from_builtins(stored)
    assert summary.to_builtins() == stored
    assert RunSummary.from_json(summary.to_json()) == summary
    assert summary.reuse.global_ == stored["reuse"]["global"]


def test_summary_json_round_trips_and_keeps_what_surrounds_the_runs(tmp_path: Path) -> None:
    run = RunSummary.from_json(GOLDEN["weka-smetric-1x"]["summary"])
    path = tmp_path / "summary.json"
    meta = {"cluster_shape": {"instances": 4}, "policies": None, "policy_params": {}}
    write_summaries(path, meta, {"smetric": run})
    data = json.loads(path.read_text())
    assert list(data) == ["cluster_shape", "policies", "policy_params"]
    assert read_summaries(path) == {"smetric": run}


def test_sections_a_run_lacks_are_left_out_of_the_file() -> None:
    run = RunSummary.from_json(GOLDEN["weka-smetric-1x"]["summary"])
    measured = msgspec.structs.replace(run, global_tier_bytes=None, busy_fraction=None)
    written = measured.to_builtins()
    assert "global_tier_bytes" not in written and "busy_fraction" not in written
    assert "pd" not in written and "learned_params" not in written
    assert RunSummary.from_builtins(written) == measured


def test_a_file_of_another_shape_is_refused_naming_the_version(tmp_path: Path) -> None:
    stored = json.loads(GOLDEN["weka-smetric-1x"]["summary"])
    del stored["stickiness"]
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"policies": {"smetric": stored}}))
    with pytest.raises(UserError, match=f"schema version {SCHEMA_VERSION}") as error:
        read_summaries(path)
    assert str(path) in str(error.value) and "stickiness" in str(error.value)
