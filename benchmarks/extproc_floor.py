"""What the exchange with Envoy costs a picker that decides nothing, on each Python gRPC
stack and with gRPC's transport options, for agent and tiny bodies.

    python benchmarks/extproc_floor.py [--rounds 3] [--requests 160] [--concurrency 8]
                                       [--latency-requests 40]

Each variant is ``null_picker.py`` (``ext_proc`` answered as ``smetric pick`` answers it,
nothing read, nothing decided) behind its own Envoy on the shipped configuration, in
front of two trivial engines, all started at once and measured round by round in a
rotating order. The picker cluster's one-a-second health check is left out of every
variant's configuration, since ``grpclib`` here answers no health service. Per variant
and body: requests a second at ``--concurrency`` (closed loop), the CPU the null picker
and Envoy spend per request there (from ``/proc``), and the median latency of
``--latency-requests`` requests sent one at a time, each median over rounds (min-max). The
``grpclib`` row runs where ``grpclib`` is installed (the ``dev`` extra has it).

What it answers: whether any stack or option available to a Python picker takes a body
through ``ext_proc`` for less than ``smetric serve`` spends on a whole request
(``picker_vs_serve.py`` measures that side by side).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import statistics
import sys
from collections.abc import Sequence
from urllib.parse import urlsplit

from picker_vs_serve import NULL_PICKER, TRIVIAL, bodies, cpu_seconds, drive, spread
from router_overhead import processes, quantile_ms, wait_ready

from smetric.testing.gateway import gateway_config, run_envoy

VARIANTS: dict[str, list[str]] = {
    "grpc.aio (as pick)": [],
    "grpc.aio, 4 MiB HTTP/2 frames": ["--option", "grpc.http2.max_frame_size=4194304"],
    "grpc.aio, 8 MiB window": ["--option", "grpc.http2.lookahead_bytes=8388608"],
    "grpc.aio, 8 MiB window, no BDP probe": [
        "--option",
        "grpc.http2.lookahead_bytes=8388608",
        "--option",
        "grpc.http2.bdp_probe=0",
    ],
    "grpc.aio, 1 MiB TCP reads": [
        "--option",
        "grpc.experimental.tcp_read_chunk_size=1048576",
        "--option",
        "grpc.experimental.tcp_min_read_chunk_size=1048576",
    ],
    "grpc threads": ["--stack", "threads"],
    "grpclib": ["--stack", "grpclib"],
}


def tiny_bodies(count: int) -> list[bytes]:
    return [
        json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 8}
        ).encode()
        for i in range(count)
    ]


def unchecked_config(picker_port: int, engines: list[str]) -> dict:
    """The shipped configuration, less the picker cluster's health check."""
    config = gateway_config(picker_port, engines)
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == "picker":
            cluster.pop("health_checks", None)
    return config


async def measure(
    rounds: int,
    concurrency: int,
    latency_requests: int,
    workloads: dict[str, list[bytes]],
    targets: dict[str, tuple[str, int, int]],
) -> dict[tuple[str, str], dict[str, list[float]]]:
    """Per (variant, body): rates and CPU ms per request of the picker and Envoy, and
    the median latency at concurrency 1 (``targets``: variant to its Envoy's URL, the
    picker's and Envoy's pids)."""
    names = list(targets)
    results: dict[tuple[str, str], dict[str, list[float]]] = {
        (name, body): {"rps": [], "picker": [], "envoy": [], "p50": []}
        for name in names
        for body in workloads
    }
    for name in names:  # warm every path's connections before measuring
        for payloads in workloads.values():
            await drive(targets[name][0], payloads[: 2 * concurrency], concurrency)
    for round_ in range(rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            url, picker_pid, envoy_pid = targets[name]
            for body, payloads in workloads.items():
                before = cpu_seconds([picker_pid]), cpu_seconds([envoy_pid])
                rps, _ = await drive(url, payloads, concurrency)
                after = cpu_seconds([picker_pid]), cpu_seconds([envoy_pid])
                row = results[(name, body)]
                row["rps"].append(rps)
                row["picker"].append((after[0] - before[0]) / len(payloads) * 1000)
                row["envoy"].append((after[1] - before[1]) / len(payloads) * 1000)
                _, latencies = await drive(url, payloads[:latency_requests], 1)
                row["p50"].append(quantile_ms(latencies, 0.5))
        print(f"round {round_ + 1}/{rounds} done", file=sys.stderr)
    return results


def report(
    args: argparse.Namespace,
    results: dict[tuple[str, str], dict[str, list[float]]],
    sizes: dict[str, float],
) -> None:
    print(
        f"\n{args.rounds} rounds; {args.requests} requests per phase at concurrency "
        f"{args.concurrency}; median over rounds (min-max)\n"
    )
    for body, size in sizes.items():
        print(f"{body} bodies ({size:,.0f} bytes on average)\n")
        print("| stack | requests/s | null picker CPU ms/req | Envoy CPU ms/req | p50 ms (c=1) |")
        print("|---|---|---|---|---|")
        for (name, kind), row in results.items():
            if kind == body:
                print(
                    f"| {name} | {spread(row['rps'], 0)} | {spread(row['picker'], 2)} "
                    f"| {spread(row['envoy'], 2)} | {spread(row['p50'], 2)} |"
                )
        print()


def variants() -> dict[str, list[str]]:
    if importlib.util.find_spec("grpclib") is None:
        print("grpclib is not installed: its row is left out", file=sys.stderr)
        return {name: flags for name, flags in VARIANTS.items() if "grpclib" not in flags}
    return VARIANTS


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--latency-requests", type=int, default=40)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--body-kb", type=int, default=400)
    args = parser.parse_args(argv)
    turns = max(1, args.requests // args.sessions)
    workloads = {
        "agent": bodies(args.sessions, turns, args.body_kb)[: args.requests],
        "tiny": tiny_bodies(args.requests),
    }
    sizes = {body: statistics.mean(map(len, payloads)) for body, payloads in workloads.items()}
    with processes() as procs:
        started = [procs.start_listening([sys.executable, str(TRIVIAL), "0"]) for _ in range(2)]
        engines = [url for url, _ in started]
        asyncio.run(wait_ready(engines))
        first = urlsplit(engines[0]).netloc
        targets: dict[str, tuple[str, int, int]] = {}
        with contextlib.ExitStack() as stack:
            for name, flags in variants().items():
                url, picker = procs.start_listening(
                    [sys.executable, str(NULL_PICKER), first, *flags]
                )
                envoy = stack.enter_context(
                    run_envoy(unchecked_config(urlsplit(url).port or 0, engines))
                )
                targets[name] = (envoy.url, picker.pid, envoy.process.pid)
            results = asyncio.run(
                measure(args.rounds, args.concurrency, args.latency_requests, workloads, targets)
            )
    report(args, results, sizes)


if __name__ == "__main__":
    main()
