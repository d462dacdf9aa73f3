"""Prove a real-engine install works before the setup script marks it done: start one
instance on loopback, ask for one short completion, stop it.

A build can link and still crash on its first forward pass (llama.cpp built with
``-march=native`` segfaults in its AMX kernels on some CPUs); without this check such a
build would be cached as good and fail later as a test error. Runs on a bare Python (the
project's venv may not exist yet): only the standard library and ``smetric.testing``.

    python smoke_check.py llama-cpp SERVER_BINARY MODEL.gguf
    python smoke_check.py vllm VENV_PYTHON MODEL_DIR
"""

from __future__ import annotations

import json
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from smetric.testing.engines import (
    MODEL_NAME,
    EngineProcess,
    LlamaCppInstall,
    LlamaCppServer,
    VLLMInstall,
    VLLMServer,
    start_engines,
)


def engine(kind: str, program: Path, model: Path, scratch: Path) -> EngineProcess:
    if kind == "llama-cpp":
        return LlamaCppServer(scratch, install=LlamaCppInstall(program, model), core=0)
    if kind == "vllm":
        return VLLMServer(scratch, install=VLLMInstall(program, model), topic="smoke", core=0)
    raise SystemExit(f"unknown engine kind {kind!r}: llama-cpp or vllm")


def complete(url: str) -> str:
    body = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 4}
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as reply:
        answer = json.load(reply)
    text = answer["choices"][0]["text"]
    if answer["usage"]["completion_tokens"] < 1:
        raise RuntimeError(f"no tokens generated: {answer}")
    return text


def main(kind: str, program: str, model: str) -> int:
    with tempfile.TemporaryDirectory(prefix="smetric-smoke-") as scratch:
        server = engine(kind, Path(program), Path(model), Path(scratch))
        try:
            start_engines([server])
            text = complete(server.url)
            if server.process is None or server.process.poll() is not None:
                raise RuntimeError("the engine exited after answering")
        except Exception as exc:  # any failure: report it with the engine's own log
            print(f"smoke check of {kind} failed: {exc}\n{server.log_tail()}", file=sys.stderr)
            return 1
        finally:
            server.stop()
    print(f"smoke check of {kind} passed: completion {text!r}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    raise SystemExit(main(*sys.argv[1:]))
