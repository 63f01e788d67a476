#!/usr/bin/env python3
"""ncu_table.py - sum an Nsight Compute CSV export by kernel.

Usage: ncu_table.py RAW.csv [--top N] [--bandwidth GBPS]

RAW.csv is `ncu -i REPORT --csv --page raw` of a run that collected
gpu__time_duration.sum, and optionally dram__bytes_read.sum and
dram__bytes_write.sum (scripts/gpu-check.sh, stage `kernels`): one row per
profiled kernel, a units row under the header. Prints a Markdown table of
the kernels by total time (launches, total us, us per launch, share) and
the sum of all kernels, each timed on its own (so launch gaps and overlap
between kernels are not in it). With the DRAM columns the table also gives
the bytes each kernel moved to and from device memory per launch and the
rate it reached; with --bandwidth (GB/s, e.g. the copy bandwidth that
`ds4server bench` measured) that rate as a share of it: the roofline ratio
of each kernel and of the whole token.
"""
import csv
import sys

TIME = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}
BYTES = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12,
         "KB": 1e3, "MB": 1e6, "GB": 1e9, "B": 1.0}
DRAM = ("dram__bytes_read.sum", "dram__bytes_write.sum")


def number(cell):
    return float(cell.replace(",", ""))


def load(path):
    """[(name, us, bytes or None)], rows left out, whether bytes were collected."""
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
    byte_i = [header.index(c) for c in DRAM if c in header]
    body = rows[h + 1:]
    t_scale, b_scale = 1e-3, [1.0] * len(byte_i)  # ncu's default units: nanoseconds, bytes
    if body and len(body[0]) > time_i and body[0][time_i] in TIME:  # the units row
        t_scale = TIME[body[0][time_i]]
        b_scale = [BYTES.get(body[0][i], 1.0) if i < len(body[0]) else 1.0 for i in byte_i]
        body = body[1:]
    out, skipped = [], 0
    for r in body:
        try:
            us = number(r[time_i]) * t_scale
            nbytes = sum(number(r[i]) * s for i, s in zip(byte_i, b_scale)) if byte_i else None
        except (IndexError, ValueError):  # a short row, or no figure (ncu writes n/a)
            skipped += 1
            continue
        out.append((r[name_i], us, nbytes))
    return out, skipped, bool(byte_i)


def option(args, flag, kind, what):
    if flag not in args:
        return None
    i = args.index(flag)
    try:
        value = kind(args[i + 1])
    except (IndexError, ValueError):
        raise SystemExit(f"ncu_table: {flag} takes {what}")
    del args[i:i + 2]
    return value


def main(argv):
    args = list(argv[1:])
    top = option(args, "--top", int, "a number of kernels")
    bandwidth = option(args, "--bandwidth", float, "a bandwidth in GB/s")
    if top is None:
        top = 40
    if bandwidth is not None and bandwidth <= 0:
        raise SystemExit("ncu_table: --bandwidth takes a bandwidth in GB/s")
    if len(args) != 1:
        raise SystemExit(__doc__.strip().splitlines()[2])
    kernels, skipped, with_bytes = load(args[0])
    if not kernels:
        raise SystemExit(f"ncu_table: {args[0]}: no kernels")
    agg = {}
    for name, us, nbytes in kernels:
        n, t, b = agg.get(name, (0, 0.0, 0.0))
        agg[name] = (n + 1, t + us, b + (nbytes or 0.0))
    total = sum(t for _, t, _ in agg.values())
    total_b = sum(b for _, _, b in agg.values())
    left = f"; {skipped} rows without a duration left out" if skipped else ""
    line = f"{len(kernels)} kernels, {total:.1f} us in all (each timed on its own){left}"
    if with_bytes:
        rate = total_b / (total * 1e3)  # bytes / us / 1e3 = GB/s
        line += f"; {total_b / 1e9:.3f} GB to and from device memory, {rate:.0f} GB/s"
        if bandwidth:
            line += f", {100 * rate / bandwidth:.1f}% of {bandwidth:.0f} GB/s"
    print(line + "\n")
    cols = ["kernel", "launches", "total us", "us/launch", "share"]
    if with_bytes:
        cols += ["MB/launch", "GB/s"] + (["of bandwidth"] if bandwidth else [])
    print("| " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * (len(cols) - 1))
    for name, (n, t, b) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]:
        short = name if len(name) <= 70 else name[:67] + "..."
        cells = [f"`{short}`", str(n), f"{t:.1f}", f"{t / n:.2f}", f"{100 * t / total:.1f}%"]
        if with_bytes:
            gbps = b / (t * 1e3) if t > 0 else 0.0
            cells += [f"{b / n / 1e6:.3f}", f"{gbps:.0f}"]
            if bandwidth:
                cells.append(f"{100 * gbps / bandwidth:.0f}%")
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
