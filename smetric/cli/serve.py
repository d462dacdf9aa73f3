"""``smetric serve``: the session-centric router in front of OpenAI-compatible engines."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from smetric.cli.app import app, console, user_errors
from smetric.core.policies import DEFAULT_POLICY, POLICY_NAMES
from smetric.core.policies.decode import DECODE_POLICY_NAMES
from smetric.record.recorder import Recorder, RecordSettings, read_salt
from smetric.serve.app import Router, RouterSettings
from smetric.serve.config import disaggregation_from, engines_from, router_options
from smetric.serve.discovery import Discovery
from smetric.serve.listen import bound_port, listen
from smetric.serve.metrics import share_metrics_between_processes
from smetric.serve.tokenizers import make_tokenizer
from smetric.serve.workers import serve as serve_router

# Options serve and pick share: engines found in DNS, and the drain on SIGTERM.
DiscoverOpt = Annotated[
    str | None,
    typer.Option(
        "--discover",
        help="Find engines in DNS, as a Kubernetes headless Service lists its ready pods: "
        "dns://NAME:PORT (A/AAAA records, engines on PORT) or dns+srv://NAME (SRV "
        "records); re-resolved every --discover-interval, so engines join and leave "
        "without a restart. Beside or instead of --engine.",
    ),
]
DiscoverIntervalOpt = Annotated[
    float, typer.Option(help="Seconds between DNS lookups of --discover.", min=0.05)
]
DnsServerOpt = Annotated[
    str | None,
    typer.Option(help="Ask this DNS server (IP or IP:PORT) for --discover. Default: the system's."),
]
DrainTimeoutOpt = Annotated[
    float | None,
    typer.Option(
        help="On SIGTERM, stop accepting at once and give the requests in flight this many "
        "seconds to finish before they are cut. Default: 30.",
        min=0.0,
    ),
]

# ... and the recording of the requests served.
RecordOpt = Annotated[
    Path | None,
    typer.Option(
        help="Write a trace of the requests served into this folder: per request its "
        "salted block ids, arrival and completion times, token counts, turn, session, "
        "agent, trigger, engine and branch, nothing else (no text, no header values). "
        "Read it with analyze, simulate, replay and plan.",
        rich_help_panel="Recording",
    ),
]
RecordMaxMbOpt = Annotated[
    int,
    typer.Option(
        help="Megabytes the recording may hold; the oldest segments go first.",
        min=1,
        rich_help_panel="Recording",
    ),
]
RecordRotateOpt = Annotated[
    float,
    typer.Option(
        help="Seconds between recording segments (each one zstd-compressed Parquet).",
        min=0.1,
        rich_help_panel="Recording",
    ),
]
RecordSaltFileOpt = Annotated[
    Path | None,
    typer.Option(
        help="The deployment's salt (16 bytes or more, e.g. head -c 32 /dev/urandom): "
        "recordings with the same salt compare across restarts and replicas. Without "
        "one, a fresh salt lives in memory only and the recording stands alone.",
        rich_help_panel="Recording",
    ),
]


def recorder_from(
    folder: Path | None,
    max_mb: int,
    rotate_s: float,
    salt_file: Path | None,
    block_size: int,
    tokenizer: str,
) -> Recorder | None:
    """The recorder ``--record`` asks for, if it does."""
    if folder is None:
        return None
    salt = None if salt_file is None else read_salt(salt_file)
    return Recorder(
        RecordSettings(
            folder,
            max_bytes=max_mb << 20,
            rotate_s=rotate_s,
            salt=salt,
            block_size=block_size,
            tokenizer=tokenizer,
        )
    )


def discovered(
    urls: list[str], spec: str | None, interval_s: float, server: str | None, kv_blocks: int
) -> tuple[list[str], Discovery | None]:
    """``urls`` plus the engines DNS lists now (waiting up to a minute for one to appear),
    and the discovery that keeps them current."""
    if spec is None:
        return urls, None
    discovery = Discovery.parse(spec, interval_s, server, kv_blocks)
    return [*urls, *discovery.first()], discovery


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
    port: Annotated[
        int,
        typer.Option(
            help="Port to listen on (0: any free port; the startup line names it).",
            min=0,
            max=65535,
        ),
    ] = 8000,
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
            "are retried elsewhere (0: never); prompts still to prefill add a second per "
            "stall_prefill_tps tokens (config, default 1000). Default: 20.",
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
        typer.Option(help=f"How the decode engine is chosen: {', '.join(DECODE_POLICY_NAMES)}."),
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
            "drain_timeout_s": drain_timeout,
        }
        options.update({name: value for name, value in flags.items() if value is not None})
        if api_key:
            options["api_keys"] = frozenset(api_key)
        settings = RouterSettings(**options)
        disaggregated = disaggregation_from(
            prefill_engine or [], decode_engine or [], config, kv_blocks, decode_policy
        )
        disagg = None
        if discover is not None and (disaggregated is not None or workers > 1):
            raise ValueError("--discover serves colocated engines with one worker")
        if disaggregated is None:
            urls, discovery = discovered(
                engine or [], discover, discover_interval, dns_server, kv_blocks
            )
            engines, subscribers = engines_from(urls, config, kv_blocks, settings.block_size)
        elif engine:
            raise ValueError("give --engine for a colocated cluster, or prefill and decode engines")
        else:
            (engines, disagg), subscribers, discovery = disaggregated, {}, None
        level = logging.getLevelName(log_level.upper())
        if not isinstance(level, int):
            raise ValueError(f"unknown log level {log_level!r}")
        # Before the router's metrics exist: with several workers they live in files that
        # every worker writes and any of them reads, so a scrape sums them all.
        if workers > 1:
            share_metrics_between_processes()
        by_engine = tokenizer == "engine"
        encoder, template = make_tokenizer("bytes" if by_engine else tokenizer)
        recorder = recorder_from(
            record, record_max_mb, record_rotate, record_salt_file, settings.block_size, tokenizer
        )
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
        # Bound before any banner: a port in use is said plainly, and nothing claims to serve.
        sockets = listen(host, port, workers)
    logging.basicConfig(level=level, format="%(message)s")
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
