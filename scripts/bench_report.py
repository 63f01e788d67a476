#!/usr/bin/env python3
"""Turn `ds4server bench --json` results into a Markdown report and an SVG plot.

    scripts/bench_report.py RESULT.json [MORE.json ...] --md OUT.md --svg OUT.svg
                            [--label NAME ...] [--title TEXT] [--notes NOTES.md]
                            [--ops OPS.json ...]

Each JSON file is one series: its provenance, prefill, time to first token,
decode-at-context and roofline tables (and the A/B table when it was an A/B
run) go to the Markdown; the plot has two panels, decode tokens/s against the
context position and prefill tokens/s against the batch size (both on log2
axes), one line per file. Each --ops file (`ds4server bench --ops --json`)
adds a table of the weight products measured on their own: time per call,
bytes read per second and their share of the measured bandwidth. Python
standard library only; the SVG is written by hand. Used to produce
docs/benchmarks.md from the GPU results.
"""
import argparse
import json
import math
import os
import sys
from xml.sax.saxutils import escape

SCHEMA = "ds4server-bench/1"
OPS_SCHEMA = "ds4server-bench-ops/1"
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def load(path, schema=SCHEMA):
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict) or data.get("schema") != schema:
        raise ValueError(f"{path}: not a {schema} file (schema {data.get('schema') if isinstance(data, dict) else None!r})")
    return data


def md_ops(data, path, out):
    """The table of one `bench --ops` result."""
    bw = (data.get("bandwidth") or {}).get("gbps")
    out.append(f"## Weight products on their own (`{md_cell(os.path.basename(path))}`)\n")
    src = (data.get("bandwidth") or {}).get("source")
    commit = f"`{md_cell(data['commit'])}`" if data.get("commit") else "not recorded"
    out.append(f"- backend {md_cell(data.get('backend'))}, numerics {md_cell(data.get('numerics'))}, commit "
               f"{commit}, widths / {data.get('div')}, dense weights rotated over "
               f"{data.get('rotate_mib')} MiB")
    out.append(f"- bandwidth: {fmt(bw, '.1f')} GB/s ({md_cell(src)})\n")
    out.append("| product | weight | shape (in x out) | rows | us/call | p95 us | GB/s | of bandwidth |")
    out.append("|---|---|---|---:|---:|---:|---:|---:|")
    for o in data.get("ops", []):
        t = o.get("type", "?") + ("/" + o["down_type"] if o.get("down_type") else "")
        if o.get("kind") == "moe":
            shape = f"{o.get('n_in')}x{o.get('n_out')}, {o.get('used')} of {o.get('experts')}"
        elif o.get("kind") == "top_k":
            shape = f"{o.get('n_out')} of {o.get('keys')}"
        elif o.get("kind") in ("indexer_scores", "indexer_scores_f16"):
            shape = f"{o.get('n_out')} heads x {o.get('n_in')}, {o.get('keys')} keys"
        elif o.get("groups", 1) > 1:
            shape = f"{o.get('groups')} x ({o.get('n_in')}x{o.get('n_out')})"
        else:
            shape = f"{o.get('n_in')}x{o.get('n_out')}"
        head = f"| {md_cell(o.get('name'))} | {md_cell(t)} | {shape} | {o.get('rows')} |"
        if "skipped" in o:
            out.append(f"{head} skipped: {md_cell(o['skipped'])} | | | |")
            continue
        pc = o.get("per_call") or {}
        share = o.get("of_bandwidth")
        share_s = fmt(100 * share, ".0f") + "%" if isinstance(share, (int, float)) else "-"

        def us(key):
            v = pc.get(key)
            return fmt(v * 1e6, ".2f") if isinstance(v, (int, float)) else "-"

        out.append(f"{head} {us('median_s')} | {us('p95_s')} | {fmt(o.get('gbps'), '.0f')} | {share_s} |")
    out.append("")


def label_of(data, path):
    p = data.get("provenance", {})
    o = data.get("options", {})
    return f"{o.get('backend', '?')} {o.get('numerics', '')} @ {p.get('commit', '?')} ({os.path.basename(path)})"


def md_cell(x):
    return str(x).replace("|", "\\|").replace("\n", " ")


def fmt(x, spec):
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return format(x, spec)


def gib(b):
    return b / 1073741824.0 if b else 0.0


def md_one(data, label, out):
    p, o, m = data["provenance"], data["options"], data["provenance"]["model"]
    out.append(f"## {md_cell(label)}\n")
    dirty = " (uncommitted changes)" if p.get("git_dirty") else ""
    out.append(f"- commit `{md_cell(p.get('commit'))}`{dirty}, {md_cell(p.get('date_utc'))}, "
               f"build {md_cell(p.get('build'))}, compiler {md_cell(p.get('compiler'))}")
    out.append(f"- device: {md_cell(p.get('device'))}; host {md_cell(p.get('host_cpu'))}, {p.get('host_cores')} cores")
    out.append(f"- model `{md_cell(m.get('path'))}`: {m.get('file_bytes', 0) / 1e9:.3f} GB, fingerprint "
               f"`{m.get('fingerprint')}`, {m.get('n_layer')} layers, {m.get('n_expert_used')} of "
               f"{m.get('n_expert')} experts, context {m.get('context_length')}")
    out.append(f"- backend {o.get('backend')}, numerics {o.get('numerics')}, threads {o.get('threads')}, "
               f"repeat {o.get('repeat')}, warm-up {o.get('warmup')}, gen {o.get('gen')}, seed {o.get('seed')}")
    out.append(f"- command: `{md_cell(p.get('command_line'))}`")
    ld = data.get("load") or {}
    up = f", upload {ld['upload_gbps']:.2f} GB/s" if ld.get("upload_gbps") else ""
    out.append(f"- load {fmt(ld.get('total_s'), '.3f')} s (weights {fmt(ld.get('weights_s'), '.3f')} s{up})")
    bw = data.get("bandwidth") or {}
    if bw.get("gbps"):
        out.append(f"- bandwidth {bw['gbps']:.1f} GB/s ({bw.get('source')})")
    rl = data.get("roofline") or {}
    if rl.get("weights_bytes_per_token"):
        out.append(f"- weights read per decoded token: {rl['weights_bytes_per_token'] / 1e9:.4f} GB")
    if data.get("peak_device_bytes"):
        out.append(f"- peak device memory: {gib(data['peak_device_bytes']):.2f} GiB")
    out.append("")

    if data.get("prefill") or data.get("prefill_skipped"):
        out.append("| prefill tokens | tokens/s (median) | median s | p95 s | min s | max s | samples |")
        out.append("|---:|---:|---:|---:|---:|---:|---:|")
        for r in data.get("prefill", []):
            out.append(f"| {r['tokens']} | {fmt(r['tokens_per_s'], '.1f')} | {fmt(r['median_s'], '.6f')} | "
                       f"{fmt(r['p95_s'], '.6f')} | {fmt(r['min_s'], '.6f')} | {fmt(r['max_s'], '.6f')} | {r['n']} |")
        for r in data.get("prefill_skipped", []):
            out.append(f"| {r['tokens']} | skipped: {md_cell(r['reason'])} | | | | | 0 |")
        out.append("")
    t = data.get("ttft")
    if t:
        out.append(f"Time to first token ({t['tokens']}-token prompt): median {t['median_s']:.4f} s, "
                   f"p95 {t['p95_s']:.4f} s ({t['n']} samples)\n")
    elif data.get("ttft_reason"):
        out.append(f"Time to first token: skipped ({md_cell(data['ttft_reason'])})\n")

    if data.get("decode") or data.get("decode_skipped"):
        out.append("| context | interval prefill tok/s | decode tok/s | p50 ms | p95 ms | launches/tok | "
                   "H2D B/tok | D2H B/tok | syncs/tok | wait ms/tok | peak GiB | measured/floor (weights) | "
                   "measured/floor (weights+KV) |")
        out.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in data.get("decode", []):
            pt, rf = r.get("per_token", {}), r.get("roofline", {})
            out.append(f"| {r['ctx']} | {fmt(r.get('interval_tokens_per_s'), '.1f')} | {fmt(r['tokens_per_s'], '.2f')} | "
                       f"{fmt(r['p50_s'] * 1e3, '.3f')} | {fmt(r['p95_s'] * 1e3, '.3f')} | "
                       f"{fmt(pt.get('launches'), '.1f')} | {fmt(pt.get('h2d_bytes'), '.0f')} | "
                       f"{fmt(pt.get('d2h_bytes'), '.0f')} | {fmt(pt.get('syncs'), '.2f')} | {fmt(pt.get('wait_ms'), '.3f')} | "
                       f"{gib(r.get('peak_device_bytes', 0)):.2f} | {fmt(rf.get('measured_over_floor_weights'), '.2f')} | "
                       f"{fmt(rf.get('measured_over_floor_weights_kv'), '.2f')} |")
        for r in data.get("decode_skipped", []):
            out.append(f"| {r['ctx']} | skipped: {md_cell(r['reason'])} | | | | | | | | | | | |")
        out.append("")
        rec = [r for r in data.get("decode", []) if (r.get("per_token", {}).get("graphs") or 0) > 0]
        if rec:
            out.append("Recorded steps, per decoded token: steps run as graphs, graph launches (a step in segments "
                       "launches several), graphs built (of them for an update CUDA refused), node parameters set anew, "
                       "steps cut short, host time inside "
                       "the step, device time from the step's first graph to the end of its last.\n")
            out.append("| context | graphs | launched | built | refused | node updates | cut short | host ms | graph GPU ms |")
            out.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            for r in rec:
                pt = r["per_token"]
                out.append(f"| {r['ctx']} | {fmt(pt.get('graphs'), '.2f')} | {fmt(pt.get('graph_launches'), '.2f')} | "
                           f"{fmt(pt.get('graph_builds'), '.3f')} | {fmt(pt.get('graph_refusals'), '.3f')} | "
                           f"{fmt(pt.get('node_updates'), '.1f')} | {fmt(pt.get('step_breaks'), '.2f')} | "
                           f"{fmt(pt.get('step_host_ms'), '.3f')} | {fmt(pt.get('graph_gpu_ms'), '.3f')} |")
            out.append("")

    if data.get("batch") or data.get("batch_skipped"):
        first = (data.get("batch") or [{}])[0]
        out.append(f"Batched decode (each stream prefilled with {first.get('ctx', '?')} tokens of its own, then "
                   f"{first.get('gen', '?')} greedy tokens in lockstep):\n")
        out.append("| streams | tokens/s (all) | tokens/s (per stream) | p50 ms/step | p95 ms/step | launches/step | "
                   "graph GPU ms/step | peak GiB |")
        out.append("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in data.get("batch", []):
            ps = r.get("per_step", {})
            out.append(f"| {r['streams']} | {fmt(r['tokens_per_s'], '.2f')} | {fmt(r['per_stream_tokens_per_s'], '.2f')} | "
                       f"{fmt(r['median_s'] * 1e3, '.3f')} | {fmt(r['p95_s'] * 1e3, '.3f')} | "
                       f"{fmt(ps.get('launches'), '.1f')} | {fmt(ps.get('graph_gpu_ms'), '.3f')} | "
                       f"{gib(r.get('peak_device_bytes', 0)):.2f} |")
        for r in data.get("batch_skipped", []):
            out.append(f"| {r['streams']} | skipped: {md_cell(r['reason'])} | | | | | | |")
        out.append("")

    k = data.get("kernels")
    if k and k.get("per_token"):
        total = sum(e["ms"] for e in k["per_token"])
        out.append(f"Device time per decoded token by kernel at context {k['context']} ({k['tokens']} tokens, "
                   f"every launch timed with events, so each carries a few microseconds of timing overhead; "
                   f"{len(k['per_token'])} of {k['distinct']} kernels):\n")
        out.append("| kernel | op | launches/tok | us/tok | us/launch | share |")
        out.append("|---|---|---:|---:|---:|---:|")
        for e in k["per_token"]:
            per = e["ms"] * 1e3 / e["launches"] if e["launches"] else 0.0
            out.append(f"| `{md_cell(e['name'])}` | {md_cell(e['what'])} | {e['launches']:.1f} | {e['ms'] * 1e3:.1f} | "
                       f"{per:.2f} | {100.0 * e['ms'] / total if total else 0.0:.1f}% |")
        out.append("")

    ab = data.get("ab")
    if ab:
        va, vb = ab["variants"]["A"], ab["variants"]["B"]
        if ab["key"] == "command":  # --compare: B is another build or configuration
            out.append(f"A/B: A = `{md_cell(va['command'])}` (commit {md_cell(va.get('commit'))}), "
                       f"B = `{md_cell(vb['command'])}` (commit {md_cell(vb.get('commit'))}), "
                       f"{va['backend']}/{va['numerics']}/{va['threads']} threads; ratio = B/A tokens/s, "
                       f"paired 95% CI\n")
        else:
            out.append(f"A/B: A = {va['backend']}/{va['numerics']}/{va['threads']} threads, "
                       f"B = A with {ab['key']}={md_cell(ab['value'])}; ratio = B/A tokens/s, paired 95% CI\n")
        out.append("| measurement | A tokens/s | B tokens/s | B/A | 95% CI | pairs | order |")
        out.append("|---|---:|---:|---:|---|---:|---|")
        for name, key in (("decode", "ctx"), ("prefill", "tokens")):
            r = ab.get(name)
            if not r:
                continue
            if r.get("skipped"):
                out.append(f"| {name} | skipped: {md_cell(r.get('reason'))} | | | | 0 | |")
                continue
            ci = r.get("ci95")
            ci_s = f"{ci[0]:.4f} .. {ci[1]:.4f}" if ci else "-"
            order = "".join(r.get("order", []))
            out.append(f"| {name} at {r[key]} | {fmt(r.get('a_tokens_per_s_median'), '.2f')} | "
                       f"{fmt(r.get('b_tokens_per_s_median'), '.2f')} | {fmt(r.get('ratio'), '.4f')} | {ci_s} | "
                       f"{r.get('n_pairs')} | {order[:16]}{'...' if len(order) > 16 else ''} |")
        out.append("")


def nice_ticks(hi, n=5):
    """Linear ticks from 0 to at least hi."""
    if not hi or hi <= 0:
        return [0, 1]
    raw = hi / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(s * mag for s in (1, 2, 2.5, 5, 10) if s * mag >= raw)
    ticks, v = [], 0.0
    while v < hi * (1 + 1e-9) or len(ticks) < 2:
        ticks.append(v)
        v += step
    if ticks[-1] < hi:
        ticks.append(ticks[-1] + step)
    return ticks


def fmt_tick(v):
    if v >= 1e6:
        return f"{v / 1e6:g}M"
    if v >= 1e4:
        return f"{v / 1e3:g}K"
    return f"{v:g}"


def fmt_pos(v):
    if v >= 1024 and v % 1024 == 0:
        return f"{v // 1024}K"
    return str(v)


def panel(x0, y0, w, h, title, xlabel, series):
    """One plot: series = [(label, color, [(x, y), ...])]; log2 x, linear y."""
    parts = [f'<g class="panel">',
             f'<text x="{x0 + w / 2:.1f}" y="{y0 - 12:.1f}" text-anchor="middle" font-size="14" '
             f'font-weight="bold">{escape(title)}</text>',
             f'<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#444"/>']
    pts = [p for _, _, s in series for p in s if p[0] > 0 and p[1] is not None and math.isfinite(p[1])]
    if not pts:
        parts.append(f'<text x="{x0 + w / 2:.1f}" y="{y0 + h / 2:.1f}" text-anchor="middle" font-size="12" '
                     f'fill="#666">no data</text>')
        parts.append("</g>")
        return parts
    xs = sorted({p[0] for p in pts})
    lx0, lx1 = math.log2(xs[0]), math.log2(xs[-1])
    if lx1 - lx0 < 1e-9:
        lx0, lx1 = lx0 - 1, lx1 + 1
    yt = nice_ticks(max(p[1] for p in pts))
    ymax = yt[-1]

    def sx(x):
        return x0 + 10 + (math.log2(x) - lx0) / (lx1 - lx0) * (w - 20)

    def sy(y):
        return y0 + h - y / ymax * h

    for v in yt:
        yy = sy(v)
        parts.append(f'<line x1="{x0}" y1="{yy:.1f}" x2="{x0 + w}" y2="{yy:.1f}" stroke="#ddd"/>')
        parts.append(f'<text x="{x0 - 6}" y="{yy + 4:.1f}" text-anchor="end" font-size="11">{fmt_tick(v)}</text>')
    for x in xs:
        xx = sx(x)
        parts.append(f'<line x1="{xx:.1f}" y1="{y0 + h}" x2="{xx:.1f}" y2="{y0 + h + 5}" stroke="#444"/>')
        parts.append(f'<text x="{xx:.1f}" y="{y0 + h + 18}" text-anchor="middle" font-size="11">{fmt_pos(x)}</text>')
    parts.append(f'<text x="{x0 + w / 2:.1f}" y="{y0 + h + 36}" text-anchor="middle" font-size="12">'
                 f'{escape(xlabel)}</text>')
    parts.append(f'<text x="{x0 - 48}" y="{y0 + h / 2:.1f}" text-anchor="middle" font-size="12" '
                 f'transform="rotate(-90 {x0 - 48} {y0 + h / 2:.1f})">tokens/s</text>')
    for label, color, s in series:
        s = sorted(p for p in s if p[0] > 0 and p[1] is not None and math.isfinite(p[1]))
        if not s:
            continue
        if len(s) > 1:
            path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s)
            parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        for x, y in s:
            parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3.5" fill="{color}">'
                         f'<title>{escape(label)}: {fmt_pos(x)} -&gt; {y:.2f} tokens/s</title></circle>')
    parts.append("</g>")
    return parts


def svg(datasets, title):
    W, H = 1000, 470
    pw, ph, top, left = 380, 280, 70, 90
    dec, pre = [], []
    for i, (data, label) in enumerate(datasets):
        color = COLORS[i % len(COLORS)]
        dec.append((label, color, [(r["ctx"], r.get("tokens_per_s")) for r in data.get("decode", [])]))
        pre.append((label, color, [(r["tokens"], r.get("tokens_per_s")) for r in data.get("prefill", [])]))
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
             f'font-family="sans-serif">',
             f'<rect width="{W}" height="{H}" fill="white"/>',
             f'<text x="{W / 2}" y="26" text-anchor="middle" font-size="16" font-weight="bold">{escape(title)}</text>']
    parts += panel(left, top, pw, ph, "decode tokens/s vs context", "context position (tokens, log2)", dec)
    parts += panel(left + pw + 110, top, pw, ph, "prefill tokens/s vs batch size", "prompt tokens (log2)", pre)
    ly = top + ph + 60
    for i, (data, label) in enumerate(datasets):
        color = COLORS[i % len(COLORS)]
        if not data.get("decode") and not data.get("prefill"):
            label += " (no sweep rows: not plotted)"
        y = ly + i * 18
        parts.append(f'<rect x="{left}" y="{y - 9}" width="14" height="10" fill="{color}"/>')
        parts.append(f'<text x="{left + 20}" y="{y}" font-size="12">{escape(label)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+", help="ds4server bench --json outputs")
    ap.add_argument("--md", required=True, help="Markdown report to write")
    ap.add_argument("--svg", required=True, help="SVG plot to write")
    ap.add_argument("--label", action="append", default=[], help="series name (once per JSON file, in order)")
    ap.add_argument("--title", default="ds4server bench", help="title of the report and the plot")
    ap.add_argument("--notes", help="Markdown file inserted after the title (how to read the figures)")
    ap.add_argument("--ops", action="append", default=[], help="ds4server bench --ops --json output (a table each)")
    a = ap.parse_args(argv)
    if a.label and len(a.label) != len(a.json):
        ap.error("give --label once per JSON file")
    datasets = []
    for i, path in enumerate(a.json):
        try:
            data = load(path)
        except (OSError, ValueError) as e:
            print(f"bench_report: {e}", file=sys.stderr)
            return 1
        datasets.append((data, a.label[i] if a.label else label_of(data, path)))
    ops = []
    for path in a.ops:
        try:
            ops.append((load(path, OPS_SCHEMA), path))
        except (OSError, ValueError) as e:
            print(f"bench_report: {e}", file=sys.stderr)
            return 1
    notes = ""
    if a.notes:
        try:
            with open(a.notes, encoding="utf-8") as f:
                notes = f.read().strip() + "\n"
        except OSError as e:
            print(f"bench_report: {e}", file=sys.stderr)
            return 1
    out = [f"# {md_cell(a.title)}\n"] + ([notes] if notes else []) + [
           f"Generated by scripts/bench_report.py from {', '.join('`' + os.path.basename(p) + '`' for p in a.json)}.\n",
           f"![decode and prefill tokens/s]({os.path.relpath(a.svg, os.path.dirname(os.path.abspath(a.md)))})\n"]
    for data, label in datasets:
        md_one(data, label, out)
    for data, path in ops:
        md_ops(data, path, out)
    try:
        with open(a.svg, "w", encoding="utf-8") as f:
            f.write(svg(datasets, a.title))
        with open(a.md, "w", encoding="utf-8") as f:
            f.write("\n".join(out).rstrip() + "\n")
    except OSError as e:
        print(f"bench_report: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
