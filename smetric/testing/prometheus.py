"""A real Prometheus on loopback, for the dashboard test: Debian's ``prometheus`` binary
(``scripts/ci/install_prometheus.sh`` installs it), scraping given targets every second
into a scratch folder, asked over its HTTP API."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import yaml

from smetric.testing.ports import port_for_external


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> list[dict]:
        """An instant query's result vector (raises on a query Prometheus refuses)."""
        address = self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(address, timeout=10) as reply:
            answer = json.loads(reply.read())
        if answer.get("status") != "success":
            raise ValueError(f"{expr}: {answer}")
        return answer["data"]["result"]

    def targets_up(self) -> int:
        return sum(int(float(r["value"][1])) for r in self.query("up"))


@contextlib.contextmanager
def run_prometheus(targets: dict[str, list[str]], scratch: Path) -> Iterator[Prometheus]:
    """Prometheus scraping ``targets`` (job name to ``host:port`` list) every second, on a
    free loopback port (picked, and picked again if it was taken meanwhile)."""
    binary = prometheus_binary()
    if binary is None:
        raise RuntimeError("no prometheus binary: scripts/ci/install_prometheus.sh installs it")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": hosts}]}
            for job, hosts in targets.items()
        ],
    }
    (scratch / "prometheus.yml").write_text(yaml.safe_dump(config))
    # Picked here, not port 0: the port Prometheus got could only be read from its log,
    # whose wording differs between releases; a taken port makes it exit, and the loop
    # picks another.
    for _ in range(5):
        port = port_for_external()
        log = (scratch / "prometheus.log").open("wb")
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={scratch / 'prometheus.yml'}",
                f"--storage.tsdb.path={scratch / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            prometheus = Prometheus(f"http://127.0.0.1:{port}")
            if _wait_ready(prometheus, process, 30.0):
                yield prometheus
                return
        finally:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            log.close()
    raise RuntimeError(
        f"prometheus did not start: {(scratch / 'prometheus.log').read_text()[-2000:]}"
    )


def _wait_ready(prometheus: Prometheus, process: subprocess.Popen, timeout_s: float) -> bool:
    """True once it answers; False if it exited (its port was taken)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(prometheus.url + "/-/ready", timeout=2) as reply,
        ):
            if reply.status == 200:
                return True
        time.sleep(0.2)
    raise RuntimeError("prometheus did not become ready")
