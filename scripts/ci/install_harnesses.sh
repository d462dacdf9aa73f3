#!/usr/bin/env bash
# The agent harnesses the harness tests (tests/test_harness_*.py) run through the router,
# at pinned versions, into one folder outside the repository (SMETRIC_HARNESSES_DIR,
# default /opt/smetric-harnesses; the tests find the binaries in its node_modules/.bin).
# Node and npm from Debian when missing. Idempotent: npm leaves a pinned version that is
# already installed alone.
set -euo pipefail
DIR="${SMETRIC_HARNESSES_DIR:-/opt/smetric-harnesses}"
if ! command -v npm >/dev/null 2>&1; then
    if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
        nodejs npm >/dev/null
fi
mkdir -p "$DIR"
npm install --prefix "$DIR" --save-exact --no-audit --no-fund @anthropic-ai/claude-code@2.1.332
npm install --prefix "$DIR" --save-exact --no-audit --no-fund opencode-ai@1.18.33
npm install --prefix "$DIR" --save-exact --no-audit --no-fund @openai/codex@0.171.0
"$DIR/node_modules/.bin/claude" --version
"$DIR/node_modules/.bin/opencode" --version
"$DIR/node_modules/.bin/codex" --version
