#!/usr/bin/env python3
"""ncu_table.py - sum an Nsight Compute CSV export by kernel.

Usage: ncu_table.py RAW.csv [--top N]

RAW.csv is `ncu -i REPORT --csv --page raw` of a run that collected
gpu__time_duration.sum (scripts/gpu-check.sh, stage `kernels`): one row per
profiled kernel, a units row under the header. Prints a Markdown table of
the kernels by total time (launches, total us, us per launch, share) and
the sum of all kernels, each timed on its own (so launch gaps and overlap
between kernels are not in it).
"""
import csv
import sys

SCALE = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}


def load(path):
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    # ncu may print log lines before the CSV: the header is the first row naming both columns
    for h, row in enumerate(rows):
        if "Kernel Name" in row and "gpu__time_duration.sum" in row:
            break
    else:
        raise SystemExit(f"ncu_table: {path}: no 'Kernel Name' / 'gpu__time_duration.sum' header")
    header = rows[h]
    name_i, time_i = header.index("Kernel Name"), header.index("gpu__time_duration.sum")
    body = rows[h + 1:]
    scale = 1e-3  # ncu's default unit for durations is nanoseconds
    if body and len(body[0]) > time_i and body[0][time_i] in SCALE:  # the units row
        scale = SCALE[body[0][time_i]]
        body = body[1:]
    out, skipped = [], 0
    for r in body:
        try:
            out.append((r[name_i], float(r[time_i].replace(",", "")) * scale))
        except (IndexError, ValueError):  # a short row, or no figure (ncu writes n/a)
            skipped += 1
    return out, skipped


def main(argv):
    args = [a for a in argv[1:]]
    top = 40
    if "--top" in args:
        i = args.index("--top")
        try:
            top = int(args[i + 1])
        except (IndexError, ValueError):
            raise SystemExit("ncu_table: --top takes a number of kernels")
        del args[i:i + 2]
    if len(args) != 1:
        raise SystemExit(__doc__.strip().splitlines()[2])
    kernels, skipped = load(args[0])
    if not kernels:
        raise SystemExit(f"ncu_table: {args[0]}: no kernels")
    agg = {}
    for name, us in kernels:
        n, t = agg.get(name, (0, 0.0))
        agg[name] = (n + 1, t + us)
    total = sum(t for _, t in agg.values())
    left = f"; {skipped} rows without a duration left out" if skipped else ""
    print(f"{len(kernels)} kernels, {total:.1f} us in all (each timed on its own){left}\n")
    print("| kernel | launches | total us | us/launch | share |")
    print("|---|---:|---:|---:|---:|")
    for name, (n, t) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]:
        short = name if len(name) <= 70 else name[:67] + "..."
        print(f"| `{short}` | {n} | {t:.1f} | {t / n:.2f} | {100 * t / total:.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
