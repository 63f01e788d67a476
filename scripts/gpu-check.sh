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
#   UNIT_TIMEOUT    seconds per CUDA test binary of the unit stage (default 360: the
#                   whole of test_cuda_matmul takes about 170; a hang then costs less device time)
#   CPU_TESTS=0     skip `make test-c` in the build stage (CI runs the CPU tests; saves device time)
#   CPU_BUILD=0     skip the CPU build and (unless CPU_TESTS=1) its tests: only build/cuda
#   UNIT_ONLY       "[VAR=V,...:]BIN[:FILTER] ..." runs only those CUDA tests in the unit stage
#                   (e.g. "test_cuda_matmul:test_moe DS4_CUDA_GRAPH=0:test_cuda_session"), no second runs
#   STAGES          comma-separated stages to run (default build,unit,parity,sanitize):
#                     build     make clean, CPU and CUDA builds, CPU unit tests
#                     unit      the CUDA unit test binaries
#                     parity    `ds4server parity` cpu vs cuda on the tiny synthetic models
#                               (every quant scheme, both numerics, greedy 32) and on the
#                               oracle models of tests/oracle (reference numerics); with OUT
#                               the JSON reports go to $OUT/parity.tar.gz; PARITY_FULL_LAYERS=N adds
#                               the full-size q2 layout's first N layers (real shapes: the tensor-core
#                               prefill attention), 24 prompt tokens, DS4 numerics
#                     sanitize  compute-sanitizer memcheck/racecheck/initcheck on the CUDA tests
#                               (SAN_ONLY="BIN:FILTER ...", e.g. "test_cuda_matmul:test_moe_mma": only
#                               the tests of BIN whose names contain FILTER)
#                     full      full-size q2 model in /dev/shm: synth (timed), parity of the first
#                               2 layers cpu vs cuda, 128 greedy tokens on CUDA (finite logits,
#                               peak device memory), layer parity on the generated tokens
#                     ops       `bench --ops`: each decode-shaped weight product of the full-size model
#                               on its own (JSON/Markdown to $OUT; OPS_ROWS, default 1,8), then once per
#                               variable of OPS_AB="VAR=0 ..." (e.g. DS4_CUDA_MV_RPW=0, DS4_CUDA_PDL=0;
#                               "A=0,B=1" sets two at once);
#                               OPS_ARGS adds options (e.g. "--only attn --rotate-mib 0": weights in L2;
#                               "--only indexer_scores,top_k --keys 4096,16384": the decoded row's selection
#                               at 16K and 64K contexts, seconds instead of a 64K prefill per A/B round),
#                               OPS_AB_ARGS options of the OPS_AB runs only (e.g. "--only experts");
#                               OPS_DETAIL="[VAR=V,...:]REGEX ..." ncu's full report of one launch of each
#                               matching kernel (demangled name) in `bench --ops --only OPS_DETAIL_ONLY
#                               (default experts) --rows OPS_DETAIL_ROWS (default 32)` with those settings,
#                               and its per-instruction (SASS) counters as CSV (ncu-source-ops-N.csv),
#                               summed by opcode with the stall reasons (scripts/ncu_source.py, .md)
#                     perf      full-size q2: bench (JSON/Markdown to $OUT; BENCH_CTX, BENCH_PREFILL,
#                               BENCH_GEN, BENCH_REPEAT, BENCH_TTFT, BENCH_BATCH e.g. 1,8,32 for batched
#                               decode), PERF_AB="VAR=0 ..." adds an A/B run per variable against
#                               the defaults (bench --compare; "numerics=ds4-f16": bench --ab; AB_REPEAT rounds, default 4, of decode
#                               at context AB_CTX, default 256, and prefill of AB_PREFILL, default 128; e.g. DS4_CUDA_GRAPH=0,
#                               DS4_CUDA_MATVEC=0, DS4_CUDA_GEMM=0), and an nsys per-kernel table;
#                               BENCH_SYNTHETIC=1 benches `--synthetic deepseek4-full-q2` (weights made on the
#                               device in about a second) instead of writing and loading the file, with
#                               BENCH_LAYERS=N only its first N layers (an H100's 80 GB: N <= about 38;
#                               also for the kernels and timeline stages)
#                     kernels   ncu (Nsight Compute) times each kernel of one decoded token of the
#                               synthetic full-size q2 model at context KERN_CTX (default 2048), table
#                               by kernel to $OUT/ncu-token.md (scripts/ncu_table.py); KERN_PREFILL=N also
#                               times each kernel of one N-token prefill (to $OUT/ncu-prefill.md);
#                               KERN_CTX=0 skips the decoded token; KERN_LAYERS=FIRST,COUNT times only those
#                               layers of the prefill (bench --profile-layers); KERN_AB="VAR=1 ..." adds a
#                               prefill table per variable (ncu-prefill-VAR.md); KERN_DETAIL="REGEX,..."
#                               writes ncu's full report (--set full: occupancy, stall reasons, memory
#                               charts) of the first launch of each kernel matching a REGEX in that
#                               prefill to $OUT/ncu-detail-REGEX.txt; KERN_TOKEN_DETAIL="REGEX,..." the
#                               same for kernels of the decoded token ($OUT/ncu-detail-token-REGEX.txt;
#                               matched against demangled names, which spell template arguments with their
#                               types: 'mv_kernel<.unsigned int.16' is IQ2_XXS, and since commas separate the
#                               patterns, 'mv_kernel<.unsigned int.8. .int.1. .bool.1. .int.0>' the one-row
#                               Q8_0 products that quantise their own x)
#                     timeline  the kernels of decoded tokens as the GPU ran them (graph replays, no
#                               serialisation): scripts/cupti_trace.c, built here against the machine's
#                               CUPTI, records every kernel's start and end during `bench --synthetic
#                               deepseek4-full-q2 --ctx TL_CTX (default 2048) --gen TL_GEN (default 16)`;
#                               scripts/timeline.py sums the last 8 tokens to $OUT/timeline.md (spans,
#                               gaps, each kernel's time at the head of the chain, one layer in order);
#                               TL_AB="VAR=V ..." once more per setting (timeline-VAR.md)
#                     probe     build/cuda/tools/persist_probe (scripts/persist_probe.cu): grid barrier
#                               costs and chained weight reads of decode sizes as separate launches,
#                               programmatic launches and one persistent kernel, with and without L2
#                               prefetch (docs/persistent-decode.md); Markdown to $OUT/persist-probe.md;
#                               PROBE_ARGS adds options (e.g. "--bps 4 --lat-ns 0,2000,8000")
#   SHM             where the model files go (default /dev/shm/ds4-gpu-check)
#   PACK_OUT=0      keep the files under $OUT loose (by default everything but summary.txt is
#                   packed into $OUT/results.tar.gz when the script ends: the device tool brings
#                   back few files, and none of them past its count). A run killed at the device
#                   tool's limit leaves them loose and loses them; run long ones under
#                   `timeout 560 scripts/gpu-check.sh ...`: on its SIGTERM the script packs and exits 124
#   DS4_BENCH_COMMIT  the commit bench records; by default the contents of .ds4-commit when
#                   present (the GPU machine's copy of the tree may carry older git metadata
#                   than the files it runs: before a run, `git rev-parse --short HEAD > .ds4-commit`
#                   here and carry it, with `carry: [".gpu-debs", ".ds4-commit"]`)
# Exit status: 0 when every step passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

JOBS=${JOBS:-16}
STEP_TIMEOUT=${STEP_TIMEOUT:-600}
UNIT_TIMEOUT=${UNIT_TIMEOUT:-360}
ALLOW_SKIP=${ALLOW_SKIP:-0}
STAGES=${STAGES:-build,unit,parity,sanitize}
SHM=${SHM:-/dev/shm/ds4-gpu-check}
has_stage() { case ",$STAGES," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
# BENCH_LAYERS=N: the synthetic full-size model of the perf, kernels and timeline stages has only
# its first N layers (the real shapes on a card too small for all 43)
SYNTH_LAYERS=()
if [ -n "${BENCH_LAYERS:-}" ]; then SYNTH_LAYERS=(--layers "$BENCH_LAYERS"); fi
export DS4_TEST_SEED=${DS4_TEST_SEED:-$(date +%s)}
if [ -z "${DS4_BENCH_COMMIT:-}" ] && [ -s .ds4-commit ]; then
    DS4_BENCH_COMMIT=$(head -c 64 .ds4-commit | tr -cd '0-9a-f')
    export DS4_BENCH_COMMIT
fi
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
fi

ROWS=()
FAILED=0
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

record() { # record NAME RESULT (also appended to $OUT/summary.txt at once, so a run cut short keeps its rows)
    ROWS+=("$(printf '%-52s %s' "$1" "$2")")
    if [ -n "${OUT:-}" ]; then printf '%-52s %s (at %ds)\n' "$1" "$2" "$SECONDS" >>"$OUT/summary.txt"; fi
    case "$2" in PASS* | SKIP*) ;; *) FAILED=1 ;; esac
}

section() { printf '\n==== %s ==== (%ds)\n' "$*" "$SECONDS"; }

# envs_of "A=0,B=1": the array envs=(A=0 B=1) (for env "${envs[@]}").
envs_of() { IFS=, read -r -a envs <<<"$1"; }

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

# parity_step NAME ARGS...: `ds4server parity` cpu vs cuda, JSON under $OUT.
parity_step() {
    local name=$1
    shift
    section "parity $name: $*"
    local json="${OUT:-$TMP}/parity-$name.json"
    timeout "$STEP_TIMEOUT" build/cuda/ds4server parity --backends cpu,cuda --json "$json" "$@"
    local rc=$?
    if [ $rc -eq 0 ]; then record "parity $name" PASS; else record "parity $name" "FAIL (exit $rc)"; fi
}

parity_stage() {
    mkdir -p "$SHM"
    local q num
    for q in f32 q8_0 q2 q4; do
        build/cuda/ds4server synth --arch deepseek4 --scale tiny --quant $q --seed 7 --out "$SHM/tiny-$q.gguf" ||
            record "synth tiny $q" FAIL
        for num in reference ds4; do
            parity_step "tiny-$q-$num" -m "$SHM/tiny-$q.gguf" --numerics $num --n-tokens 80 --decode 4 --greedy 32
        done
    done
    local cfg py=${PYTHON:-python3}
    for cfg in tests/oracle/configs/*.json; do
        local name d toks
        name=$(basename "$cfg" .json)
        d="$SHM/oracle-$name"
        rm -rf "$d"
        if ! "$py" tests/oracle/gen_weights.py "$cfg" "$d" >/dev/null ||
            ! build/cuda/ds4server convert --from-hf "$d" --out "$d/m.gguf" --quant f32 >/dev/null; then
            record "oracle $name model" FAIL
            continue
        fi
        toks=$("$py" -c 'import json,sys; print(",".join(map(str, json.load(open(sys.argv[1])))))' "$d/tokens.json")
        parity_step "oracle-$name-reference" -m "$d/m.gguf" --numerics reference --tokens "$toks" --decode 4 --greedy 32
    done
    parity_step "oracle-aligned-ds4" -m "$SHM/oracle-aligned/m.gguf" --numerics ds4 --n-tokens 64 --greedy 32
    # PARITY_FULL_LAYERS=N: the full-size q2 layout's first N layers (synth --layers; about 1.9 GB a layer),
    # the whole model run (head and logits too) on the real shapes: 64 heads of 512 take the
    # tensor-core prefill attention, which the tiny and oracle models never reach
    if [ -n "${PARITY_FULL_LAYERS:-}" ]; then
        local fl="$SHM/full-q2-l${PARITY_FULL_LAYERS}.gguf"
        if build/cuda/ds4server synth --arch deepseek4 --scale full --quant q2 --seed 7 --layers "$PARITY_FULL_LAYERS" \
            --out "$fl"; then
            parity_step "full-q2-l${PARITY_FULL_LAYERS}-ds4" -m "$fl" --numerics ds4 --n-tokens 24 --decode 2 --greedy 4
        else
            record "synth full q2, ${PARITY_FULL_LAYERS} layers" FAIL
        fi
        rm -f "$fl"
    fi
    # the 13 reports as one file in $OUT ($OUT comes back as a few files)
    if [ -n "${OUT:-}" ] && compgen -G "$OUT/parity-*.json" >/dev/null; then
        (cd "$OUT" && tar -czf parity.tar.gz parity-*.json && rm -f parity-*.json)
    fi
}

# The full-size q2 file in $SHM (generated once per machine); false if it cannot be made.
full_model() {
    mkdir -p "$SHM"
    local m="$SHM/full-q2.gguf" t0 t1
    [ -s "$m" ] && return 0
    section "synth --scale full --quant q2 -> $m"
    df -h /dev/shm
    t0=$(date +%s.%N)
    if build/cuda/ds4server synth --arch deepseek4 --scale full --quant q2 --seed 1 --out "$m"; then
        t1=$(date +%s.%N)
        ls -l "$m"
        echo "synth seconds: $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')"
        record "synth full q2" PASS
    else
        rm -f "$m"
        record "synth full q2" FAIL
        return 1
    fi
}

full_stage() {
    local m="$SHM/full-q2.gguf" t0 t1
    full_model || return
    parity_step "full-q2-2layers-ds4" -m "$m" --layers 2 --numerics ds4 --n-tokens 6 --decode 2
    parity_step "full-q2-2layers-reference" -m "$m" --layers 2 --numerics reference --n-tokens 4 --decode 1
    section "full q2 on CUDA: 16 prompt tokens + 128 greedy"
    local log="${OUT:-$TMP}/full-greedy.log" prompt="1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16"
    t0=$(date +%s.%N)
    timeout "$STEP_TIMEOUT" build/cuda/ds4server logits -m "$m" --backend cuda --tokens "$prompt" --greedy 128 \
        --out "$SHM/full-logits.bin" | tee "$log"
    local rc=${PIPESTATUS[0]}
    t1=$(date +%s.%N)
    echo "seconds (load + prefill + 128 tokens): $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')"
    rm -f "$SHM/full-logits.bin"
    if [ $rc -eq 0 ] && grep -q " 0 non-finite values" "$log"; then
        record "full q2 cuda greedy 128" PASS
        local gen
        gen=$(sed -n 's/^generated: //p' "$log" | cut -d, -f1-8)
        parity_step "full-q2-2layers-generated" -m "$m" --layers 2 --numerics ds4 --tokens "$prompt,$gen" --decode 8
    else
        record "full q2 cuda greedy 128" "FAIL (exit $rc or non-finite logits)"
    fi
}

# Speed of the full-size q2 model: `bench` (JSON + Markdown to $OUT), the
# same decode with the streaming matvec kernels off (DS4_CUDA_MATVEC=0), and
# a per-kernel GPU time table from Nsight Systems when it is installed.
perf_stage() {
    local m="$SHM/full-q2.gguf" out="${OUT:-$TMP}"
    local model=(-m "$m")
    if [ "${BENCH_SYNTHETIC:-0}" = 1 ]; then
        model=(--synthetic deepseek4-full-q2 "${SYNTH_LAYERS[@]}") # weights made on the device: no file to write or read
    else
        full_model || return
    fi
    section "bench full q2 (ctx ${BENCH_CTX:-2048}, prefill ${BENCH_PREFILL:-1,128})"
    if timeout "$STEP_TIMEOUT" build/cuda/ds4server bench "${model[@]}" --backend cuda --ctx "${BENCH_CTX:-2048}" \
        --prefill "${BENCH_PREFILL:-1,128}" --gen "${BENCH_GEN:-64}" --repeat "${BENCH_REPEAT:-3}" --warmup 1 \
        --ttft "${BENCH_TTFT:-512}" ${BENCH_BATCH:+--batch "$BENCH_BATCH"} --json "$out/bench.json" \
        --md "$out/bench.md"; then
        record "bench full q2" PASS
    else
        record "bench full q2" "FAIL (exit $?)"
    fi
    # each variable against the build as it is, alternated in one run
    # (bench --compare: rounds A B B A ..., one child run per sample)
    local v envs js ratio
    local b_args
    for v in ${PERF_AB:-}; do
        section "A/B: $v against the defaults"
        if [[ $v == numerics=* ]]; then # another numerics: bench's own --ab, in one process
            b_args=(--ab "$v")
        else
            envs_of "$v"
            b_args=(--compare "env $(printf '%q ' "${envs[@]}" "$PWD/build/cuda/ds4server")")
        fi
        js="$out/bench-${v//[^A-Za-z0-9_]/_}.json"
        if timeout "$STEP_TIMEOUT" build/cuda/ds4server bench "${model[@]}" --backend cuda \
            --ctx "${AB_CTX:-256}" --prefill "${AB_PREFILL:-128}" --gen 32 --repeat "${AB_REPEAT:-4}" --warmup 1 \
            "${b_args[@]}" --json "$js" \
            --md "$out/bench-${v//[^A-Za-z0-9_]/_}.md"; then
            ratio=$(python3 -c 'import json, sys
a = json.load(open(sys.argv[1]))["ab"]
def f(e):
    r = a[e]
    if r["skipped"]: return e + " skipped"
    ci = r["ci95"]
    return "%s B/A %.3f%s" % (e, r["ratio"], " [%.3f, %.3f]" % tuple(ci) if ci else "")
print(", ".join(f(e) for e in ("decode", "prefill")))' "$js" 2>/dev/null)
            record "bench full q2 ($v)" "PASS (${ratio:-no ratio})"
        else
            record "bench full q2 ($v)" "FAIL (exit $?)"
        fi
    done
    local nsys
    nsys=$(command -v nsys 2>/dev/null || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -n1)
    if [ -n "$nsys" ] && [ -s "$m" ]; then
        section "nsys: 4 prompt tokens + 32 greedy"
        if timeout "$STEP_TIMEOUT" "$nsys" profile -t cuda -o "$TMP/decode" --force-overwrite true \
            build/cuda/ds4server logits -m "$m" --backend cuda --tokens 1,2,3,4 --greedy 32 >/dev/null &&
            "$nsys" stats --report cuda_gpu_kern_sum --format csv --output "$out/kernels" "$TMP/decode.nsys-rep"; then
            head -n 40 "$out"/kernels*.csv
            record "nsys kernel table" PASS
        else
            record "nsys kernel table" "FAIL"
        fi
    elif [ -n "$nsys" ]; then
        record "nsys kernel table" "SKIP (no model file: BENCH_SYNTHETIC=1)"
    else
        record "nsys kernel table" "SKIP (nsys not installed)"
    fi
}

# One decoded token kernel by kernel, with Nsight Compute: every kernel of
# decoded token 2 at context KERN_CTX (default 2048) of the synthetic
# full-size q2 model, each timed on its own (no clock or cache control) with
# the bytes it moved to and from device memory, then summed by kernel
# (scripts/ncu_table.py; raw CSV and table to $OUT; with the perf stage's
# bench.json, each kernel's share of the measured bandwidth). With
# KERN_PREFILL=N (e.g. 128) also every kernel of one N-token prefill on a
# fresh state, to $OUT/ncu-prefill.md (KERN_LAYERS=FIRST,COUNT: only those
# layers; KERN_AB="VAR=1 ...": once more per setting; KERN_DETAIL: the full
# report of one launch per named kernel).
ncu_env=() # VAR=VALUE settings ncu_table runs its bench with
ncu_table() { # ncu_table NAME LABEL BENCH_ARGS...
    local name=$1 label=$2 out="${OUT:-$TMP}"
    shift 2
    section "ncu: $label"
    if env "${ncu_env[@]}" timeout "$STEP_TIMEOUT" "$ncu" --profile-from-start off --clock-control none --cache-control none \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum -f -o "$TMP/$name" \
        build/cuda/ds4server bench --synthetic deepseek4-full-q2 "${SYNTH_LAYERS[@]}" --backend cuda "$@" >"$TMP/ncu-$name.log" 2>&1 &&
        "$ncu" -i "$TMP/$name.ncu-rep" --csv --page raw >"$out/ncu-$name.csv" &&
        python3 scripts/ncu_table.py "$out/ncu-$name.csv" "${bw[@]}" >"$out/ncu-$name.md"; then
        head -n 45 "$out/ncu-$name.md"
        record "ncu kernel table ($label)" PASS
    else
        tail -n 20 "$TMP/ncu-$name.log"
        record "ncu kernel table ($label)" "FAIL"
    fi
}

find_ncu() { command -v ncu 2>/dev/null || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | sort -V | tail -n1; }

# The full ncu report of one launch of each kernel named in the comma-separated
# REGEXES (ncu-detail-NAME.txt; KERN_TOKEN_DETAIL's are named token-NAME).
ncu_details() { # ncu_details LABEL REGEXES BENCH_ARGS...
    local what=$1 out="${OUT:-$TMP}" k kn pre= base=function pats=()
    IFS=, read -ra pats <<<"$2"
    shift 2
    # the token's kernels by their demangled names (templates: "mv_kernel<.unsigned int.16"),
    # the prefill's by function name
    [ "$what" = token ] && pre=token- && base=demangled
    for k in "${pats[@]}"; do
        [ -n "$k" ] || continue
        section "ncu: details of $k ($what)"
        kn=$pre${k//[^A-Za-z0-9_]/_}
        if timeout "$STEP_TIMEOUT" "$ncu" --profile-from-start off --set full --kernel-name-base "$base" \
            -k "regex:$k" --launch-count 1 \
            -f -o "$TMP/detail-$kn" build/cuda/ds4server bench --synthetic deepseek4-full-q2 "${SYNTH_LAYERS[@]}" --backend cuda \
            "$@" >"$TMP/ncu-detail-$kn.log" 2>&1 &&
            "$ncu" -i "$TMP/detail-$kn.ncu-rep" --page details >"$out/ncu-detail-$kn.txt" 2>&1 &&
            [ -s "$out/ncu-detail-$kn.txt" ]; then
            grep -E "Duration|Throughput|Achieved Occupancy|Registers Per|Stall|Issue Slots Busy" \
                "$out/ncu-detail-$kn.txt" | head -n 20
            record "ncu details ($pre$k)" PASS
        else
            tail -n 20 "$TMP/ncu-detail-$kn.log"
            record "ncu details ($pre$k)" FAIL
        fi
    done
}

kernels_stage() {
    local out="${OUT:-$TMP}" ncu
    ncu=$(find_ncu)
    if [ -z "$ncu" ]; then
        record "ncu kernel table" "SKIP (ncu not installed)"
        return
    fi
    local bw=()
    if [ -s "$out/bench.json" ]; then # the copy bandwidth the perf stage measured: a roofline share per kernel
        bw=(--bandwidth "$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["bandwidth"]["gbps"])' \
            "$out/bench.json" 2>/dev/null)")
        [ "${bw[1]}" = "" ] && bw=()
    fi
    if [ "${KERN_CTX:-2048}" != 0 ]; then
        local targs=(--ctx "${KERN_CTX:-2048}" --prefill 1 --gen 3 --repeat 1 --warmup 0 --ttft 0 --profile-token 2)
        ncu_table token "decoded token 2 at context ${KERN_CTX:-2048}" "${targs[@]}"
        ncu_details "token" "${KERN_TOKEN_DETAIL:-}" "${targs[@]}"
    fi
    if [ -n "${KERN_PREFILL:-}" ]; then
        local pargs=(--ctx "$((KERN_PREFILL + 8))" --prefill "$KERN_PREFILL" --gen 1 --repeat 1 --warmup 1 --ttft 0
            --profile-prefill "$KERN_PREFILL" ${KERN_LAYERS:+--profile-layers "$KERN_LAYERS"}) v envs
        local what="prefill of ${KERN_PREFILL} tokens${KERN_LAYERS:+, layers $KERN_LAYERS (first,count)}"
        ncu_table prefill "$what" "${pargs[@]}"
        for v in ${KERN_AB:-}; do
            envs_of "$v"
            ncu_env=("${envs[@]}")
            ncu_table "prefill-${v//[^A-Za-z0-9_]/_}" "$what, $v" "${pargs[@]}"
            ncu_env=()
        done
        ncu_details "$what" "${KERN_DETAIL:-}" "${pargs[@]}"
    fi
}

# Each weight product on its own: `bench --ops` (no model file needed).
# The decoded tokens' kernel timeline (CUPTI activity records, see the
# timeline stage above): the library is built against the CUPTI that the
# machine has (the toolkit's, else the nvidia-cuda-cupti wheel's), its
# kernel record struct the newest that compiles.
find_cupti() {
    local d
    for d in /usr/local/cuda/extras/CUPTI "$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))' 2>/dev/null)" \
        "$(python3 -c 'import nvidia.cuda_cupti as c, os; print(list(c.__path__)[0])' 2>/dev/null)"; do
        [ -n "$d" ] && [ -f "$d/include/cupti_activity.h" ] && ls "$d"/lib*/libcupti.so* >/dev/null 2>&1 && { echo "$d"; return; }
    done
}
timeline_stage() {
    local out="${OUT:-$TMP}" cupti lib k so="$TMP/cupti_trace.so" v envs
    cupti=$(find_cupti)
    if [ -z "$cupti" ]; then
        record "kernel timeline" "SKIP (no CUPTI headers and library)"
        return
    fi
    lib=$(dirname "$(ls "$cupti"/lib*/libcupti.so* | head -n1)")
    for k in 13 12 11 10 9; do
        cc -O2 -shared -fPIC -o "$so" scripts/cupti_trace.c -DKREC=CUpti_ActivityKernel$k -I"$cupti/include" \
            -I/usr/local/cuda/include -L"$lib" -l:"$(basename "$(ls "$lib"/libcupti.so* | head -n1)")" \
            -Wl,-rpath,"$lib" 2>"$TMP/cupti-cc.log" && break
    done
    if [ ! -s "$so" ]; then
        tail -n 5 "$TMP/cupti-cc.log"
        record "kernel timeline" "FAIL (cupti_trace.c did not build against $cupti)"
        return
    fi
    local targs=(--ctx "${TL_CTX:-2048}" --prefill 1 --gen "${TL_GEN:-16}" --repeat 1 --ttft 0)
    for v in "" ${TL_AB:-}; do
        envs_of "$v"
        local tag=${v:+-${v//[^A-Za-z0-9_]/_}}
        section "kernel timeline${v:+ ($v)}"
        if env "${envs[@]}" CUDA_INJECTION64_PATH="$so" DS4_TRACE_OUT="$TMP/trace$tag.csv" timeout "$STEP_TIMEOUT" \
            build/cuda/ds4server bench --synthetic deepseek4-full-q2 "${SYNTH_LAYERS[@]}" --backend cuda "${targs[@]}" \
            >"$TMP/timeline$tag.log" 2>&1 &&
            python3 scripts/timeline.py "$TMP/trace$tag.csv" >"$out/timeline$tag.md"; then
            grep -h "cupti_trace" "$TMP/timeline$tag.log"
            head -n 12 "$out/timeline$tag.md"
            record "kernel timeline${v:+ ($v)}" PASS
        else
            tail -n 20 "$TMP/timeline$tag.log"
            record "kernel timeline${v:+ ($v)}" FAIL
        fi
    done
}

probe_stage() {
    local out="${OUT:-$TMP}"
    section "persist_probe ${PROBE_ARGS:-}"
    # shellcheck disable=SC2086
    if timeout "$STEP_TIMEOUT" build/cuda/tools/persist_probe ${PROBE_ARGS:-} >"$out/persist-probe.md" 2>"$TMP/probe.err"; then
        record "persist_probe" PASS
    else
        record "persist_probe" "FAIL (exit $?: $(tail -n1 "$TMP/probe.err" | cut -c1-80))"
    fi
    cat "$out/persist-probe.md" "$TMP/probe.err"
}

ops_stage() {
    local out="${OUT:-$TMP}" v envs
    section "bench --ops (rows ${OPS_ROWS:-1,8})"
    if timeout "$STEP_TIMEOUT" build/cuda/ds4server bench --ops --backend cuda --rows "${OPS_ROWS:-1,8}" \
        ${OPS_ARGS:-} --json "$out/ops.json" --md "$out/ops.md"; then
        record "bench --ops" PASS
    else
        record "bench --ops" "FAIL (exit $?)"
    fi
    for v in ${OPS_AB:-}; do
        section "bench --ops with $v"
        envs_of "$v"
        if env "${envs[@]}" timeout "$STEP_TIMEOUT" build/cuda/ds4server bench --ops --backend cuda --rows "${OPS_ROWS:-1,8}" \
            --repeat 3 ${OPS_ARGS:-} ${OPS_AB_ARGS:-} --json "$out/ops-${v//[^A-Za-z0-9_]/_}.json" --md "$out/ops-${v//[^A-Za-z0-9_]/_}.md"; then
            record "bench --ops ($v)" PASS
        else
            record "bench --ops ($v)" "FAIL (exit $?)"
        fi
    done
    # OPS_DETAIL="[VAR=V,...:]REGEX ...": ncu's full report of one launch of the
    # matching kernel (demangled names) in `bench --ops --only ${OPS_DETAIL_ONLY:-experts}
    # --rows ${OPS_DETAIL_ROWS:-32}`, with those settings (ncu-detail-ops-N.txt)
    local ncu e n=0 pat
    ncu=$(find_ncu)
    for e in ${OPS_DETAIL:-}; do
        n=$((n + 1))
        envs=()
        pat=$e
        if [[ $e == *=*:* ]]; then
            envs_of "${e%%:*}"
            pat=${e#*:}
        fi
        section "ncu: details of $pat in bench --ops (${envs[*]:-defaults})"
        if [ -z "$ncu" ]; then
            record "ncu details (ops $e)" "SKIP (ncu not installed)"
        elif env "${envs[@]}" timeout "$STEP_TIMEOUT" "$ncu" --set full --kernel-name-base demangled \
            -k "regex:$pat" --launch-skip 2 --launch-count 1 -f -o "$TMP/ops-detail-$n" build/cuda/ds4server bench \
            --ops --backend cuda --only "${OPS_DETAIL_ONLY:-experts}" --rows "${OPS_DETAIL_ROWS:-32}" --repeat 1 \
            --warmup 0 >"$TMP/ops-detail-$n.log" 2>&1 &&
            "$ncu" -i "$TMP/ops-detail-$n.ncu-rep" --page details >"$out/ncu-detail-ops-$n.txt" 2>&1 &&
            [ -s "$out/ncu-detail-ops-$n.txt" ]; then
            echo "$e" >>"$out/ncu-detail-ops-$n.txt"
            # per-instruction counters (SASS): wavefronts, sectors, stall samples
            "$ncu" -i "$TMP/ops-detail-$n.ncu-rep" --page source --csv --print-source sass \
                >"$out/ncu-source-ops-$n.csv" 2>&1 &&
                python3 scripts/ncu_source.py "$out/ncu-source-ops-$n.csv" >"$out/ncu-source-ops-$n.md" || true
            grep -E "Duration|Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy" \
                "$out/ncu-detail-ops-$n.txt" | head -n 12
            record "ncu details (ops $e)" PASS
        else
            tail -n 20 "$TMP/ops-detail-$n.log" 2>/dev/null
            record "ncu details (ops $e)" FAIL
        fi
    done
}

main() {
    section "gpu-check $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname)"
    echo "repo: $(pwd)"
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo none) $(git status --porcelain 2>/dev/null | wc -l | tr -d ' ') changed paths (bench records ${DS4_BENCH_COMMIT:-the same})"
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
        [ ! -e /usr/include/pcre2.h ] || [ ! -e /usr/include/editline/readline.h ] || [ ! -e /usr/include/civetweb.h ]; }; then
        section "unpacking .gpu-debs into /opt/gpu-debs"
        for f in .gpu-debs/*.deb; do dpkg -x "$f" /opt/gpu-debs; done
        local libdir=/opt/gpu-debs/usr/lib/x86_64-linux-gnu
        export CFLAGS="-I/opt/gpu-debs/usr/include" LDFLAGS="-L$libdir -Wl,-rpath,$libdir"
    fi
    if has_stage build; then
        run_step "make clean" make clean
        if [ "${CPU_BUILD:-1}" != 0 ]; then
            run_step "make -j$JOBS (CPU build)" make -j"$JOBS"
        else
            record "make -j$JOBS (CPU build)" "SKIP (CPU_BUILD=0)"
        fi
        if ! run_step "make -j$JOBS cuda" make -j"$JOBS" cuda; then
            section "the CUDA build failed: no CUDA tests to run"
        fi
        if [ "${CPU_TESTS:-${CPU_BUILD:-1}}" != 0 ]; then
            run_step "make test-c (CPU unit tests)" make -j"$JOBS" test-c
        else
            record "make test-c (CPU unit tests)" "SKIP (CPU_TESTS=0 or CPU_BUILD=0)"
        fi
    fi

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
    local bins_to_test=("${bins[@]}")

    local b log rc counts name envs variants=1
    has_stage unit || bins_to_test=()
    if has_stage unit && [ -n "${UNIT_ONLY:-}" ]; then # [VAR=V,...:]BIN[:FILTER] entries: those tests only, no second runs
        bins_to_test=()
        variants=0
        read -ra bins_to_test <<<"$UNIT_ONLY"
    fi
    # second runs: the session tests with every launch direct (no recorded
    # steps), without the grouped MoE and with head_norm_rope as the separate
    # ops' kernels, the attention tests with every top-k through the device-wide sort
    # and with the per-head kernel, the product tests with every activation
    # quantised by its own kernel ("A=0,B=0:binary" sets both)
    for b in "${bins_to_test[@]}" $(has_stage unit && [ $variants = 1 ] && [ -x build/cuda/tests/test_cuda_session ] &&
        echo "DS4_CUDA_GRAPH=0:build/cuda/tests/test_cuda_session DS4_IQ_BRANCH=0:build/cuda/tests/test_cuda_session DS4_CUDA_MOE_GROUPED=0:build/cuda/tests/test_cuda_session DS4_CUDA_NORM_ROPE=0:build/cuda/tests/test_cuda_session DS4_CUDA_GEMM_SPLIT=0:build/cuda/tests/test_cuda_matmul DS4_CUDA_TOPK_SORT=1:build/cuda/tests/test_cuda_attention DS4_CUDA_ATT_MQA=0:build/cuda/tests/test_cuda_attention DS4_CUDA_ATT_STAGE=0:build/cuda/tests/test_cuda_attention DS4_CUDA_MV_XQ=0,DS4_CUDA_MOE_XQ=0:build/cuda/tests/test_cuda_matmul"); do
        envs=()
        name=$b
        if [[ $b == *=*:* ]]; then
            envs_of "${b%%:*}"
            b=${b#*:}
        fi
        local filter=
        if [ $variants = 0 ]; then # UNIT_ONLY: BIN[:FILTER] under build/cuda/tests
            [[ $b == *:* ]] && filter=${b#*:}
            b=build/cuda/tests/${b%%:*}
        fi
        section "$name"
        log="$TMP/$(basename "$b")${filter:+.$filter}.log"
        env "${envs[@]}" timeout "$UNIT_TIMEOUT" "$b" $filter >"$log" 2>&1
        rc=$?
        cat "$log"
        counts=$(test_counts "$log")
        read -r p f s <<<"${counts:-? ? ?}"
        if [ $rc -eq 124 ]; then
            record "$name" "FAIL (timed out after ${UNIT_TIMEOUT}s, in the test after: $(grep -E '^(ok|FAIL|SKIP) ' "$log" | tail -n1 | cut -c1-60))"
        elif [ $rc -ne 0 ]; then
            record "$name" "FAIL (exit $rc; $p passed, $f failed, $s skipped)"
        elif [ "$s" != "0" ] && [ "$ALLOW_SKIP" != "1" ]; then
            record "$name" "FAIL ($s skipped on a GPU machine; $p passed)"
        elif [ -n "$filter" ] && [ "$p" = 0 ]; then
            record "$name" "FAIL (no test matched '$filter')"
        else
            record "$name" "PASS ($p passed, $f failed, $s skipped)"
        fi
    done

    if has_stage probe && [ -x build/cuda/tools/persist_probe ]; then probe_stage; fi
    if has_stage parity && [ -x build/cuda/ds4server ]; then parity_stage; fi
    if has_stage full && [ -x build/cuda/ds4server ]; then full_stage; fi
    if has_stage ops && [ -x build/cuda/ds4server ]; then ops_stage; fi
    if has_stage perf && [ -x build/cuda/ds4server ]; then perf_stage; fi
    if has_stage kernels && [ -x build/cuda/ds4server ]; then kernels_stage; fi
    if has_stage timeline && [ -x build/cuda/ds4server ]; then timeline_stage; fi

    if ! has_stage sanitize; then
        :
    elif [ -n "$san" ]; then
        # All sanitizer runs at once (they are CPU-bound; the GPU has room),
        # each with its own log, then reported in order.
        local tool pids=() runs=() targets=() tg
        if [ -n "${SAN_ONLY:-}" ]; then # BIN:FILTER entries: those tests of those binaries only
            for tg in $SAN_ONLY; do targets+=("build/cuda/tests/${tg%%:*}:${tg#*:}"); done
        else
            for b in "${bins[@]}"; do targets+=("$b:"); done
        fi
        section "compute-sanitizer memcheck/racecheck/initcheck on ${#targets[@]} test binaries, in parallel"
        for tg in "${targets[@]}"; do
            b=${tg%%:*}
            local filter=${tg#*:}
            for tool in memcheck racecheck initcheck; do
                # racecheck of whole-model runs takes far longer than the step
                # limit (its kernels are all covered by the per-op tests)
                if [ "$tool" = racecheck ] && [ "$(basename "$b")" = test_cuda_session ]; then continue; fi
                local extra=()
                [ "$tool" = memcheck ] && extra=(--leak-check full)
                log="$TMP/$(basename "$b")${filter:+.$filter}.$tool.log"
                (
                    timeout "$STEP_TIMEOUT" "$san" --tool "$tool" "${extra[@]}" --error-exitcode 86 "$b" $filter \
                        >"$log" 2>&1
                    echo $? >"$log.rc"
                ) &
                pids+=($!)
                runs+=("$tool $b${filter:+ $filter}")
            done
        done
        wait "${pids[@]}"
        local run
        for run in "${runs[@]}"; do
            tool=${run%% *}
            b=${run#* }
            filter=""
            case "$b" in *" "*) filter=${b#* }; b=${b%% *} ;; esac
            log="$TMP/$(basename "$b")${filter:+.$filter}.$tool.log"
            rc=$(cat "$log.rc" 2>/dev/null || echo 1)
            section "compute-sanitizer --tool $tool $b (exit $rc)"
            grep -E "ERROR SUMMARY|passed, .* failed|LEAK SUMMARY|Invalid|Race|Uninitialized" "$log" | head -n 20
            # a failing run's whole report comes back (the hazards' both sides, the stacks)
            if [ "$rc" -ne 0 ] && [ -n "${OUT:-}" ]; then cp "$log" "$OUT/" 2>/dev/null || true; fi
            if [ "$rc" -eq 0 ]; then
                record "$tool $b" PASS
            elif [ "$rc" -eq 86 ]; then
                record "$tool $b" "FAIL (sanitizer errors: $(grep -E '^========= ERROR SUMMARY' "$log" | tail -n1 | sed 's/^========= //'))"
            elif [ "$rc" -eq 124 ]; then
                record "$tool $b" "FAIL (timed out after ${STEP_TIMEOUT}s)"
            else
                record "$tool $b" "FAIL (exit $rc)"
            fi
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

# Everything under $OUT but summary.txt into $OUT/results.tar.gz (the
# device tool brings back only a few files; PACK_OUT=0 keeps them loose).
pack_out() {
    [ -n "${OUT:-}" ] && [ "${PACK_OUT:-1}" = 1 ] || return 0
    local tmp
    tmp=$(mktemp "${TMPDIR:-/tmp}/gpu-check-results.XXXXXX") || return 0
    if tar -czf "$tmp" -C "$OUT" --exclude=./summary.txt --exclude=./results.tar.gz . 2>/dev/null; then
        find "$OUT" -mindepth 1 -maxdepth 1 ! -name summary.txt ! -name results.tar.gz -exec rm -rf {} +
        mv "$tmp" "$OUT/results.tar.gz"
    else
        rm -f "$tmp"
    fi
}

if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    # a run stopped by `timeout` (which signals the whole process group) still packs what it made
    trap 'pack_out; exit 124' TERM INT
    main 2>&1 | tee "$OUT/gpu-check.log"
    rc=${PIPESTATUS[0]}
    trap '' TERM INT # (a signal now would pack twice, over a half-cleared $OUT)
    pack_out
    exit "$rc"
fi
main
