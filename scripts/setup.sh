#!/usr/bin/env bash
# Install what building and testing DS4Server needs on Debian/Ubuntu:
# the C toolchain, clang with libFuzzer, civetweb (the HTTP server library),
# Chromium (the server's web-page test) and a Python venv (.venv) with the
# test oracles and API clients (tests/requirements.txt). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=
if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; fi
PKGS="build-essential clang libclang-rt-14-dev libcjson-dev zlib1g-dev libedit-dev libpcre2-dev libcivetweb-dev python3 python3-venv python3-pip binutils"
missing=
for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
    echo "setup: installing Debian packages:$missing"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    # libclang-rt-14-dev is Debian 12's name; other releases carry libclang-rt-dev.
    $SUDO apt-get install -y -qq $missing || $SUDO apt-get install -y -qq build-essential clang libclang-rt-dev libcjson-dev zlib1g-dev libedit-dev libpcre2-dev libcivetweb-dev python3 python3-venv python3-pip binutils
fi
# Chromium only loads the server's chat page in a test, which skips without it.
if ! command -v chromium >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium; } ||
        echo "setup: chromium is not available here; the web-page test will be skipped"
fi
make venv
echo "setup: done"
