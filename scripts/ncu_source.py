#!/usr/bin/env python3
"""ncu_source.py - summarise Nsight Compute's per-instruction counters of a kernel.

Usage: ncu_source.py SOURCE.csv [--top N]

SOURCE.csv is `ncu -i REPORT --page source --csv --print-source sass` of a
report with the source counters (`--set full`; scripts/gpu-check.sh's
OPS_DETAIL writes one per kernel as ncu-source-ops-N.csv): a "Kernel Name"
line, then one row per SASS instruction with its executed count, stall
samples and memory counters. Prints, in Markdown, the warp instructions
executed in all, a table of the opcodes (the first word of the SASS, without
its modifiers except for loads, stores and shuffles, where the width says
what a wavefront carries) by executed instructions with their share of the
stall samples, of the shared-memory wavefronts and of the L1 global
requests, and the stall reasons by share of all samples: what bounds a
kernel (instruction issue, the shared-memory pipe, a dependency) without
reading the whole listing.
"""
import collections
import csv
import sys

EXECUTED = "Instructions Executed"
SAMPLES = "Warp Stall Sampling (All Samples)"
SHARED_WF = "L1 Wavefronts Shared"
GLOBAL_REQ = "L1 Tag Requests Global"
KEEP_WIDTH = ("LDS", "STS", "LDG", "STG", "LDGSTS", "SHFL", "LD", "ST", "ATOMS", "RED")


def number(cell):
    try:
        return float(cell.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(source):
    words = source.split()
    if words and words[0].startswith("@"):  # a predicate
        words = words[1:]
    if not words:
        return None
    op = words[0]
    return op if op.split(".")[0] in KEEP_WIDTH else op.split(".")[0]


def load(path):
    """(kernel name, header, rows) of an ncu source-page CSV."""
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    kernel = next((r[1] for r in rows if len(r) > 1 and r[0] == "Kernel Name"), None)
    for h, row in enumerate(rows):
        if "Source" in row and EXECUTED in row:
            break
    else:
        raise SystemExit(f"ncu_source: {path}: no 'Source' / '{EXECUTED}' header")
    return kernel, rows[h], rows[h + 1:]


def summarise(path, top):
    kernel, header, body = load(path)
    col = {name: i for i, name in enumerate(header)}
    stall_cols = [n for n in header if n.startswith("stall_") and "Not Issued" not in n]
    by_op = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    stalls = collections.Counter()
    skipped = 0
    for r in body:
        if len(r) < len(header):
            skipped += 1
            continue
        op = opcode(r[col["Source"]])
        if op is None:
            skipped += 1
            continue
        acc = by_op[op]
        acc[0] += number(r[col[EXECUTED]])
        for k, name in ((1, SAMPLES), (2, SHARED_WF), (3, GLOBAL_REQ)):
            if name in col:
                acc[k] += number(r[col[name]])
        for s in stall_cols:
            stalls[s] += number(r[col[s]])
    total = [sum(v[k] for v in by_op.values()) for k in range(4)]
    out = [f"kernel: `{kernel or '?'}`", "",
           f"{total[0]:,.0f} warp instructions executed, {total[1]:,.0f} stall samples, "
           f"{total[2]:,.0f} shared-memory wavefronts, {total[3]:,.0f} L1 global requests"
           + (f" ({skipped} rows without an instruction left out)" if skipped else ""), "",
           "| opcode | executed | share | stall samples | shared wavefronts | L1 global requests |",
           "|---|---:|---:|---:|---:|---:|"]

    def share(v, t):
        return f"{100 * v / t:.1f}%" if t else "-"

    for op, v in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]:
        out.append(f"| `{op}` | {v[0]:,.0f} | {share(v[0], total[0])} | {share(v[1], total[1])} | "
                   f"{v[2]:,.0f} | {v[3]:,.0f} |")
    all_stalls = sum(stalls.values())
    if all_stalls:
        out += ["", "| stall reason | share of samples |", "|---|---:|"]
        for s, v in stalls.most_common():
            if v:
                out.append(f"| {s[len('stall_'):]} | {share(v, all_stalls)} |")
    return "\n".join(out) + "\n"


def main(argv):
    args = list(argv[1:])
    top = 25
    if "--top" in args:
        i = args.index("--top")
        try:
            top = int(args[i + 1])
        except (IndexError, ValueError):
            raise SystemExit("ncu_source: --top takes a number of opcodes")
        del args[i:i + 2]
    if len(args) != 1:
        raise SystemExit("usage: ncu_source.py SOURCE.csv [--top N]")
    sys.stdout.write(summarise(args[0], top))


if __name__ == "__main__":
    main(sys.argv)
