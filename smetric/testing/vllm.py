"""Real vLLM engines on this machine: find the CPU build, start and stop instances on
loopback with prefix caching and KV events on, read their metrics.

vLLM lives in a venv of its own (``scripts/real_engines/setup_vllm.sh``), because it pins
torch and transformers and weighs 3.4 GB; everything here only starts its processes and
speaks HTTP to them, so the project never imports vLLM.
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

from prometheus_client.parser import text_string_to_metric_families

SETUP_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "real_engines" / "setup_vllm.sh"
MODEL_NAME = "smollm2"
BLOCK_SIZE = 32  # vLLM's CPU attention backend needs a multiple of 32


@dataclass(frozen=True)
class VLLMInstall:
    python: Path
    model: Path


def cache_root() -> Path:
    """Where the setup script installs: ``$SMETRIC_ENGINES_DIR`` or the user's cache."""
    if "SMETRIC_ENGINES_DIR" in os.environ:
        return Path(os.environ["SMETRIC_ENGINES_DIR"])
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "smetric" / "engines"


def find_install() -> VLLMInstall | None:
    """The finished install, or None (each step leaves a stamp file when it completes)."""
    root = cache_root()
    venv, model = root / "vllm-venv", root / "smollm2-135m-instruct"
    if (venv / ".installed").exists() and (model / ".converted").exists():
        return VLLMInstall(venv / "bin" / "python", model)
    return None


def install() -> VLLMInstall:
    """Run the setup script (minutes the first time, instant after); raises on failure."""
    done = subprocess.run([str(SETUP_SCRIPT)], capture_output=True, text=True, check=False)
    found = find_install()
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"{SETUP_SCRIPT} failed:\n{done.stderr[-3000:]}")
    return found


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """(status, body); status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, ""
    except (urllib.error.URLError, OSError):
        return 0, ""


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` (as exposed, ``_total`` included) whose labels
    include ``labels``, from Prometheus text; AssertionError when there is none."""
    values = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    ]
    if not values:
        raise AssertionError(f"{name}{labels} not in the metrics")
    return sum(values)


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

    def engines_yaml_entry(self) -> str:
        """This engine in ``smetric serve --config``, on its KV-event view."""
        return (
            f"  - url: {self.url}\n"
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
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: 23,296 tokens of this model
            "VLLM_CPU_OMP_THREADS_BIND": str(self.core),
            "VLLM_CACHE_ROOT": str(self.scratch / "vllm-cache"),
            "TMPDIR": str(tmp),  # it writes IPC sockets and caches there
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
        """Until ``/health`` answers 200; raises with the log's tail if the process dies."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"vLLM on {self.port} exited:\n{self.log_tail()}")
            if http_get(self.url + "/health", timeout=2.0)[0] == 200:
                return
            time.sleep(1.0)
        tail = self.log_tail()
        raise RuntimeError(f"vLLM on {self.port} not healthy in {timeout_s} s:\n{tail}")

    def stop(self) -> None:
        """SIGTERM to the whole process group, SIGKILL to what is left after 30 s."""
        if self.process is None:
            return
        process, self.process = self.process, None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(30.0)
        # The engine core and workers of the group may outlive the API server.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10.0)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def metrics(self) -> str:
        status, text = http_get(self.url + "/metrics")
        if status != 200:
            raise RuntimeError(f"{self.url}/metrics answered {status}")
        return text
