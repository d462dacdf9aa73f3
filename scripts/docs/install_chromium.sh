#!/usr/bin/env bash
# Headless Chromium for the docs site's browser test (tests/test_docs_site.py), from
# Debian's packages. Idempotent: does nothing when chromium is already installed.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
command -v chromium >/dev/null
