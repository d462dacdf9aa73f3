"""Engine discovery from DNS, against a real DNS server on loopback (UDP, dnspython's wire
format): A/AAAA and SRV records, re-resolved as they change, and outages that change
nothing."""

from __future__ import annotations

import asyncio
import contextlib
import time

import dns.rcode
import dns.resolver
import pytest

from smetric.core.errors import ConfigError
from smetric.serve.discovery import DnsDiscovery, DnsTarget, LookupFailed, resolve, resolver_for
from smetric.testing.dns import LoopbackDNS

from conftest import eventually

NAME = "vllm.llm.svc.cluster.local"
SRV = "_http._tcp." + NAME


def test_targets_parse_and_bad_ones_are_refused() -> None:
    assert DnsTarget.parse(f"dns://{NAME}:8000") == DnsTarget(NAME, 8000)
    assert DnsTarget.parse(f"dns+srv://{SRV}") == DnsTarget(SRV, None, srv=True)
    assert DnsTarget.parse(f"dns+https://{NAME}:443").scheme == "https"
    for bad in (f"dns://{NAME}", f"http://{NAME}:80", "dns://:80", f"dns://{NAME}:99999"):
        with pytest.raises(ConfigError):
            DnsTarget.parse(bad)
    with pytest.raises(ConfigError):
        resolver_for("not-an-ip:53")


def test_a_aaaa_and_srv_records_become_engine_urls() -> None:
    async def go(server: LoopbackDNS) -> None:
        resolver = resolver_for(server.address)
        server.set(NAME, "A", ["127.0.0.11", "127.0.0.12"])
        server.set(NAME, "AAAA", ["::1"])
        found = await resolve(DnsTarget(NAME, 8000), resolver)
        assert found == {"http://127.0.0.11:8000", "http://127.0.0.12:8000", "http://[::1]:8000"}
        # SRV: ports from the records; one target's address comes as additional data, the
        # other's is looked up.
        server.set(SRV, "SRV", ["0 50 8001 pod-a.llm.svc.", "0 50 8002 pod-b.llm.svc."])
        server.set("pod-a.llm.svc.", "A", ["127.0.0.21"])
        found = await resolve(DnsTarget(SRV, srv=True), resolver)
        assert found == {"http://127.0.0.21:8001"}  # pod-b has no address (yet)
        server.set("pod-b.llm.svc.", "AAAA", ["::1"])
        found = await resolve(DnsTarget(SRV, srv=True), resolver)
        assert found == {"http://127.0.0.21:8001", "http://[::1]:8002"}
        assert await resolve(DnsTarget("gone.llm.svc", 80), resolver) == set()  # NXDOMAIN

    with LoopbackDNS() as server:
        asyncio.run(go(server))


def test_engines_join_and_leave_as_the_records_change_and_outages_change_nothing() -> None:
    async def go(server: LoopbackDNS) -> None:
        pool: dict[str, object] = {}
        changes: list[str] = []

        async def join(url: str) -> None:
            pool[url] = object()
            changes.append(f"+{url}")

        async def leave(url: str) -> None:
            del pool[url]
            changes.append(f"-{url}")

        discovery = DnsDiscovery(
            DnsTarget(NAME, 8000),
            resolver_for(server.address, timeout_s=0.3),
            lambda: set(pool),
            join,
            leave,
            interval_s=0.05,
        )
        server.set(NAME, "A", ["127.0.0.11", "127.0.0.12"])
        assert await discovery.refresh()
        stays = pool["http://127.0.0.11:8000"]
        discovery.start()
        server.set(NAME, "A", ["127.0.0.11", "127.0.0.13"])
        await eventually(lambda: "http://127.0.0.13:8000" in pool)
        assert set(pool) == {"http://127.0.0.11:8000", "http://127.0.0.13:8000"}
        assert pool["http://127.0.0.11:8000"] is stays  # the engine that stayed is untouched
        server.silent = True  # DNS down: lookups time out, the pool stays as it is
        before = discovery.failures
        await eventually(lambda: discovery.failures >= before + 2)
        assert set(pool) == {"http://127.0.0.11:8000", "http://127.0.0.13:8000"}
        server.silent = False
        server.set(NAME, "A", [])  # no ready pod: NXDOMAIN, every engine leaves
        await eventually(lambda: not pool)
        await discovery.close()
        assert changes == [
            "+http://127.0.0.11:8000",
            "+http://127.0.0.12:8000",
            "+http://127.0.0.13:8000",
            "-http://127.0.0.12:8000",
            "-http://127.0.0.11:8000",
            "-http://127.0.0.13:8000",
        ]

    with LoopbackDNS() as server:
        asyncio.run(go(server))


def test_a_dns_server_that_does_not_answer_is_a_failed_lookup() -> None:
    async def go(server: LoopbackDNS) -> None:
        server.silent = True
        with pytest.raises(LookupFailed):
            await resolve(DnsTarget(NAME, 80), resolver_for(server.address, timeout_s=0.2))

    with LoopbackDNS() as server:
        asyncio.run(go(server))


def test_discovery_survives_any_answer_and_keeps_listed_engines() -> None:
    """YXDOMAIN, REFUSED and a join that fails are each a failed lookup, counted; the
    lookups go on and see the next change. An engine listed beside discovery never
    leaves, even when DNS says the name has no records."""

    async def go(server: LoopbackDNS) -> None:
        pool = {"http://127.0.0.50:8000"}
        counted: list[int] = []
        broken = {"join": True}

        async def join(url: str) -> None:
            if broken.pop("join", False):
                raise RuntimeError("the pool refused it")
            pool.add(url)

        async def leave(url: str) -> None:
            pool.discard(url)

        discovery = DnsDiscovery(
            DnsTarget(NAME, 8000),
            resolver_for(server.address, timeout_s=0.3),
            lambda: set(pool),
            join,
            leave,
            interval_s=0.05,
            listed=frozenset({"http://127.0.0.50:8000"}),
            failed=lambda: counted.append(1),
        )
        discovery.start()
        for rcode in (dns.rcode.YXDOMAIN, dns.rcode.REFUSED, dns.rcode.FORMERR):
            server.rcode = rcode
            before = discovery.failures
            # Awaited within the iteration, so the loop variable is the one meant.
            await eventually(lambda: discovery.failures >= before + 2)  # noqa: B023
        server.rcode = None
        server.set(NAME, "A", ["127.0.0.11"])  # the first join fails; the next succeeds
        await eventually(lambda: "http://127.0.0.11:8000" in pool)
        assert len(counted) == discovery.failures >= 7
        server.set(NAME, "A", [])  # NXDOMAIN: the discovered engine leaves, the listed stays
        await eventually(lambda: pool == {"http://127.0.0.50:8000"})
        await asyncio.sleep(0.2)
        assert pool == {"http://127.0.0.50:8000"}
        await discovery.close()

    with LoopbackDNS() as server:
        asyncio.run(go(server))


def test_close_ends_the_lookups_even_when_a_lookup_swallows_its_cancellation() -> None:
    """Python 3.11's ``asyncio.wait_for``, which dnspython awaits each answer with, returns
    the answer when a cancellation arrives with it: the loop must end anyway (a router
    stopping must not hang)."""

    class Swallowing:
        """No records, at once, but for its first lookup, which waits to be cancelled and
        then ends as if its answer had come."""

        lookups = 0

        async def resolve(self, *args: object, **kwargs: object) -> object:
            self.lookups += 1
            if self.lookups == 1:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(10)
            raise dns.resolver.NXDOMAIN

    async def go() -> None:
        resolver = Swallowing()
        discovery = DnsDiscovery(
            DnsTarget(NAME, 8000),
            resolver,  # type: ignore[arg-type]
            set,
            lambda url: asyncio.sleep(0),
            lambda url: asyncio.sleep(0),
            interval_s=0.01,
        )
        discovery.start()
        await eventually(lambda: resolver.lookups == 1)
        started = time.monotonic()
        await asyncio.wait_for(discovery.close(), 5)
        assert time.monotonic() - started < 2

    asyncio.run(go())
