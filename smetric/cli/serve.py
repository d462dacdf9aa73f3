"""``smetric serve``: the session-centric router in front of OpenAI-compatible engines."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from smetric.cli.app import app, console, user_errors
from smetric.cli.settings_options import Given, SettingFlag, setting_flags, with_setting_flags
from smetric.core.errors import UserError
from smetric.record.recorder import Recorder, RecordSettings, read_salt
from smetric.serve.app import Router, RouterSettings
from smetric.serve.config import (
    ColocatedEngine,
    FrontDoor,
    Recording,
    ServeConfig,
    ServeOptions,
    disaggregation_from,
    engine_url,
    engines_from,
    load_config,
    router_settings,
    with_flags,
)
from smetric.serve.discovery import Discovery
from smetric.serve.listen import bound_port, listen
from smetric.serve.logs import log_to_stderr
from smetric.serve.metrics import share_metrics_between_processes
from smetric.serve.tokenizers import make_tokenizer
from smetric.serve.workers import check_workers, serve_router

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

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

C = TypeVar("C", bound="DataclassInstance")


def router_flags(top: type, router: type) -> tuple[SettingFlag, ...]:
    """The flags of serve or pick: one per setting of the config file ``top`` and of its
    ``router:`` section (``router``). Engine lists take a flag per engine
    (``--engine``), a setting of seconds drops its ``_s`` (``--health-interval``), and
    the router's and the recording's settings have their own headings in ``--help``."""
    seconds = {f.name: (f"--{f.name[:-2].replace('_', '-')}",) for f in dataclasses.fields(router)}
    names: dict[str, tuple[str, ...]] = {n: d for n, d in seconds.items() if n.endswith("_s")}
    names |= {
        "engines": ("--engine", "-e"),
        "prefill_engines": ("--prefill-engine",),
        "decode_engines": ("--decode-engine",),
        "policy": ("--policy", "-p"),
        "api_keys": ("--api-key",),
        "open_metrics": ("--open-metrics/--no-open-metrics",),
        "allow_client_kv_transfer_params": (
            "--allow-client-kv-transfer-params/--no-allow-client-kv-transfer-params",
        ),
    }
    panels = {f.name: "Routing" for f in dataclasses.fields(RouterSettings)}
    panels |= {f.name: "Recording" for f in dataclasses.fields(Recording)}
    flags = (*setting_flags(top, names=names), *setting_flags(router, "router", names=names))
    return tuple(dataclasses.replace(f, panel=panels.get(f.field)) for f in flags)


def resolved(cls: type[C], config: Path | None, given: Given) -> C:
    """The config file of ``cls`` at ``config`` with the flags ``given`` over it."""
    return with_flags(load_config(cls, config), {**given.section(""), **given.section("router")})


SERVE_FLAGS = router_flags(ServeConfig, ServeOptions)


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


def discovered(
    options: FrontDoor, listed: tuple[str | ColocatedEngine, ...]
) -> tuple[tuple[str, ...], Discovery | None]:
    """The engines DNS lists now beside those ``listed`` (with none listed, waiting up to
    a minute for one to appear), and the discovery that keeps them current."""
    if options.discover is None:
        return (), None
    urls = frozenset(engine_url(e if isinstance(e, str) else e.url) for e in listed)
    discovery = Discovery.parse(
        options.discover,
        options.discover_interval_s,
        options.dns_server,
        options.kv_blocks,
        listed=urls,
    )
    return tuple(discovery.first()), discovery


def log_level(options: FrontDoor) -> int:
    level = logging.getLevelName(options.log_level.upper())
    assert isinstance(level, int)  # the setting's choices are level names
    return level


@app.command()
@with_setting_flags(SERVE_FLAGS)
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
        file = resolved(ServeConfig, config, given)
        options = file.router
        settings = router_settings(options)
        disaggregated = disaggregation_from(file)
        disagg = None
        workers = options.workers
        if options.discover is not None and (disaggregated is not None or workers > 1):
            raise UserError("--discover serves colocated engines with one worker")
        if disaggregated is None:
            found, discovery = discovered(options, file.engines)
            engines, subscribers = engines_from(
                (*file.engines, *found), options.kv_blocks, settings.block_size
            )
        elif file.engines:
            raise UserError("give --engine for a colocated cluster, or prefill and decode engines")
        else:
            (engines, disagg), subscribers, discovery = disaggregated, {}, None
        check_workers(subscribers, workers)
        by_engine = options.tokenizer == "engine"
        encoder, template = make_tokenizer("bytes" if by_engine else options.tokenizer)
        recorder = recorder_from(options)
        # Bound before any banner: a port in use is said plainly, and nothing claims to serve.
        host, port = options.host, options.port
        sockets = listen(host, port, workers)
        # Before the router's metrics exist: with several workers they live in files that
        # every worker writes and any of them reads, so a scrape sums them all. That holds
        # for the rest of this process, so it comes once nothing is left to refuse.
        if workers > 1:
            share_metrics_between_processes()
        router = Router(
            engines,
            settings,
            tokenizer=encoder,
            template=template,
            engine_tokenizer=by_engine,
            subscribers=subscribers,
            disagg=disagg,
            discovery=discovery,
            recorder=recorder,
        )
    log_to_stderr(log_level(options))
    shape = f"{len(engines)} engines"
    if disagg is not None:
        shape = f"{len(disagg.prefill_urls)} prefill + {len(disagg.decode_urls)} decode engines"
    # One line, flushed before any worker forks: scripts read the port from it.
    console.print(
        f"smetric serve: {settings.policy} over {shape} on http://{host}:{bound_port(sockets[0])}"
        + (f" ({workers} workers)" if workers > 1 else ""),
        highlight=False,
        soft_wrap=True,
    )
    console.file.flush()
    with user_errors():
        serve_router(router, sockets)
