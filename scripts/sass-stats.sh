#!/usr/bin/env bash
# sass-stats.sh - registers, spills and SASS instruction counts of the CUDA
# kernels of one source file, compiled here for sm_90 (no GPU needed): the
# quick check of a kernel change before spending GPU time on it.
#
#     scripts/sass-stats.sh src/backends/cuda/cuda_matvec.cu [KERNEL_REGEX]
#
# Prints one line per kernel (mangled name, registers, spill bytes, stack
# bytes, SASS instructions, and the static size of each loop, the
# instructions between a backward branch and its target, smallest first: an
# upper bound of an iteration's cost, both sides of its branches counted);
# with KERNEL_REGEX only the matching kernels,
# and SASS=1 also writes each matching kernel's SASS to $OUT (default
# /tmp/sass-stats)/<name>.sass. cuobjdump comes from the CUDA toolkit when
# it is on PATH, else from PyPI's nvidia-cuda-cuobjdump wheel, unpacked once
# into .tools/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
src=${1:?usage: scripts/sass-stats.sh FILE.cu [KERNEL_REGEX]}
filter=${2:-.}
out=${OUT:-/tmp/sass-stats}
mkdir -p "$out"

# cuobjdump and the nvdisasm it runs: the toolkit's, else PyPI's wheels
cuobjdump=$(command -v cuobjdump || true)
if [ -z "$cuobjdump" ] || ! command -v nvdisasm >/dev/null; then
    if [ ! -x .tools/cuda/nvidia/cu13/bin/cuobjdump ] || [ ! -x .tools/cuda/nvidia/cu13/bin/nvdisasm ]; then
        echo "sass-stats: fetching cuobjdump and nvdisasm (PyPI nvidia-cuda-cuobjdump, -nvdisasm) into .tools/" >&2
        rm -rf .tools/wheels .tools/cuda
        mkdir -p .tools/wheels
        python3 -m pip download --no-deps -q nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm -d .tools/wheels
        for w in .tools/wheels/*.whl; do python3 -m zipfile -e "$w" .tools/cuda; done
        chmod +x .tools/cuda/nvidia/*/bin/*
    fi
    bin=$(dirname "$(find .tools/cuda -name cuobjdump -type f | head -n1)")
    export PATH="$PWD/$bin:$PATH"
    cuobjdump="$PWD/$bin/cuobjdump"
fi

cubin="$out/$(basename "$src" .cu).cubin"
if ! nvcc -std=c++17 -O3 -gencode arch=compute_90,code=sm_90 -Iinclude -Isrc -Xptxas -v -cubin -o "$cubin" "$src" \
    2>"$out/ptxas.log"; then
    grep -v "^ptxas info" "$out/ptxas.log" | head -n 40 >&2
    echo "sass-stats: $src does not compile" >&2
    exit 1
fi
"$cuobjdump" -sass "$cubin" >"$out/all.sass"

python3 - "$out/ptxas.log" "$out/all.sass" "$filter" "$out" "${SASS:-0}" <<'EOF'
import re, sys
ptxas, sass, filt, out, dump = sys.argv[1:6]
info, cur = {}, None
for line in open(ptxas):
    m = re.search(r"Compiling entry function '(\S+)'", line)
    if m:
        cur = m.group(1)
        info[cur] = {}
    elif cur:
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            info[cur].update(stack=int(m.group(1)), spill=int(m.group(2)) + int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            info[cur]["regs"] = int(m.group(1))
counts, body, name = {}, {}, None
for line in open(sass):
    m = re.search(r"Function : (\S+)", line)
    if m:
        name = m.group(1)
        counts[name], body[name] = 0, []
    elif name and re.match(r"\s+/\*[0-9a-f]{4,}\*/", line):
        counts[name] += 1
        body[name].append(line.rstrip())
def loops(lines):
    """(first, last, instructions) of each backward branch's range, smallest first."""
    addr = []
    for ln in lines:
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*)", ln)
        addr.append((int(m.group(1), 16), m.group(2)) if m else (None, ""))
    out = []
    for a, text in addr:
        m = re.search(r"\bBRA(?:\.\w+)*\s+(?:`?\(?\.?L?_?x?_?)?(0x[0-9a-f]+)", text)
        if a is None or not m:
            continue
        t = int(m.group(1), 16)
        if t <= a:
            out.append((t, a, sum(1 for b, _ in addr if b is not None and t <= b <= a)))
    return sorted(set(out), key=lambda x: x[2])
print(f"{'kernel':70} {'regs':>5} {'spill':>6} {'stack':>6} {'instr':>7}  loop sizes (smallest first)")
for k in sorted(counts):
    if not re.search(filt, k):
        continue
    i = info.get(k, {})
    lp = " ".join(str(n) for _, _, n in loops(body[k]) if n > 1)
    print(f"{k[:70]:70} {i.get('regs', '?'):>5} {i.get('spill', '?'):>6} {i.get('stack', '?'):>6} {counts[k]:>7}  {lp}")
    if dump == "1":
        with open(f"{out}/{k[:120]}.sass", "w") as f:
            f.write("\n".join(body[k]) + "\n")
EOF
