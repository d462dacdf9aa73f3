"""What the router costs per request: one mock engine, hit directly and through the router.

    python benchmarks/router_overhead.py [--requests 2000] [--concurrency 32]

The engine runs with ``--speed 0`` (steps take no modelled time), so what is left is HTTP,
JSON, prompt parsing and prefix-cache work: the router's share shows as the gap between
the two columns. Both phases send the same prompts (about 2 kB each, ``max_tokens`` 8)
with the same concurrency from this process, after a short warm-up of each path, in one
run, so that the ratios compare like with like on the same machine state. Each phase
prefixes its prompts with its own tag, so neither phase finds the other's prompts cached.
Engine and router are subprocesses, killed on the way out whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import aiohttp
import numpy as np

from smetric.testing.ports import read_startup_port

LOCALHOST = "127.0.0.1"
PROMPT_BYTES = 2_000
WORDS = ("read", "file", "grep", "test", "patch", "build", "diff", "log", "run", "fix")


# --- Subprocesses (also used by router_vs_sglang.py) ---------------------------------------


class Processes:
    """Subprocesses started in their own process groups, so one kill takes their children."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, args: Sequence[str]) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            list(args),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def start_listening(self, args: Sequence[str]) -> tuple[str, subprocess.Popen[bytes]]:
        """A server told to bind port 0, and its URL, read from its startup line once it
        listens on the port the OS picked."""
        proc = subprocess.Popen(
            list(args), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True
        )
        self.procs.append(proc)
        assert proc.stdout is not None
        return f"http://{LOCALHOST}:{read_startup_port(proc.stdout, proc)}", proc

    def start_smetric(self, args: Sequence[str]) -> tuple[str, subprocess.Popen[bytes]]:
        """``python -m smetric ARGS --port 0`` (serve or engine) and its URL."""
        return self.start_listening([sys.executable, "-m", "smetric", *args, "--port", "0"])

    def stop(self) -> None:
        """SIGTERM, a grace period, then SIGKILL for whatever is still there."""
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for proc in self.procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()


@contextlib.contextmanager
def processes() -> Iterator[Processes]:
    """Kill every started subprocess on exit, on errors and on Ctrl-C or SIGTERM too."""
    procs = Processes()
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        yield procs
    finally:
        procs.stop()
        signal.signal(signal.SIGTERM, previous)


def start_engine(procs: Processes, speed: float, kv_blocks: int) -> str:
    url, _ = procs.start_smetric(["engine", "--speed", str(speed), "--kv-blocks", str(kv_blocks)])
    return url


def start_smetric_router(
    procs: Processes, engines: Sequence[str], policy: str, kv: int, workers: int = 1
) -> str:
    args = ["serve", "--policy", policy]
    args += ["--kv-blocks", str(kv), "--health-interval", "1", "--workers", str(workers)]
    for url in engines:
        args += ["-e", url]
    url, _ = procs.start_smetric(args)
    return url


async def wait_ready(urls: Sequence[str], path: str = "/health", timeout_s: float = 60.0) -> None:
    """Poll until every URL answers 200: subprocesses take a second or two to import."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as client:
        for url in urls:
            while True:
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with client.get(url + path, timeout=aiohttp.ClientTimeout(2)) as r:
                        if r.status == 200:
                            break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{url}{path} not ready after {timeout_s:.0f} s")
                await asyncio.sleep(0.2)


def quantile_ms(latencies: Sequence[float], q: float) -> float:
    return float(np.quantile(np.asarray(latencies), q)) * 1000 if latencies else float("nan")


# --- The load ------------------------------------------------------------------------------


@dataclass
class PhaseResult:
    name: str
    requests: int
    failed: int
    wall_s: float
    latencies: list[float]

    @property
    def rps(self) -> float:
        return self.requests / self.wall_s


def prompts(count: int, tag: str) -> list[dict]:
    """Distinct chat bodies of about PROMPT_BYTES each; the tag keeps phases apart."""
    bodies = []
    for i in range(count):
        words = " ".join(WORDS[(i * 7 + j * 3 + j // 10) % len(WORDS)] for j in range(400))
        text = f"{tag} request {i}: {words}"[:PROMPT_BYTES]
        bodies.append({"messages": [{"role": "user", "content": text}], "max_tokens": 8})
    return bodies


async def drive(url: str, bodies: Sequence[dict], concurrency: int, name: str) -> PhaseResult:
    """Closed loop: ``concurrency`` workers each send their next body when the last returns."""
    latencies: list[float] = []
    failed = 0
    queue = iter(bodies)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as client:

        async def worker() -> None:
            nonlocal failed
            for body in queue:
                start = time.perf_counter()
                try:
                    async with client.post(url + "/v1/chat/completions", json=body) as reply:
                        data = await reply.json()
                        ok = reply.status == 200 and "choices" in data
                except aiohttp.ClientError:
                    ok = False
                if ok:
                    latencies.append(time.perf_counter() - start)
                else:
                    failed += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return PhaseResult(name, len(latencies), failed, wall, latencies)


def report(direct: PhaseResult, routed: PhaseResult, concurrency: int) -> None:
    rows = [
        ("requests/s", direct.rps, routed.rps),
        ("p50 latency ms", quantile_ms(direct.latencies, 0.5), quantile_ms(routed.latencies, 0.5)),
        (
            "p99 latency ms",
            quantile_ms(direct.latencies, 0.99),
            quantile_ms(routed.latencies, 0.99),
        ),
    ]
    print(
        f"\n{direct.requests + direct.failed} requests per phase, concurrency {concurrency}, "
        f"~{PROMPT_BYTES} B prompts, max_tokens 8; failed: direct {direct.failed}, "
        f"router {routed.failed}"
    )
    print(f"{'':<16}{'direct':>10}{'router':>10}{'router/direct':>15}")
    for label, a, b in rows:
        print(f"{label:<16}{a:>10.1f}{b:>10.1f}{b / a:>15.2f}")
    added = quantile_ms(routed.latencies, 0.5) - quantile_ms(direct.latencies, 0.5)
    print(f"added p50 latency: {added:.2f} ms per request")


async def run(requests: int, concurrency: int, warmup: int) -> None:
    with processes() as procs:
        engine = start_engine(procs, speed=0.0, kv_blocks=4096)
        router = start_smetric_router(procs, [engine], "smetric", kv=4096)
        await wait_ready([engine, router])
        await drive(engine, prompts(warmup, "warm-direct"), concurrency, "warm")
        await drive(router, prompts(warmup, "warm-router"), concurrency, "warm")
        direct = await drive(engine, prompts(requests, "direct"), concurrency, "direct")
        routed = await drive(router, prompts(requests, "router"), concurrency, "router")
    report(direct, routed, concurrency)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=200)
    args = parser.parse_args()
    t0 = time.perf_counter()
    asyncio.run(run(args.requests, args.concurrency, args.warmup))
    print(f"total time {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
