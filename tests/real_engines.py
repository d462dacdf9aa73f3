"""What the real-engine tests share: finding (or installing) an engine, a router subprocess
in front of engine processes, and agent-like sessions that go through it.

``SMETRIC_REAL_ENGINES`` says what to do when an engine is missing: unset, skip with the
command that installs it; ``install``, run its setup script (cached per machine) and fail
if that fails, as `.ci/run` does; ``off``, always skip.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from email.message import Message
from pathlib import Path
from typing import Any, TypeVar

import pytest

from smetric.testing.engines import (
    MODEL_NAME,
    EngineProcess,
    http_get,
    metric,
    run_setup,
    start_engines,
)
from smetric.testing.fault_suite import SmetricProcess

T = TypeVar("T")

SYSTEM = (
    "You are a careful coding agent working in a Python repository. Read the files you "
    "need, run the tests after each change, keep changes small, explain what you did. "
) * 4


def find_or_install(find: Callable[[], T | None], script: str, what: str, cost: str) -> T:
    mode = os.environ.get("SMETRIC_REAL_ENGINES", "")
    if mode == "off":
        pytest.skip("real-engine tests are off (SMETRIC_REAL_ENGINES=off)")
    found = find()
    if found is None and mode == "install":
        try:
            run_setup(script)
        except RuntimeError as exc:
            pytest.fail(str(exc))
        found = find()
    if found is None:
        pytest.skip(
            f"{what} is not installed: run scripts/real_engines/{script} once ({cost}, cached "
            "in ~/.cache/smetric/engines), or set SMETRIC_REAL_ENGINES=install"
        )
    return found


@dataclass
class Cluster:
    """Engine processes behind one ``smetric serve`` subprocess."""

    engines: Sequence[EngineProcess]
    router: SmetricProcess

    @property
    def url(self) -> str:
        return self.router.url

    def router_metrics(self) -> str:
        status, text = http_get(self.url + "/metrics")
        assert status == 200, f"router /metrics answered {status}:\n{self.router_tail()}"
        return text

    def router_tail(self) -> str:
        return self.router.log_tail()

    def wait_router_sees(self, engine: EngineProcess, healthy: bool, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            process = self.router.process
            assert process is None or process.poll() is None, self.router_tail()
            status, text = http_get(self.url + "/metrics")
            if status == 200:
                seen = metric(text, "smetric_engine_healthy", engine=engine.url)
                if seen == float(healthy):
                    return
            time.sleep(0.2)
        raise AssertionError(f"router never saw {engine.url} healthy={healthy}")

    def restart(self, engine: EngineProcess) -> None:
        """Stop the engine until the router ejects it, then start it until readmitted."""
        engine.stop()
        self.wait_router_sees(engine, healthy=False)
        engine.start()
        engine.wait_ready()
        self.wait_router_sees(engine, healthy=True)


@contextlib.contextmanager
def running_cluster(
    engines: Sequence[EngineProcess], scratch: Path, router_args: Callable[[], list[str]]
) -> Iterator[Cluster]:
    """Start the engines, then ``smetric serve ROUTER_ARGS`` in front (``router_args`` is
    called once the engines are up, on the ports they got); stop all on exit.

    The router gets no ``--scrape-interval``: a scraped load can be a second stale, and the
    placements the tests check should follow from in-flight counts alone.
    """
    router: SmetricProcess | None = None
    try:
        start_engines(engines)
        router = SmetricProcess(scratch, args=("serve", "--health-interval", "0.5", *router_args()))
        router.start()
        router.wait_listening()
        cluster = Cluster(engines, router)
        for engine in engines:
            cluster.wait_router_sees(engine, healthy=True)
        yield cluster
    finally:
        if router is not None:
            router.stop()
        for engine in engines:
            engine.stop()


@dataclass
class Reply:
    engine: str
    predicted: int
    cached: int
    prompt_tokens: int
    text: str
    turn: int = 0


def post_chat(
    cluster: Cluster, messages: list[dict[str, str]], timeout_s: float = 120
) -> tuple[dict[str, Any], Message]:
    """One greedy 8-token chat completion through the router: its body and headers."""
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 8, "temperature": 0}
    request = urllib.request.Request(
        cluster.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read()), response.headers


def chat(cluster: Cluster, messages: list[dict[str, str]]) -> Reply:
    data, headers = post_chat(cluster, messages)
    engine = headers["x-smetric-engine"]
    predicted = int(headers["x-smetric-predicted-hit-tokens"])
    usage = data["usage"]
    return Reply(
        engine,
        predicted,
        (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
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
        n = reply.turn = len(self.replies)
        self.messages += [
            {"role": "assistant", "content": reply.text},
            {"role": "user", "content": f"Tool output {n}: 3 passed, 1 failed in step {n}. " * 4},
        ]
        self.replies.append(reply)
        return reply


def session_on(cluster: Cluster, engine: EngineProcess, name: str) -> Session:
    """A new session whose first turn the router placed on ``engine``."""
    for i in range(6):
        session = Session(f"{name}-{i}")
        if session.turn(cluster).engine == engine.url:
            return session
    pytest.fail(f"six new sessions and none was placed on {engine.url}")


def counter_by_engine(cluster: Cluster, name: str) -> dict[str, float]:
    return {e.url: metric(e.metrics(), name) for e in cluster.engines}


def sticky_sessions(cluster: Cluster, min_hit: Callable[[Reply], int]) -> list[Reply]:
    """Four sessions of three turns: their first turns must spread two per instance (the
    router balances them), and every follow-up must go back to its session's instance and
    find at least ``min_hit(previous reply)`` tokens cached there. Returns every reply."""
    sessions = [Session(name) for name in ("alpha", "beta", "gamma", "delta")]
    homes = [s.turn(cluster).engine for s in sessions]
    assert sorted(homes.count(e.url) for e in cluster.engines) == [2, 2], homes
    for _ in range(2):
        for session, home in zip(sessions, homes, strict=True):
            reply = session.turn(cluster)
            assert reply.engine == home, f"follow-up left its cache: {reply}"
            assert reply.cached >= min_hit(session.replies[-2]), reply
    return [r for s in sessions for r in s.replies]


def assert_counted_where_routed(
    cluster: Cluster, counter: str, before: dict[str, float], replies: list[Reply]
) -> None:
    """The engines' own cached-token counter grew, per instance, by exactly the cached
    tokens of the replies the router sent there."""
    after = counter_by_engine(cluster, counter)
    for engine in cluster.engines:
        served = sum(r.cached for r in replies if r.engine == engine.url)
        assert after[engine.url] - before[engine.url] == served > 0, engine.url
