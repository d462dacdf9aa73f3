"""`smetric serve` in front of two real vLLM instances (CPU build, SmolLM2-135M), routing on
their KV events, judged by what vLLM itself reports: ``cached_tokens`` per response and
``vllm:prefix_cache_hits_total`` per instance.

These take minutes (vLLM starts in about a minute per instance and prefills about 200
tokens a second on one core), so they share one cluster per module. vLLM is installed by
``scripts/real_engines/setup_vllm.sh`` (see ``real_engines.find_or_install``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from real_engines import (
    Cluster,
    assert_counted_where_routed,
    counter_by_engine,
    find_or_install,
    running_cluster,
    session_on,
    sticky_sessions,
)

from smetric.testing.engines import BLOCK_SIZE, find_vllm, metric, vllm_instances

pytestmark = pytest.mark.real_engine


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    install = find_or_install(find_vllm, "setup_vllm.sh", "vLLM (CPU build)", "about 7 minutes")
    scratch = tmp_path_factory.mktemp("vllm")
    engines = vllm_instances(install, scratch)

    def router_args() -> list[str]:
        config = scratch / "engines.yaml"
        config.write_text("engines:\n" + "".join(e.engines_yaml_entry() for e in engines))
        args = ["--config", str(config), "--block-size", str(BLOCK_SIZE)]
        return [*args, "--tokenizer", f"hf:{install.model}"]

    with running_cluster(engines, scratch, router_args) as made:
        yield made


HITS = "vllm:prefix_cache_hits_total"


def test_follow_ups_hit_where_routed_and_the_router_predicts_vllm_s_hits(cluster) -> None:
    before = counter_by_engine(cluster, HITS)
    # Follow-ups find at least the previous prompt's whole blocks cached.
    replies = sticky_sessions(cluster, lambda last: last.prompt_tokens // BLOCK_SIZE * BLOCK_SIZE)
    # The router's prediction (its view built from vLLM's BlockStored events) is what vLLM
    # reports as cached, request by request. First turns share the system prompt, so they
    # hit too, on the instance that served an earlier first turn.
    assert [r.predicted for r in replies] == [r.cached for r in replies]
    assert sum(r.cached for r in replies if r.turn == 0) > 0
    # vLLM's own counters agree with what it said per request, instance by instance.
    assert_counted_where_routed(cluster, HITS, before, replies)

    text = cluster.router_metrics()
    # With the model's tokenizer and chat template, the bodies were read from their
    # envelope (messages left raw, found again by their bytes), not decoded whole.
    assert metric(text, "smetric_request_reads_total", how="envelope") >= len(replies)
    for engine in cluster.engines:
        assert metric(text, "smetric_engine_kv_view_exact", engine=engine.url) == 1.0
        assert metric(text, "smetric_engine_kv_view_blocks", engine=engine.url) > 0
        assert metric(text, "smetric_kv_events_total", engine=engine.url, kind="gaps") == 0


def test_after_an_instance_restarts_the_router_s_view_of_it_is_rebuilt(cluster) -> None:
    restarted = cluster.engines[0]
    session = session_on(cluster, restarted, "epsilon")
    assert session.turn(cluster).cached > 0  # warm: its prefix is cached there
    restarts = metric(
        cluster.router_metrics(), "smetric_kv_events_total", engine=restarted.url, kind="restarts"
    )

    cluster.restart(restarted)

    # The new process holds nothing, and neither does the router's view of it: the session
    # is placed afresh (wherever its shared system prompt is), predicted as it hits.
    view = metric(cluster.router_metrics(), "smetric_engine_kv_view_blocks", engine=restarted.url)
    assert view == 0
    reply = session.turn(cluster)
    assert reply.predicted == reply.cached, reply
    reply = session.turn(cluster)
    assert reply.predicted == reply.cached > 0, reply

    # On the new process, a new session's follow-up hits as predicted, from events numbered
    # from 0 again, which the router's subscriber took for a restart.
    fresh = session_on(cluster, restarted, "zeta")
    reply = fresh.turn(cluster)
    assert reply.engine == restarted.url
    assert reply.predicted == reply.cached > 0, reply
    text = cluster.router_metrics()
    assert metric(text, "smetric_engine_kv_view_exact", engine=restarted.url) == 1.0
    kind = "restarts"
    assert metric(text, "smetric_kv_events_total", engine=restarted.url, kind=kind) == restarts + 1
