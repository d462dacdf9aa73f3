"""``smetric pick``: the endpoint picker of an Envoy-based inference gateway."""

from __future__ import annotations

import asyncio
import signal
from typing import TYPE_CHECKING

import typer

from smetric.cli.app import app, console, err_console, user_errors
from smetric.cli.serve import (
    ConfigOpt,
    discovered,
    log_level,
    recorder_from,
    resolved,
    router_flags,
)
from smetric.cli.settings_options import Given, with_setting_flags
from smetric.core.errors import UserError
from smetric.gateway.options import PickConfig, PickOptions
from smetric.serve import collector
from smetric.serve.app import Router
from smetric.serve.config import engines_from, router_settings
from smetric.serve.logs import log_to_stderr
from smetric.serve.tokenizers import make_tokenizer

PICK_FLAGS = router_flags(PickConfig, PickOptions)

if TYPE_CHECKING:
    from smetric.gateway.server import PickerServer


@app.command()
@with_setting_flags(PICK_FLAGS)
def pick(given: Given, config: ConfigOpt = None) -> None:
    """Pick engines for an Envoy gateway (Gateway API Inference Extension protocol).

    Envoy's ext_proc filter sends each request here; the picker routes it with the same
    policies, KV views, load accounting, decision log and metrics as 'smetric serve', names
    the engine in 'x-gateway-destination-endpoint' and the 'envoy.lb' metadata, and Envoy
    sends the request there. No engine ready: 503; every engine at --max-inflight: 429.
    """
    try:
        from smetric.gateway.picker import Picker
        from smetric.gateway.server import PickerServer
    except ImportError as exc:
        err_console.print(
            f"[bold red]error:[/] the picker needs gRPC ({exc.name}): "
            "pip install 'smetric[gateway]'"
        )
        raise typer.Exit(2) from exc
    with user_errors():
        file = resolved(PickConfig, config, given)
        options = file.router
        found, discovery = discovered(options, file.engines)
        engines, subscribers = engines_from(
            (*file.engines, *found), options.kv_blocks, options.block_size
        )
        tokenizer = options.tokenizer
        encoder, template = make_tokenizer("bytes" if tokenizer == "engine" else tokenizer)
        router = Router(
            engines,
            router_settings(options),
            tokenizer=encoder,
            template=template,
            engine_tokenizer=tokenizer == "engine",
            subscribers=subscribers,
            discovery=discovery,
            recorder=recorder_from(options),
        )
        picker = Picker(router, max_inflight=options.max_inflight)
    log_to_stderr(log_level(options))
    server = PickerServer(picker, options.host, options.port, options.metrics_port)
    collector.settle()
    with user_errors():
        asyncio.run(_serve(server, options.drain_timeout_s, options.policy, len(engines)))


async def _serve(server: PickerServer, drain_s: float, policy: str, engines: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
    except OSError as exc:
        raise UserError(f"cannot listen on {server.host}: {exc}") from None
    # One line, flushed: scripts read the ports from it.
    console.print(
        f"smetric pick: {policy} over {engines} engines; ext_proc on "
        f"{server.host}:{server.grpc_port}, metrics on http://{server.host}:{server.metrics_port}",
        highlight=False,
        soft_wrap=True,
    )
    console.file.flush()
    try:
        await stop.wait()
    finally:
        await server.stop(drain_s)
