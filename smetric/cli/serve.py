"""``smetric serve``: the session-centric router in front of OpenAI-compatible engines."""

from __future__ import annotations

import logging
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from smetric.cli.app import app, console, user_errors
from smetric.core.kv_events import EventIndex
from smetric.core.policies import DEFAULT_POLICY, POLICY_NAMES
from smetric.serve.app import Router, RouterSettings
from smetric.serve.disagg import DECODE_POLICIES, disaggregation_from
from smetric.serve.engines import Engine
from smetric.serve.global_tier import GLOBAL_TIERS
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


# What a config's ``router:`` section may set: the limits, timeouts, passive health and
# the global tier's source. The flags of the same names win over it.
TUNABLE = (
    "max_body_bytes",
    "max_prompt_tokens",
    "analysis_threads",
    "connect_timeout_s",
    "first_byte_timeout_s",
    "idle_timeout_s",
    "retries",
    "eject_after",
    "eject_backoff_s",
    "eject_backoff_max_s",
    "open_metrics",
    "global_tier",
    "global_tier_tokens",
)


def router_options(config: Path | None) -> dict[str, Any]:
    """The ``router:`` section of the YAML config, checked against ``RouterSettings``."""
    if config is None:
        return {}
    try:
        data = yaml.safe_load(config.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"{config}: cannot read YAML: {exc}") from exc
    section = data.get("router", {}) if isinstance(data, dict) else {}
    if not isinstance(section, dict):
        raise ValueError(f"{config}: 'router:' must map settings to values")
    types = {f.name: type(getattr(RouterSettings(), f.name)) for f in fields(RouterSettings)}
    for key, value in section.items():
        if key not in TUNABLE:
            raise ValueError(f"{config}: unknown router setting {key!r}; one of {TUNABLE}")
        wanted = types[key]
        if wanted is str:
            if value not in GLOBAL_TIERS:
                raise ValueError(f"{config}: router.{key} must be one of {GLOBAL_TIERS}")
            continue
        fits = isinstance(value, wanted) or (wanted is float and type(value) is int)
        if not fits or isinstance(value, bool) != (wanted is bool) or value < 0:
            raise ValueError(f"{config}: router.{key} must be a non-negative {wanted.__name__}")
    return dict(section)


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
    ] = DEFAULT_POLICY,
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
        list[str] | None,
        typer.Option(
            "--api-key",
            help="Accepted client key (repeatable); then every route but /health needs one, "
            "as 'Authorization: Bearer KEY' or 'x-api-key: KEY'.",
        ),
    ] = None,
    open_metrics: Annotated[
        bool | None,
        typer.Option("--open-metrics", help="Let /metrics answer without a key (scrapers)."),
    ] = None,
    first_byte_timeout: Annotated[
        float | None,
        typer.Option(
            help="Seconds to wait for an engine's response headers (a non-streaming "
            "reply's come at its end, a disaggregated prefill's too) or a stream's first "
            "chunk; then the request is retried elsewhere. Default: 300.",
            min=0.001,
        ),
    ] = None,
    idle_timeout: Annotated[
        float | None,
        typer.Option(
            help="Seconds an engine may go silent mid-response before it is cut off. Default: 60.",
            min=0.001,
        ),
    ] = None,
    retries: Annotated[
        int | None,
        typer.Option(
            help="Other engines to try for a request (disaggregated: for each leg) that "
            "failed before the client got any byte (refused connections do not count). "
            "Default: 2.",
            min=0,
        ),
    ] = None,
    eject_after: Annotated[
        int | None,
        typer.Option(
            help="Failed requests (5xx, garbage, timeouts) in a row that eject an engine "
            "for a backoff doubling from --eject-backoff. Default: 3.",
            min=1,
        ),
    ] = None,
    eject_backoff: Annotated[
        float | None, typer.Option(help="First ejection's seconds. Default: 5.", min=0.0)
    ] = None,
    max_body_bytes: Annotated[
        int | None, typer.Option(help="Largest request body. Default: 32 MiB.", min=1)
    ] = None,
    max_prompt_tokens: Annotated[
        int | None,
        typer.Option(
            help="Longest prompt analysed, in tokens; longer ones get a 400 before they "
            "are tokenised. Default: the engines' max_model_len from /v1/models.",
            min=1,
        ),
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
    prefill_engine: Annotated[
        list[str] | None,
        typer.Option(
            "--prefill-engine",
            help="Disaggregated serving: a prefill engine's URL (repeatable; YAML "
            "prefill_engines:). The policy picks one per request on unprefilled tokens.",
        ),
    ] = None,
    decode_engine: Annotated[
        list[str] | None,
        typer.Option(
            "--decode-engine",
            help="Disaggregated serving: a decode engine's URL (repeatable; YAML "
            "decode_engines:); gets the request with the prefill's kv_transfer_params.",
        ),
    ] = None,
    decode_policy: Annotated[
        str,
        typer.Option(help=f"How the decode engine is chosen: {', '.join(DECODE_POLICIES)}."),
    ] = "least_kv",
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
    global_tier: Annotated[
        str | None,
        typer.Option(
            help="What the router knows of the cluster's global KV tier (what a session "
            "moved to another engine loads instead of recomputing): 'none' (unknown), "
            "'events' (the blocks engines with kv_events report on a CPU or storage "
            "medium, as vLLM's CPU offloading and LMCache do, taken as one shared store) "
            "or 'full' (a store without events that keeps every prompt the engines "
            "prefilled). YAML router: global_tier. Default: none.",
        ),
    ] = None,
    global_tier_tokens: Annotated[
        int | None,
        typer.Option(
            help="Capacity of the 'full' global tier in tokens, least recently used out "
            "first (0: unbounded). YAML router: global_tier_tokens. Default: 0.",
            min=0,
        ),
    ] = None,
    log_level: Annotated[
        str, typer.Option(help="debug, info (a JSON line per decision), warning or error.")
    ] = "info",
) -> None:
    """Route OpenAI-compatible traffic (chat, completions, Anthropic messages) to engines.

    First turns go where load is lowest; follow-ups go where their prefix is cached, unless
    that engine is overloaded or has evicted it. One JSON log line per decision.

    A request that fails before the client got any byte (engine refused, stalled, answered
    5xx or garbage) is retried on another engine, so it may run twice (at-least-once); the
    YAML config's 'router:' section may set the limits, timeouts, ejection settings and
    the global tier's source.
    """
    with user_errors():
        disaggregated = disaggregation_from(
            prefill_engine or [],
            decode_engine or [],
            config,
            kv_blocks,
            decode_policy,
        )
        disagg = None
        if disaggregated is None:
            engines, subscribers = engines_from(engine or [], config, kv_blocks, block_size)
        elif engine:
            raise ValueError("give --engine for a colocated cluster, or prefill and decode engines")
        else:
            (engines, disagg), subscribers = disaggregated, {}
        options = router_options(config)
        flags = {
            "open_metrics": open_metrics,
            "first_byte_timeout_s": first_byte_timeout,
            "idle_timeout_s": idle_timeout,
            "retries": retries,
            "eject_after": eject_after,
            "eject_backoff_s": eject_backoff,
            "max_body_bytes": max_body_bytes,
            "max_prompt_tokens": max_prompt_tokens,
            "global_tier": global_tier,
            "global_tier_tokens": global_tier_tokens,
        }
        options.update({name: value for name, value in flags.items() if value is not None})
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
                **options,
            ),
            tokenizer=encoder,
            template=template,
            engine_tokenizer=by_engine,
            subscribers=subscribers,
            disagg=disagg,
        )
    with user_errors():
        level = logging.getLevelName(log_level.upper())
        if not isinstance(level, int):
            raise ValueError(f"unknown log level {log_level!r}")
    logging.basicConfig(level=level, format="%(message)s")
    shape = f"{len(engines)} engines"
    if disagg is not None:
        shape = f"{len(disagg.prefill_urls)} prefill + {len(disagg.decode_urls)} decode engines"
    console.print(
        f"smetric serve: {policy} over {shape} on http://{host}:{port}"
        + (f" ({workers} workers)" if workers > 1 else ""),
        highlight=False,
    )
    with user_errors():
        serve_router(router, host, port, workers)
