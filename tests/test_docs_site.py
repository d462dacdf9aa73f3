"""The documentation site, built and opened in a real browser.

``mkdocs build --strict`` catches broken links and missing pages; this checks that what it
builds renders: headless Chromium (Debian's package, installed by
``scripts/docs/install_chromium.sh``) opens the home page and a guide from the built site,
served on loopback, and the search index is there. Without Chromium the test skips,
unless ``SMETRIC_BROWSER=required`` (set by ``.ci/run``), where a missing browser fails.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
# Headless and quiet: no sandbox (CI runs as root), no GPU, and no traffic of its own
# (updates, sync, QUIC) beyond the loopback page it is given.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    return out


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def browser() -> str:
    if BROWSER is None:
        if os.environ.get("SMETRIC_BROWSER") == "required":
            pytest.fail("chromium is not installed: run scripts/docs/install_chromium.sh")
        pytest.skip("chromium is not installed (scripts/docs/install_chromium.sh installs it)")
    return BROWSER


def chromium(browser: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    """One headless run with a fresh profile; ``--virtual-time-budget`` lets the page's
    scripts run before the DOM is dumped or the screenshot taken."""
    return subprocess.run(
        [browser, *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=5000", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_search_index_lists_every_page(site: Path) -> None:
    index = json.loads((site / "search" / "search_index.json").read_text())
    locations = {doc["location"] for doc in index["docs"]}
    for page in (
        "",
        "getting-started/",
        "guides/serve-vllm/",
        "reference/cli/",
        "reference/policies/",
    ):
        assert page in locations, sorted(locations)[:20]
    texts = " ".join(doc["text"] for doc in index["docs"])
    assert "smetric serve" in texts and "kv_events" in texts


def test_home_page_and_a_guide_render_in_chromium(
    served: str, browser: str, tmp_path: Path
) -> None:
    home = chromium(browser, tmp_path / "p1", "--dump-dom", f"{served}/")
    assert home.returncode == 0, home.stderr
    assert "<title>SMetric</title>" in home.stdout
    assert "SMetric is a request router" in home.stdout
    # Material's navigation and search widget were rendered into the page.
    assert 'class="md-nav' in home.stdout and "md-search" in home.stdout

    guide = chromium(browser, tmp_path / "p2", "--dump-dom", f"{served}/guides/serve-vllm/")
    assert guide.returncode == 0, guide.stderr
    assert "Serve in front of vLLM with KV events" in guide.stdout
    assert "--kv-events-config" in guide.stdout

    shot = tmp_path / "home.png"
    taken = chromium(
        browser, tmp_path / "p3", f"--screenshot={shot}", "--window-size=1280,900", f"{served}/"
    )
    assert taken.returncode == 0, taken.stderr
    png = shot.read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000
    if os.environ.get("SMETRIC_DOCS_SCREENSHOT"):
        shutil.copy(shot, os.environ["SMETRIC_DOCS_SCREENSHOT"])


def test_the_references_are_generated_from_the_code(site: Path) -> None:
    from smetric.cli.app import COMMANDS, command
    from smetric.core.policies.registry import POLICY_NAMES
    from smetric.serve.metrics import RouterMetrics

    cli = (site / "reference" / "cli" / "index.html").read_text()
    for name in COMMANDS:
        for sub in getattr(command(name), "commands", {None: None}):
            full = f"smetric {name}" + (f" {sub}" if sub else "")
            assert f'id="{full.replace(" ", "-")}"' in cli, full
    assert "--trace-format" in cli and "--format" in cli
    metrics = (site / "reference" / "metrics" / "index.html").read_text()
    for family in RouterMetrics("smetric", []).registry.collect():
        assert family.name in metrics, family.name
    policies = (site / "reference" / "policies" / "index.html").read_text()
    assert all(f"<code>{name}</code>" in policies for name in POLICY_NAMES)
    config = (site / "reference" / "configuration" / "index.html").read_text()
    assert "global_capacity" in config and "first_byte_timeout_s" in config
