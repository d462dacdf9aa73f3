"""What ``smetric serve`` runs with, declared once: the flags and the YAML config's keys.

``ServeConfig`` is the config file: its engine lists and its ``router:`` section
(``ServeOptions``: the router's ``RouterSettings`` and the serving process's own). Every
field declares its default, help and bounds (``core.settings.setting``); the flags of
``smetric serve`` and ``smetric pick`` are generated from the same fields
(``cli.settings_options``), and both are read by ``core.settings_load``, so a file and a
flag are held to the same checks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from smetric.core.errors import ConfigError
from smetric.core.kv_events import DEFAULT_MAX_BLOCKS, EventIndex
from smetric.core.policies.decode import DECODE_POLICY_NAMES
from smetric.core.settings import setting
from smetric.core.settings_load import load, read_yaml, with_values
from smetric.serve.backends import BACKENDS, backend_named
from smetric.serve.disagg import Disaggregation
from smetric.serve.engines import Engine
from smetric.serve.kv_subscriber import KVEventSubscriber
from smetric.serve.settings import RouterSettings

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

C = TypeVar("C", bound="DataclassInstance")

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class KVEvents:
    """Where an engine publishes its KV events (vLLM's ``--kv-events-config``)."""

    endpoint: str = setting(
        dataclasses.MISSING, "ZMQ endpoint of the engine's publisher: tcp://HOST:PORT."
    )
    topic: str = setting("", "Topic the engine publishes on ('': every topic).")
    replay_endpoint: str | None = setting(
        None, "ZMQ endpoint of the engine's replay socket, to resend missed batches; none: none."
    )
    bind: bool | None = setting(
        None,
        "true: the router binds the endpoint and the engine connects; false: the engine "
        "binds it and routers connect (several may share one engine); none: tcp:// binds, "
        "anything else connects.",
    )
    max_blocks: int = setting(
        DEFAULT_MAX_BLOCKS,
        "Blocks the router's view of this engine holds at most (some 350 bytes each); "
        "beyond it the oldest are forgotten and the view is no longer exact.",
        ge=1,
    )


@dataclass(frozen=True)
class EngineEntry:
    """One engine of a disaggregated cluster's ``prefill_engines:`` or ``decode_engines:``."""

    url: str = setting(dataclasses.MISSING, "Engine base URL, http(s)://HOST:PORT.")
    kv_blocks: int | None = setting(
        None, "KV blocks of this engine for the prefix index; none: the router's kv_blocks.", ge=1
    )
    api_key: str | None = setting(
        None, "Key sent to this engine as 'Authorization: Bearer KEY'; none: engine_api_key."
    )


@dataclass(frozen=True)
class ColocatedEngine(EngineEntry):
    """One engine of ``engines:``, routed on its exact KV-event view when it has
    ``kv_events``."""

    backend: str = setting("vllm", "How the engine speaks.", choices=tuple(BACKENDS))
    kv_events: KVEvents | None = setting(
        None, "The engine's KV events; none: the router's own view of what it cached."
    )


@dataclass
class Recording:
    """The recording of the requests served (``smetric.record``)."""

    record: Path | None = setting(
        None,
        "Write a trace of the requests served into this folder: per request its salted "
        "block ids, arrival and completion times, token counts, turn, session, agent, "
        "trigger, engine and branch, nothing else (no text, no header values). Read it "
        "with analyze, simulate, replay and plan. None: no recording.",
    )
    record_max_mb: int = setting(
        1024, "MiB the recording may hold; the oldest segments go first.", ge=1
    )
    record_rotate_s: float = setting(
        300.0, "Seconds between recording segments (each one zstd-compressed Parquet).", ge=0.1
    )
    record_salt_file: Path | None = setting(
        None,
        "The deployment's salt (16 bytes or more, e.g. head -c 32 /dev/urandom): "
        "recordings with the same salt compare across restarts and replicas. None: a "
        "fresh salt lives in memory only and the recording stands alone.",
    )


@dataclass
class FrontDoor(Recording, RouterSettings):
    """What ``smetric serve`` and ``smetric pick`` share beyond the router's settings."""

    host: str = setting("127.0.0.1", "Address to listen on.")
    kv_blocks: int = setting(
        16384, "KV blocks per engine for the prefix index, where its entry sets none.", ge=1
    )
    tokenizer: str = setting(
        "bytes",
        "How prompts are tokenised for the prefix index: 'bytes' (fallback), "
        "'hf:/local/model/dir' (tokenizer.json and its chat template), or 'engine' (the "
        "engines' /tokenize).",
    )
    discover: str | None = setting(
        None,
        "Find engines in DNS, as a Kubernetes headless Service lists its ready pods: "
        "dns://NAME:PORT (A/AAAA records, engines on PORT) or dns+srv://NAME (SRV records); "
        "re-resolved every discover_interval_s, so engines join and leave without a "
        "restart. Beside or instead of the engines listed. None: no discovery.",
    )
    discover_interval_s: float = setting(5.0, "Seconds between DNS lookups of discover.", ge=0.05)
    dns_server: str | None = setting(
        None, "Ask this DNS server (IP or IP:PORT) for discover; none: the system's."
    )
    log_level: str = setting(
        "info",
        "What is logged: debug, info (a JSON line per decision), warning or error.",
        choices=LOG_LEVELS,
    )


@dataclass
class ServeOptions(FrontDoor):
    """The ``router:`` section of ``smetric serve --config``."""

    port: int = setting(
        8000, "Port to listen on (0: any free port; the startup line names it).", ge=0, le=65535
    )
    workers: int = setting(
        1,
        "Router processes sharing the port (SO_REUSEPORT), in-flight load and routed "
        "prefixes; one per core the router may use.",
        ge=1,
    )
    decode_policy: str = setting(
        "least_kv",
        "Disaggregated serving: how the decode engine is chosen.",
        choices=DECODE_POLICY_NAMES,
    )


@dataclass(frozen=True)
class ColocatedConfig:
    """A config's ``engines:``: engines that prefill and decode alike."""

    engines: tuple[str | ColocatedEngine, ...] = setting(
        (),
        "Engines: base URLs, or {url, kv_blocks, backend, kv_events} (a flag per engine; "
        "those of the flags join those of the file).",
    )


@dataclass(frozen=True)
class ServeConfig(ColocatedConfig):
    """A ``smetric serve --config`` file."""

    prefill_engines: tuple[str | EngineEntry, ...] = setting(
        (),
        "Disaggregated serving: prefill engines, URLs or {url, kv_blocks} (a flag per "
        "engine). The policy picks one per request on unprefilled tokens.",
    )
    decode_engines: tuple[str | EngineEntry, ...] = setting(
        (),
        "Disaggregated serving: decode engines, URLs or {url, kv_blocks} (a flag per "
        "engine); they get the request with the prefill's kv_transfer_params.",
    )
    router: ServeOptions = field(default_factory=ServeOptions)


# The engine lists, whose flags add engines to the file's rather than replace them.
ENGINE_LISTS = ("engines", "prefill_engines", "decode_engines")


def load_config(cls: type[C], path: Path | None) -> C:
    """The config file at ``path`` (None: every default) read as ``cls``; a key ``cls``
    does not know, a value of the wrong type or range, or a YAML syntax error is a
    ``ConfigError`` naming the file."""
    if path is None:
        return cls()
    data = read_yaml(path)
    return load(cls, data, str(path))


def with_flags(config: C, given: Mapping[str, Any]) -> C:
    """``config`` with the settings of the flags ``given`` (by setting name): a flag's
    value replaces the file's, but the engines of flags join the file's."""
    joined = {
        name: (*getattr(config, name), *given[name])
        for name in ENGINE_LISTS
        if name in given and hasattr(config, name)
    }
    return with_values(config, {**given, **joined}, "flags")


def engine_url(url: str) -> str:
    """``url`` without a trailing slash, once it is an http(s) URL with a host and a
    valid port (``http://host:99999`` is refused here, not at the first request)."""
    if not isinstance(url, str):
        raise ConfigError(f"engine {url!r} must be an http(s):// URL")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"engine {url!r} must be an http(s):// URL with a host")
    try:
        parts.port  # noqa: B018 - raises on a port out of range or not a number
    except ValueError:
        raise ConfigError(f"engine {url!r}: the port must be a number from 1 to 65535") from None
    if parts.port == 0:
        raise ConfigError(f"engine {url!r}: the port must be a number from 1 to 65535")
    if parts.query or parts.fragment:
        raise ConfigError(f"engine {url!r}: a base URL has no query or fragment")
    return url.rstrip("/")


def engines_from(
    entries: tuple[str | ColocatedEngine, ...], kv_blocks: int, block_size: int
) -> tuple[list[Engine], dict[str, KVEventSubscriber]]:
    """The engines of ``engines:`` and ``--engine``; one with ``kv_events`` is routed on
    its exact KV-event view, and gets a subscriber keeping that view current."""
    engines: list[Engine] = []
    subscribers: dict[str, KVEventSubscriber] = {}
    for listed in entries:
        entry = ColocatedEngine(listed) if isinstance(listed, str) else listed
        backend = backend_named(entry.backend)
        url = engine_url(entry.url)
        index = None
        if entry.kv_events is not None:
            index = EventIndex(block_size, entry.kv_events.max_blocks)
            spec = dataclasses.asdict(entry.kv_events)
            subscribers[url] = backend.kv_event_subscriber(index, spec, url)
        blocks = kv_blocks if entry.kv_blocks is None else entry.kv_blocks
        key = entry.api_key or ""
        engines.append(Engine(url, blocks, events=index, backend=backend, api_key=key))
    if not engines:
        raise ConfigError("give at least one --engine URL (or engines: in --config)")
    return listed_once(engines), subscribers


def disaggregation_from(config: ServeConfig) -> tuple[list[Engine], Disaggregation] | None:
    """Engines and roles of ``prefill_engines:`` and ``decode_engines:`` (and their flags);
    None when neither names any, i.e. the cluster is colocated."""
    if not (config.prefill_engines or config.decode_engines):
        return None
    kv_blocks = config.router.kv_blocks

    def engines(entries: tuple[str | EngineEntry, ...]) -> list[Engine]:
        return [
            Engine(
                engine_url(e.url),
                kv_blocks if e.kv_blocks is None else e.kv_blocks,
                api_key=e.api_key or "",
            )
            for e in (EngineEntry(x) if isinstance(x, str) else x for x in entries)
        ]

    prefills, decodes = engines(config.prefill_engines), engines(config.decode_engines)
    disagg = Disaggregation(
        frozenset(e.url for e in prefills),
        frozenset(e.url for e in decodes),
        config.router.decode_policy,
    )
    return listed_once(prefills + decodes), disagg


def listed_once(engines: list[Engine]) -> list[Engine]:
    """``engines``, once no URL is listed twice (flags and file together)."""
    seen: set[str] = set()
    for engine in engines:
        if engine.url in seen:
            raise ConfigError(f"engine {engine.url} is listed twice")
        seen.add(engine.url)
    return engines


def router_settings(options: RouterSettings) -> RouterSettings:
    """The router's own settings out of a command's options."""
    names = [f.name for f in dataclasses.fields(RouterSettings)]
    return RouterSettings(**{name: getattr(options, name) for name in names})
