"""``smetric demo``: mock engines, the router, and agentic sessions, all on loopback.

Everything runs in one process and one event loop, so Ctrl-C leaves nothing behind. The
sessions come from a trace (the embedded Claude Code sample by default), composed closed
loop as the simulator does: each turn is sent its (scaled) think time after the previous
response arrived, and carries the conversation so far — including what the engine answered
— plus new content sized after the trace's prompt growth (scaled down, so that the byte
tokenizer keeps bodies small), so every follow-up can hit the previous turn's cache.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
from aiohttp.test_utils import TestServer

from smetric.engine import EngineConfig, create_app
from smetric.serve.app import ENGINE_HEADER, Router, RouterSettings
from smetric.serve.engines import Engine
from smetric.trace.compose import ClosedLoopIssuer, compose_sessions
from smetric.trace.schema import Trace

_WORDS = ("read", "file", "grep", "test", "patch", "build", "diff", "log", "run", "fix")


@dataclass(frozen=True)
class DemoOptions:
    engines: int = 4
    policy: str = "smetric"
    session_rate: float = 2.0
    duration_s: float = 20.0
    # Trace tokens per demo token, and trace seconds per demo second.
    token_scale: float = 100.0
    time_scale: float = 20.0
    max_tokens: int = 8
    engine_speed: float = 0.05
    kv_blocks: int = 2048
    seed: int = 0


@dataclass
class EngineTally:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class DemoState:
    urls: list[str] = field(default_factory=list)
    tallies: dict[str, EngineTally] = field(default_factory=dict)
    router: Router | None = None
    sent: int = 0
    failed: int = 0
    started: float = field(default_factory=time.monotonic)


def filler(seed: str, tokens: int) -> str:
    """Deterministic text of about ``tokens`` bytes, different per seed."""
    digest = hashlib.blake2b(seed.encode(), digest_size=8).digest()
    words = [_WORDS[(b + i) % len(_WORDS)] for i, b in enumerate(digest * (tokens // 40 + 1))]
    return (" ".join(words) + " ")[: max(tokens, 1)]


MIN_CHUNK = 16


def next_conversation(
    session: str,
    turn: int,
    trace_tokens: int,
    history: list[dict] | None,
    token_scale: float,
) -> list[dict]:
    """The messages a synthetic agent sends: its history as it happened, plus new content
    that brings the prompt to the trace's size (scaled), deterministic per session and turn.

    Tool output goes back as a user turn: strict OpenAI servers (sglang-router, for one)
    reject a ``tool`` message without the ``tool_call_id`` of a real tool call.
    """
    scaled = max(int(trace_tokens / token_scale), MIN_CHUNK)
    if history is None:
        system = {"role": "system", "content": filler("system-prompt", scaled // 3)}
        task = {"role": "user", "content": filler(f"{session}/task", scaled - scaled // 3)}
        return [system, task]
    grown = max(scaled - sum(len(m["content"]) for m in history), MIN_CHUNK)
    return [*history, {"role": "user", "content": filler(f"{session}/{turn}", grown)}]


async def run_demo(
    trace: Trace, options: DemoOptions, on_tick: Callable[[DemoState], None]
) -> DemoState:
    state = DemoState()
    config = EngineConfig(speed=options.engine_speed, kv_blocks=options.kv_blocks)
    servers = [TestServer(create_app(config), host="127.0.0.1") for _ in range(options.engines)]
    for server in servers:
        await server.start_server()
    state.urls = [f"http://127.0.0.1:{s.port}" for s in servers]
    state.tallies = {url: EngineTally() for url in state.urls}
    router = Router(
        [Engine(url, options.kv_blocks) for url in state.urls],
        RouterSettings(policy=options.policy, health_interval_s=1.0),
    )
    state.router = router
    front = TestServer(router.app(), host="127.0.0.1")
    await front.start_server()
    try:
        async with aiohttp.ClientSession() as client:
            driver = SessionDriver(trace, options, state, client, f"http://127.0.0.1:{front.port}")
            ticker = asyncio.create_task(_tick(state, on_tick))
            try:
                await driver.run()
            finally:
                ticker.cancel()
                on_tick(state)
    finally:
        await front.close()
        for server in servers:
            await server.close()
    return state


async def _tick(state: DemoState, on_tick: Callable[[DemoState], None]) -> None:
    while True:
        on_tick(state)
        await asyncio.sleep(0.25)


class SessionDriver:
    """Closed-loop sessions: a request goes out its think time after its parent finished."""

    def __init__(
        self,
        trace: Trace,
        options: DemoOptions,
        state: DemoState,
        client: aiohttp.ClientSession,
        url: str,
    ) -> None:
        self.options = options
        self.state = state
        self.client = client
        self.url = url
        self.workload = compose_sessions(
            trace,
            rate=options.session_rate / options.time_scale,
            duration_s=options.duration_s * options.time_scale,
            seed=options.seed,
        )
        self.issuer = ClosedLoopIssuer(self.workload)
        frame = self.workload.requests
        self.rows = frame.select("session_id", "parent_id", "input_tokens", "turn").rows()
        # The conversation each request sends, once its parent's answer is known.
        self.messages: dict[int, list[dict]] = {}
        self.tasks: set[asyncio.Task] = set()
        self.t0 = time.monotonic()

    async def run(self) -> None:
        deadline = self.t0 + self.options.duration_s
        for at, rid in self.issuer.initial():
            self._schedule(at, rid)
        while self.tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def _schedule(self, at_trace_s: float, rid: int) -> None:
        delay = at_trace_s / self.options.time_scale - (time.monotonic() - self.t0)
        task = asyncio.create_task(self._send(rid, max(delay, 0.0)))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _conversation(self, rid: int) -> list[dict]:
        session, parent, tokens, turn = self.rows[rid]
        history = self.messages.get(parent) if parent is not None else None
        return next_conversation(session, turn, tokens, history, self.options.token_scale)

    async def _send(self, rid: int, delay: float) -> None:
        await asyncio.sleep(delay)
        messages = self._conversation(rid)
        body = {"messages": messages, "max_tokens": self.options.max_tokens}
        self.state.sent += 1
        try:
            async with self.client.post(self.url + "/v1/chat/completions", json=body) as reply:
                data = await reply.json()
                engine = reply.headers.get(ENGINE_HEADER, "")
        except aiohttp.ClientError:
            self.state.failed += 1
            return
        if "choices" not in data:
            self.state.failed += 1
            return
        answer = data["choices"][0]["message"]["content"]
        self.messages[rid] = [*messages, {"role": "assistant", "content": answer}]
        tally = self.state.tallies.get(engine)
        if tally is not None:
            usage = data.get("usage", {})
            tally.requests += 1
            tally.prompt_tokens += usage.get("prompt_tokens", 0)
            tally.cached_tokens += (usage.get("prompt_tokens_details") or {}).get(
                "cached_tokens", 0
            )
        now_trace = (time.monotonic() - self.t0) * self.options.time_scale
        for at, child in self.issuer.complete(rid, max(now_trace, 0.0)):
            self._schedule(at, child)
