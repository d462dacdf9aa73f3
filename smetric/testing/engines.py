"""Real engines on this machine, for tests and benchmarks: find (or install) vLLM's CPU
build and llama.cpp's server, start and stop instances on loopback, read their metrics.

Both are installed by scripts in ``scripts/real_engines/``, outside the project's venv:
vLLM pins torch and transformers and weighs 3.4 GB, llama.cpp is a binary built from
source. Everything here only starts their processes and speaks HTTP to them, so the
project never imports either.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from smetric.testing.ports import ADDRESS_IN_USE, port_for_external

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts" / "real_engines"
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


# Stamp files the setup scripts leave once an install has served a completion; a build or
# install that never passed that smoke check is not taken for a finished one.
VERIFIED = ".verified"


def find_vllm() -> VLLMInstall | None:
    """The finished, smoke-checked install, or None."""
    root = cache_root()
    venv, model = root / "vllm-venv", root / "smollm2-135m-instruct"
    if (venv / VERIFIED).exists() and (model / ".converted").exists():
        return VLLMInstall(venv / "bin" / "python", model)
    return None


@dataclass(frozen=True)
class LlamaCppInstall:
    server: Path
    model: Path


def find_llama_cpp() -> LlamaCppInstall | None:
    """The finished, smoke-checked build, or None."""
    folder = cache_root() / "llama-cpp"
    server, model = folder / "llama-server", folder / "smollm2.gguf"
    if (folder / VERIFIED).exists() and server.exists() and model.exists():
        return LlamaCppInstall(server, model)
    return None


def run_setup(script: str) -> None:
    """Run one of the setup scripts (minutes the first time, instant after); raises on
    failure with the end of what it printed."""
    done = subprocess.run([str(SCRIPTS / script)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{SCRIPTS / script} failed:\n{done.stderr[-3000:]}")


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
    # Imported here so that the setup scripts' smoke check runs this module on a bare
    # Python, before the project's venv exists.
    from prometheus_client.parser import text_string_to_metric_families

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
class EngineProcess:
    """An engine server started as its own process group, logging to ``scratch``.

    ``port`` is 0 until ``start_engines`` picks the ports (``choose_ports``) and starts it.
    """

    scratch: Path
    port: int = 0
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False, kw_only=True)
    _log: Path | None = field(default=None, init=False, repr=False)
    _log_start: int = field(default=0, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        """One file for every start of this process, named once."""
        if self._log is None:
            self.scratch.mkdir(parents=True, exist_ok=True)
            handle, name = tempfile.mkstemp(
                prefix=f"{type(self).__name__}-", suffix=".log", dir=self.scratch
            )
            os.close(handle)
            self._log = Path(name)
        return self._log

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        return dict(os.environ)

    def choose_ports(self) -> None:
        """Pick the ports the program binds."""
        self.port = port_for_external()

    def start(self) -> None:
        """Start on the ports chosen (a restart: the same ones, where clients look)."""
        self.scratch.mkdir(parents=True, exist_ok=True)
        self._log_start = self.log_path.stat().st_size
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                cwd=self.scratch,
                start_new_session=True,  # its own process group: stop() reaps the workers
            )

    def wait_ready(self, timeout_s: float = 420.0) -> None:
        """Until ``/health`` answers 200; raises with the log's tail if the process dies."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"{self.url} exited:\n{self.log_tail()}")
            if http_get(self.url + "/health", timeout=2.0)[0] == 200:
                return
            time.sleep(0.5)
        raise RuntimeError(f"{self.url} not healthy in {timeout_s} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM to the whole process group, SIGKILL to what is left after 30 s."""
        if self.process is None:
            return
        process, self.process = self.process, None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(30.0)
        # Child processes of the group (vLLM's engine core and workers) may outlive it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10.0)

    def log_since_start(self) -> str:
        """What the process wrote since its latest start."""
        with self.log_path.open("rb") as log:
            log.seek(self._log_start)
            return log.read().decode(errors="replace")

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


def start_engines(
    engines: Sequence[EngineProcess], timeout_s: float = 420.0, tries: int = 3
) -> None:
    """Start ``engines`` on freshly chosen ports, all at once (they load their models side
    by side), and wait for each; one that fails because another process took a port
    between choosing and binding starts again on new ones."""
    for engine in engines:
        engine.choose_ports()
        engine.start()
    for engine in engines:
        for attempt in range(tries):
            try:
                engine.wait_ready(timeout_s)
                break
            except RuntimeError:
                taken = ADDRESS_IN_USE.search(engine.log_since_start())
                engine.stop()
                if taken is None or attempt == tries - 1:
                    raise
                engine.choose_ports()
                engine.start()


@dataclass(kw_only=True)
class VLLMServer(EngineProcess):
    """One ``vllm.entrypoints.openai.api_server``, pinned to one core, prefix caching on.

    It publishes its KV events under ``topic`` on ``tcp://*:events_port`` and answers
    replays on ``replay_port``, binding both itself (routers connect): then every port it
    uses is one it binds, and a port taken before it started is seen, and chosen again,
    before any router is configured with it.
    """

    install: VLLMInstall
    topic: str
    core: int
    events_port: int = 0
    replay_port: int = 0
    # vLLM's ``--kv-transfer-config``, for one side of a disaggregated pair.
    kv_transfer: dict[str, object] | None = None

    def engines_yaml_entry(self) -> str:
        """This engine in ``smetric serve --config``, on its KV-event view."""
        return (
            f"  - url: {self.url}\n"
            f"    kv_events: {{endpoint: 'tcp://127.0.0.1:{self.events_port}', "
            f"topic: {self.topic}, replay_endpoint: 'tcp://127.0.0.1:{self.replay_port}', "
            "bind: false}\n"
        )

    def choose_ports(self) -> None:
        # vLLM binds ``--port`` 0 but logs 0, and its publisher binds no wildcard port but
        # ``tcp://*:0`` on the node's IP, which it logs nowhere: all three are picked here.
        self.port, self.events_port, self.replay_port = (port_for_external() for _ in range(3))

    def command(self) -> list[str]:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events_port}",
            "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}",
            "topic": self.topic,
        }
        return [
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
            *(["--kv-transfer-config", json.dumps(self.kv_transfer)] if self.kv_transfer else []),
        ]

    def environment(self) -> dict[str, str]:
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
        return env


def vllm_pd_pair(install: VLLMInstall, scratch: Path) -> list[VLLMServer]:
    """A prefill and a decode vLLM instance sharing a KV store under ``scratch``.

    The CPU build has no NIXL or Mooncake package, but vLLM's ``ExampleConnector`` runs on
    it: the prefill side (``kv_producer``) writes each prompt's KV, layer by layer, to
    safetensors files keyed by the prompt's tokens, and the decode side (``kv_consumer``)
    finds them there and injects them into its paged KV cache. It returns no
    ``kv_transfer_params``, so the router sends the decode the plain request.
    """
    storage = scratch / "kv-store"
    storage.mkdir(parents=True, exist_ok=True)
    pair = vllm_instances(install, scratch)
    for engine, role in zip(pair, ("kv_producer", "kv_consumer"), strict=True):
        engine.kv_transfer = {
            "kv_connector": "ExampleConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(storage)},
        }
    return pair


@dataclass(kw_only=True)
class LlamaCppServer(EngineProcess):
    """One ``llama-server`` on one core, with ``slots`` parallel sequences whose KV it keeps
    between requests (its prefix cache) and its Prometheus ``/metrics``.

    Its port is picked for it (``choose_ports``), and picked again if taken: only some
    releases of llama-server bind port 0 and print the port they got, and the build here
    is whichever one llama-cpp-python vendors.
    """

    install: LlamaCppInstall
    core: int
    slots: int = 4

    def command(self) -> list[str]:
        return [
            "taskset",
            "-c",
            str(self.core),
            str(self.install.server),
            "--model",
            str(self.install.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--threads",
            "1",
            "--parallel",
            str(self.slots),
            "--ctx-size",
            str(2048 * self.slots),  # shared by the slots: 2,048 tokens each
            "--metrics",
            "--alias",
            MODEL_NAME,
        ]


def vllm_instances(install: VLLMInstall, scratch: Path, count: int = 2) -> list[VLLMServer]:
    """``count`` vLLM instances (ports chosen when ``start_engines`` starts them), each on a
    core of its own while there are cores, each publishing KV events under its own topic."""
    cores = os.cpu_count() or 1
    return [
        VLLMServer(scratch, install=install, topic=f"kv-{i}", core=i % cores) for i in range(count)
    ]


def llama_cpp_instances(
    install: LlamaCppInstall, scratch: Path, count: int = 2
) -> list[LlamaCppServer]:
    cores = os.cpu_count() or 1
    return [LlamaCppServer(scratch, install=install, core=i % cores) for i in range(count)]
