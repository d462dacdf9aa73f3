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
    Session,
    counter_by_engine,
    find_or_install,
    running_cluster,
    session_on,
)

from smetric.testing.engines import BLOCK_SIZE, find_vllm, metric, vllm_instances

pytestmark = pytest.mark.real_engine


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    install = find_or_install(find_vllm, "setup_vllm.sh", "vLLM (CPU build)", "about 7 minutes")
    scratch = tmp_path_factory.mktemp("vllm")
    engines = vllm_instances(install, scratch)
    config = scratch / "engines.yaml"
    config.write_text("engines:\n" + "".join(e.engines_yaml_entry() for e in engines))
    router_args = ["--config", str(config), "--block-size", str(BLOCK_SIZE)]
    router_args += ["--tokenizer", f"hf:{install.model}"]
    with running_cluster(engines, scratch, router_args) as made:
        yield made


def hits_by_engine(cluster: Cluster) -> dict[str, float]:
    return counter_by_engine(cluster, "vllm:prefix_cache_hits_total")


def test_follow_ups_hit_where_routed_and_the_router_predicts_vllm_s_hits(cluster) -> None:
    before = hits_by_engine(cluster)
    sessions = [Session(name) for name in ("alpha", "beta", "gamma", "delta")]
    homes = [s.turn(cluster).engine for s in sessions]
    # First turns go for balance: two sessions on each instance.
    assert sorted(homes.count(e.url) for e in cluster.engines) == [2, 2], homes
    for _ in range(2):
        for session, home in zip(sessions, homes, strict=True):
            reply = session.turn(cluster)
            assert reply.engine == home, f"follow-up left its cache: {reply}"
            # The previous prompt's whole blocks, at least, were cached on vLLM.
            assert reply.cached >= (session.replies[-2].prompt_tokens // BLOCK_SIZE) * BLOCK_SIZE

    replies = [r for s in sessions for r in s.replies]
    # The router's prediction (its view built from vLLM's BlockStored events) is what vLLM
    # reports as cached, request by request. First turns share the system prompt, so they
    # hit too, on the instance that served an earlier first turn.
    assert [r.predicted for r in replies] == [r.cached for r in replies]
    assert sum(s.replies[0].cached for s in sessions) > 0

    # vLLM's own counters agree: each instance's prefix-cache hits are the cached tokens
    # of the requests the router sent there.
    after = hits_by_engine(cluster)
    for engine in cluster.engines:
        served_hits = sum(r.cached for r in replies if r.engine == engine.url)
        assert after[engine.url] - before[engine.url] == served_hits > 0

    text = cluster.router_metrics()
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
