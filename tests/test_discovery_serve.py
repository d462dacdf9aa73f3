"""``smetric serve --discover`` and ``smetric pick --discover``: engines join and leave a
running router (and picker) as a real DNS server on loopback changes its records, and the
engines that stay keep their KV views."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest
from dns.rcode import YXDOMAIN

from smetric.testing.dns import LoopbackDNS
from smetric.testing.engines import http_get, metric
from smetric.testing.fault_suite import SmetricProcess
from smetric.testing.gateway import run_picker

pytestmark = pytest.mark.subprocess

NAME = "vllm-engines.llm.svc.cluster.local"


def conversation(session: int, turns: int) -> list[dict]:
    messages = [{"role": "user", "content": f"task {session}: " + "fix the bug " * 40}]
    for turn in range(turns):
        messages += [
            {"role": "assistant", "content": f"step {turn} " * 10},
            {"role": "tool", "content": f"output {turn} " * 40},
        ]
    return messages


async def chat(
    client: aiohttp.ClientSession, url: str, session: int, turns: int
) -> tuple[str, int]:
    payload = {"model": "m", "messages": conversation(session, turns), "max_tokens": 2}
    async with client.post(url + "/v1/chat/completions", json=payload) as response:
        assert response.status == 200, await response.text()
        return response.headers["x-smetric-engine"], int(
            response.headers["x-smetric-predicted-hit-tokens"]
        )


def engines_in(metrics: str) -> set[str]:
    """The engines a router's or picker's /metrics lists."""
    return {
        line.split('engine="')[1].split('"')[0]
        for line in metrics.splitlines()
        if line.startswith("smetric_engine_healthy{")
    }


def wait_until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def test_engines_join_and_leave_a_running_router(tmp_path: Path) -> None:
    a, b = "127.0.0.11", "127.0.0.12"
    engines = {
        address: SmetricProcess(tmp_path, args=("engine", "--host", address, "--speed", "0.001"))
        for address in (a, b)
    }
    # DNS names hosts, not ports: both engines listen on the port the OS gave the first.
    # Nothing else binds the second's address, and a wildcard bind of that port fails
    # while the first holds it, so the port stays free for the second.
    engines[a].start()
    try:
        engines[a].wait_listening()
    except BaseException:
        engines[a].stop()
        raise
    port = engines[b].port = engines[a].port
    urls = {address: f"http://{address}:{port}" for address in engines}
    with LoopbackDNS() as dns:
        dns.set(NAME, "A", [a])
        router = SmetricProcess(
            tmp_path,
            args=(
                "serve",
                "--discover",
                f"dns://{NAME}:{port}",
                "--dns-server",
                dns.address,
                "--discover-interval",
                "0.2",
                "--health-interval",
                "0.2",
                "--policy",
                "smetric",
            ),
        )
        try:
            engines[b].start()
            for address in engines:
                wait_until(lambda u=urls[address]: http_get(u + "/health")[0] == 200, 90)
            router.start()
            router.wait_ready(90)
            asyncio.run(_joins_and_leaves(router.url, dns, urls, a, b))
            # smetric pick discovers the same way.
            dns.set(NAME, "A", [a])
            discover = ["--discover", f"dns://{NAME}:{port}", "--dns-server", dns.address]
            with run_picker([*discover, "--discover-interval", "0.2"]) as picker:
                assert engines_in(picker.metrics()) == {urls[a]}
                dns.set(NAME, "A", [a, b])
                wait_until(lambda: engines_in(picker.metrics()) == {urls[a], urls[b]})
                dns.set(NAME, "A", [b])
                wait_until(lambda: engines_in(picker.metrics()) == {urls[b]})
        finally:
            router.stop()
            for engine in engines.values():
                engine.stop()


async def _joins_and_leaves(
    url: str, dns: LoopbackDNS, urls: dict[str, str], a: str, b: str
) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as client:
        where, _ = await chat(client, url, 0, 0)
        assert where == urls[a]  # the only engine
        dns.set(NAME, "A", [a, b])  # b's pod becomes ready
        deadline = time.monotonic() + 30
        seen = set()
        session = 1
        while urls[b] not in seen:  # first turns balance onto the newcomer
            assert time.monotonic() < deadline, "the new engine never got traffic"
            seen.add((await chat(client, url, session, 0))[0])
            session += 1
            await asyncio.sleep(0.1)
        # The engine that stayed kept its view: session 0's follow-up sticks to a, predicted.
        where, predicted = await chat(client, url, 0, 1)
        assert where == urls[a] and predicted > 0
        dns.set(NAME, "A", [b])  # a's pod goes away
        await asyncio.sleep(1.0)  # a few re-resolutions
        for session in range(100, 106):
            assert (await chat(client, url, session, 0))[0] == urls[b]
        async with client.get(url + "/metrics") as response:
            text = await response.text()
        assert f'engine="{urls[b]}"' in text


def test_listed_engines_stay_beside_discovered_ones_and_odd_answers_are_survived(
    tmp_path: Path,
) -> None:
    """``serve -e A --discover NAME``: A and what DNS lists serve together. A YXDOMAIN
    answer is counted and changes nothing; later changes are still seen; NXDOMAIN takes
    the discovered engine out, never A."""
    a, b = "127.0.0.21", "127.0.0.22"
    engines = {
        address: SmetricProcess(tmp_path, args=("engine", "--host", address, "--speed", "0.001"))
        for address in (a, b)
    }
    engines[a].start()
    try:
        engines[a].wait_listening()
    except BaseException:
        engines[a].stop()
        raise
    port = engines[b].port = engines[a].port
    urls = {address: f"http://{address}:{port}" for address in engines}
    with LoopbackDNS() as dns:
        dns.set(NAME, "A", [b])
        router = SmetricProcess(
            tmp_path,
            args=(
                *("serve", "-e", urls[a], "--discover", f"dns://{NAME}:{port}"),
                *("--dns-server", dns.address, "--discover-interval", "0.2"),
            ),
        )
        try:
            engines[b].start()
            for address in engines:
                wait_until(lambda u=urls[address]: http_get(u + "/health")[0] == 200, 90)
            router.start()
            router.wait_ready(90)
            assert engines_in(router.metrics()) == {urls[a], urls[b]}
            dns.rcode = YXDOMAIN
            wait_until(lambda: metric(router.metrics(), "smetric_discovery_errors_total") >= 3)
            assert engines_in(router.metrics()) == {urls[a], urls[b]}
            dns.rcode = None
            dns.set(NAME, "A", [])
            wait_until(lambda: engines_in(router.metrics()) == {urls[a]})
            dns.set(NAME, "A", [b])
            wait_until(lambda: engines_in(router.metrics()) == {urls[a], urls[b]})
            assert router.process is not None and router.process.poll() is None
        finally:
            router.stop()
            for engine in engines.values():
                engine.stop()
