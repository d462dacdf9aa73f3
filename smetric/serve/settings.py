"""How the router routes, checks engines and guards itself, apart from how it serves HTTP:
the ``router:`` section of ``smetric serve --config`` and the flags of the same names, read
by every front door (``serve``, ``pick``) and by the config loader without aiohttp."""

from __future__ import annotations

from dataclasses import dataclass

from smetric.core.policies import DEFAULT_POLICY, POLICY_NAMES
from smetric.core.settings import check_settings, setting
from smetric.serve.global_tier import GLOBAL_TIERS
from smetric.serve.upstream import Timeouts

__all__ = ["RouterSettings"]


@dataclass
class RouterSettings:
    """How the router routes, checks engines and guards itself: what the ``router:``
    section of ``smetric serve --config`` and the flags of the same names set."""

    policy: str = setting(
        DEFAULT_POLICY,
        f"Routing policy: {', '.join(POLICY_NAMES)}, or NAME:key=value,... with its parameters.",
    )
    block_size: int = setting(16, "Tokens per KV block (the engines' block size).", ge=1)
    api_keys: frozenset[str] = setting(
        frozenset(),
        "Accepted client keys (a flag per key); with any, every route but /health needs one, "
        "as 'Authorization: Bearer KEY' or 'x-api-key: KEY'.",
        # An empty key (``--api-key "$KEY"`` with KEY unset) would admit an empty header.
        nonempty_items=True,
    )
    engine_api_key: str | None = setting(
        None,
        "Key sent to every engine as 'Authorization: Bearer KEY', for engines that require "
        "one (an engine's own api_key in the config wins); the client's key then never "
        "reaches an engine. None: engines get the client's key, unless the router has "
        "api_keys.",
    )
    open_metrics: bool = setting(False, "Let /metrics answer without a key (scrapers).")
    allow_client_kv_transfer_params: bool = setting(
        False,
        "Pass clients' kv_transfer_params on to engines; else they are dropped, since "
        "they name the address an engine reads or sends KV to.",
    )
    health_interval_s: float = setting(2.0, "Seconds between health checks.", ge=0.05)
    max_body_bytes: int = setting(
        32 << 20,
        "Largest request body, in bytes once inflated; a larger one gets a 413 before it "
        "is parsed.",
        ge=1,
    )
    max_buffered_bytes: int = setting(
        256 << 20,
        "Bytes of request bodies held at once, all requests together (each parsed body "
        "takes several times its size): a body holds its Content-Length before it is "
        "read, else the bytes arrived so far; one that would go past it waits up to 2 s, "
        "then gets a 503 with Retry-After.",
        ge=1,
    )
    body_timeout_s: float = setting(
        60.0,
        "Seconds a client has to send a request's whole body; then it gets a 408 and the "
        "connection closes, so a body trickled a byte at a time holds nothing for long.",
        gt=0,
    )
    max_prompt_tokens: int = setting(
        0,
        "Longest prompt routed, in tokens: a longer one gets a 400, once tokenised (a "
        "single text over 16 characters a token of it, before); images count as their "
        "placeholders (0: the largest max_model_len the engines' /v1/models report).",
        ge=0,
    )
    analysis_threads: int = setting(
        2,
        "Large prompts analysed at once in worker threads with a model's tokenizer, each "
        "holding its tokens meanwhile (0: on the event loop, where the byte tokenizer's "
        "always are: it holds the GIL, so a thread gains nothing).",
        ge=0,
    )
    connect_timeout_s: float = setting(
        Timeouts.connect_s, "Seconds to wait for a connection to an engine.", gt=0
    )
    first_byte_timeout_s: float = setting(
        Timeouts.first_byte_s,
        "Seconds to wait for an engine's response headers (a non-streaming reply's come at "
        "its end, a disaggregated prefill's too) or a stream's first chunk; then the "
        "request is retried elsewhere.",
        gt=0,
    )
    idle_timeout_s: float = setting(
        Timeouts.idle_s, "Seconds an engine may go silent mid-response before it is cut off.", gt=0
    )
    stream_headers_timeout_s: float = setting(
        Timeouts.stream_headers_s,
        "Seconds to wait for a streaming reply's headers, which engines send as soon as "
        "they take the request; then it is retried elsewhere.",
        gt=0,
    )
    stall_timeout_s: float = setting(
        20.0,
        "Seconds an engine with requests in flight may show no progress (no byte of any "
        "response, no prompt or generation counter moved in its /metrics) before it is "
        "ejected as stalled and its requests that sent the client nothing are retried "
        "elsewhere (0: never); prompts still to prefill add a second per stall_prefill_tps "
        "tokens.",
        ge=0,
    )
    # The default is below the slowest long prefills the performance model puts on its
    # presets: a fresh 129 k-token prompt of Qwen3-30B-A3B on one H20 at about 2,200
    # tokens/s (58 s), of Qwen3-235B-A22B-FP8 on four at about 1,700 (76 s).
    stall_prefill_tps: float = setting(
        1000.0,
        "Prompt tokens routed to an engine and not yet prefilled that earn it one more "
        "second before a stall: a prefill sends nothing and moves no counter until its "
        "first token.",
        gt=0,
    )
    retries: int = setting(
        2,
        "Other engines to try for a request (disaggregated: for each leg) that failed "
        "before the client got any byte (refused connections do not count).",
        ge=0,
    )
    eject_after: int = setting(
        3,
        "Failed requests (5xx, garbage, timeouts) in a row that eject an engine, for a "
        "backoff that doubles with each ejection until a request succeeds there again.",
        ge=1,
    )
    eject_backoff_s: float = setting(5.0, "Seconds of an engine's first ejection.", ge=0)
    eject_backoff_max_s: float = setting(
        300.0, "Longest ejection, in seconds, however often an engine fails.", ge=0
    )
    scrape_interval_s: float = setting(
        0.0,
        "Seconds between scrapes of engines' /metrics (0: off); running + waiting then "
        "raise the load, and cache_config_info sizes the prefix index. Busy engines are "
        "scraped for their progress anyway (see stall_timeout_s).",
        ge=0,
    )
    staleness_s: float = setting(5.0, "Ignore a scrape older than this many seconds.", ge=0)
    memo_bytes: int = setting(
        256 << 20,
        "Bytes each of the router's memories of earlier bodies holds (so up to three times "
        "this): message runs as rendered, tokenised and hashed; messages' JSON and "
        "rendering; bodies' leading bytes through their history.",
        ge=0,
    )
    global_tier: str = setting(
        "none",
        "What the router knows of the cluster's global KV tier (what a session moved to "
        "another engine loads instead of recomputing): none (unknown), events (the blocks "
        "engines with kv_events report on a CPU or storage medium, as vLLM's CPU offloading "
        "and LMCache do, taken as one shared store) or full (a store without events that "
        "keeps every prompt the engines prefilled).",
        choices=GLOBAL_TIERS,
    )
    global_tier_tokens: int = setting(
        0,
        "Capacity of the full global tier in tokens, least recently used out first (0: unbounded).",
        ge=0,
    )
    drain_timeout_s: float = setting(
        30.0,
        "On SIGTERM, stop accepting at once and give the requests in flight this many "
        "seconds to finish before they are cut.",
        ge=0,
    )

    def __post_init__(self) -> None:
        check_settings(self)
