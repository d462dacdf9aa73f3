"""Reading ``smetric serve``'s YAML config and checking what it names."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from smetric.core.kv_events import EventIndex
from smetric.serve.app import RouterSettings
from smetric.serve.backends import backend_named
from smetric.serve.disagg import Disaggregation
from smetric.serve.engines import Engine
from smetric.serve.global_tier import GLOBAL_TIERS
from smetric.serve.kv_subscriber import KVEventSubscriber

# What a config may hold at its top level.
SECTIONS = ("engines", "prefill_engines", "decode_engines", "router")


def read_config(path: Path) -> dict[str, Any]:
    """The config's top-level mapping (empty for an empty file); a key it does not know
    (a typo such as ``engine:``) is an error, not silently nothing."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: cannot read YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the config must be a mapping (engines:, router:, ...)")
    unknown = [str(key) for key in data if key not in SECTIONS]
    if unknown:
        raise ValueError(
            f"{path}: unknown key(s) {', '.join(unknown)}; a config has {', '.join(SECTIONS)}"
        )
    return data


def engine_url(url: str) -> str:
    """``url`` without a trailing slash, once it is an http(s) URL with a host and a
    valid port (``http://host:99999`` is refused here, not at the first request)."""
    if not isinstance(url, str):
        raise ValueError(f"engine {url!r} must be an http(s):// URL")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"engine {url!r} must be an http(s):// URL with a host")
    try:
        parts.port  # noqa: B018 - raises on a port out of range or not a number
    except ValueError:
        raise ValueError(f"engine {url!r}: the port must be a number from 1 to 65535") from None
    if parts.port == 0:
        raise ValueError(f"engine {url!r}: the port must be a number from 1 to 65535")
    if parts.query or parts.fragment:
        raise ValueError(f"engine {url!r}: a base URL has no query or fragment")
    return url.rstrip("/")


def engines_from(
    urls: list[str], config: Path | None, kv_blocks: int, block_size: int
) -> tuple[list[Engine], dict[str, KVEventSubscriber]]:
    """Engines from --engine flags and/or a YAML list of URLs or ``{url, kv_blocks,
    backend, kv_events: {endpoint, topic, replay_endpoint, bind}}``; an engine with
    ``kv_events`` is routed on its exact KV-event view (vLLM's ``--kv-events-config``).
    ``bind: false`` connects to an engine that binds its publisher (several routers share
    one engine). ``backend`` names how the engine speaks (``vllm``, the default)."""
    engines = [Engine(engine_url(url), kv_blocks) for url in urls]
    subscribers: dict[str, KVEventSubscriber] = {}
    if config is not None:
        entries = read_config(config).get("engines", [])
        if not isinstance(entries, list):
            raise ValueError(f"{config}: expected 'engines:' with a list of engines")
        for entry in entries:
            if isinstance(entry, str):
                engines.append(Engine(engine_url(entry), kv_blocks))
            elif isinstance(entry, dict) and isinstance(entry.get("url"), str):
                unknown = set(entry) - {"url", "kv_blocks", "kv_events", "backend"}
                if unknown:
                    raise ValueError(
                        f"{config}: unknown engine key(s) {', '.join(sorted(unknown))}; "
                        "an engine has url, kv_blocks, backend and kv_events"
                    )
                backend = backend_named(str(entry.get("backend", "vllm")))
                url = engine_url(entry["url"])
                events = entry.get("kv_events")
                index = None
                if events is not None:
                    if not isinstance(events, dict) or not isinstance(events.get("endpoint"), str):
                        raise ValueError(f"{config}: kv_events needs an endpoint (tcp://...)")
                    index = EventIndex(block_size)
                    subscribers[url] = backend.kv_event_subscriber(index, events, url)
                blocks = entry.get("kv_blocks", kv_blocks)
                if type(blocks) is not int or blocks < 1:
                    raise ValueError(f"{config}: kv_blocks of {url} must be a positive integer")
                engines.append(Engine(url, blocks, events=index, backend=backend))
            else:
                raise ValueError(f"{config}: each engine is a URL or {{url, kv_blocks}}")
    if not engines:
        raise ValueError("give at least one --engine URL (or engines: in --config)")
    return engines, subscribers


# What a config's ``router:`` section may set: every setting a flag sets, by the
# setting's name. The flags win over it.
TUNABLE = (
    "policy",
    "api_keys",
    "block_size",
    "health_interval_s",
    "scrape_interval_s",
    "staleness_s",
    "stall_timeout_s",
    "stall_prefill_tps",
    "stream_headers_timeout_s",
    "memo_bytes",
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
    "drain_timeout_s",
)


def router_options(config: Path | None) -> dict[str, Any]:
    """The ``router:`` section of the YAML config, checked against ``RouterSettings``."""
    if config is None:
        return {}
    section = read_config(config).get("router", {})
    if not isinstance(section, dict):
        raise ValueError(f"{config}: 'router:' must map settings to values")
    types = {f.name: type(getattr(RouterSettings(), f.name)) for f in fields(RouterSettings)}
    for key, value in section.items():
        if key not in TUNABLE:
            raise ValueError(f"{config}: unknown router setting {key!r}; one of {TUNABLE}")
        wanted = types[key]
        if key == "api_keys":
            if not isinstance(value, list) or not all(isinstance(k, str) and k for k in value):
                raise ValueError(f"{config}: router.api_keys must be a list of keys")
            continue
        if key == "policy":
            if not isinstance(value, str):
                raise ValueError(f"{config}: router.policy must be a policy name")
            continue
        if wanted is str:
            if value not in GLOBAL_TIERS:
                raise ValueError(f"{config}: router.{key} must be one of {GLOBAL_TIERS}")
            continue
        fits = isinstance(value, wanted) or (wanted is float and type(value) is int)
        if not fits or isinstance(value, bool) != (wanted is bool) or value < 0:
            raise ValueError(f"{config}: router.{key} must be a non-negative {wanted.__name__}")
    options = dict(section)
    if "api_keys" in options:
        options["api_keys"] = frozenset(options["api_keys"])
    return options


def disaggregation_from(
    prefill: list[str],
    decode: list[str],
    config: Path | None,
    kv_blocks: int,
    decode_policy: str,
) -> tuple[list[Engine], Disaggregation] | None:
    """Engines and roles from ``--prefill-engine``/``--decode-engine`` flags and/or the YAML
    keys ``prefill_engines:`` and ``decode_engines:`` (URLs or ``{url, kv_blocks}``);
    None when neither names any, i.e. the cluster is colocated."""
    roles = {"prefill_engines": list(prefill), "decode_engines": list(decode)}
    sized: dict[str, int] = {}
    if config is not None:
        data = read_config(config)
        for key, urls in roles.items():
            entries = data.get(key, [])
            if not isinstance(entries, list):
                raise ValueError(f"{config}: {key} must be a list of URLs or {{url, kv_blocks}}")
            for entry in entries:
                if isinstance(entry, dict) and isinstance(entry.get("url"), str):
                    blocks = entry.get("kv_blocks", kv_blocks)
                    if type(blocks) is not int or blocks < 1:
                        raise ValueError(f"{config}: kv_blocks must be a positive integer")
                    sized[engine_url(entry["url"])] = blocks
                    entry = entry["url"]
                if not isinstance(entry, str):
                    raise ValueError(f"{config}: each of {key} is a URL or {{url, kv_blocks}}")
                urls.append(entry)
    if not any(roles.values()):
        return None
    prefills, decodes = (
        [Engine(url, sized.get(url, kv_blocks)) for url in map(engine_url, roles[k])]
        for k in ("prefill_engines", "decode_engines")
    )
    engines = prefills + decodes
    disagg = Disaggregation(
        frozenset(e.url for e in prefills), frozenset(e.url for e in decodes), decode_policy
    )
    return engines, disagg
