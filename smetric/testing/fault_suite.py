"""The router's fault suite: ``smetric serve`` as its own process in front of mock engines
(``smetric engine`` processes) and misbehaving ones (``testing.faulty``), all on loopback,
driven through faults one scenario at a time; one row of counts per scenario.

Every request ends one way: completed (a whole answer; a stream with its ``[DONE]``), a
clean error (an OpenAI-style JSON error body, or a stream's error event), aborted by the
client on purpose, unclean (anything else: a non-JSON error, a 200 with a broken body; must
be 0) or hung (no end within the deadline; must be 0). After each scenario the router's
own ``/metrics`` must show no request in flight and every live mock engine healthy.
``benchmarks/faults.py`` prints the table at full size; ``tests/test_fault_suite.py`` runs
a small one in CI.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import struct
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import msgspec
import zmq
import zmq.asyncio

from smetric.testing.engines import EngineProcess, metric
from smetric.testing.faulty import Fault, FaultyEngine
from smetric.testing.ports import startup_port

OUTCOMES = ("completed", "clean_error", "aborted", "unclean", "hung")
JSON = {"Content-Type": "application/json"}


@dataclass
class Scale:
    """How big each scenario is; ``Scale()`` is the published run, ``Scale.quick()`` CI's."""

    streams: int = 200  # concurrent streams when an engine is SIGKILLed
    requests: int = 200  # requests per misbehaving-engine scenario
    aborts: int = 50  # clients that give up or reset, per scenario
    huge_prompts: int = 6  # 25 MB chat bodies sent at once
    deadline_s: float = 60.0  # a request not ended by then is hung
    # The router's first-byte and idle timeouts: what a stalled engine costs a request.
    engine_timeout_s: float = 5.0

    @classmethod
    def quick(cls) -> Scale:
        return cls(
            streams=24,
            requests=24,
            aborts=8,
            huge_prompts=2,
            deadline_s=30.0,
            engine_timeout_s=3.0,
        )


@dataclass
class Row:
    scenario: str
    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    inflight_after: int = 0
    wrongly_ejected: int = 0
    rss_before_mb: float = 0.0
    rss_after_mb: float = 0.0
    note: str = ""

    @property
    def requests(self) -> int:
        return sum(self.outcomes.values())


@dataclass
class SmetricProcess(EngineProcess):
    """``python -m smetric ARGS --port PORT`` (``serve`` or ``engine``) in its own process
    group. The first start binds port 0, a port the OS picks, and reads it from the
    startup line; a restart binds that port again, where its clients look."""

    args: tuple[str, ...] = ()

    def command(self) -> list[str]:
        return [sys.executable, "-m", "smetric", *self.args, "--port", str(self.port)]

    def choose_ports(self) -> None:
        """None to choose: the process binds port 0."""

    def wait_listening(self, timeout_s: float = 120.0) -> None:
        """Until the startup line says the port (``url`` holds from then on)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            port = startup_port(self.log_since_start())
            if port is not None:
                self.port = port
                return
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"smetric {' '.join(self.args)} exited:\n{self.log_tail()}")
            time.sleep(0.05)
        raise RuntimeError(f"smetric {' '.join(self.args)} said no port:\n{self.log_tail()}")

    def wait_ready(self, timeout_s: float = 420.0) -> None:
        self.wait_listening(timeout_s)
        super().wait_ready(timeout_s)

    def rss_mb(self, peak: bool = False) -> float:
        """Resident memory now, or its high-water mark since the process started."""
        assert self.process is not None
        field = "VmHWM:" if peak else "VmRSS:"
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) / 1024
        return float("nan")

    def kill(self) -> None:
        """SIGKILL, as the OOM killer or a crash ends an engine: no goodbye to anyone."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.process = None


# -- requests and their outcomes ----------------------------------------------------------


def chat(i: int, *, stream: bool = False, max_tokens: int = 8) -> dict:
    text = f"request {i}: read the file, run the tests, fix what fails. " * 8
    return {
        "model": "m",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


def is_clean_error(data: object, status: int | None = None) -> bool:
    if not isinstance(data, dict) or not isinstance(data.get("error"), dict):
        return False
    error = data["error"]
    return bool(error.get("message")) and (status is None or error.get("code") == status)


async def judge(response: aiohttp.ClientResponse, head: bytes = b"") -> str:
    """How one response ended, read to its end (``head``: what was read of it already)."""
    body = head + await response.read()
    if response.status >= 400:
        with contextlib.suppress(ValueError):
            if is_clean_error(json.loads(body), response.status):
                return "clean_error"
        return "unclean"
    if response.content_type == "text/event-stream":
        events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
        if events and events[-1] == "[DONE]":
            return "completed"
        with contextlib.suppress(ValueError, IndexError):
            if is_clean_error(json.loads(events[-1])):
                return "clean_error"
        return "unclean"
    with contextlib.suppress(ValueError):
        if "choices" in json.loads(body):
            return "completed"
    return "unclean"


async def send(
    client: aiohttp.ClientSession,
    url: str,
    deadline_s: float,
    *,
    json_body: object = None,
    data: bytes | None = None,
    headers: dict[str, str] | None = None,
    path: str = "/v1/chat/completions",
    started: asyncio.Event | None = None,
) -> str:
    """One request's outcome; ``started`` is set once its first chunk arrived."""
    try:
        async with (
            asyncio.timeout(deadline_s),
            client.post(url + path, json=json_body, data=data, headers=headers) as response,
        ):
            head = b""
            if started is not None:
                head = await response.content.readline()
                started.set()
            return await judge(response, head)
    except TimeoutError:
        return "hung"
    except aiohttp.ClientError:
        return "unclean"


def _reset(response: aiohttp.ClientResponse) -> None:
    """Close the client's socket with a TCP reset, as a killed client process does."""
    assert response.connection is not None and response.connection.transport is not None
    transport = response.connection.transport
    sock: socket.socket = transport.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


# -- the cluster ----------------------------------------------------------------------------


# A bad engine, once ejected, stays out for the rest of its scenario.
ROUTER_FLAGS = ("--health-interval", "0.2", "--eject-backoff", "60")


@dataclass
class Suite:
    scale: Scale
    scratch: Path
    mocks: list[SmetricProcess] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)

    async def start_mocks(self, count: int) -> None:
        for _ in range(count):
            mock = SmetricProcess(self.scratch, args=("engine", "--speed", "1"))
            mock.start()
            self.mocks.append(mock)
        for mock in self.mocks:
            await asyncio.to_thread(mock.wait_ready, 120.0)

    async def restart(self, mock: SmetricProcess) -> None:
        if mock.process is not None:
            mock.stop()
        mock.start()
        await asyncio.to_thread(mock.wait_ready, 120.0)

    @contextlib.asynccontextmanager
    async def router(
        self, engines: list[str], config: str | None = None, default_timeouts: bool = False
    ) -> AsyncIterator[SmetricProcess]:
        """A router in front of ``engines``; with the scale's short engine timeouts unless
        ``default_timeouts`` (what a user who sets none gets)."""
        timeout = str(self.scale.engine_timeout_s)
        args = ["serve", *ROUTER_FLAGS]
        if not default_timeouts:
            args += ["--first-byte-timeout", timeout, "--idle-timeout", timeout]
        for url in engines:
            args += ["-e", url]
        if config is not None:
            handle, path = tempfile.mkstemp(prefix="router-", suffix=".yaml", dir=self.scratch)
            with os.fdopen(handle, "w") as file:
                file.write(config)
            args += ["--config", path]
        router = SmetricProcess(self.scratch, args=tuple(args))
        router.start()
        try:
            await asyncio.to_thread(router.wait_ready, 120.0)
            yield router
        finally:
            router.stop()

    async def scenario(
        self,
        name: str,
        router: SmetricProcess,
        load: Callable[[aiohttp.ClientSession, str], Awaitable[list[str]]],
        healthy: list[str],
    ) -> Row:
        """Run ``load`` through ``router``, then count what is left in flight and which of
        the ``healthy`` engines the router holds ejected."""
        row = Row(name, rss_before_mb=router.rss_mb())
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as client:
            for outcome in await load(client, router.url):
                row.outcomes[outcome] += 1
            text = await _settled_metrics(client, router.url)
        row.inflight_after = round(metric(text, "smetric_engine_inflight_requests"))
        row.wrongly_ejected = sum(
            metric(text, "smetric_engine_healthy", engine=url) == 0 for url in healthy
        )
        row.rss_after_mb = router.rss_mb()
        self.rows.append(row)
        return row


async def _settled_metrics(client: aiohttp.ClientSession, url: str, wait_s: float = 5.0) -> str:
    """The router's /metrics once nothing is in flight (or after ``wait_s``) and a few
    health checks have run, so a wrongly ejected engine has had the time to come back."""
    deadline = time.monotonic() + wait_s
    await asyncio.sleep(0.6)
    while True:
        async with client.get(url + "/metrics") as response:
            text = await response.text()
        if metric(text, "smetric_engine_inflight_requests") == 0 or time.monotonic() > deadline:
            return text
        await asyncio.sleep(0.1)


# -- scenarios ----------------------------------------------------------------------------


async def engine_killed_mid_stream(suite: Suite) -> None:
    scale, victim = suite.scale, suite.mocks[0]
    urls = [m.url for m in suite.mocks]
    async with suite.router(urls) as router:

        async def load(client: aiohttp.ClientSession, url: str) -> list[str]:
            started = [asyncio.Event() for _ in range(scale.streams)]
            tasks = [
                asyncio.create_task(
                    send(
                        client,
                        url,
                        scale.deadline_s,
                        json_body=chat(i, stream=True, max_tokens=300),
                        started=started[i],
                    )
                )
                for i in range(scale.streams)
            ]
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(scale.deadline_s / 2):
                    await asyncio.gather(*(event.wait() for event in started))
            victim.kill()
            return list(await asyncio.gather(*tasks))

        row = await suite.scenario(
            f"engine SIGKILLed mid-stream ({scale.streams} streams)", router, load, urls[1:]
        )
        row.note = "streams on the killed engine end with an error event"
    await suite.restart(victim)


async def misbehaving_engine(suite: Suite, fault: Fault, title: str) -> None:
    scale = suite.scale
    fake = await FaultyEngine(fault).start()
    healthy = [m.url for m in suite.mocks[1:]]
    try:
        async with suite.router([fake.url, *healthy]) as router:

            async def load(client: aiohttp.ClientSession, url: str) -> list[str]:
                bodies = [chat(i) for i in range(scale.requests)]
                return list(
                    await asyncio.gather(
                        *(send(client, url, scale.deadline_s, json_body=b) for b in bodies)
                    )
                )

            row = await suite.scenario(title, router, load, healthy)
            row.note = f"the bad engine got {fake.generations} requests"
    finally:
        await fake.close()


async def stalled_engine_default_timeouts(suite: Suite) -> None:
    """An engine that takes requests, answers /health and never answers a generation, in
    front of a router left at its default timeouts (a first byte may take 300 s): stall
    detection and the short headers timeout of streams must end every request well
    within 60 s, half of them streams, all retried on the good engines."""
    scale = suite.scale
    deadline = max(scale.deadline_s, 60.0)
    fake = await FaultyEngine("stall").start()
    healthy = [m.url for m in suite.mocks[1:]]
    try:
        async with suite.router([fake.url, *healthy], default_timeouts=True) as router:

            async def load(client: aiohttp.ClientSession, url: str) -> list[str]:
                bodies = [chat(i, stream=i % 2 == 1) for i in range(scale.requests)]
                return list(
                    await asyncio.gather(
                        *(send(client, url, deadline, json_body=b) for b in bodies)
                    )
                )

            row = await suite.scenario(
                "stalled engine, default timeouts (1 of 4)", router, load, healthy
            )
            row.note = f"the stalled engine got {fake.generations} requests; none hung in 60 s"
    finally:
        await fake.close()


async def give_up_before_headers(client: aiohttp.ClientSession, url: str, i: int) -> str:
    quick = aiohttp.ClientTimeout(total=0.3)
    body = chat(i, max_tokens=500)  # seconds of decoding before any header
    try:
        async with client.post(url + "/v1/chat/completions", json=body, timeout=quick) as response:
            return await judge(response)
    except TimeoutError:
        return "aborted"


async def reset_mid_stream(client: aiohttp.ClientSession, url: str, i: int) -> str:
    body = chat(i, stream=True, max_tokens=500)
    async with client.post(url + "/v1/chat/completions", json=body) as response:
        if response.status != 200:
            return await judge(response)
        await response.content.readline()
        _reset(response)
        return "aborted"


async def clients_hang_up(
    suite: Suite,
    title: str,
    hang_up: Callable[[aiohttp.ClientSession, str, int], Awaitable[str]],
) -> None:
    urls = [m.url for m in suite.mocks]
    async with suite.router(urls) as router:

        async def load(client: aiohttp.ClientSession, url: str) -> list[str]:
            clients = (hang_up(client, url, i) for i in range(suite.scale.aborts))
            return list(await asyncio.gather(*clients))

        await suite.scenario(title, router, load, urls)


class _Publisher:
    """KV-event batches for the router's subscriber, as vLLM's publisher frames them, on
    ``endpoint``, a loopback port the OS picked."""

    def __init__(self, topic: bytes) -> None:
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.PUB)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.topic = topic
        self.seq = 0
        self.block = 0

    async def send(self, payload: bytes, seq: int | None = None) -> None:
        seq = self.seq if seq is None else seq
        self.seq = seq + 1
        await self.socket.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def stored(self, token: int = 7) -> bytes:
        """One BlockStored of a fresh 16-token root block."""
        self.block += 1
        event = ["BlockStored", [self.block], None, [token] * 16, 16, None, "GPU"]
        return msgspec.msgpack.encode([time.time(), [event], 0])

    def close(self) -> None:
        self.context.destroy(linger=0)


async def kv_event_fault(suite: Suite, fault: str) -> None:
    """One mock engine's view fed by a publisher of our own, which delivers valid batches,
    then the fault, then valid batches again, while requests flow through the router."""
    scale = suite.scale
    urls = [m.url for m in suite.mocks]
    # The publisher binds (a port the OS picks) and the router connects to it: the router's
    # own bound port would be known only to the router.
    publisher = _Publisher(b"kv")
    config = (
        "engines:\n"
        f"  - url: {urls[0]}\n"
        f"    kv_events: {{endpoint: '{publisher.endpoint}', topic: kv, bind: false}}\n"
    )
    try:
        async with suite.router(urls[1:], config=config) as router:
            notes: list[str] = []

            async def batches_heard(client: aiohttp.ClientSession, url: str) -> float:
                async with client.get(url + "/metrics") as response:
                    text = await response.text()
                return metric(text, "smetric_kv_events_total", engine=urls[0], kind="batches")

            async def load(client: aiohttp.ClientSession, url: str) -> list[str]:
                for _ in range(40):  # the slow joiner: publish until the router hears
                    await publisher.send(publisher.stored())
                    await asyncio.sleep(0.05)
                    if await batches_heard(client, url) > 0:
                        break
                first = asyncio.gather(
                    *(send(client, url, scale.deadline_s, json_body=chat(i)) for i in range(10))
                )
                if fault == "gap":
                    await publisher.send(publisher.stored(), seq=publisher.seq + 5)
                elif fault == "garbage":
                    await publisher.send(b"\xc1 not msgpack")
                    await publisher.send(publisher.stored(token=1 << 40))
                else:  # the engine restarts: a new process, its batches numbered from 0 again
                    await suite.restart(suite.mocks[0])
                    await publisher.send(publisher.stored(), seq=0)
                await asyncio.sleep(0.3)  # the fault's own batches are in before counting
                before = await batches_heard(client, url)
                for _ in range(5):
                    await publisher.send(publisher.stored())
                await asyncio.sleep(0.5)
                applied = await batches_heard(client, url) - before
                rest = asyncio.gather(
                    *(send(client, url, scale.deadline_s, json_body=chat(i)) for i in range(10, 20))
                )
                async with client.get(url + "/metrics") as response:
                    exact = metric(await response.text(), "smetric_engine_kv_view_exact")
                notes.append(
                    f"batches applied after the fault: {applied:.0f} of 5; exact {exact:.0f}"
                )
                return [*await first, *await rest]

            titles = {
                "gap": "KV events: a gap",
                "garbage": "KV events: garbage",
                "restart": "KV events: engine restart",
            }
            row = await suite.scenario(titles[fault], router, load, urls)
            row.note = "; ".join(notes)
    finally:
        publisher.close()


def malformed_bodies() -> list[tuple[bytes, dict[str, str]]]:
    """Bodies no client should send, each with the headers that go with it."""
    deep = b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    cases: list[bytes] = [
        b"",
        b"{",
        b"{not json",
        b"null",
        b"[]",
        b"42",
        b'"a string"',
        b"{}",
        b'{"messages": null}',
        b'{"messages": "hi"}',
        b'{"messages": {}}',
        b'{"messages": [1, 2]}',
        b'{"messages": [{}]}',
        b'{"messages": [{"role": 5, "content": "x"}]}',
        b'{"messages": [{"content": "x"}]}',
        b'{"messages": [{"role": "user", "content": 5}]}',
        b'{"messages": [{"role": "user", "content": [{"type": "text"}]}]}',
        b'{"messages": [{"role": "user", "content": [5]}]}',
        b'{"messages": [{"role": "user", "content": "x"}], "tools": "all"}',
        b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": 1}',
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}',
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}',
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
        b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
        b'{"messages": [{"role": "user", "content": "x"}], "stream_options": 3}',
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1' + b"0" * 5000 + b"}",
        b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
        b'{"messages": [{"role": "user", "content": "x"}]',
        b'{"messages": [{"role": "user", "content": "x"}]}}',
        b'{"messages": [{"role": "user", "content": "x"}], }',
        b"{'messages': []}",
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": NaN}',
        b"\x00\x01\x02\x03",
        deep,
        b"[" * 100_000,
        b'{"a":' * 3000 + b"1" + b"}" * 3000,
        b'{"messages": [{"role": "user", "content": {"text": "x"}}]}',
        b'{"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": 1}}',
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1e999}',
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 10000000}',
    ]
    pairs = [(body, JSON) for body in cases]
    pairs.append((b"\x1f\x8b not gzip at all", {**JSON, "Content-Encoding": "gzip"}))
    pairs.append((b"garbage", {**JSON, "Content-Encoding": "br"}))
    pairs.append((b"x" * (40 << 20), JSON))  # over the 32 MiB body limit
    return pairs


async def hostile_bodies(suite: Suite) -> None:
    urls = [m.url for m in suite.mocks]
    async with suite.router(urls) as router:

        async def load(client: aiohttp.ClientSession, url: str) -> list[str]:
            outcomes = []
            for body, headers in malformed_bodies():
                outcome = await send(
                    client, url, suite.scale.deadline_s, data=body, headers=headers
                )
                # A malformed body must be refused: an answer would be a miss too.
                outcomes.append("unclean" if outcome == "completed" else outcome)
            return outcomes

        row = await suite.scenario(
            f"{len(malformed_bodies())} malformed bodies", router, load, urls
        )
        row.note = "each must get a JSON 4xx"


async def huge_prompts(suite: Suite) -> None:
    """25 MB chats, longer than any engine's context: refused before they are tokenised."""
    urls = [m.url for m in suite.mocks]
    text = "agents resend the whole conversation on every call " * 500_000
    body = json.dumps({"messages": [{"role": "user", "content": text}]}).encode()
    async with suite.router(urls) as router:

        async def load(client: aiohttp.ClientSession, url: str) -> list[str]:
            async with client.get(url + "/v1/models") as response:  # learns max_model_len
                await response.read()
            return list(
                await asyncio.gather(
                    *(
                        send(client, url, suite.scale.deadline_s, data=body, headers=JSON)
                        for _ in range(suite.scale.huge_prompts)
                    )
                )
            )

        row = await suite.scenario(
            f"{suite.scale.huge_prompts} prompts of 25 MB at once", router, load, urls
        )
        row.note = f"peak RSS {router.rss_mb(peak=True):.0f} MB"


async def run_suite(scale: Scale, mocks: int = 4) -> list[Row]:
    """Every scenario in turn on one set of mock engines; a fresh router for each."""
    with tempfile.TemporaryDirectory(prefix="smetric-faults-") as scratch:
        suite = Suite(scale, Path(scratch))
        try:
            await suite.start_mocks(mocks)
            await engine_killed_mid_stream(suite)
            await misbehaving_engine(suite, "stall", "stalled engine (1 of 4)")
            await stalled_engine_default_timeouts(suite)
            await misbehaving_engine(suite, "http_500", "engine answering 500 (1 of 4)")
            await misbehaving_engine(suite, "garbage", "engine answering garbage (1 of 4)")
            await clients_hang_up(
                suite, "clients time out before the headers", give_up_before_headers
            )
            await clients_hang_up(suite, "clients reset mid-stream", reset_mid_stream)
            for fault in ("gap", "garbage", "restart"):
                await kv_event_fault(suite, fault)
            await hostile_bodies(suite)
            await huge_prompts(suite)
        finally:
            for mock in suite.mocks:
                mock.stop()
        return suite.rows


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table."""
    head = (
        "| scenario | requests | completed | clean error | client aborted | unclean | hung "
        "| in flight after | healthy engines ejected | router RSS MB before → after | note |"
    )
    lines = [head, "|" + "---|" * 11]
    for row in rows:
        o = row.outcomes
        lines.append(
            f"| {row.scenario} | {row.requests} | {o['completed']} | {o['clean_error']} "
            f"| {o['aborted']} | {o['unclean']} | {o['hung']} | {row.inflight_after} "
            f"| {row.wrongly_ejected} | {row.rss_before_mb:.0f} → {row.rss_after_mb:.0f} "
            f"| {row.note} |"
        )
    return "\n".join(lines)
