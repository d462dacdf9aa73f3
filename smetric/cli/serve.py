"""``smetric serve``: the session-centric router in front of OpenAI-compatible engines."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from smetric.cli.app import app, console, user_errors
from smetric.core.policies import DEFAULT_POLICY, POLICY_NAMES
from smetric.serve.app import Router, RouterSettings
from smetric.serve.config import disaggregation_from, engines_from, router_options
from smetric.serve.disagg import DECODE_POLICIES
from smetric.serve.listen import listen
from smetric.serve.metrics import share_metrics_between_processes
from smetric.serve.tokenizers import make_tokenizer
from smetric.serve.workers import serve as serve_router


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
        str | None,
        typer.Option(
            "--policy", "-p", help=f"One of {', '.join(POLICY_NAMES)}. Default: {DEFAULT_POLICY}."
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.", min=1, max=65535)] = 8000,
    block_size: Annotated[
        int | None,
        typer.Option(help="Tokens per KV block (the engines' block size). Default: 16.", min=1),
    ] = None,
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
        float | None,
        typer.Option(help="Seconds between health checks. Default: 2.", min=0.05),
    ] = None,
    scrape_interval: Annotated[
        float | None,
        typer.Option(
            help="Seconds between scrapes of engines' /metrics (0: off); running + waiting "
            "then raise the load, and cache_config_info sizes the prefix index. Busy "
            "engines are scraped for their progress anyway (see --stall-timeout). Default: 0.",
            min=0.0,
        ),
    ] = None,
    staleness: Annotated[
        float | None,
        typer.Option(help="Ignore a scrape older than this many seconds. Default: 5.", min=0.0),
    ] = None,
    stall_timeout: Annotated[
        float | None,
        typer.Option(
            help="Seconds an engine with requests in flight may show no progress (no byte "
            "of any response, no prompt or generation counter moved in its /metrics) "
            "before it is ejected as stalled and its requests that sent the client nothing "
            "are retried elsewhere (0: never). Default: 20.",
            min=0.0,
        ),
    ] = None,
    stream_headers_timeout: Annotated[
        float | None,
        typer.Option(
            help="Seconds to wait for a streaming reply's headers, which engines send as "
            "soon as they take the request; then it is retried elsewhere. Default: 10.",
            min=0.001,
        ),
    ] = None,
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
        options = router_options(config)
        flags = {
            "policy": policy,
            "block_size": block_size,
            "health_interval_s": health_interval,
            "scrape_interval_s": scrape_interval,
            "staleness_s": staleness,
            "stall_timeout_s": stall_timeout,
            "stream_headers_timeout_s": stream_headers_timeout,
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
        settings = RouterSettings(api_keys=frozenset(api_key or []), **options)
        disaggregated = disaggregation_from(
            prefill_engine or [], decode_engine or [], config, kv_blocks, decode_policy
        )
        disagg = None
        if disaggregated is None:
            engines, subscribers = engines_from(
                engine or [], config, kv_blocks, settings.block_size
            )
        elif engine:
            raise ValueError("give --engine for a colocated cluster, or prefill and decode engines")
        else:
            (engines, disagg), subscribers = disaggregated, {}
        level = logging.getLevelName(log_level.upper())
        if not isinstance(level, int):
            raise ValueError(f"unknown log level {log_level!r}")
        # Before the router's metrics exist: with several workers they live in files that
        # every worker writes and any of them reads, so a scrape sums them all.
        if workers > 1:
            share_metrics_between_processes()
        by_engine = tokenizer == "engine"
        encoder, template = make_tokenizer("bytes" if by_engine else tokenizer)
        router = Router(
            engines,
            settings,
            tokenizer=encoder,
            template=template,
            engine_tokenizer=by_engine,
            subscribers=subscribers,
            disagg=disagg,
        )
        # Bound before any banner: a port in use is said plainly, and nothing claims to serve.
        sockets = listen(host, port, workers)
    logging.basicConfig(level=level, format="%(message)s")
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
