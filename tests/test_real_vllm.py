"""`smetric serve` in front of two real vLLM instances (CPU build, SmolLM2-135M), routing on
their KV events, judged by what vLLM itself reports: ``cached_tokens`` per response and
``vllm:prefix_cache_hits_total`` per instance.

These take minutes (vLLM starts in about a minute per instance and prefills about 200
tokens a second on one core), so they share one cluster per module. vLLM is installed by
``scripts/real_engines/setup_vllm.sh`` (cached per machine). ``SMETRIC_REAL_ENGINES`` says
what to do when it is missing: unset, skip with a message; ``install``, run the script and
fail if that fails, as `.ci/run` does; ``off``, always skip.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from smetric.testing.vllm import (
    BLOCK_SIZE,
    MODEL_NAME,
    VLLMInstall,
    VLLMServer,
    find_install,
    http_get,
    install,
    metric,
)

pytestmark = pytest.mark.real_engine

SYSTEM = (
    "You are a careful coding agent working in a Python repository. Read the files you "
    "need, run the tests after each change, keep changes small, explain what you did. "
) * 4


def find_or_install_vllm() -> VLLMInstall:
    mode = os.environ.get("SMETRIC_REAL_ENGINES", "")
    if mode == "off":
        pytest.skip("real-engine tests are off (SMETRIC_REAL_ENGINES=off)")
    found = find_install()
    if found is None and mode == "install":
        try:
            found = install()
        except RuntimeError as exc:
            pytest.fail(str(exc))
    if found is None:
        pytest.skip(
            "vLLM (CPU build) is not installed: run scripts/real_engines/setup_vllm.sh once "
            "(about 7 minutes, 3.4 GB, cached in ~/.cache/smetric/engines), or set "
            "SMETRIC_REAL_ENGINES=install"
        )
    return found


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Cluster:
    """Two vLLM instances behind one ``smetric serve`` subprocess."""

    engines: list[VLLMServer]
    router_port: int
    router_log: Path
    router: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def router_metrics(self) -> str:
        status, text = http_get(self.url + "/metrics")
        assert status == 200, f"router /metrics answered {status}:\n{self.router_tail()}"
        return text

    def router_tail(self) -> str:
        return self.router_log.read_text(errors="replace")[-4000:]

    def wait_router_sees(self, engine: VLLMServer, healthy: bool, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.router_metrics()
            if metric(text, "smetric_engine_healthy", engine=engine.url) == float(healthy):
                return
            time.sleep(0.2)
        raise AssertionError(f"router never saw {engine.url} healthy={healthy}")


@dataclass
class Reply:
    engine: str
    predicted: int
    cached: int
    prompt_tokens: int
    text: str


def chat(cluster: Cluster, messages: list[dict[str, str]]) -> Reply:
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 8, "temperature": 0}
    request = urllib.request.Request(
        cluster.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        data: dict[str, Any] = json.loads(response.read())
        engine = response.headers["x-smetric-engine"]
        predicted = int(response.headers["x-smetric-predicted-hit-tokens"])
    usage = data["usage"]
    return Reply(
        engine,
        predicted,
        usage["prompt_tokens_details"]["cached_tokens"],
        usage["prompt_tokens"],
        data["choices"][0]["message"]["content"],
    )


class Session:
    """A conversation as an agent holds it: the whole history goes out on every turn."""

    def __init__(self, name: str) -> None:
        self.messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Task {name}: the test suite of {name} fails. " * 6},
        ]
        self.replies: list[Reply] = []

    def turn(self, cluster: Cluster) -> Reply:
        reply = chat(cluster, self.messages)
        n = len(self.replies)
        self.messages += [
            {"role": "assistant", "content": reply.text},
            {"role": "user", "content": f"Tool output {n}: 3 passed, 1 failed in step {n}. " * 4},
        ]
        self.replies.append(reply)
        return reply


def hits_by_engine(cluster: Cluster) -> dict[str, float]:
    return {e.url: metric(e.metrics(), "vllm:prefix_cache_hits_total") for e in cluster.engines}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    install = find_or_install_vllm()
    scratch = tmp_path_factory.mktemp("vllm")
    cores = os.cpu_count() or 1
    engines = [
        VLLMServer(install, free_port(), free_port(), free_port(), f"kv-{i}", i % cores, scratch)
        for i in range(2)
    ]
    config = scratch / "engines.yaml"
    config.write_text("engines:\n" + "".join(e.engines_yaml_entry() for e in engines))
    made = Cluster(engines, free_port(), scratch / "router.log")
    try:
        for engine in engines:
            engine.start()
        with made.router_log.open("wb") as log:
            made.router = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "smetric",
                    "serve",
                    "--config",
                    str(config),
                    "--port",
                    str(made.router_port),
                    "--block-size",
                    str(BLOCK_SIZE),
                    "--tokenizer",
                    f"hf:{install.model}",
                    # No --scrape-interval: a scraped load can be a second stale, and the
                    # placements checked here should follow from in-flight counts alone.
                    "--health-interval",
                    "0.5",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        for engine in engines:
            engine.wait_ready()
        for engine in engines:
            made.wait_router_sees(engine, healthy=True)
        yield made
    finally:
        if made.router is not None:
            made.router.terminate()
            made.router.wait(10)
        for engine in engines:
            engine.stop()


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


def session_on(cluster: Cluster, engine: VLLMServer, name: str) -> Session:
    """A new session whose first turn the router placed on ``engine``."""
    for i in range(6):
        session = Session(f"{name}-{i}")
        if session.turn(cluster).engine == engine.url:
            return session
    pytest.fail(f"six new sessions and none was placed on {engine.url}")


def test_after_an_instance_restarts_the_router_s_view_of_it_is_rebuilt(cluster) -> None:
    restarted = cluster.engines[0]
    session = session_on(cluster, restarted, "epsilon")
    assert session.turn(cluster).cached > 0  # warm: its prefix is cached there
    restarts = metric(
        cluster.router_metrics(), "smetric_kv_events_total", engine=restarted.url, kind="restarts"
    )

    restarted.stop()
    cluster.wait_router_sees(restarted, healthy=False)
    restarted.start()
    restarted.wait_ready()
    cluster.wait_router_sees(restarted, healthy=True)

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
