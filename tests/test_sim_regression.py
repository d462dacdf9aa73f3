"""The simulator's results are pinned: a change of representation must not move a number.

``sim_golden.json`` holds the summary and a digest of the per-request table of a few small
runs, as a straightforward representation of the workload produced them (block ids
materialised per request, every request kept to the end); the compact representation the
simulator uses must reproduce them exactly. A deliberate change of the model's behaviour
regenerates the file, together with the change:

    python tests/test_sim_regression.py        # rewrites tests/sim_golden.json
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from smetric.sim.config import SimConfig
from smetric.sim.request_log import RequestLog
from smetric.sim.run import simulate
from smetric.trace.load import load_trace

GOLDEN = Path(__file__).with_name("sim_golden.json")

# name: (trace, policy, instances, global tier, rate, seconds, open loop)
CASES = {
    "weka-smetric-1x": ("sample:weka", "smetric", 4, "1x", 0.05, 900.0, False),
    "weka-least_load-full": ("sample:weka", "least_load", 3, "full", 0.05, 900.0, False),
    "mooncake-linear-open": ("sample:mooncake", "linear", 2, "1x", 1.0, 60.0, True),
}


def run_case(name: str) -> dict[str, str]:
    trace, policy, instances, tier, rate, seconds, open_loop = CASES[name]
    config = (
        SimConfig()
        .override("cluster", instances=instances, global_capacity=tier)
        .override("workload", session_rate=rate, duration_s=seconds, open_loop=open_loop)
    )
    result = simulate(load_trace(trace), config, policy)
    table = result.requests.write_csv().encode()
    return {
        "summary": json.dumps(result.summary.to_builtins(), sort_keys=True),
        "requests_sha256": hashlib.sha256(table).hexdigest(),
        "requests": str(result.requests.height),
    }


@pytest.mark.parametrize("name", sorted(CASES))
def test_results_match_the_golden_run(name: str) -> None:
    golden = json.loads(GOLDEN.read_text())[name]
    assert run_case(name) == golden


def test_rows_recorded_in_many_chunks_give_the_same_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(RequestLog, "CHUNK", 64)
    name = "weka-smetric-1x"
    assert run_case(name) == json.loads(GOLDEN.read_text())[name]


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps({name: run_case(name) for name in CASES}, indent=1) + "\n")
    print(f"wrote {GOLDEN}")
