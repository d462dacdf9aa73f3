"""Codex CLI, as installed from npm, runs two turns through ``smetric serve`` in front of two
mock engines publishing KV events: ``codex exec``, then ``codex exec resume --last``.

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


@contextlib.contextmanager
def cluster(scratch: Path) -> Iterator[SmetricProcess]:
    """Two mock engines with KV events, and ``smetric serve`` subscribed to both."""
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
    router = None
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
        router = SmetricProcess(
            scratch, args=("serve", "--config", str(config), "--health-interval", "0.2")
        )
        router.start()
        router.wait_ready(60)
        for engine in engines:
            engine.wait_ready(60)
            until_heard(engine, router)
        yield router
    finally:
        for process in [router, *engines]:
            if process is not None:
                process.stop()


def until_heard(engine: SmetricProcess, router: SmetricProcess) -> None:
    """Small requests straight to the engine until the router has its KV events: a ZMQ
    subscriber misses what was published before it joined."""
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
            text = http_get(router.url + "/metrics")[1]
            if metric(text, "smetric_kv_events_total", engine=engine.url, kind="batches") > 0:
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


def test_codex_exec_twice_through_the_router(tmp_path: Path) -> None:
    codex = codex_binary()
    with cluster(tmp_path) as router, proxy_trap() as trap:
        home, work = tmp_path / "codex-home", tmp_path / "work"
        home.mkdir()
        work.mkdir()
        (home / "config.toml").write_text(documented_config(router.url))
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
        text = http_get(router.url + "/metrics")[1]
        routes = [
            json.loads(line)
            for line in router.log_since_start().splitlines()
            if line.startswith('{"event": "route"')
        ]
    assert trap.caught == [], [c.split(b"\r\n")[0] for c in trap.caught]  # loopback only
    # Every request was routed and counted under Codex, with its session.
    assert len(routes) >= 2
    assert metric(text, "smetric_agent_requests_total", harness="codex") == len(routes)
    assert all(r["harness"] == "codex" and r["session"] for r in routes)
    assert len({r["session"] for r in routes}) == 1  # resume continues the session
    # Follow-ups go where their history is cached, predicted as the engine reports it.
    home_engine = routes[0]["engine"]
    follow_ups = [r for r in routes if r["agent_call"] == "follow_up"]
    assert follow_ups
    assert all(r["engine"] == home_engine and r["predicted_hit_tokens"] > 0 for r in follow_ups)
    predicted = metric(text, "smetric_predicted_hit_tokens_total", engine=home_engine)
    reported = metric(text, "smetric_reported_cached_tokens_total", engine=home_engine)
    assert predicted == reported == sum(r["predicted_hit_tokens"] for r in routes)
