"""What a new user trying ``smetric serve`` met: health that lied about a disaggregated
cluster, ports in use and bad engine URLs, and ``/metrics`` that answered from one worker
of several."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from test_serve import FAST, conversation
from typer.testing import CliRunner

from smetric.cli import app
from smetric.engine import EngineConfig, create_app
from smetric.serve.app import Router, RouterSettings
from smetric.serve.config import engine_url, engines_from
from smetric.serve.disagg import Disaggregation
from smetric.serve.engines import Engine
from smetric.testing.engines import metric
from smetric.testing.fault_suite import SmetricProcess

from conftest import closed_port, router_client, run

pytestmark = [pytest.mark.server, pytest.mark.subprocess]


def test_health_says_503_when_a_role_has_no_healthy_engine() -> None:
    async def scenario() -> None:
        prefill = TestServer(create_app(EngineConfig(role="prefill", speed=0.0001)))
        await prefill.start_server()
        live, dead = f"http://127.0.0.1:{prefill.port}", f"http://127.0.0.1:{closed_port()}"
        router = Router(
            [Engine(live, 1000), Engine(dead, 1000)],
            RouterSettings(health_interval_s=0.05),
            disagg=Disaggregation(frozenset({live}), frozenset({dead})),
        )
        try:
            async with router_client(router.app(), True, 30) as (client, url):
                while router.engines[1].healthy:
                    await asyncio.sleep(0.02)
                async with client.get(url + "/health") as response:
                    assert response.status == 503
                    assert (await response.json())["roles"] == {"prefill": 1, "decode": 0}
        finally:
            await prefill.close()

    run(scenario)


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:99999", "http://127.0.0.1:0", "http://:8000", "ftp://h:1", "http://h:x"],
)
def test_engine_urls_are_checked_before_anything_starts(url: str) -> None:
    with pytest.raises(ValueError, match="engine"):
        engine_url(url)
    with pytest.raises(ValueError):
        engines_from((url,), 1000, 16)
    result = CliRunner().invoke(app, ["serve", "-e", url])
    assert result.exit_code != 0
    assert "engine" in result.output and "Traceback" not in result.output


def test_a_port_in_use_is_said_plainly_before_any_banner() -> None:
    """serve (one worker and two) and engine, each on a port another process listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = str(holder.getsockname()[1])
        command = [sys.executable, "-m", "smetric"]
        runs = [
            [*command, "serve", "-e", "http://127.0.0.1:1", "--port", port],
            [*command, "serve", "-e", "http://127.0.0.1:1", "--port", port, "--workers", "2"],
            [*command, "engine", "--port", port],
        ]
        processes = [
            subprocess.Popen(r, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in runs
        ]
        for process in processes:
            output, _ = process.communicate(timeout=120)
            assert process.returncode != 0, output
            assert "already in use" in output and port in output, output
            assert "Traceback" not in output, output
            assert "smetric serve:" not in output and "smetric engine (" not in output, output


def test_metrics_sum_over_workers_and_never_go_back(tmp_path) -> None:
    """Requests over new connections land on both workers; every scrape, whichever worker
    takes it, counts all of them."""

    async def scenario() -> None:
        engine = TestServer(create_app(FAST), host="127.0.0.1")
        await engine.start_server()
        args = ("serve", "-e", f"http://127.0.0.1:{engine.port}", "--workers", "2")
        router = SmetricProcess(tmp_path, args=(*args, "--log-level", "warning"))
        try:
            router.start()
            await asyncio.to_thread(router.wait_ready, 120.0)
            url = router.url
            payload = {"model": "m", "messages": conversation(0, 0), "max_tokens": 2}
            for _ in range(24):  # a new connection each: SO_REUSEPORT spreads them
                async with aiohttp.request(
                    "POST", url + "/v1/chat/completions", json=payload
                ) as response:
                    assert response.status == 200
            seen = []
            for _ in range(6):
                async with aiohttp.request("GET", url + "/metrics") as response:
                    text = await response.text()
                seen.append(metric(text, "smetric_request_seconds_count", api="chat"))
                decisions = metric(text, "smetric_routing_decisions_total")
                assert decisions == 24, text
            assert seen == [24] * 6
            assert metric(text, "smetric_engine_healthy") == 1
        finally:
            await asyncio.to_thread(router.stop)
            await engine.close()

    run(scenario)


def test_the_config_refuses_unknown_keys_and_sets_what_flags_set(tmp_path) -> None:
    from smetric.serve.config import ServeConfig, load_config, router_settings

    typo = tmp_path / "typo.yaml"
    typo.write_text("engine: [http://127.0.0.1:8100]\n")
    with pytest.raises(ValueError, match="unknown key 'engine'"):
        load_config(ServeConfig, typo)
    config = tmp_path / "router.yaml"
    config.write_text(
        "engines: [http://127.0.0.1:8100]\n"
        "router: {api_keys: [k1], stall_timeout_s: 3, stream_headers_timeout_s: 2.5, "
        "stall_prefill_tps: 400, policy: least_load, block_size: 32}\n"
    )
    settings = router_settings(load_config(ServeConfig, config).router)
    assert settings.api_keys == frozenset({"k1"}) and settings.block_size == 32
    assert (settings.stall_timeout_s, settings.stream_headers_timeout_s) == (3, 2.5)
    assert settings.stall_prefill_tps == 400
    config.write_text("router: {api_keys: k1}\n")
    with pytest.raises(ValueError, match="api_keys"):
        load_config(ServeConfig, config)
    config.write_text("router: {stall_timeout_s: soon}\n")
    with pytest.raises(ValueError, match="stall_timeout_s"):
        load_config(ServeConfig, config)
