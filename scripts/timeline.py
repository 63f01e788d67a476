#!/usr/bin/env python3
"""timeline.py - where a decoded token's time goes on the GPU, from the
kernel records of scripts/cupti_trace.c (start and end of every kernel as
it ran, graph replays included).

    python3 scripts/timeline.py trace.csv [--marker REGEX] [--tokens N] [--layer K]

Tokens are cut at each kernel whose demangled name matches --marker (the
step's first kernel, the embedding's by default); the last --tokens whole
tokens are summed. For each instant of a token the "head" is the running
kernel that started first: the chain waits for it, so its time counts
against it, and an instant with no kernel running counts as a gap before
the next kernel. Prints the tokens' spans, busy and gap time, the kernels
by name (launches, summed duration, head time, gap before them), and the
kernels of one layer of the median token in order (--layer K: the K-th
occurrence of the layer's first kernel, a HC partial pass by default).
"""
import argparse
import csv
import re
import statistics
import subprocess
import sys


def demangle(names):
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
        dem = out.split("\n")[: len(names)]
        if len(dem) == len(names):
            return dict(zip(names, dem))
    except (OSError, subprocess.CalledProcessError):
        pass
    return {n: n for n in names}


def short(name):
    name = re.sub(r"^void ", "", name)
    name = re.sub(r"\(.*\)$", "", name)  # the parameter list
    return name.replace("unsigned int", "u")


def load(path):
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            rows.append((int(r["start_ns"]), int(r["end_ns"]), r["name"],
                         "%sx%sx%s" % (r["grid_x"], r["grid_y"], r["grid_z"]), int(r["graph_id"])))
    rows.sort()
    dem = demangle(sorted({r[2] for r in rows}))
    return [(s, e, short(dem[n]), g, gid) for s, e, n, g, gid in rows]


def head_times(ks):
    """Per kernel index: the time it was the head; per index: the gap (no
    kernel running) just before it started."""
    head = [0] * len(ks)
    gap = [0] * len(ks)
    running = []  # indices, in start order
    t = ks[0][0]
    events = sorted([(k[0], 1, i) for i, k in enumerate(ks)] + [(k[1], 0, i) for i, k in enumerate(ks)])
    for when, kind, i in events:
        if running:
            head[min(running)] += when - t
        elif kind == 1:
            gap[i] += when - t
        t = when
        if kind == 1:
            running.append(i)
        else:
            running.remove(i)
    return head, gap


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--marker", default=r"^embed")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--layer", type=int, default=20)
    ap.add_argument("--layer-first", default=r"^hc_partial_kernel")
    a = ap.parse_args()
    ks = load(a.trace)
    if not ks:
        sys.exit("timeline: no kernels in %s" % a.trace)
    marks = [i for i, k in enumerate(ks) if re.search(a.marker, k[2])]
    if len(marks) < 2:
        sys.exit("timeline: fewer than two kernels match --marker %r" % a.marker)
    bounds = list(zip(marks[:-1], marks[1:]))[-a.tokens:]
    per_name = {}
    spans, busys, gaps_total, counts, sums = [], [], [], [], []
    tokens = []
    for b0, b1 in bounds:
        tk = ks[b0:b1]
        head, gap = head_times(tk)
        span = tk[-1][1] - tk[0][0]
        busy = sum(head)
        spans.append(span)
        busys.append(busy)
        gaps_total.append(sum(gap))
        counts.append(len(tk))
        sums.append(sum(k[1] - k[0] for k in tk))
        for i, k in enumerate(tk):
            d = per_name.setdefault(k[2], [0, 0, 0, 0])
            d[0] += 1
            d[1] += k[1] - k[0]
            d[2] += head[i]
            d[3] += gap[i]
        tokens.append((tk, head, gap))
    n = len(bounds)
    print("## Decoded tokens on the GPU (kernel records, %d tokens)\n" % n)
    print("| | median | min | max |\n|---|---:|---:|---:|")
    for label, v in (("kernels a token", counts), ("first kernel start to last end (ms)", spans),
                     ("some kernel running (ms)", busys), ("no kernel running (ms)", gaps_total),
                     ("kernel durations summed (ms)", sums)):
        scale = 1 if label.startswith("kernels") else 1e-6
        print("| %s | %.3f | %.3f | %.3f |" % (label, statistics.median(v) * scale, min(v) * scale, max(v) * scale))
    print("\nStarts of consecutive tokens' first kernels (ms, includes the host between steps): %s\n"
          % ", ".join("%.3f" % ((ks[b1][0] - ks[b0][0]) * 1e-6) for b0, b1 in bounds))
    print("## Kernels by name (per token)\n")
    print("| kernel | launches | duration ms | head ms | gap before ms | head us a launch |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, d in sorted(per_name.items(), key=lambda kv: -(kv[1][2] + kv[1][3])):
        print("| `%s` | %.1f | %.3f | %.3f | %.3f | %.2f |" % (name[:90], d[0] / n, d[1] / n * 1e-6, d[2] / n * 1e-6,
                                                           d[3] / n * 1e-6, d[2] / max(d[0], 1) * 1e-3))
    # one layer of the median token, in order
    mid = sorted(range(n), key=lambda i: spans[i])[n // 2]
    tk, head, gap = tokens[mid]
    firsts = [i for i, k in enumerate(tk) if re.search(a.layer_first, k[2])]
    # a layer has two sublayers, each starting with an HC partial pass
    if len(firsts) > 2 * a.layer + 2:
        i0, i1 = firsts[2 * a.layer], firsts[2 * a.layer + 2]
        t0 = tk[i0][0]
        print("\n## One layer of the median token (kernels %d .. %d), in order\n" % (i0, i1 - 1))
        print("| # | kernel | grid | start us | duration us | gap before us | head us |")
        print("|---:|---|---|---:|---:|---:|---:|")
        for i in range(i0, i1):
            k = tk[i]
            print("| %d | `%s` | %s | %.2f | %.2f | %.2f | %.2f |" % (i, k[2][:70], k[3], (k[0] - t0) * 1e-3,
                                                               (k[1] - k[0]) * 1e-3, gap[i] * 1e-3, head[i] * 1e-3))
        print("\nlayer: %.2f us from its first kernel's start to the next layer's" % ((tk[i1][0] - t0) * 1e-3))


if __name__ == "__main__":
    main()
