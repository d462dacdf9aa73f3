"""``smetric serve``: the session-centric router in front of OpenAI-compatible engines."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from smetric.cli.app import app, console, user_errors
from smetric.cli.settings_options import Given, settings_flags
from smetric.record.recorder import Recorder, RecordSettings, read_salt
from smetric.serve.app import Router, RouterSettings
from smetric.serve.config import (
    FrontDoor,
    Recording,
    ServeConfig,
    disaggregation_from,
    engines_from,
    load_config,
    router_settings,
    with_flags,
)
from smetric.serve.discovery import Discovery
from smetric.serve.listen import listen
from smetric.serve.metrics import share_metrics_between_processes
from smetric.serve.tokenizers import make_tokenizer
from smetric.serve.workers import serve as serve_router

ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        help="YAML config: engines: [...] and router: {...}, the keys of the flags "
        "(docs: reference/configuration); the flags win over it.",
        show_default=False,
    ),
]
# The help groups of the flags: the classes that declare their settings, by heading.
PANELS = {RouterSettings: "Routing", Recording: "Recording"}


def recorder_from(options: FrontDoor) -> Recorder | None:
    """The recorder ``--record`` asks for, if it does."""
    if options.record is None:
        return None
    salt = None if options.record_salt_file is None else read_salt(options.record_salt_file)
    return Recorder(
        RecordSettings(
            options.record,
            max_bytes=options.record_max_mb << 20,
            rotate_s=options.record_rotate_s,
            salt=salt,
            block_size=options.block_size,
            tokenizer=options.tokenizer,
        )
    )


def discovered(options: FrontDoor) -> tuple[tuple[str, ...], Discovery | None]:
    """The engines DNS lists now (waiting up to a minute for one to appear), and the
    discovery that keeps them current."""
    if options.discover is None:
        return (), None
    discovery = Discovery.parse(
        options.discover, options.discover_interval_s, options.dns_server, options.kv_blocks
    )
    return tuple(discovery.first()), discovery


def log_level(options: FrontDoor) -> int:
    level = logging.getLevelName(options.log_level.upper())
    assert isinstance(level, int)  # the setting's choices are level names
    return level


@app.command()
@settings_flags(ServeConfig, PANELS)
def serve(given: Given, config: ConfigOpt = None) -> None:
    """Route OpenAI-compatible traffic (chat, completions, Anthropic messages) to engines.

    First turns go where load is lowest; follow-ups go where their prefix is cached, unless
    that engine is overloaded or has evicted it. One JSON log line per decision.

    A request that fails before the client got any byte (engine refused, stalled, answered
    5xx or garbage) is retried on another engine, so it may run twice (at-least-once).

    Every flag is also a key of the YAML config (--config): the engine lists at its top
    level, the rest in its 'router:' section, under the names the configuration reference
    lists.
    """
    with user_errors():
        resolved = with_flags(load_config(ServeConfig, config), given)
        options = resolved.router
        settings = router_settings(options)
        disaggregated = disaggregation_from(resolved)
        disagg = None
        workers = options.workers
        if options.discover is not None and (disaggregated is not None or workers > 1):
            raise ValueError("--discover serves colocated engines with one worker")
        if disaggregated is None:
            found, discovery = discovered(options)
            engines, subscribers = engines_from(
                (*resolved.engines, *found), options.kv_blocks, settings.block_size
            )
        elif resolved.engines:
            raise ValueError("give --engine for a colocated cluster, or prefill and decode engines")
        else:
            (engines, disagg), subscribers, discovery = disaggregated, {}, None
        # Before the router's metrics exist: with several workers they live in files that
        # every worker writes and any of them reads, so a scrape sums them all.
        if workers > 1:
            share_metrics_between_processes()
        by_engine = options.tokenizer == "engine"
        encoder, template = make_tokenizer("bytes" if by_engine else options.tokenizer)
        router = Router(
            engines,
            settings,
            tokenizer=encoder,
            template=template,
            engine_tokenizer=by_engine,
            subscribers=subscribers,
            disagg=disagg,
            discovery=discovery,
            recorder=recorder_from(options),
        )
        # Bound before any banner: a port in use is said plainly, and nothing claims to serve.
        host, port = options.host, options.port
        sockets = listen(host, port, workers)
    logging.basicConfig(level=log_level(options), format="%(message)s")
    shape = f"{len(engines)} engines"
    if disagg is not None:
        shape = f"{len(disagg.prefill_urls)} prefill + {len(disagg.decode_urls)} decode engines"
    console.print(
        f"smetric serve: {settings.policy} over {shape} on http://{host}:{port}"
        + (f" ({workers} workers)" if workers > 1 else ""),
        highlight=False,
    )
    with user_errors():
        serve_router(router, sockets)
