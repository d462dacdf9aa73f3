"""``smetric engine``: a vLLM-compatible mock engine, to run the router without GPUs."""

from __future__ import annotations

from typing import Annotated

import typer
from aiohttp import web

from smetric.cli.app import app, console, user_errors
from smetric.engine import EngineConfig, run_engine
from smetric.engine.server import KV_EVENTS
from smetric.model.perf import load_hardware, load_model
from smetric.serve.listen import bound_port, listen


@app.command()
def engine(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[
        int,
        typer.Option(
            help="Port to listen on (0: any free port; the startup line names it).",
            min=0,
            max=65535,
        ),
    ] = 8100,
    served_model_name: Annotated[str, typer.Option(help="Model id it reports.")] = (
        EngineConfig.served_model_name
    ),
    model: Annotated[str, typer.Option(help="Step-time model preset.")] = EngineConfig.model,
    hardware: Annotated[str, typer.Option(help="GPU preset.")] = EngineConfig.hardware,
    gpus: Annotated[int, typer.Option(help="GPUs (tensor parallel).", min=1)] = 1,
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.", min=1)] = 16,
    kv_blocks: Annotated[int, typer.Option(help="KV blocks in the pool.", min=1)] = 4096,
    max_num_batched_tokens: Annotated[int, typer.Option(min=1)] = 2048,
    max_num_seqs: Annotated[int, typer.Option(min=1)] = 256,
    default_max_tokens: Annotated[int, typer.Option(min=1)] = 16,
    speed: Annotated[
        float, typer.Option(help="Multiplier on every step's modelled duration (1 = real).")
    ] = 1.0,
    role: Annotated[
        str,
        typer.Option(
            help="Disaggregated serving: prefill (holds a finished prompt's KV for a decode "
            "engine, answers kv_transfer_params), decode (pulls it over the link model "
            "first), or both.",
        ),
    ] = EngineConfig.role,
    kv_link_gb_s: Annotated[
        float, typer.Option(help="Bandwidth a decode engine pulls KV at, GB/s.", min=0.001)
    ] = EngineConfig.kv_link_gb_s,
    kv_events_endpoint: Annotated[
        str | None,
        typer.Option(
            help="Publish vLLM KV events on this ZMQ endpoint, as vLLM does: tcp://*:PORT "
            "binds (routers connect, several per engine; PORT * : any free port, the "
            "startup line names it), tcp://HOST:PORT connects (to a router that binds)."
        ),
    ] = None,
    kv_events_topic: Annotated[str, typer.Option(help="Topic of the KV events.")] = "kv",
    kv_events_replay_endpoint: Annotated[
        str | None,
        typer.Option(
            help="ZMQ endpoint to bind the replay socket on (tcp://HOST:* : any free port, "
            "the startup line names it)."
        ),
    ] = None,
    cpu_offload_blocks: Annotated[
        int,
        typer.Option(
            help="Offload prompt blocks to an LRU CPU store of this many blocks and load "
            "them back on a hit, as vLLM's OffloadingConnector does; its KV events report "
            "them with medium CPU (0: no offloading).",
            min=0,
        ),
    ] = 0,
) -> None:
    """Serve vLLM's OpenAI API with a real prefix cache and the simulator's step timing.

    Endpoints: /v1/chat/completions, /v1/completions (streaming or not), /v1/models,
    /tokenize, /health and /metrics with vLLM's metric names; cached tokens are reported in
    usage.prompt_tokens_details.cached_tokens.
    """
    with user_errors():
        config = EngineConfig(
            served_model_name=served_model_name,
            model=model,
            hardware=hardware,
            gpus=gpus,
            block_size=block_size,
            kv_blocks=kv_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            default_max_tokens=default_max_tokens,
            speed=speed,
            role=role,
            kv_link_gb_s=kv_link_gb_s,
            kv_events_endpoint=kv_events_endpoint,
            kv_events_topic=kv_events_topic,
            kv_events_replay_endpoint=kv_events_replay_endpoint,
            cpu_offload_blocks=cpu_offload_blocks,
        )
        load_model(model)
        load_hardware(hardware, gpus=gpus)
        # Bound before the banner: a port in use is said plainly, not as a traceback.
        (sock,) = listen(host, port)
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
