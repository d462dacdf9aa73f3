"""``smetric engine``: a vLLM-compatible mock engine, to run the router without GPUs."""

from __future__ import annotations

from typing import Annotated

import typer

from smetric.cli.app import app, console, user_errors
from smetric.cli.settings_options import Given, settings_flags
from smetric.core.settings_load import with_values
from smetric.engine import EngineConfig, run_engine
from smetric.model.perf import load_hardware, load_model
from smetric.serve.listen import listen


@app.command()
@settings_flags(EngineConfig)
def engine(
    given: Given,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.", min=1, max=65535)] = 8100,
) -> None:
    """Serve vLLM's OpenAI API with a real prefix cache and the simulator's step timing.

    Endpoints: /v1/chat/completions, /v1/completions (streaming or not), /v1/models,
    /tokenize, /health and /metrics with vLLM's metric names; cached tokens are reported in
    usage.prompt_tokens_details.cached_tokens.
    """
    with user_errors():
        config = with_values(EngineConfig(), given, "flags")
        load_model(config.model)
        load_hardware(config.hardware, gpus=config.gpus)
        # Bound before the banner: a port in use is said plainly, not as a traceback.
        (sock,) = listen(host, port)
    console.print(
        f"smetric engine ({config.model} on {config.gpus}x{config.hardware}) on http://{host}:{port}"
    )
    run_engine(config, sock)
