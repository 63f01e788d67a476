#!/usr/bin/env bash
# Artifact audit: every shared library a built binary needs must be a system
# library or be listed in docs/licenses.md; static third-party components that
# a binary contains must be listed too. Usage: scripts/audit.sh BINARY...
set -euo pipefail
cd "$(dirname "$0")/.."
INVENTORY=docs/licenses.md
# The C runtime and toolchain libraries every Linux program links.
SYSTEM='^(linux-vdso\.so\.1|ld-linux-x86-64\.so\.2|ld-linux-aarch64\.so\.1|libc\.so\.6|libm\.so\.6|libpthread\.so\.0|libdl\.so\.2|librt\.so\.1|libgcc_s\.so\.1)$'

# Sonames the inventory lists: backquoted words ending in .so or .so.N in its tables.
listed=$(grep -oE '`lib[A-Za-z0-9_+.-]+\.so(\.[0-9]+)*`' "$INVENTORY" | tr -d '`' | sort -u)

status=0
for bin in "$@"; do
    if [ ! -e "$bin" ]; then echo "audit: $bin: missing (build it first)"; status=1; continue; fi
    needed=$(readelf -d "$bin" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
    for lib in $needed; do
        if [[ $lib =~ $SYSTEM ]]; then continue; fi
        if ! grep -qxF "$lib" <<<"$listed"; then
            echo "audit: $bin needs $lib, which $INVENTORY does not list"
            status=1
        fi
    done
    # Every dependency must resolve on this machine.
    if ldd "$bin" 2>&1 | grep -q 'not found'; then
        echo "audit: $bin has unresolved libraries:"; ldd "$bin" | grep 'not found'
        status=1
    fi
    # Static components: the CUDA runtime is linked statically into CUDA builds.
    if nm -D --defined-only "$bin" 2>/dev/null | grep -q ' cudaGetDeviceCount$' \
       || nm --defined-only "$bin" 2>/dev/null | grep -q ' cudaGetDeviceCount$'; then
        grep -q 'cudart_static' "$INVENTORY" || { echo "audit: $bin contains the static CUDA runtime, which $INVENTORY does not list"; status=1; }
    fi
    echo "audit: $bin: needs ${needed//$'\n'/ }"
done
if [ $status -eq 0 ]; then echo "audit: ok"; fi
exit $status
