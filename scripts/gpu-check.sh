#!/usr/bin/env bash
# gpu-check.sh - build and test the CUDA backend on a GPU machine.
#
# Run from a fresh copy of the working tree (it cleans first: objects built on
# another machine may not run here), with the .debs of scripts/gpu-debs.sh:
#     run(command="scripts/gpu-check.sh", carry=[".gpu-debs"])
# Steps: GPU/toolchain summary; make clean; make (CPU); make cuda; the CPU unit
# tests; build/cuda/ds4server version; every build/cuda/tests/* binary; then
# compute-sanitizer memcheck, racecheck and initcheck on each CUDA test binary
# (when compute-sanitizer is installed). A final table lists every step.
#
# Environment:
#   OUT             when set, the whole log is also written to $OUT/gpu-check.log
#   JOBS            make parallelism (default 16)
#   DS4_TEST_SEED   test seed (default: the clock; printed, so a run can be replayed)
#   ALLOW_SKIP=1    accept skipped CUDA tests (by default a skip is a failure:
#                   on a GPU machine it means the device was not usable)
#   STEP_TIMEOUT    seconds per test / sanitizer run (default 600)
# Exit status: 0 when every step passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

JOBS=${JOBS:-16}
STEP_TIMEOUT=${STEP_TIMEOUT:-600}
ALLOW_SKIP=${ALLOW_SKIP:-0}
export DS4_TEST_SEED=${DS4_TEST_SEED:-$(date +%s)}
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
fi

ROWS=()
FAILED=0
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

record() { # record NAME RESULT
    ROWS+=("$(printf '%-52s %s' "$1" "$2")")
    case "$2" in PASS* | SKIP*) ;; *) FAILED=1 ;; esac
}

section() { printf '\n==== %s ====\n' "$*"; }

# run_step NAME CMD...: run, show its output, record PASS or FAIL (rc).
run_step() {
    local name=$1
    shift
    section "$name: $*"
    "$@"
    local rc=$?
    if [ $rc -eq 0 ]; then record "$name" PASS; else record "$name" "FAIL (exit $rc)"; fi
    return $rc
}

# The "N passed, N failed, N skipped" line of a harness run, as "P F S".
test_counts() {
    sed -n 's/.*: \([0-9][0-9]*\) passed, \([0-9][0-9]*\) failed, \([0-9][0-9]*\) skipped.*/\1 \2 \3/p' "$1" | tail -n1
}

find_sanitizer() {
    local c
    for c in "$(command -v compute-sanitizer 2>/dev/null)" /usr/local/cuda/bin/compute-sanitizer \
        /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
        if [ -n "$c" ] && [ -x "$c" ]; then
            echo "$c"
            return 0
        fi
    done
    return 1
}

main() {
    section "gpu-check $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname)"
    echo "repo: $(pwd)"
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo none) $(git status --porcelain 2>/dev/null | wc -l | tr -d ' ') changed paths"
    echo "DS4_TEST_SEED=$DS4_TEST_SEED"

    section "GPU"
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=index,name,driver_version,memory.total,compute_cap,mig.mode.current,persistence_mode \
            --format=csv
        nvidia-smi
        record "nvidia-smi" PASS
    else
        echo "nvidia-smi not found"
        record "nvidia-smi" "FAIL (not found)"
    fi

    section "toolchain"
    uname -a
    # shellcheck disable=SC1091
    (. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME")
    ${CC:-cc} --version | head -n1
    if command -v nvcc >/dev/null 2>&1; then nvcc --version | tail -n2; else echo "nvcc not found"; fi
    local san=
    if san=$(find_sanitizer); then "$san" --version | tail -n1; else echo "compute-sanitizer not found"; fi

    # Libraries the GPU machine lacks arrive as .debs (scripts/gpu-debs.sh, carried
    # as .gpu-debs) and are unpacked beside the system, never over it.
    if [ -d .gpu-debs ] && { [ ! -e /usr/include/cjson/cJSON.h ] || [ ! -e /usr/include/zlib.h ] ||
        [ ! -e /usr/include/pcre2.h ] || [ ! -e /usr/include/editline/readline.h ]; }; then
        section "unpacking .gpu-debs into /opt/gpu-debs"
        for f in .gpu-debs/*.deb; do dpkg -x "$f" /opt/gpu-debs; done
        local libdir=/opt/gpu-debs/usr/lib/x86_64-linux-gnu
        export CFLAGS="-I/opt/gpu-debs/usr/include" LDFLAGS="-L$libdir -Wl,-rpath,$libdir"
    fi
    run_step "make clean" make clean
    run_step "make -j$JOBS (CPU build)" make -j"$JOBS"
    if ! run_step "make -j$JOBS cuda" make -j"$JOBS" cuda; then
        section "the CUDA build failed: no CUDA tests to run"
    fi
    run_step "make test-c (CPU unit tests)" make -j"$JOBS" test-c

    if [ -x build/cuda/ds4server ]; then
        section "build/cuda/ds4server version"
        local v
        v=$(build/cuda/ds4server version 2>&1)
        local rc=$?
        echo "$v"
        if [ $rc -eq 0 ] && grep -q "cuda" <<<"$v"; then
            record "build/cuda/ds4server version" PASS
        else
            record "build/cuda/ds4server version" "FAIL (exit $rc, cuda backend not listed?)"
        fi
    fi

    local bins=()
    if [ -d build/cuda/tests ]; then
        while IFS= read -r b; do bins+=("$b"); done < <(find build/cuda/tests -maxdepth 1 -type f -perm -u+x | sort)
    fi
    if [ ${#bins[@]} -eq 0 ]; then record "CUDA test binaries" "FAIL (none built)"; fi

    local b log rc counts
    for b in "${bins[@]}"; do
        section "$b"
        log="$TMP/$(basename "$b").log"
        timeout "$STEP_TIMEOUT" "$b" >"$log" 2>&1
        rc=$?
        cat "$log"
        counts=$(test_counts "$log")
        read -r p f s <<<"${counts:-? ? ?}"
        if [ $rc -ne 0 ]; then
            record "$b" "FAIL (exit $rc; $p passed, $f failed, $s skipped)"
        elif [ "$s" != "0" ] && [ "$ALLOW_SKIP" != "1" ]; then
            record "$b" "FAIL ($s skipped on a GPU machine; $p passed)"
        else
            record "$b" "PASS ($p passed, $f failed, $s skipped)"
        fi
    done

    if [ -n "$san" ]; then
        local tool
        for b in "${bins[@]}"; do
            for tool in memcheck racecheck initcheck; do
                local extra=()
                [ "$tool" = memcheck ] && extra=(--leak-check full)
                section "compute-sanitizer --tool $tool $b"
                log="$TMP/$(basename "$b").$tool.log"
                timeout "$STEP_TIMEOUT" "$san" --tool "$tool" "${extra[@]}" --error-exitcode 86 "$b" >"$log" 2>&1
                rc=$?
                cat "$log"
                if [ $rc -eq 0 ]; then
                    record "$tool $b" PASS
                elif [ $rc -eq 86 ]; then
                    record "$tool $b" "FAIL (sanitizer errors: $(grep -E '^========= ERROR SUMMARY' "$log" | tail -n1 | sed 's/^========= //'))"
                else
                    record "$tool $b" "FAIL (exit $rc)"
                fi
            done
        done
    else
        record "compute-sanitizer" "SKIP (not installed)"
    fi

    section "summary"
    printf '%-52s %s\n' "step" "result"
    printf '%-52s %s\n' "----" "------"
    printf '%s\n' "${ROWS[@]}"
    if [ $FAILED -ne 0 ]; then
        echo "gpu-check: FAILED"
        return 1
    fi
    echo "gpu-check: all passed"
    return 0
}

if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    main 2>&1 | tee "$OUT/gpu-check.log"
    exit "${PIPESTATUS[0]}"
fi
main
