"""``smetric serve``: the session-centric router in front of OpenAI-compatible engines."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
import yaml

from smetric.cli.app import app, console, user_errors
from smetric.core.kv_events import EventIndex
from smetric.core.policy import POLICY_NAMES
from smetric.serve.app import Router, RouterSettings
from smetric.serve.engines import Engine
from smetric.serve.kv_subscriber import KVEventSubscriber
from smetric.serve.tokenizers import make_tokenizer
from smetric.serve.workers import serve as serve_router


def engines_from(
    urls: list[str], config: Path | None, kv_blocks: int, block_size: int
) -> tuple[list[Engine], dict[str, KVEventSubscriber]]:
    """Engines from --engine flags and/or a YAML list of URLs or ``{url, kv_blocks,
    kv_events: {endpoint, topic, replay_endpoint, bind}}``; an engine with ``kv_events``
    is routed on its exact KV-event view (vLLM's ``--kv-events-config``). ``bind: false``
    connects to an engine that binds its publisher (several routers share one engine)."""
    engines = [Engine(url, kv_blocks) for url in urls]
    subscribers: dict[str, KVEventSubscriber] = {}
    if config is not None:
        try:
            data = yaml.safe_load(config.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"{config}: cannot read YAML: {exc}") from exc
        entries = data.get("engines", []) if isinstance(data, dict) else None
        if not isinstance(entries, list):
            raise ValueError(f"{config}: expected 'engines:' with a list of engines")
        for entry in entries:
            if isinstance(entry, str):
                engines.append(Engine(entry, kv_blocks))
            elif isinstance(entry, dict) and isinstance(entry.get("url"), str):
                engine = Engine(entry["url"], int(entry.get("kv_blocks", kv_blocks)))
                events = entry.get("kv_events")
                if events is not None:
                    if not isinstance(events, dict) or not isinstance(events.get("endpoint"), str):
                        raise ValueError(f"{config}: kv_events needs an endpoint (tcp://...)")
                    engine.events = EventIndex(block_size)
                    subscribers[engine.url] = KVEventSubscriber(
                        engine.events,
                        events["endpoint"],
                        topic=str(events.get("topic", "")),
                        replay_endpoint=events.get("replay_endpoint"),
                        bind=events.get("bind"),
                        name=engine.url,
                    )
                engines.append(engine)
            else:
                raise ValueError(f"{config}: each engine is a URL or {{url, kv_blocks}}")
    for engine in engines:
        if not engine.url.startswith(("http://", "https://")):
            raise ValueError(f"engine {engine.url!r} must be an http(s):// URL")
    if not engines:
        raise ValueError("give at least one --engine URL (or engines: in --config)")
    return engines, subscribers


@app.command()
def serve(
    engine: Annotated[
        list[str] | None,
        typer.Option("--engine", "-e", help="Engine base URL (repeat for each engine)."),
    ] = None,
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="YAML with 'engines: [...]'.")
    ] = None,
    policy: Annotated[
        str, typer.Option("--policy", "-p", help=f"One of {', '.join(POLICY_NAMES)}.")
    ] = "smetric",
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.", min=1, max=65535)] = 8000,
    block_size: Annotated[
        int, typer.Option(help="Tokens per KV block (the engines' block size).", min=1)
    ] = 16,
    kv_blocks: Annotated[
        int,
        typer.Option(help="KV blocks per engine for the router's prefix index.", min=1),
    ] = 16384,
    api_key: Annotated[
        list[str] | None, typer.Option("--api-key", help="Accepted client key (repeatable).")
    ] = None,
    health_interval: Annotated[
        float, typer.Option(help="Seconds between health checks.", min=0.05)
    ] = 2.0,
    scrape_interval: Annotated[
        float,
        typer.Option(
            help="Seconds between scrapes of engines' /metrics (0: off); running + waiting "
            "then raise the load, and cache_config_info sizes the prefix index.",
            min=0.0,
        ),
    ] = 0.0,
    staleness: Annotated[
        float, typer.Option(help="Ignore a scrape older than this many seconds.", min=0.0)
    ] = 5.0,
    tokenizer: Annotated[
        str,
        typer.Option(
            help="How prompts are tokenised for the prefix index: 'bytes' (fallback), "
            "'hf:/local/model/dir' (tokenizer.json and its chat template), or 'engine' "
            "(the engines' /tokenize)."
        ),
    ] = "bytes",
    workers: Annotated[
        int,
        typer.Option(
            help="Router processes sharing the port (SO_REUSEPORT), in-flight load and "
            "routed prefixes; one per core the router may use.",
            min=1,
        ),
    ] = 1,
    log_level: Annotated[
        str, typer.Option(help="debug, info (a JSON line per decision), warning or error.")
    ] = "info",
) -> None:
    """Route OpenAI-compatible traffic (chat, completions, Anthropic messages) to engines.

    First turns go where load is lowest; follow-ups go where their prefix is cached, unless
    that engine is overloaded or has evicted it. One JSON log line per decision.
    """
    with user_errors():
        engines, subscribers = engines_from(engine or [], config, kv_blocks, block_size)
        by_engine = tokenizer == "engine"
        encoder, template = make_tokenizer("bytes" if by_engine else tokenizer)
        router = Router(
            engines,
            RouterSettings(
                policy=policy,
                block_size=block_size,
                api_keys=frozenset(api_key or []),
                health_interval_s=health_interval,
                scrape_interval_s=scrape_interval,
                staleness_s=staleness,
            ),
            tokenizer=encoder,
            template=template,
            engine_tokenizer=by_engine,
            subscribers=subscribers,
        )
    with user_errors():
        level = logging.getLevelName(log_level.upper())
        if not isinstance(level, int):
            raise ValueError(f"unknown log level {log_level!r}")
    logging.basicConfig(level=level, format="%(message)s")
    console.print(
        f"smetric serve: {policy} over {len(engines)} engines on http://{host}:{port}"
        + (f" ({workers} workers)" if workers > 1 else ""),
        highlight=False,
    )
    with user_errors():
        serve_router(router, host, port, workers)
