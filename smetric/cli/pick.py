"""``smetric pick``: the endpoint picker of an Envoy-based inference gateway."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from smetric.cli.app import app, console, err_console, user_errors
from smetric.cli.serve import (
    DiscoverIntervalOpt,
    DiscoverOpt,
    DnsServerOpt,
    DrainTimeoutOpt,
    RecordMaxMbOpt,
    RecordOpt,
    RecordRotateOpt,
    RecordSaltFileOpt,
    discovered,
    recorder_from,
)
from smetric.core.policies import DEFAULT_POLICY, POLICY_NAMES
from smetric.serve.app import Router, RouterSettings
from smetric.serve.config import engines_from, router_options
from smetric.serve.tokenizers import make_tokenizer

if TYPE_CHECKING:
    from smetric.gateway.server import PickerServer


@app.command()
def pick(
    engine: Annotated[
        list[str] | None,
        typer.Option("--engine", "-e", help="Engine base URL, by IP (repeat for each engine)."),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", "-c", help="YAML with 'engines: [...]' and 'router:', as serve's."
        ),
    ] = None,
    policy: Annotated[
        str, typer.Option("--policy", "-p", help=f"One of {', '.join(POLICY_NAMES)}.")
    ] = DEFAULT_POLICY,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[
        int,
        typer.Option(help="gRPC port: ext_proc and health (0: any free port).", min=0, max=65535),
    ] = 9002,
    metrics_port: Annotated[
        int,
        typer.Option(help="HTTP port of /metrics, /health and /live (0: any).", min=0, max=65535),
    ] = 9090,
    block_size: Annotated[
        int, typer.Option(help="Tokens per KV block (the engines' block size).", min=1)
    ] = 16,
    kv_blocks: Annotated[
        int, typer.Option(help="KV blocks per engine for the prefix index.", min=1)
    ] = 16384,
    tokenizer: Annotated[
        str,
        typer.Option(help="How prompts are tokenised: 'bytes', 'hf:/local/model/dir' or 'engine'."),
    ] = "bytes",
    max_inflight: Annotated[
        int,
        typer.Option(
            help="Answer 429 when every engine a request may go to has this many requests "
            "in flight (0: never shed).",
            min=0,
        ),
    ] = 0,
    health_interval: Annotated[
        float, typer.Option(help="Seconds between engine health checks.", min=0.05)
    ] = 2.0,
    scrape_interval: Annotated[
        float, typer.Option(help="Seconds between scrapes of engines' /metrics (0: off).", min=0.0)
    ] = 0.0,
    discover: DiscoverOpt = None,
    discover_interval: DiscoverIntervalOpt = 5.0,
    dns_server: DnsServerOpt = None,
    drain_timeout: DrainTimeoutOpt = None,
    record: RecordOpt = None,
    record_max_mb: RecordMaxMbOpt = 1024,
    record_rotate: RecordRotateOpt = 300.0,
    record_salt_file: RecordSaltFileOpt = None,
    log_level: Annotated[
        str, typer.Option(help="debug, info (a JSON line per decision), warning or error.")
    ] = "info",
) -> None:
    """Pick engines for an Envoy gateway (Gateway API Inference Extension protocol).

    Envoy's ext_proc filter streams each request here; the picker routes it with the same
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
        urls, discovery = discovered(
            engine or [], discover, discover_interval, dns_server, kv_blocks
        )
        engines, subscribers = engines_from(urls, config, kv_blocks, block_size)
        encoder, template = make_tokenizer("bytes" if tokenizer == "engine" else tokenizer)
        router = Router(
            engines,
            RouterSettings(
                **{
                    **router_options(config),
                    "policy": policy,
                    "block_size": block_size,
                    "health_interval_s": health_interval,
                    "scrape_interval_s": scrape_interval,
                }
            ),
            tokenizer=encoder,
            template=template,
            engine_tokenizer=tokenizer == "engine",
            subscribers=subscribers,
            discovery=discovery,
            recorder=recorder_from(
                record, record_max_mb, record_rotate, record_salt_file, block_size, tokenizer
            ),
        )
        picker = Picker(router, max_inflight=max_inflight)
        level = logging.getLevelName(log_level.upper())
        if not isinstance(level, int):
            raise ValueError(f"unknown log level {log_level!r}")
    logging.basicConfig(level=level, format="%(message)s")
    server = PickerServer(picker, host, port, metrics_port)
    with user_errors():
        drain_s = router.settings.drain_timeout_s if drain_timeout is None else drain_timeout
        asyncio.run(_serve(server, drain_s, policy, len(engines)))


async def _serve(server: PickerServer, drain_s: float, policy: str, engines: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
    except OSError as exc:
        raise ValueError(f"cannot listen on {server.host}: {exc}") from None
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
