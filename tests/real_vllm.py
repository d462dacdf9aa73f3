"""Real vLLM engines for the end-to-end tests: find (or install) the CPU build, start and
stop instances on loopback with prefix caching and KV events on.

vLLM lives in a venv of its own (``scripts/real_engines/setup_vllm.sh``), because it pins
torch and transformers and weighs 3.4 GB; the tests only speak HTTP and ZMQ to it.
``SMETRIC_REAL_ENGINES`` says what to do when it is missing: unset, skip with a message;
``install``, run the setup script (cached per machine) and fail if that fails, as CI does;
``off``, always skip.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SETUP = REPO / "scripts" / "real_engines" / "setup_vllm.sh"
MODEL_NAME = "smollm2"
BLOCK_SIZE = 32  # vLLM's CPU attention backend needs a multiple of 32


@dataclass(frozen=True)
class VLLMInstall:
    python: Path
    model: Path


def _cache_root() -> Path:
    if "SMETRIC_ENGINES_DIR" in os.environ:
        return Path(os.environ["SMETRIC_ENGINES_DIR"])
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "smetric" / "engines"


def _installed() -> VLLMInstall | None:
    root = _cache_root()
    python, model = root / "vllm-venv" / "bin" / "python", root / "smollm2-135m-instruct"
    if (root / "vllm-venv" / ".installed").exists() and (model / ".converted").exists():
        return VLLMInstall(python, model)
    return None


def find_or_install_vllm() -> VLLMInstall:
    """The cached install; installs it first under ``SMETRIC_REAL_ENGINES=install``."""
    mode = os.environ.get("SMETRIC_REAL_ENGINES", "")
    if mode == "off":
        pytest.skip("real-engine tests are off (SMETRIC_REAL_ENGINES=off)")
    found = _installed()
    if found is None and mode == "install":
        done = subprocess.run([str(SETUP)], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            pytest.fail(f"{SETUP} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        found = _installed()
    if found is None:
        pytest.skip(
            "vLLM (CPU build) is not installed: run scripts/real_engines/setup_vllm.sh once "
            "(about 7 minutes, 3.4 GB, cached in ~/.cache/smetric/engines), or set "
            "SMETRIC_REAL_ENGINES=install"
        )
    return found


def get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, ""
    except (urllib.error.URLError, OSError):
        return 0, ""


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (Prometheus text)."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric_name, _, label_text = head.partition("{")
        if metric_name != name:
            continue
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            total, seen = total + float(value), True
    if not seen:
        raise AssertionError(f"{name}{labels} not in the metrics")
    return total


@dataclass
class VLLMServer:
    """One ``vllm.entrypoints.openai.api_server`` process group, pinned to one core.

    Its KV events go to ``tcp://127.0.0.1:events_port`` (vLLM connects, the router's
    subscriber binds) under ``topic``; its replay ROUTER binds ``replay_port``.
    """

    install: VLLMInstall
    port: int
    events_port: int
    replay_port: int
    topic: str
    core: int
    scratch: Path
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.scratch / f"vllm-{self.port}.log"

    def kv_events_yaml(self) -> str:
        return (
            f"    kv_events: {{endpoint: 'tcp://127.0.0.1:{self.events_port}', "
            f"topic: {self.topic}, replay_endpoint: 'tcp://127.0.0.1:{self.replay_port}'}}\n"
        )

    def start(self) -> None:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{self.events_port}",
            "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}",
            "topic": self.topic,
        }
        command = [
            str(self.install.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.install.model),
            "--served-model-name",
            MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",  # bf16 is 4x slower on AVX2
            "--enforce-eager",  # starts in about a minute instead of three
            "--block-size",
            str(BLOCK_SIZE),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--max-model-len",
            "2048",
            "--kv-events-config",
            json.dumps(events),
        ]
        tmp = self.scratch / f"tmp-{self.port}"
        tmp.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(self.core),
            "VLLM_CACHE_ROOT": str(self.scratch / "vllm-cache"),
            "TMPDIR": str(tmp),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        env.pop("VIRTUAL_ENV", None)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.scratch,
                start_new_session=True,  # its own process group: stop() reaps the workers
            )

    def wait_ready(self, timeout_s: float = 420.0) -> None:
        """Until ``/health`` answers 200; fails with the log's tail if the process dies."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise AssertionError(f"vLLM on {self.port} exited:\n{self.log_tail()}")
            if get(self.url + "/health", timeout=2.0)[0] == 200:
                return
            time.sleep(1.0)
        tail = self.log_tail()
        raise AssertionError(f"vLLM on {self.port} not healthy in {timeout_s} s:\n{tail}")

    def stop(self) -> None:
        if self.process is None:
            return
        process, self.process = self.process, None
        for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        # Workers of the group may outlive the API server for a moment.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def metrics(self) -> str:
        status, text = get(self.url + "/metrics")
        assert status == 200, f"{self.url}/metrics answered {status}"
        return text
