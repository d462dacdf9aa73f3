"""Engines found in DNS, as a Kubernetes headless Service publishes its ready pods.

A headless Service ``vllm`` in namespace ``ns`` answers ``vllm.ns.svc.cluster.local`` with
one A (or AAAA) record per ready pod, and ``_http._tcp.vllm.ns.svc.cluster.local`` with one
SRV record per pod and named port. ``dns://NAME:PORT`` reads the first (every address is an
engine on ``PORT``), ``dns+srv://NAME`` the second (each record gives host and port; the
host is resolved in turn unless the answer carries its address).

The name is resolved again every ``interval_s``: engines that appear join the router's
pool, engines that disappear leave it (requests already there run to their end), and the
engines that stay are untouched, views and load included. Engines the operator listed
stay beside the discovered ones whatever DNS says. A lookup that fails (timeout,
SERVFAIL, no server, an answer no resolver expects) changes nothing, so a DNS outage
does not empty the pool; an answer that the name has no records (NXDOMAIN or no answer:
no ready pod) takes every discovered engine out. Each failure is logged and counted
(``smetric_discovery_errors_total``), and the lookups go on, whatever the answer was.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import dns.asyncresolver
import dns.exception
import dns.rdatatype
import dns.resolver

from smetric.core.errors import ConfigError, UserError
from smetric.serve.engines import Engine

log = logging.getLogger("smetric.serve")


@dataclass(frozen=True)
class DnsTarget:
    """What to resolve: ``name`` (A and AAAA, engines on ``port``) or, with ``srv``, its SRV
    records; engines are ``scheme://ip:port``."""

    name: str
    port: int | None = None
    srv: bool = False
    scheme: str = "http"

    @classmethod
    def parse(cls, spec: str) -> DnsTarget:
        """``dns://NAME:PORT``, ``dns+srv://NAME`` (``+https`` for TLS engines)."""
        parts = urlsplit(spec)
        kinds = {"dns": (False, "http"), "dns+srv": (True, "http")}
        kinds |= {"dns+https": (False, "https"), "dns+srv+https": (True, "https")}
        if parts.scheme not in kinds or not parts.hostname:
            raise ConfigError(
                f"engine discovery {spec!r}: expected dns://NAME:PORT (A/AAAA records) or "
                "dns+srv://NAME (SRV records)"
            )
        srv, scheme = kinds[parts.scheme]
        try:
            port = parts.port
        except ValueError:
            raise ConfigError(f"engine discovery {spec!r}: bad port") from None
        if not srv and port is None:
            raise ConfigError(f"engine discovery {spec!r}: give the engines' port (NAME:PORT)")
        return cls(parts.hostname, port, srv, scheme)


def resolver_for(server: str | None, timeout_s: float = 2.0) -> dns.asyncresolver.Resolver:
    """The system's resolver (``/etc/resolv.conf``), or one that asks ``server``
    (``IP`` or ``IP:PORT``) alone."""
    if server is None:
        resolver = dns.asyncresolver.Resolver()
    else:
        resolver = dns.asyncresolver.Resolver(configure=False)
        host, _, port = server.rpartition(":") if server.count(":") == 1 else (server, "", "")
        try:
            ipaddress.ip_address(host.strip("[]"))
            resolver.port = int(port) if port else 53
        except ValueError:
            raise ConfigError(f"DNS server {server!r}: expected IP or IP:PORT") from None
        resolver.nameservers = [host.strip("[]")]
    resolver.lifetime = timeout_s
    return resolver


class LookupFailed(Exception):
    """The DNS server could not be asked, did not answer, or answered what says nothing
    of the name's records (YXDOMAIN, REFUSED, a malformed message): the engines are
    unknown."""


def _url(scheme: str, address: str, port: int) -> str:
    ip = ipaddress.ip_address(address)
    return f"{scheme}://[{ip}]:{port}" if ip.version == 6 else f"{scheme}://{ip}:{port}"


async def _addresses(resolver: dns.asyncresolver.Resolver, name: str) -> list[str]:
    found = []
    for rdtype in ("A", "AAAA"):
        try:
            answer = await resolver.resolve(name, rdtype, search=False)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            continue
        except (dns.exception.DNSException, OSError) as exc:
            raise LookupFailed(f"{name} {rdtype}: {type(exc).__name__}: {exc}") from None
        found += [record.address for record in answer]
    return found


async def resolve(target: DnsTarget, resolver: dns.asyncresolver.Resolver) -> set[str]:
    """The engine URLs the name has now; raises ``LookupFailed`` if that is unknown."""
    if not target.srv:
        assert target.port is not None
        return {
            _url(target.scheme, a, target.port) for a in await _addresses(resolver, target.name)
        }
    try:
        answer = await resolver.resolve(target.name, "SRV", search=False)
    except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
        return set()
    except (dns.exception.DNSException, OSError) as exc:
        raise LookupFailed(f"{target.name} SRV: {type(exc).__name__}: {exc}") from None
    # Addresses the answer already carries (Kubernetes adds them as additional records).
    glue: dict[str, list[str]] = {}
    for rrset in answer.response.additional:
        if rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
            glue.setdefault(rrset.name.to_text(), []).extend(r.address for r in rrset)
    urls = set()
    for record in answer:
        host = record.target.to_text()
        addresses = glue.get(host) or await _addresses(resolver, host)
        urls |= {_url(target.scheme, a, record.port) for a in addresses}
    return urls


class DnsDiscovery:
    """Keeps a pool's engines in step with a DNS name: ``join(url)`` and ``leave(url)`` are
    awaited for each change, ``known`` is what the pool has now; ``listed`` engines never
    leave; ``failed`` is called once per failed refresh."""

    def __init__(
        self,
        target: DnsTarget,
        resolver: dns.asyncresolver.Resolver,
        known: Callable[[], set[str]],
        join: Callable[[str], Awaitable[None]],
        leave: Callable[[str], Awaitable[None]],
        interval_s: float = 5.0,
        listed: frozenset[str] = frozenset(),
        failed: Callable[[], None] = lambda: None,
    ) -> None:
        self.target = target
        self.resolver = resolver
        self.known = known
        self.join = join
        self.leave = leave
        self.interval_s = interval_s
        self.listed = listed
        self.failed = failed
        self.failures = 0
        self._task: asyncio.Task[None] | None = None
        self._running = False

    async def refresh(self) -> bool:
        """One lookup and the changes it brings; False if it failed, however it failed
        (logged and counted): the lookups that follow must run whatever this one met."""
        try:
            await self._apply(await resolve(self.target, self.resolver))
        except LookupFailed as exc:
            self._failure(str(exc))
            return False
        except Exception as exc:
            log.exception("engine discovery failed")
            self._failure(f"{type(exc).__name__}: {exc}")
            return False
        return True

    def _failure(self, reason: str) -> None:
        self.failures += 1
        self.failed()
        log.warning(json.dumps({"event": "discovery_failed", "reason": reason}))

    async def _apply(self, found: set[str]) -> None:
        known = self.known()
        for url in sorted(found - known):
            log.info(json.dumps({"event": "engine_joined", "engine": url}))
            await self.join(url)
        for url in sorted(known - found - self.listed):
            log.info(json.dumps({"event": "engine_left", "engine": url}))
            await self.leave(url)

    async def _forever(self) -> None:
        # The flag, not only the cancellation, ends the loop: Python 3.11's
        # ``asyncio.wait_for``, which dnspython awaits each answer with, swallows a
        # cancellation that arrives as the answer does, and the loop would run on.
        while self._running:
            await asyncio.sleep(self.interval_s)
            if self._running:
                await self.refresh()

    def start(self) -> None:
        self._running = True
        self._task = asyncio.create_task(self._forever())

    async def close(self) -> None:
        self._running = False
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


async def first_engines(
    target: DnsTarget,
    resolver: dns.asyncresolver.Resolver,
    wait_s: float,
    interval_s: float,
    required: bool = True,
) -> set[str]:
    """The engines to start with: looked up until some appear, at most ``wait_s``; when
    not ``required`` (other engines are listed), what one lookup finds, maybe none."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        with contextlib.suppress(LookupFailed):
            if (found := await resolve(target, resolver)) or not required:
                return found
        if not required:
            return set()
        if loop.time() >= deadline:
            raise UserError(f"no engine found at {target.name} within {wait_s:g} s")
        await asyncio.sleep(interval_s)


class Membership(Protocol):
    """What discovery changes: an engine pool (``serve.pool.EnginePool``)."""

    engines: list[Engine]

    async def add(self, engine: Engine) -> None: ...

    async def remove(self, url: str) -> Engine | None: ...


@dataclass(frozen=True)
class Discovery:
    """``--discover``, ``--discover-interval`` and ``--dns-server``, checked; engines found
    get ``kv_blocks`` for their prefix index, as ``--kv-blocks`` gives listed ones.
    ``listed``: the engines given beside discovery, which stay whatever DNS says."""

    target: DnsTarget
    interval_s: float = 5.0
    server: str | None = None
    kv_blocks: int = 16384
    # How long to look for the first engines before giving up (none listed).
    wait_s: float = 60.0
    listed: frozenset[str] = frozenset()

    @classmethod
    def parse(
        cls,
        spec: str,
        interval_s: float,
        server: str | None,
        kv_blocks: int,
        listed: frozenset[str] = frozenset(),
    ) -> Discovery:
        resolver_for(server)  # a bad server address fails here, before anything starts
        return cls(DnsTarget.parse(spec), interval_s, server, kv_blocks, listed=listed)

    def resolver(self) -> dns.asyncresolver.Resolver:
        return resolver_for(self.server, timeout_s=min(2.0, max(0.2, self.interval_s)))

    def first(self) -> list[str]:
        """The engines to start with (blocking: called before the server starts)."""
        required = not self.listed
        lookup = first_engines(self.target, self.resolver(), self.wait_s, 1.0, required)
        return sorted(asyncio.run(lookup) - self.listed)

    @contextlib.asynccontextmanager
    async def kept(
        self, pool: Membership, failed: Callable[[], None] = lambda: None
    ) -> AsyncIterator[None]:
        """Keep ``pool`` in step with DNS while the block runs; ``failed`` counts each
        failed lookup."""

        async def join(url: str) -> None:
            await pool.add(Engine(url, self.kv_blocks))

        async def leave(url: str) -> None:
            await pool.remove(url)

        discovery = DnsDiscovery(
            self.target,
            self.resolver(),
            lambda: {e.url for e in pool.engines},
            join,
            leave,
            self.interval_s,
            self.listed,
            failed,
        )
        await discovery.refresh()
        discovery.start()
        try:
            yield
        finally:
            await discovery.close()
