"""`smetric serve` in front of two real llama.cpp servers (SmolLM2-135M, GGUF). llama.cpp
publishes no KV events, so the router routes on its approximate view (what it sent where),
judged by what llama.cpp reports: ``cached_tokens`` per response and its prompt-cache
counter per instance.

llama.cpp keeps each slot's KV between requests and reuses the longest common prefix, at
token granularity, and the router hashes bytes here (no tokenizer of the model is needed),
so these check placement and hits, not predictions to the token. The server is built from
source by ``scripts/real_engines/setup_llama_cpp.sh`` (see ``real_engines.find_or_install``).
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

from smetric.testing.engines import find_llama_cpp, llama_cpp_instances, metric

pytestmark = pytest.mark.real_engine

CACHED_COUNTER = "llamacpp:prompt_tokens_cached_total"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    install = find_or_install(
        find_llama_cpp, "setup_llama_cpp.sh", "llama.cpp's server", "about 11 minutes to build"
    )
    scratch = tmp_path_factory.mktemp("llama-cpp")
    engines = llama_cpp_instances(install, scratch)
    with running_cluster(
        engines, scratch, lambda: [a for e in engines for a in ("-e", e.url)]
    ) as made:
        yield made


def test_follow_ups_stick_and_hit_on_the_approximate_view(cluster) -> None:
    before = counter_by_engine(cluster, CACHED_COUNTER)
    # llama.cpp reuses the session's KV: at least half of the previous prompt.
    replies = sticky_sessions(cluster, lambda last: last.prompt_tokens // 2)
    # The router remembers what it sent where, so it expects every follow-up's hit.
    assert all(r.predicted > 0 for r in replies if r.turn > 0)
    assert_counted_where_routed(cluster, CACHED_COUNTER, before, replies)


def test_a_restarted_engine_is_forgotten(cluster) -> None:
    restarted = cluster.engines[0]
    session = session_on(cluster, restarted, "epsilon")
    assert session.turn(cluster).cached > 0

    cluster.restart(restarted)

    # The approximate view cannot hear the restart; the health check did, and dropped it.
    text = cluster.router_metrics()
    assert metric(text, "smetric_engine_kv_view_blocks", engine=restarted.url) == 0
    # So the session is placed afresh, and the router expects a hit exactly where one is.
    reply = session.turn(cluster)
    assert (reply.predicted > 0) == (reply.cached > 0), reply
    reply = session.turn(cluster)
    assert reply.predicted > 0 and reply.cached > 0, reply
