"""``smetric demo``: mock engines, the router, and agentic sessions, all on loopback.

Everything runs in one process and one event loop, so Ctrl-C leaves nothing behind. The
sessions are ``smetric replay``'s: composed closed loop from a trace (the embedded Claude
Code sample by default), each turn sent its (scaled) think time after the previous response
arrived, carrying the conversation so far, the engine's answers included, so every
follow-up can hit the previous turn's cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp.test_utils import TestServer

from smetric.core.policies import DEFAULT_POLICY
from smetric.engine import EngineConfig, create_app
from smetric.replay import Replayer, ReplayOptions
from smetric.serve.app import Router, RouterSettings
from smetric.serve.engines import Engine
from smetric.trace.schema import Trace


@dataclass(frozen=True)
class DemoOptions:
    engines: int = 4
    policy: str = DEFAULT_POLICY
    session_rate: float = 2.0
    duration_s: float = 20.0
    # Trace tokens per demo token, and trace seconds per demo second.
    token_scale: float = 100.0
    time_scale: float = 20.0
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
    router: Router | None = None
    replayer: Replayer | None = None

    def tallies(self) -> dict[str, EngineTally]:
        """Per engine, what the finished requests it served reported."""
        out = {url: EngineTally() for url in self.urls}
        records = self.replayer.records.values() if self.replayer else ()
        for record in records:
            tally = out.get(record.engine or "")
            if tally is not None and record.finished_s is not None:
                tally.requests += 1
                tally.prompt_tokens += record.prompt_tokens
                tally.cached_tokens += record.cached_tokens
        return out


async def run_demo(
    trace: Trace, options: DemoOptions, on_tick: Callable[[DemoState], None]
) -> DemoState:
    state = DemoState()
    config = EngineConfig(speed=options.engine_speed, kv_blocks=options.kv_blocks)
    servers = [TestServer(create_app(config), host="127.0.0.1") for _ in range(options.engines)]
    for server in servers:
        await server.start_server()
    state.urls = [f"http://127.0.0.1:{s.port}" for s in servers]
    router = Router(
        [Engine(url, options.kv_blocks) for url in state.urls],
        RouterSettings(policy=options.policy, health_interval_s=1.0),
    )
    state.router = router
    front = TestServer(router.app(), host="127.0.0.1")
    await front.start_server()
    state.replayer = Replayer(
        trace,
        ReplayOptions(
            url=f"http://127.0.0.1:{front.port}",
            rate=options.session_rate,
            duration_s=options.duration_s,
            time_scale=options.time_scale,
            token_scale=options.token_scale,
            seed=options.seed,
        ),
    )
    try:
        await state.replayer.run(lambda _: on_tick(state))
    finally:
        await front.close()
        for server in servers:
            await server.close()
    return state
