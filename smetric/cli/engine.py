"""``smetric engine``: a vLLM-compatible mock engine, to run the router without GPUs."""

from __future__ import annotations

from typing import Annotated

import typer
from aiohttp import web

from smetric.cli.app import app, console, user_errors
from smetric.cli.settings_options import Given, setting_flags, with_setting_flags
from smetric.core.settings_load import with_values
from smetric.engine import EngineConfig, run_engine
from smetric.engine.server import KV_EVENTS
from smetric.model.perf import load_hardware, load_model
from smetric.serve.listen import bound_port, listen

# A bind flag that also says "connect", against the endpoint's own choice; agent mode on
# or off.
ENGINE_FLAGS = setting_flags(
    EngineConfig,
    names={
        "kv_events_bind": ("--kv-events-bind/--no-kv-events-bind",),
        "agent": ("--agent/--no-agent",),
    },
)


@app.command()
@with_setting_flags(ENGINE_FLAGS)
def engine(
    given: Given,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[
        int,
        typer.Option(
            help="Port to listen on (0: any free port; the startup line names it).",
            min=0,
            max=65535,
        ),
    ] = 8100,
) -> None:
    """Serve vLLM's OpenAI API with a real prefix cache and the simulator's step timing.

    Endpoints: /v1/chat/completions, /v1/completions (streaming or not), /v1/models,
    /tokenize, /health and /metrics with vLLM's metric names; cached tokens are reported in
    usage.prompt_tokens_details.cached_tokens.
    """
    with user_errors():
        config = with_values(EngineConfig(), given.section(""), "flags")
        load_model(config.model)
        load_hardware(config.hardware, gpus=config.gpus)
        # Bound before the banner: a port in use is said plainly, not as a traceback.
        (sock,) = listen(host, port)
    model, gpus, hardware = config.model, config.gpus, config.hardware
    banner = f"smetric engine ({model} on {gpus}x{hardware}) on http://{host}:{bound_port(sock)}"

    def announce(app: web.Application) -> None:
        """One line, flushed, once every socket is bound: scripts read the addresses from it."""
        line = banner
        if KV_EVENTS in app:
            events = app[KV_EVENTS]
            line += f"; KV events on {events.endpoint}"
            if events.replay_endpoint is not None:
                line += f", replay on {events.replay_endpoint}"
        console.print(line, highlight=False, soft_wrap=True)
        console.file.flush()

    run_engine(config, sock, announce)
