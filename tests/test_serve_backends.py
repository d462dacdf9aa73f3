"""The vLLM engine backend (metric names, context length, the PD protocol) and the routing
core as a front door without HTTP uses it."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from smetric.core.blocks import ByteTokenizer
from smetric.core.conversation import analyze_request
from smetric.serve.backends import KV_TRANSFER_PARAMS, VLLM, backend_named
from smetric.serve.engines import Engine
from smetric.serve.identity import AgentIdentity
from smetric.serve.routing import RoutingCore, explain

pytestmark = pytest.mark.subprocess

METRICS = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0"} 2
vllm:num_requests_running{engine="1"} 1
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0"} 4
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0"} 1000
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0"} 50
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="4096"} 1
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.7e9
"""


def test_vllm_metrics_are_read_summed_over_ranks_with_the_progress_counters() -> None:
    report = VLLM.parse_metrics(METRICS, at=3.0)
    assert report.queued == 7
    assert (report.num_gpu_blocks, report.block_size) == (4096, 16)
    assert report.progress_tokens == 1050 and report.started_at == 1.7e9
    assert VLLM.parse_metrics("# nothing\n", at=0.0).progress_tokens is None
    with pytest.raises(ValueError):
        VLLM.parse_metrics("not { prometheus", at=0.0)


def test_a_moving_counter_is_progress_and_a_still_one_is_not() -> None:
    engine = Engine("http://127.0.0.1:1", 64)
    engine.adopt(VLLM.parse_metrics(METRICS, at=1.0), 16)
    engine.progressed_at = before = 0.0
    engine.adopt(VLLM.parse_metrics(METRICS, at=2.0), 16)
    assert engine.progressed_at == before  # the same counters: no progress
    moved = METRICS.replace("} 50", "} 51")
    engine.adopt(VLLM.parse_metrics(moved, at=3.0), 16)
    assert engine.progressed_at > before


def test_context_length_and_the_disaggregated_protocol() -> None:
    assert VLLM.context_length([{"id": "m", "max_model_len": 8192}, {"id": "n"}]) == 8192
    assert VLLM.context_length([{"id": "m", "max_model_len": True}]) == 0
    body = {"messages": [], "max_tokens": 64, "stream": True, "stream_options": {}}
    leg = VLLM.prefill_request({**body, KV_TRANSFER_PARAMS: {"tag": 1}})
    assert leg["max_tokens"] == 1 and leg["stream"] is False and "stream_options" not in leg
    assert leg[KV_TRANSFER_PARAMS]["do_remote_decode"] is True
    assert leg[KV_TRANSFER_PARAMS]["tag"] == 1
    answer = {KV_TRANSFER_PARAMS: {"remote_engine_id": "e"}}
    assert VLLM.decode_request(body, answer)[KV_TRANSFER_PARAMS] == {"remote_engine_id": "e"}
    assert VLLM.decode_request(body, {}) is body  # a prompt-keyed connector hands nothing
    assert backend_named("vllm") is VLLM
    with pytest.raises(ValueError, match="backend"):
        backend_named("tgi")


def test_the_routing_core_decides_and_explains_without_http() -> None:
    """What an endpoint picker does: facts from a body, a decision over engines, the
    prompt recorded where it went, the follow-up sent after it."""
    core = RoutingCore("smetric", block_size=16, staleness_s=5.0)
    engines = [Engine(f"http://127.0.0.1:{9000 + i}", 1000, number=i) for i in range(3)]
    system = {"role": "system", "content": "You are a coding agent. " * 40}
    first = [system, {"role": "user", "content": "fix the bug " * 40}]
    tokenizer = ByteTokenizer()
    facts = analyze_request({"messages": first}, "chat", tokenizer, 16)
    decision = core.decide(facts, engines)
    core.served(decision.engine, facts.blocks)
    follow_up = [*first, {"role": "assistant", "content": "done"}, {"role": "user", "content": "?"}]
    again = analyze_request({"messages": follow_up}, "chat", tokenizer, 16)
    second = core.decide(again, engines)
    assert second.engine is decision.engine and second.predicted_hit_tokens > 0
    record = explain(second, again, AgentIdentity("codex", "s"))
    assert record["engine"] == decision.engine.url and record["session"] == "s"
    assert np.array_equal(record["hit_tokens"], second.hits)


def test_the_routing_core_loads_without_the_http_stack() -> None:
    code = (
        "import sys; import smetric.serve.routing, smetric.serve.identity; "
        "assert 'aiohttp' not in sys.modules, 'aiohttp was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
