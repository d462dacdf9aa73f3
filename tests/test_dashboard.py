"""The Grafana dashboard against a real Prometheus (Debian's package) scraping a live
``smetric serve`` with mock engines (one publishing KV events, one answering 500 to every
generation): every panel's every query must return data."""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
import time
from pathlib import Path

import aiohttp
import pytest

from smetric.testing.engines import http_get
from smetric.testing.fault_suite import SmetricProcess
from smetric.testing.faulty import FaultyEngine
from smetric.testing.ports import startup_events_ports
from smetric.testing.prometheus import prometheus_binary, run_prometheus

from conftest import events_engine

pytestmark = [pytest.mark.server, pytest.mark.subprocess]

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "smetric.json"


def need_prometheus() -> None:
    """Skip without Prometheus, unless CI requires it (then fail)."""
    if prometheus_binary() is None:
        message = "no prometheus binary (scripts/ci/install_prometheus.sh installs it)"
        if os.environ.get("SMETRIC_PROMETHEUS") == "required":
            pytest.fail(message)
        pytest.skip(message)


def queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], t["expr"]) for panel in dashboard["panels"] for t in panel["targets"]]


def test_the_dashboard_is_grafana_json_with_one_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    titles = [p["title"] for p in dashboard["panels"]]
    assert len(titles) == len(set(titles)) >= 10
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"]


class FaultyThread:
    """A faulty engine on its own event loop, so it answers while the test blocks."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.engine = FaultyEngine("http_500")
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self.engine.start(), self.loop).result(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.engine.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_every_panel_has_data_from_a_real_prometheus(tmp_path: Path) -> None:
    need_prometheus()
    events = SmetricProcess(
        tmp_path,
        args=(
            "engine",
            "--speed",
            "0.001",
            "--kv-events-endpoint",
            "tcp://*:*",
            "--kv-events-replay-endpoint",
            "tcp://127.0.0.1:*",
        ),
    )
    plain = SmetricProcess(tmp_path, args=("engine", "--speed", "0.001"))
    faulty = FaultyThread()
    router = SmetricProcess(tmp_path)
    try:
        for process in (events, plain):
            process.start()
        for process in (events, plain):
            process.wait_ready(90)
        ports = startup_events_ports(events.log_since_start())
        assert ports is not None, events.log_tail()
        config = tmp_path / "router.yaml"
        config.write_text(
            "engines:\n"
            + events_engine(events.port, *ports, "kv", bind="false")
            + f"  - {plain.url}\n  - {faulty.engine.url}\n"
        )
        router.args = (
            "serve",
            "--config",
            str(config),
            "--health-interval",
            "0.2",
            "--open-metrics",
            "--eject-backoff",
            "0.5",
        )
        router.start()
        router.wait_ready(90)
        with run_prometheus({"smetric-router": [f"127.0.0.1:{router.port}"]}, tmp_path) as prom:
            deadline = time.monotonic() + 60
            while prom.targets_up() < 1:
                assert time.monotonic() < deadline, "prometheus never scraped the router"
                time.sleep(0.5)
            stop = threading.Event()
            traffic = threading.Thread(target=lambda: asyncio.run(_traffic(router.url, stop)))
            traffic.start()
            try:
                missing = _until_every_query_has_data(prom, time.monotonic() + 90)
            finally:
                stop.set()
                traffic.join(30)
            assert not missing, missing
    finally:
        for process in (router, events, plain):
            process.stop()
        faulty.close()


def _until_every_query_has_data(prom, deadline: float) -> list[str]:
    missing: list[str] = []
    while time.monotonic() < deadline:
        missing = []
        for title, expr in queries():
            expr = expr.replace("$__rate_interval", "15s").replace("$job", ".*")
            result = prom.query(expr)
            numbers = [float(r["value"][1]) for r in result]
            if not any(math.isfinite(n) for n in numbers):
                missing.append(f"{title}: {expr} -> {result}")
        if not missing:
            return []
        time.sleep(1)
    return missing


async def _traffic(url: str, stop: threading.Event) -> None:
    """Sessions of a few turns, streaming and not, for at most 2 minutes."""
    system = {"role": "system", "content": "You are a coding agent. " * 30}
    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as client:
        session = 0
        while not stop.is_set() and time.monotonic() - started < 120:
            messages = [system, {"role": "user", "content": f"task {session} " * 40}]
            for turn in range(3):
                payload = {"model": "m", "messages": messages, "max_tokens": 4}
                if turn % 2:
                    payload |= {"stream": True, "stream_options": {"include_usage": True}}
                async with client.post(url + "/v1/chat/completions", json=payload) as response:
                    await response.read()
                messages = [
                    *messages,
                    {"role": "assistant", "content": f"step {turn} " * 8},
                    {"role": "user", "content": f"output {turn} " * 30},
                ]
            session += 1
            await asyncio.sleep(0.05)
    assert http_get(url + "/health")[0] == 200
