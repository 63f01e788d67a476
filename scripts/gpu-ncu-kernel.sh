#!/usr/bin/env bash
# gpu-ncu-kernel.sh - every Nsight Compute section (--set full, with source
# counters) for the kernels of one decoded token whose name matches a regex,
# on the synthetic full-size q2 model. For a kernel's warp stall reasons and
# its hottest instructions, where the per-kernel time table of gpu-check's
# `kernels` stage says where to look.
#
#     run(command="KERNEL=hc_finish scripts/gpu-ncu-kernel.sh", carry=[".gpu-debs"])
#
# Environment: KERNEL (regex, required), COUNT (matching launches profiled,
# default 2), CTX (context of the decoded token, default 2048), JOBS (make
# parallelism, default 16), OUT (the report, details and source pages are
# written there when set). Builds build/cuda/ds4server first (make cuda).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
: "${KERNEL:?set KERNEL to a kernel name regex}"
COUNT=${COUNT:-2}
out=${OUT:-$(mktemp -d)}
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi
if [ -d .gpu-debs ] && [ ! -d /opt/gpu-debs/usr ]; then
    mkdir -p /opt/gpu-debs && for d in .gpu-debs/*.deb; do dpkg -x "$d" /opt/gpu-debs; done
fi
L=/opt/gpu-debs/usr/lib/x86_64-linux-gnu
if [ -d /opt/gpu-debs/usr ]; then export CFLAGS="-I/opt/gpu-debs/usr/include" LDFLAGS="-L$L -Wl,-rpath,$L"; fi
make -j"${JOBS:-16}" cuda >"$out/build.log" 2>&1 || { tail -n 30 "$out/build.log"; exit 1; }
ncu=$(command -v ncu 2>/dev/null || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | sort -V | tail -n1)
[ -n "$ncu" ] || { echo "ncu not installed"; exit 1; }
"$ncu" --profile-from-start off --set full --import-source yes --kernel-name "regex:$KERNEL" --launch-count "$COUNT" \
    -f -o "$out/kernel" build/cuda/ds4server bench --synthetic deepseek4-full-q2 --backend cuda --ctx "${CTX:-2048}" \
    --prefill 1 --gen 3 --repeat 1 --warmup 0 --ttft 0 --profile-token 2 >"$out/bench.log" 2>&1 ||
    { tail -n 20 "$out/bench.log"; exit 1; }
"$ncu" -i "$out/kernel.ncu-rep" --page details >"$out/details.txt" 2>&1
"$ncu" -i "$out/kernel.ncu-rep" --page source --csv --print-source sass >"$out/source.csv" 2>&1 || true
grep -E "^  [a-z_]|Duration|Warp Cycles Per Issued|Issued Warp|Achieved Occupancy|Theoretical Occupancy|Stall|Registers Per|Block Size|Grid Size|Memory Throughput|DRAM Throughput|Executed Instructions  " \
    "$out/details.txt" | head -n 120
# the instructions with the most warp stall samples (columns named as ncu names them)
python3 - "$out/source.csv" <<'EOF'
import csv, sys
try:
    rows = list(csv.reader(open(sys.argv[1])))
except OSError:
    sys.exit(0)
head = next((i for i, r in enumerate(rows) if any("Source" == c for c in r)), None)
if head is None:
    print("no source page"); sys.exit(0)
cols = rows[head]
def col(name):
    return next((i for i, c in enumerate(cols) if c.startswith(name)), None)
src, samp = col("Source"), col("Warp Stall Sampling (All")
if samp is None:
    print("columns:", cols[:12]); sys.exit(0)
body = [r for r in rows[head + 1:] if len(r) > max(src, samp)]
def num(v):
    try: return float(v.replace(",", ""))
    except ValueError: return 0.0
total = sum(num(r[samp]) for r in body) or 1.0
for r in sorted(body, key=lambda r: -num(r[samp]))[:40]:
    print(f"{100 * num(r[samp]) / total:5.1f}%  {r[src][:110]}")
EOF
