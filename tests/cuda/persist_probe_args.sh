#!/usr/bin/env bash
# persist_probe's option errors (host code, checked before it looks for a
# device, so this runs without a GPU): each bad command line exits 2 with a
# message naming the problem.
#     tests/cuda/persist_probe_args.sh build/cuda/tools/persist_probe
set -u
probe=${1:?usage: persist_probe_args.sh PATH_TO_persist_probe}
passes=0 fails=0
expect() { # expect MESSAGE_REGEX ARGS...
    local want=$1 out rc
    shift
    out=$("$probe" "$@" 2>&1 >/dev/null)
    rc=$?
    if [ $rc -eq 2 ] && grep -Eq -e "$want" <<<"$out"; then
        echo "ok   persist_probe $*"
        passes=$((passes + 1))
    else
        echo "FAIL persist_probe $*: exit $rc, '$out' (want 2 and /$want/)"
        fails=$((fails + 1))
    fi
}
expect "unknown option --nope" --nope 1
expect "--bps needs a value" --bps
expect "--bps 1\.\.8" --bps 9
expect "--bps 1\.\.8" --bps abc
expect "--pool-mib >= 64" --pool-mib 10
expect "--reps, --barriers and --ahead-mib >= 1" --reps 0
expect "--reps, --barriers and --ahead-mib >= 1" --ahead-mib 0
expect "bad --sizes-kib list '1024,x'" --sizes-kib 1024,x
expect "bad --sizes-kib list '1024,'" --sizes-kib 1024,
expect "bad --lat-ns list '-5'" --lat-ns -5
expect "empty --lat-ns list" --lat-ns ""
echo "persist_probe_args: $passes passed, $fails failed"
[ $fails -eq 0 ]
