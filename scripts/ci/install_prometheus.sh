#!/usr/bin/env bash
# Debian's prometheus, for the dashboard test (tests/test_dashboard.py); nothing if present.
set -euo pipefail
if command -v prometheus >/dev/null; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
    SUDO=sudo
fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus
prometheus --version | head -1
