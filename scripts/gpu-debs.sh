#!/usr/bin/env bash
# Download the Debian packages that the GPU machine lacks (it runs Ubuntu
# 24.04 without them) into .gpu-debs/, which is git-ignored and travels to the
# GPU machine with `carry: [".gpu-debs"]`; scripts/gpu-check.sh unpacks them.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu-debs
cd .gpu-debs
apt-get download libcjson1 libcjson-dev zlib1g zlib1g-dev libedit2 libedit-dev libbsd0 libmd0 libpcre2-dev libpcre2-8-0 libpcre2-16-0 libpcre2-32-0 libpcre2-posix3 libcivetweb1 libcivetweb-dev
ls -l
